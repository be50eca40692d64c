"""The Session's running machinery: the engine share, requests, one run,
and turning what the workers read back into a :class:`~vlens.results.Run`.

The order of one call is fixed here: every request is built (and so
validated, sampling settings included) before the first byte is shipped;
then steering vectors and edit functions go to the workers, the batch runs,
and the call's worker state (records, edit functions) is removed on every
way out, an interrupt or a failure while assembling the results included.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from vlens._progress import progress_factory
from vlens.calls import Call, RequestSpec
from vlens.protocol.tensors import decode_tensor
from vlens.checks import ModelFacts, check_budget, check_plan_size
from vlens.errors import ClosedError, EngineError, VlensError, VlensWarning
from vlens.results import Run, Trace
from vlens.edits import engine_prompt
from vlens.prompts import prompt_parts
from vlens.rows import cached_adds, match_record, token_logprobs
from vlens.tokens import TokenReader

__all__ = ["Runner", "SAE_CACHE", "env_flag", "live_engines"]

#: the most SAEs one session keeps in the workers between calls
SAE_CACHE = 8

_FALSY = {"", "0", "false", "no", "off"}


def env_flag(name: str) -> bool:
    """True unless the variable is unset or one of "", 0, false, no, off."""
    return os.environ.get(name, "").strip().lower() not in _FALSY


@dataclass
class _Shared:
    engine: Any
    users: int = 0


# Engines shared by Sessions with the same model and arguments.
_LIVE: dict[tuple, _Shared] = {}
_LIVE_LOCK = threading.Lock()


def live_engines() -> int:
    """How many engines vlens holds open in this process."""
    return len(_LIVE)


class Runner:
    """Owns one Session's share of a live engine and runs its calls."""

    def __init__(self, model: str, llm_kwargs: dict[str, Any], *, reuse: bool,
                 engine: Any = None) -> None:
        key = (model, tuple(sorted((k, repr(v)) for k, v in llm_kwargs.items())))
        with _LIVE_LOCK:
            if engine is not None:  # made elsewhere (a server connection): not shared
                self._init(_Shared(engine, users=1))
                return
            from vlens.engine import Engine

            shared = _LIVE.get(key) if reuse else None
            if shared is None or shared.engine.closed:
                shared = _Shared(Engine(model, **llm_kwargs))
                if reuse:
                    _LIVE[key] = shared
            shared.users += 1
        self._init(shared)

    def _init(self, shared: _Shared) -> None:
        self._shared = shared
        self.reused = shared.users > 1
        self.closed = False
        self._reader: TokenReader | None = None
        #: the payloads of the SAEs this session's calls use, least recently
        #: used first (at most SAE_CACHE; the oldest no call uses are released)
        self.saes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._facts = ModelFacts.from_info(shared.engine.info)
        # thread -> stages of this session it is running (see _in_flight)
        self._running: dict[int, int] = {}
        self._idle = threading.Condition()

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("this Session is closed; make a new one with vlens.Session(...)")

    @property
    def engine(self):
        self._check_open()
        return self._shared.engine

    @property
    def facts(self) -> ModelFacts:
        """What the model is, for the input checks."""
        self._check_open()
        return self._facts

    @property
    def remote(self) -> bool:
        """Whether the engine is a ``vlens serve`` server (vlens.connect)."""
        return bool(getattr(self.engine, "remote", False))

    @property
    def can_ship_functions(self) -> bool:
        """Whether an ``edit=`` function can reach this engine's workers."""
        if self.remote:
            return False
        return self.engine.in_process or env_flag("VLLM_ALLOW_INSECURE_SERIALIZATION")

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Around one stage's run: counted, so :meth:`release` can wait for it."""
        with self._idle:
            self._check_open()
            self._running[threading.get_ident()] = self._running.get(threading.get_ident(), 0) + 1
        try:
            yield
        finally:
            with self._idle:
                me = threading.get_ident()
                self._running[me] -= 1
                if not self._running[me]:
                    del self._running[me]
                self._idle.notify_all()

    def release(self, timeout: float = 30.0) -> None:
        """Give up this share: cancel this session's calls still running
        (each ends with a :class:`ClosedError`) and wait for them (at most
        ``timeout`` seconds), release its SAEs from the workers, and close
        the engine if this was its last user."""
        with self._idle:
            if self.closed:
                return
            self.closed = True
        engine = self._shared.engine
        if not engine.closed:
            engine.cancel(self, ClosedError(
                "the Session was closed while this call ran (s.close())"))
        with self._idle:  # a call of this thread (a stream's body) cannot end first
            self._idle.wait_for(
                lambda: not (set(self._running) - {threading.get_ident()}), timeout)
        if self.saes and not engine.closed:
            try:
                engine.release_saes(list(self.saes), owner=self)
            finally:
                self.saes.clear()
        with _LIVE_LOCK:
            shared = self._shared
            shared.users -= 1
            if shared.users <= 0:
                for key, value in list(_LIVE.items()):
                    if value is shared:
                        del _LIVE[key]
                shared.engine.close()

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id as it reads (see vlens.tokens), cached per id."""
        return self.reader.texts(ids)

    @property
    def reader(self) -> TokenReader:
        """The engine tokenizer's :class:`~vlens.tokens.TokenReader`."""
        if self._reader is None:
            self._reader = TokenReader(self.engine.tokenizer)
        return self._reader

    # -- requests -------------------------------------------------------------
    def sampling_params(self, spec: RequestSpec):
        """vLLM's SamplingParams of one request (a connected session's: the
        dict of them that crosses to the server): greedy unless its sampling
        settings say otherwise; ``score``: vlens's own settings over the
        logprob ones (patching asks for the top-k (``logprobs=k``) or for
        given tokens (``logprob_token_ids``))."""
        plan = spec.plan
        args = {"temperature": 0.0, "logprobs": 0 if spec.logprobs else None,
                "prompt_logprobs": 0 if spec.logprobs else None, **spec.sampling,
                **(spec.score or {})}
        needs_rows = plan is not None and bool(plan.reads or plan.edits)
        try:
            settings = dict(
                max_tokens=spec.max_new_tokens,
                # reads and edit functions need every prompt row; steer-only
                # requests may reuse KV made under the same steers (their
                # cache_salt)
                skip_reading_prefix_cache=True if needs_rows else None,
                extra_args=spec.extra_args(),
                **args,
            )
            # vLLM's SamplingParams; a connected engine's: the wire's dict (no vLLM)
            return self.engine.request_params(settings)
        except VlensError:
            raise
        except Exception as exc:  # vLLM's own validation errors vary by version
            raise VlensError(f"bad sampling settings {dict(spec.sampling)!r}: {exc}") from None

    # -- one run --------------------------------------------------------------
    def run(self, call: Call, *, budget: int, progress: Any = None) -> Any:
        """Run ``call.requests`` in ONE engine batch and return
        ``call.assemble(vLLM outputs, records by tag, self)``; when that is
        the call's next stage (a Call), run it too, and so on.

        Calls made at once (a widget's run in its thread, a cell's call)
        share the engine's steps through its driver. The vectors the requests
        name are held for the stage; the edit functions live in the workers
        only during it; if anything fails, the engine aborts what is left and
        the workers forget the stage's records before the exception goes on."""
        closing: list[Callable[[], None]] = []
        try:
            while isinstance(call, Call):
                call = self._whole_stage(call, budget, progress, closing)
            return call
        finally:
            for close in closing:
                close()

    def _whole_stage(self, call: Call, budget: int, progress: Any,
                     closing: list[Callable[[], None]]) -> Any:
        """Run one stage in one batch: its result, or the next stage."""
        factory = _stage_start(call, progress, closing)
        with self._in_flight(), self._calling(call, budget) as running:
            outputs = running.engine.generate(running.prompts, running.params, factory,
                                              owner=self)
            return running.finish(call.assemble, outputs, self)

    def stream(self, call: Call, *, budget: int, progress: Any = None) -> Iterator[Any]:
        """Like :meth:`run`, step by step: after every engine step of the
        streamed stage yield ``call.partial(latest vLLM outputs, self)``
        (None for a request with no token yet), and last the result. Stages
        before it (no ``partial``) run whole first. Closing the iterator early
        aborts the requests as an interrupt does. ``progress`` (checked now,
        not at the first step) as in :meth:`run`, counting finished
        requests; raising in it ends the stream so too."""
        progress_factory(progress)  # a bad progress= is refused before the first step
        return self._stream(call, budget, progress)

    def _stream(self, call: Call, budget: int, progress: Any) -> Iterator[Any]:
        closing: list[Callable[[], None]] = []
        try:
            while call.partial is None:  # a stage that prepares the streamed one
                call = self._whole_stage(call, budget, progress, closing)
                if not isinstance(call, Call):
                    raise TypeError("a streamed call's last stage needs its partial=")
            factory = _stage_start(call, progress, closing)
            with self._calling(call, budget) as running:
                outputs: list = []
                steps = running.engine.stream(running.prompts, running.params, owner=self)
                bar = factory(total=len(call.requests)) if factory else None
                try:
                    for outputs in steps:
                        done = sum(1 for o in outputs if o is not None and o.finished)
                        if bar is not None and done > bar.n:
                            bar.update(done - bar.n)
                        yield call.partial(outputs, self)
                finally:
                    steps.close()  # closed early: the engine aborts what is left
                    if bar is not None:
                        bar.close()
                result = running.finish(call.assemble, outputs, self)
        finally:
            for close in closing:
                close()
        yield result

    @contextmanager
    def _calling(self, call: Call, budget: int) -> Iterator[_InFlight]:
        """One stage's set-up and clean-up around running its batch: every
        request's SamplingParams made (vLLM's own checks) and the reads
        budgeted before anything is shipped."""
        engine = self.engine
        requests = call.requests
        params = [self.sampling_params(r) for r in requests]
        for r in requests:
            if r.plan is not None:
                check_plan_size(r.plan)
        check_budget([(len(r.ids), r.plan.reads, r.max_new_tokens, r.samples)
                      for r in requests if r.plan is not None], self.facts, budget)
        vectors = {vid: v for r in requests for vid, v in r.vectors.items()}
        saes = {sid: sae for r in requests for sid, sae in r.saes.items()}
        running = _InFlight(engine, [engine_prompt(r.ids, r.plan, r.prefix) for r in requests],
                            params, [r.plan.tag for r in requests if r.plan is not None])
        # a local engine's driver runs overlapping calls side by side; a
        # connection answers one call at a time
        alone = engine.lock if engine.remote else nullcontext()
        try:
            with alone, engine.hold_vectors(vectors):
                if saes:
                    self._hold_saes(engine, saes)
                if call.edit_fns:
                    engine.rpc("vlens_put_edits", call.edit_fns)
                yield running
        finally:
            self._forget(call.edit_fns, [] if running.done else running.tags)

    def _hold_saes(self, engine: Any, saes: dict[str, Any]) -> None:
        """The workers hold these SAEs' encoders for the call (the engine
        ships those its workers lack: another session on it may have
        released one); this session's least recently used ones past
        ``SAE_CACHE`` are released."""
        for sid, sae in saes.items():
            if sid not in self.saes:
                self.saes[sid] = sae.payload()  # encoded once per session
            self.saes.move_to_end(sid)
        engine.hold_saes({sid: self.saes[sid] for sid in saes}, owner=self)
        gone = list(self.saes)[:max(0, len(self.saes) - SAE_CACHE)]
        gone = [sid for sid in gone if sid not in saes]
        if gone:
            engine.release_saes(gone, owner=self)
            for sid in gone:
                del self.saes[sid]

    def _forget(self, edit_fns: dict[str, Any] | None, tags: list[str]) -> None:
        """Remove a call's edit functions and uncollected records from the
        workers. Never raises: it runs while another exception may be on its
        way out, and a closed engine holds nothing anyway."""
        if not edit_fns and not tags:
            return
        engine = self._shared.engine
        if engine.closed:
            return
        for method, arg in (("vlens_drop_edits", list(edit_fns or ())), ("vlens_drop", tags)):
            if arg:
                try:
                    engine.rpc(method, arg)
                except Exception:  # noqa: BLE001 - the original error matters more
                    pass

    # -- results --------------------------------------------------------------
    def partial_run(self, prompts: Sequence[str], requests: Sequence[RequestSpec],
                    outputs: Sequence) -> Run:
        """What a streamed call has produced so far: one Trace per sample
        seen, with its tokens and text but no reads (those come with the
        final Run). An unfinished sample has ``finish_reason`` None."""
        traces = []
        for i, (prompt, req, out) in enumerate(zip(prompts, requests, outputs)):
            for comp in (out.outputs if out is not None else []):
                fed = list(req.ids) + list(comp.token_ids[:-1])
                traces.append(Trace(
                    index=i, prompt=prompt, sample=comp.index, prompt_token_ids=list(req.ids),
                    output_token_ids=list(comp.token_ids), text=comp.text, token_ids=fed,
                    tokens=self.token_strings(fed),
                    output_tokens=self.token_strings(comp.token_ids),
                    positions=list(range(len(fed))), logprobs=[],
                    finish_reason=comp.finish_reason,
                    **prompt_parts(req.prompt, len(req.ids), fed, 0),
                ))
        return Run(traces, prompts=list(prompts))

    def build_run(self, prompts: Sequence[str], requests: Sequence[RequestSpec], outputs: Sequence,
                  collected: dict[str, list[dict[str, Any]]], logprobs: bool) -> Run:
        """Match each completion to the record of the rows the workers saw
        (by token ids) and make a Trace of each."""
        traces = []
        unlanded: list[int] = []
        for i, (prompt, req, out) in enumerate(zip(prompts, requests, outputs)):
            records = list(collected.get(req.plan.tag, []))
            for comp in sorted(out.outputs, key=lambda c: c.index):
                rec = match_record(i, prompt, req, comp, records)
                steered = rec["steered_rows"] + cached_adds(req.plan.adds, rec.get("start", 0))
                if req.plan.adds and steered == 0:
                    if not all(a.start >= len(req.ids) for a in req.plan.adds):
                        raise EngineError(
                            f"prompt {i}: its steering edits landed on no token (spans "
                            f"{[(a.start, a.stop) for a in req.plan.adds]}). This is a vlens "
                            "bug; please report it."
                        )
                    unlanded.append(i)
                traces.append(self._trace(i, prompt, req, out, comp, rec, steered, logprobs))
        if unlanded:
            warnings.warn(
                f"steering on generated tokens covered no token in prompt(s) "
                f"{sorted(set(unlanded))}: those requests stopped (a stop token or EOS) "
                "before their span began; their traces have steered_rows == 0",
                VlensWarning, stacklevel=5,
            )
        return Run(traces, prompts=list(prompts))

    def _trace(self, i, prompt, req, out, comp, rec, steered, logprobs) -> Trace:
        reads = {
            key: {part: v if isinstance(v, torch.Tensor) else decode_tensor(v)
                  for part, v in p.items() if isinstance(v, (dict, torch.Tensor))}
            for key, p in rec["reads"].items()
        }
        return Trace(
            index=i,
            prompt=prompt,
            sample=comp.index,
            prompt_token_ids=list(req.ids),
            output_token_ids=list(comp.token_ids),
            text=comp.text,
            token_ids=rec["token_ids"],
            tokens=self.token_strings(rec["token_ids"]),
            output_tokens=self.token_strings(comp.token_ids),
            positions=rec["positions"],
            logprobs=token_logprobs(out, comp, req.ids) if logprobs else [],
            finish_reason=comp.finish_reason,
            _layers={key: p["layers"] for key, p in rec["reads"].items()},
            _reads=reads,
            copied_bytes=rec["copied_bytes"],
            steered_rows=steered,
            step_rows=rec["step_rows"],
            cached_tokens=rec.get("start", 0),
            restarts=rec.get("restarts", 0),
            **prompt_parts(req.prompt, len(req.ids), rec["token_ids"], rec.get("start", 0)),
        )


def _stage_start(call: Call, progress: Any, closing: list[Callable[[], None]]) -> Any:
    """A stage's progress factory (its own ``progress`` or the call's), its
    ``closing`` kept to run when the whole call ends."""
    if call.closing is not None:
        closing.append(call.closing)
    return progress_factory(progress if call.progress is None else call.progress)


@dataclass
class _InFlight:
    """A call in flight: its engine, the prompts as vLLM takes them, the
    tags whose records it must collect (or drop), and whether it finished."""

    engine: Any
    prompts: list[dict[str, Any]]
    params: list[Any]
    tags: list[str]
    done: bool = False

    def finish(self, assemble: Callable[[list, dict, Any], Any], outputs: list,
               runs: Any) -> Any:
        # an engine in this process hands the reads over as tensors (no bytes)
        raw = bool(getattr(self.engine, "in_process", False))
        collected = self.engine.rpc("vlens_collect", self.tags, raw)[0] if self.tags else {}
        result = assemble(outputs, collected, runs)
        self.done = True
        return result
