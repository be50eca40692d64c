"""The Session's running machinery: the engine share, requests, one run,
and turning what the workers read back into a :class:`~vlens.results.Run`.

The order of one call is fixed here: every request is built (and so
validated, sampling settings included) before the first byte is shipped;
then steering vectors and edit functions go to the workers, the batch runs,
and the call's worker state (records, edit functions) is removed on every
way out, an interrupt or a failure while assembling the results included.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vlens._progress import progress_factory
from vlens.calls import Call
from vlens.protocol.tensors import decode_tensor
from vlens.checks import ModelFacts, check_budget, check_plan
from vlens.errors import ClosedError, EngineError, VlensError, VlensWarning
from vlens.protocol.plan import PLAN_KEY, Add, Edit, Plan, Read, Set
from vlens.results import Run, Trace
from vlens.edits import Steer, engine_prompt
from vlens.prompts import prompt_parts
from vlens.tokens import TokenReader

__all__ = ["Request", "Runner", "env_flag", "live_engines"]

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


@dataclass
class Request:
    """One engine request: prompt ids, its plan (None: untraced background
    traffic), vLLM's SamplingParams, and the steering vectors it names."""

    ids: list[int]
    plan: Plan | None
    params: Any
    vectors: dict[str, Any] = field(default_factory=dict)
    #: the normalised prompt (vlens.prompts.Prompt): roles, text, offsets
    prompt: Any = None


class Runner:
    """Owns one Session's share of a live engine and runs its calls."""

    _ids = itertools.count()

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
        self._name = f"s{next(Runner._ids)}-{uuid.uuid4().hex[:6]}"
        self._calls = itertools.count()
        self._reader: TokenReader | None = None
        #: the SAEs this session's calls read ({id: payload}, methods/sae.py)
        self.saes: dict[str, dict[str, Any]] = {}
        self._facts = ModelFacts.from_info(shared.engine.info)

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

    def release(self) -> None:
        """Give up this share; the engine closes with its last user."""
        if self.closed:
            return
        self.closed = True
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
    def next_call(self) -> str:
        """A tag prefix no other call of any Session in this process uses."""
        return f"{self._name}-{next(self._calls)}"

    def sampling_params(self, max_new_tokens: int, logprobs: bool, plan: Plan | None,
                        sampling: dict[str, Any], score: dict[str, Any] | None = None):
        """vLLM's SamplingParams of one request. ``score``: vlens's own
        settings over the logprob ones (patching asks for the top-k
        (``logprobs=k``) or for given tokens (``logprob_token_ids``))."""
        from vllm import SamplingParams

        args = {"temperature": 0.0, "logprobs": 0 if logprobs else None,
                "prompt_logprobs": 0 if logprobs else None, **sampling, **(score or {})}
        needs_rows = plan is not None and bool(plan.reads or plan.edits)
        try:
            return SamplingParams(
                max_tokens=max_new_tokens,
                # reads and edit functions need every prompt row; steer-only
                # requests may reuse KV made under the same steers (their
                # cache_salt)
                skip_reading_prefix_cache=True if needs_rows else None,
                extra_args={PLAN_KEY: plan.to_wire()} if plan else None,
                **args,
            )
        except Exception as exc:  # vLLM's own validation errors vary by version
            raise VlensError(f"bad sampling settings {sampling!r}: {exc}") from None

    def request(self, tag: str, index: int, ids: list[int], *, max_new_tokens: int,
                logprobs: bool, clone: bool, reads: Sequence[Read] = (),
                steers: Sequence[Steer] = (), edits: Sequence[Edit] = (),
                sets: Sequence[Set] = (), vectors: dict[str, Any] | None = None,
                sampling: dict[str, Any] | None = None,
                score: dict[str, Any] | None = None, source: Any = None) -> Request:
        """One traced request. Every traced request carries a plan, even one
        that reads and writes nothing, so its processed tokens are recorded.
        ``sets`` (ablations, patched cells) name their vectors in ``vectors``
        (``{id: tensor [width]}``). ``source``: the normalised prompt
        (:class:`vlens.prompts.Prompt`) whose roles the Trace shows."""
        adds = tuple(
            Add(st.site, st.layer, st.id, float(st.scale), *st.positions(len(ids)),
                relative=st.relative, **self._clamp_of(st))
            for st in steers
        )
        plan = Plan(tag=tag, reads=tuple(reads), adds=adds, sets=tuple(sets), edits=tuple(edits),
                    clone=clone, prompt_len=len(ids), index=index)
        vectors = {**{st.id: st.vector for st in steers}, **(vectors or {})}
        # the very checks the server's guard runs on every plan it is sent
        check_plan(plan, self.facts, {vid: (int(v.numel()), float(v.abs().max()) if v.numel()
                                            else 0.0) for vid, v in vectors.items()},
                   max_new_tokens)
        params = self.sampling_params(max_new_tokens, logprobs, plan, sampling or {}, score)
        return Request(ids, plan, params, vectors, prompt=source)

    def _clamp_of(self, st: Steer) -> dict[str, Any]:
        """A Clamp's plan fields (its SAE's encoder goes to the workers with
        the call); nothing for a plain Steer."""
        sae = getattr(st, "sae", None)
        if sae is None:
            return {}
        if sae.id not in self.saes:
            self.saes[sae.id] = sae.payload()
        return {"sae": sae.id, "feature": st.feature}

    def background(self, ids: list[int], max_new_tokens: int, sampling: dict[str, Any]) -> Request:
        """An untraced request, as other users' traffic would be."""
        return Request(ids, None, self.sampling_params(max_new_tokens, False, None, sampling))

    # -- one run --------------------------------------------------------------
    def run(self, call: Call, *, budget: int, progress: Any = None) -> Any:
        """Run ``call.requests`` in ONE engine batch and return
        ``call.assemble(vLLM outputs, records by tag)``.

        Runs are serialised per engine (a widget's run in its thread and a
        cell's call queue, they do not interleave). The vectors the requests name are held for
        the call; the edit functions live in the workers only during it; if
        anything fails, the engine aborts what is left and the workers forget
        this call's records before the exception goes on."""
        factory = progress_factory(progress)
        params = [r.params for r in call.requests]
        with self._calling(call.requests, budget, call.edit_fns) as running:
            outputs = running.engine.generate(running.prompts, params, factory)
            return running.finish(call.assemble, outputs)

    def stream(self, call: Call, *, budget: int, progress: Any = None) -> Iterator[Any]:
        """Like :meth:`run`, step by step: after every engine step yield
        ``call.partial(latest vLLM outputs)`` (None for a request with no
        token yet), and last ``call.assemble(outputs, records)``. Closing
        the iterator early aborts the requests as an interrupt does.
        ``progress`` (checked now, not at the first step) as in :meth:`run`,
        counting finished requests; raising in it ends the stream so too."""
        if call.partial is None:
            raise TypeError("a streamed call needs its partial= (what to yield each step)")
        return self._stream(call, budget, progress_factory(progress))

    def _stream(self, call: Call, budget: int, factory: Any) -> Iterator[Any]:
        with self._calling(call.requests, budget, call.edit_fns) as running:
            outputs: list = []
            steps = running.engine.stream(running.prompts, [r.params for r in call.requests])
            bar = factory(total=len(call.requests)) if factory else None
            try:
                for outputs in steps:
                    done = sum(1 for o in outputs if o is not None and o.finished)
                    if bar is not None and done > bar.n:
                        bar.update(done - bar.n)
                    yield call.partial(outputs)
            finally:
                steps.close()  # closed early: the engine aborts what is left
                if bar is not None:
                    bar.close()
            result = running.finish(call.assemble, outputs)
        yield result

    @contextmanager
    def _calling(self, requests: Sequence[Request], budget: int,
                 edit_fns: dict[str, Any] | None) -> Iterator[_InFlight]:
        """One call's set-up and clean-up around running its batch."""
        engine = self.engine
        check_budget([(len(r.ids), r.plan.reads, r.params.max_tokens, r.params.n)
                      for r in requests if r.plan is not None], self.facts, budget)
        vectors = {vid: v for r in requests for vid, v in r.vectors.items()}
        call = _InFlight(engine, [engine_prompt(r.ids, r.plan) for r in requests],
                     [r.plan.tag for r in requests if r.plan is not None])
        try:
            with engine.lock, engine.hold_vectors(vectors):
                saes = {r.sae for q in requests if q.plan
                        for r in q.plan.reads + q.plan.adds if r.sae}
                if saes:
                    engine.hold_saes({sid: self.saes[sid] for sid in saes})
                if edit_fns:
                    engine.rpc("vlens_put_edits", edit_fns)
                yield call
        finally:
            self._forget(edit_fns, [] if call.done else call.tags)

    def _forget(self, edit_fns: dict[str, Any] | None, tags: list[str]) -> None:
        """Remove a call's edit functions and uncollected records from the
        workers. Never raises: it runs while another exception may be on its
        way out, and a closed engine holds nothing anyway."""
        if not edit_fns and not tags:
            return
        engine = self._shared.engine
        if engine.closed:
            return
        with engine.lock:
            for method, arg in (("vlens_drop_edits", list(edit_fns or ())), ("vlens_drop", tags)):
                if arg:
                    try:
                        engine.rpc(method, arg)
                    except Exception:  # noqa: BLE001 - the original error matters more
                        pass

    # -- results --------------------------------------------------------------
    def partial_run(self, prompts: Sequence[str], requests: Sequence[Request],
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

    def build_run(self, prompts: Sequence[str], requests: Sequence[Request], outputs: Sequence,
                  collected: dict[str, list[dict[str, Any]]], logprobs: bool) -> Run:
        """Match each completion to the record of the rows the workers saw
        (by token ids) and make a Trace of each."""
        traces = []
        unlanded: list[int] = []
        for i, (prompt, req, out) in enumerate(zip(prompts, requests, outputs)):
            records = list(collected.get(req.plan.tag, []))
            for comp in sorted(out.outputs, key=lambda c: c.index):
                rec = _match(i, prompt, req, comp, records)
                steered = rec["steered_rows"] + _cached_adds(req.plan.adds, rec.get("start", 0))
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
            key: {part: decode_tensor(v) for part, v in p.items() if isinstance(v, dict)}
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
            logprobs=_token_logprobs(out, comp, req.ids) if logprobs else [],
            finish_reason=comp.finish_reason,
            layers={key: p["layers"] for key, p in rec["reads"].items()},
            _reads=reads,
            copied_bytes=rec["copied_bytes"],
            steered_rows=steered,
            step_rows=rec["step_rows"],
            cached_tokens=rec.get("start", 0),
            restarts=rec.get("restarts", 0),
            **prompt_parts(req.prompt, len(req.ids), rec["token_ids"], rec.get("start", 0)),
        )


@dataclass
class _InFlight:
    """A call in flight: its engine, the prompts as vLLM takes them, the
    tags whose records it must collect (or drop), and whether it finished."""

    engine: Any
    prompts: list[dict[str, Any]]
    tags: list[str]
    done: bool = False

    def finish(self, assemble: Callable[[list, dict], Any], outputs: list) -> Any:
        collected = self.engine.rpc("vlens_collect", self.tags)[0] if self.tags else {}
        result = assemble(outputs, collected)
        self.done = True
        return result


def _match(i: int, prompt: str, req: Request, comp: Any,
           records: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of completion ``comp`` of prompt ``i`` (removed from
    ``records``): the rows it fed through the model, from the first one the
    hooks saw (``start``; earlier rows came from the prefix cache)."""
    expected = list(req.ids) + list(comp.token_ids[:-1])
    rec = next((r for r in records if r["token_ids"] == expected[r.get("start", 0):]), None)
    if rec is None:
        seen = [(r.get("start", 0), len(r["token_ids"])) for r in records]
        raise EngineError(
            f"prompt {i}, sample {comp.index}: the rows vlens read do not match the tokens "
            f"vLLM processed ({len(expected)} expected, records of (start, rows) {seen}). "
            "This is a vlens bug; please report it."
        )
    records.remove(rec)
    start = rec.get("start", 0)
    if start and req.plan.reads:
        raise EngineError(
            f"prompt {i}, sample {comp.index}: rows 0 to {start - 1} came from the prefix "
            "cache and the hooks never saw them, so its reads miss them. This is a vlens "
            "bug; please report it."
        )
    if rec["errors"]:
        raise EngineError(f"prompt {i} ({prompt[:40]!r}): " + "; ".join(rec["errors"]))
    return rec


def _cached_adds(adds: Sequence[Add], start: int) -> int:
    """Rows before ``start`` (served from the prefix cache) inside each Add's
    span: they were computed under the same steers (the cache_salt is made
    from them), so they count as steered."""
    return sum(a.rows_in(0, start) for a in adds)


def _token_logprobs(out: Any, comp: Any, prompt_ids: list[int]) -> list[float | None]:
    """Logprob of each prompt and generated token (None for the first)."""
    values: list[float | None] = [None]
    prompt_lp = out.prompt_logprobs or []
    for pos in range(1, len(prompt_ids)):
        entry = prompt_lp[pos] if pos < len(prompt_lp) else None
        values.append(None if entry is None else float(entry[prompt_ids[pos]].logprob))
    for step, tok in enumerate(comp.token_ids):
        entry = comp.logprobs[step] if comp.logprobs and step < len(comp.logprobs) else None
        values.append(None if entry is None else float(entry[tok].logprob))
    return values
