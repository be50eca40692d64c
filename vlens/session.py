"""The notebook's handle on a live engine.

A ``Session`` owns (a share of) one :class:`~vlens.engine.Engine`, checks
every input before anything runs, turns a call into one request per prompt,
each carrying a small plan, and turns what the workers read back into
:class:`~vlens.results.Run` objects. Widgets and notebooks use only this API.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlens._checks import InputChecks
from vlens._progress import progress_factory
from vlens._steering_api import SteeringMethods
from vlens._wire import decode_tensor
from vlens._wire import encode_tensor as encode_vector
from vlens.errors import ClosedError, EngineError, VlensError
from vlens.plan import PLAN_KEY, Edit, Plan, Read, Write
from vlens.results import Run, Trace
from vlens.steering import (
    Steer,
    edit_salt,
)

__all__ = ["Session", "live_engines"]

# Sampling settings vlens manages itself: the user sets them another way.
_MANAGED = {
    "max_tokens": "use max_new_tokens=",
    "extra_args": "vlens uses extra_args to carry its plan",
    "logprobs": "use logprobs=True/False",
    "prompt_logprobs": "use logprobs=True/False",
    "skip_reading_prefix_cache": "traced requests always recompute their prompt",
}


@dataclass
class _Shared:
    engine: Any
    users: int = 0


_LIVE: dict[tuple, _Shared] = {}
_LIVE_LOCK = threading.Lock()


_FALSY = {"", "0", "false", "no", "off"}


def _env_flag(name: str) -> bool:
    """True unless the variable is unset or one of "", 0, false, no, off."""
    return os.environ.get(name, "").strip().lower() not in _FALSY


def live_engines() -> int:
    """How many engines vlens holds open in this process."""
    return len(_LIVE)


def _engine_key(model: str, kwargs: dict[str, Any]) -> tuple:
    return (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


def _resolve_model(model: str | os.PathLike | None) -> str:
    if model is None:
        from vlens.models import toyworld_path

        return str(toyworld_path())
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    raise VlensError(
        f"model {str(model)!r} is not a folder on this machine. vlens loads local "
        "models only (no downloads): pass the folder that holds config.json and "
        "the weights, or leave model out for the bundled toy-world model."
    )


class Session(InputChecks, SteeringMethods):
    """A live vLLM engine with vlens's hooks, from a notebook.

    ``Session()`` loads the bundled toy-world model; ``Session(path, **kw)``
    any local model folder, with ``kw`` passed to ``vllm.LLM`` (for example
    ``model_impl="transformers"``, ``max_model_len=512``,
    ``max_num_batched_tokens=64``). A second Session with the same model and
    arguments in one process shares the live engine unless ``reuse=False``.
    """

    _ids = itertools.count()

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        reuse: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        from vlens.engine import Engine

        self.model = _resolve_model(model)
        self._key = _engine_key(self.model, llm_kwargs)
        self._closed = False
        self._calls = itertools.count()
        self._name = f"s{next(Session._ids)}-{uuid.uuid4().hex[:6]}"
        with _LIVE_LOCK:
            shared = _LIVE.get(self._key) if reuse else None
            if shared is None or shared.engine.closed:
                shared = _Shared(Engine(self.model, **llm_kwargs))
                if reuse:
                    _LIVE[self._key] = shared
            shared.users += 1
        self._shared = shared
        self.reused = shared.users > 1
        self.clone_reads = _env_flag("VLENS_CLONE_READS")
        self._token_text: dict[int, str] = {}
        #: the most bytes of activations one call may read (refused above it)
        self.read_budget = int(float(os.environ.get("VLENS_READ_BUDGET_MB", "2048")) * 2**20)

    # -- what the model is --------------------------------------------------
    @property
    def _engine(self):
        if self._closed:
            raise ClosedError(
                "this Session is closed; make a new one with vlens.Session(...)"
            )
        return self._shared.engine

    @property
    def info(self) -> dict[str, Any]:
        return dict(self._engine.info)

    @property
    def n_layers(self) -> int:
        return self._engine.info["n_layers"]

    @property
    def hidden_size(self) -> int:
        return self._engine.info["hidden_size"]

    @property
    def sites(self) -> list[str]:
        return list(self._engine.info["sites"])

    @property
    def max_model_len(self) -> int:
        return self._engine.info["max_model_len"]

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def closed(self) -> bool:
        return self._closed

    def tokenize(self, text: str) -> list[int]:
        """The token ids the engine will see for ``text`` (with BOS if any)."""
        return list(self.tokenizer(text)["input_ids"])

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Each id as readable text (decoded one by one, cached per id)."""
        cache = self._token_text
        out = []
        for i in ids:
            text = cache.get(i)
            if text is None:
                text = cache[i] = self.tokenizer.decode([int(i)])
            out.append(text)
        return out

    @property
    def clone_reads(self) -> bool:
        """Serve copies instead of views of engine memory to code that runs
        inside the step (``edit=`` functions, worker-side reductions). Takes
        effect from the next run: the flag travels in each request's plan.
        Kept results are always copies (see docs/clone-reads.md)."""
        return self._clone_reads

    @clone_reads.setter
    def clone_reads(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise VlensError(f"clone_reads must be True or False, got {value!r}")
        self._clone_reads = value

    def _ship_vectors(self, steers: Iterable[Steer]) -> None:
        engine = self._engine
        have = engine.vector_ids
        new = {}
        for st in steers:
            vid = st.id
            if vid not in have and vid not in new:
                new[vid] = encode_vector(st.vector)
        if new:
            engine.rpc("vlens_put_vectors", new)
            have.update(new)

    def _sampling_params(self, max_new_tokens: int, logprobs: bool, plan: Plan | None,
                         sampling: dict):
        from vllm import SamplingParams

        for key, how in _MANAGED.items():
            if key in sampling:
                raise VlensError(f"{key}= is set by vlens: {how}")
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1
        ):
            raise VlensError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if sampling.get("seed") is not None and self._engine.info.get("device") == "cpu":
            raise VlensError(
                "seed= is refused on vLLM's CPU build: when a seeded request's "
                "prompt is split across engine steps (chunked prefill) its worker "
                "calls Generator.set_offset, which CPU generators lack, and the "
                "engine dies. Sample without a seed, or run on a GPU."
            )
        args = {"temperature": 0.0, **sampling}
        needs_rows = plan is not None and bool(plan.reads or plan.edits)
        try:
            return SamplingParams(
                max_tokens=max_new_tokens,
                logprobs=0 if logprobs else None,
                prompt_logprobs=0 if logprobs else None,
                # reads need every prompt row; steer-only requests may reuse
                # KV made under the same edits (their cache_salt)
                skip_reading_prefix_cache=True if needs_rows else None,
                extra_args={PLAN_KEY: plan.to_wire()} if plan else None,
                **args,
            )
        except Exception as exc:  # vLLM's own validation errors vary by version
            raise VlensError(f"bad sampling settings {sampling!r}: {exc}") from None

    def _request(self, tag: str, index: int, ids: list[int], reads: list[Read],
                 steers: list[Steer], edit_ids: list[tuple[str, int, str]],
                 max_new_tokens: int, logprobs: bool, sampling: dict) -> tuple:
        """One traced request, as ``_execute`` takes it: ``(prompt ids, plan,
        SamplingParams)``. Every traced request carries a plan, even one that
        reads and writes nothing, so its processed tokens are still recorded."""
        writes = tuple(
            Write(st.site, st.layer, st.id, float(st.scale), *st.positions(len(ids)),
                  relative=st.relative)
            for st in steers
        )
        edits = tuple(Edit(site, layer, fid) for site, layer, fid in edit_ids)
        plan = Plan(tag=tag, reads=tuple(reads), writes=writes, edits=edits,
                    clone=self._clone_reads, prompt_len=len(ids), index=index)
        return ids, plan, self._sampling_params(max_new_tokens, logprobs, plan, sampling)

    # -- running ------------------------------------------------------------
    def _execute(self, items: list[tuple[list[int], Plan | None, Any]],
                 progress: Any = None) -> tuple[list, dict]:
        """Run ``(prompt ids, plan, SamplingParams)`` items in ONE generate
        call; return vLLM's outputs and what the workers read, by tag.

        Runs are serialised per engine (two widget callbacks at once queue,
        they do not interleave). If the run is interrupted or fails, the
        engine aborts what is left and the workers forget this call's
        records, then the exception goes on."""
        engine = self._engine
        self._check_budget(items)
        factory = progress_factory(progress)
        prompts = []
        for ids, plan, _ in items:
            p: dict[str, Any] = {"prompt_token_ids": ids}
            if plan is not None:
                salt = edit_salt(
                    [w.__dict__ for w in plan.writes], [e.__dict__ for e in plan.edits]
                )
                if salt:
                    p["cache_salt"] = salt
            prompts.append(p)
        tags = [plan.tag for _, plan, _ in items if plan is not None]
        with engine.lock:
            try:
                outputs = engine.generate(prompts, [sp for _, _, sp in items], factory)
                collected = engine.rpc("vlens_collect", tags)[0] if tags else {}
            except BaseException:
                try:
                    engine.rpc("vlens_drop", tags)
                except Exception:
                    pass
                raise
        return outputs, collected

    def trace(
        self,
        prompts: str | Sequence[str],
        *,
        layers: int | Sequence[int] | None = None,
        sites: str | Sequence[str] = ("resid_post",),
        max_new_tokens: int = 16,
        logprobs: bool = True,
        background: Sequence[str] = (),
        steer: Any = None,
        edit: Any = None,
        edit_at: Sequence[tuple[str, int]] | None = None,
        reduce: str = "full",
        lens: int = 0,
        progress: Any = None,
        **sampling: Any,
    ) -> Run:
        """Generate from each prompt and read ``sites`` at ``layers``.

        Greedy unless sampling settings say otherwise (``temperature``,
        ``top_p``, ``n`` … go to vLLM's ``SamplingParams``). All prompts run
        in one engine batch; every request reads and writes only its own
        rows. Returns a :class:`~vlens.results.Run` with one trace per
        request (``n`` per prompt when ``n > 1``).

        * ``steer``: a :class:`~vlens.Steer`, a list of them (all applied to
          every prompt), or one entry per prompt (Steer, list, or None);
        * ``edit``: ``fn(rows, ctx) -> rows | None`` called with one
          request's rows (``[n, hidden]`` or ``[1, n, hidden]``) at each
          ``edit_at`` (site, layer) pair, every step; return the edited
          tensor (an in-place change that is not returned is an error), or
          None to only look. The rows are a copy when ``clone_reads`` is on,
          else a view of engine memory valid only during the call. Runs in
          the worker (in-process engines; see docs/steering.md);
        * ``reduce``: ``"full"`` (default) or ``"norm"`` (the worker ships
          only norms); ``lens=k`` also reads the logit lens top-k of
          ``resid_post`` at ``layers``, computed in the worker;
        * ``background``: prompts run in the same batch with no plan, as
          other users' traffic would (``run.background_texts``);
        * ``progress``: True for a progress bar, or ``fn(done, total)``
          called as requests finish (raising in it stops the run cleanly).
        """
        prompts, prompt_ids = self._check_prompts(prompts)
        layers = self._check_layers(layers)
        sites = self._check_sites(sites)
        reads = self._reads(sites, layers, reduce, lens)
        per_prompt = self._steers_per_prompt(steer, len(prompts))
        for ids, steers in zip(prompt_ids, per_prompt):
            for st in steers:
                self._check_steer(st, len(ids), max_new_tokens)
        edit_ids = self._register_edit(edit, edit_at)
        self._ship_vectors(st for steers in per_prompt for st in steers)
        call = f"{self._name}-{next(self._calls)}"
        items = [
            self._request(f"{call}-{i}", i, ids, reads, steers, edit_ids,
                          max_new_tokens, logprobs, sampling)
            for i, (ids, steers) in enumerate(zip(prompt_ids, per_prompt))
        ]
        if background:
            _, bg_ids = self._check_prompts(list(background))
            plain = self._sampling_params(max_new_tokens, False, None, sampling)
            items += [(ids, None, plain) for ids in bg_ids]
        try:
            outputs, collected = self._execute(items, progress)
        finally:
            if edit_ids:
                self._engine.rpc("vlens_drop_edits", list({f for *_, f in edit_ids}))
        run = self._build_run(prompts, prompt_ids, [it[1] for it in items[: len(prompts)]],
                              outputs, collected, logprobs)
        run.background_texts = [o.outputs[0].text for o in outputs[len(prompts):]]
        return run

    def _reads(self, sites: list[str], layers: list[int], reduce: str, lens: int) -> list[Read]:
        if reduce not in ("full", "norm"):
            raise VlensError(f"reduce must be 'full' or 'norm', got {reduce!r}")
        if not isinstance(lens, int) or isinstance(lens, bool) or lens < 0:
            raise VlensError(f"lens must be a non-negative int (top-k), got {lens!r}")
        reads = [Read(site, tuple(layers), reduce) for site in sites]
        if lens:
            vocab = self._engine.info["vocab_size"]
            if lens > vocab:
                raise VlensError(f"lens={lens} is more than the vocabulary ({vocab} tokens)")
            reads.append(Read("resid_post", tuple(layers), "lens", lens))
        return reads

    def _register_edit(self, edit: Any, edit_at: Any) -> list[tuple[str, int, str]]:
        if edit is None:
            if edit_at is not None:
                raise VlensError("edit_at= given without edit=: pass the function too")
            return []
        if not callable(edit):
            raise VlensError(f"edit must be a function fn(rows, ctx), got {type(edit).__name__}")
        if not self._engine.in_process and not _env_flag("VLLM_ALLOW_INSECURE_SERIALIZATION"):
            raise VlensError(
                "edit= functions run inside the workers and this engine runs in other "
                "processes: use an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                "the default), or set VLLM_ALLOW_INSECURE_SERIALIZATION=1 before starting "
                "it and pass a picklable function; a Steer needs neither"
            )
        if not edit_at:
            raise VlensError("edit= needs edit_at=[(site, layer), ...]: where to call it")
        pairs = []
        for pair in edit_at:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise VlensError(f"edit_at entries are (site, layer) pairs, got {pair!r}")
            site, layer = pair
            if site not in self.sites:
                raise self._no_such_site(site, self.sites)
            self._check_layers([layer])
            pairs.append((site, int(layer)))
        fid = f"fn-{uuid.uuid4().hex[:12]}"
        self._engine.rpc("vlens_put_edits", {fid: edit})
        return [(site, layer, fid) for site, layer in pairs]

    def _build_run(self, prompts, prompt_ids, plans, outputs, collected, logprobs) -> Run:
        traces = []
        for i, (prompt, ids, plan, out) in enumerate(zip(prompts, prompt_ids, plans, outputs)):
            records = list(collected.get(plan.tag, [])) if plan is not None else []
            for comp in sorted(out.outputs, key=lambda c: c.index):
                expected = list(ids) + list(comp.token_ids[:-1])
                match = next((r for r in records if r["token_ids"] == expected), None)
                if match is None:
                    seen = [len(r["token_ids"]) for r in records]
                    raise EngineError(
                        f"prompt {i}, sample {comp.index}: the rows vlens read do not "
                        f"match the tokens vLLM processed ({len(expected)} expected, "
                        f"records of {seen} rows). This is a vlens bug; please report it."
                    )
                records.remove(match)
                if match["errors"]:
                    raise EngineError(
                        f"prompt {i} ({prompt[:40]!r}): " + "; ".join(match["errors"])
                    )
                if plan.writes and match["steered_rows"] == 0:
                    raise EngineError(
                        f"prompt {i}: its steering edits landed on no token (span "
                        f"{[(w.start, w.stop) for w in plan.writes]} of a request of "
                        f"{len(expected)} tokens): widen the span"
                    )
                reads = {
                    key: {part: decode_tensor(v) for part, v in p.items()
                          if isinstance(v, dict)}
                    for key, p in match["reads"].items()
                }
                traces.append(
                    Trace(
                        index=i,
                        prompt=prompt,
                        sample=comp.index,
                        prompt_token_ids=list(ids),
                        output_token_ids=list(comp.token_ids),
                        text=comp.text,
                        token_ids=match["token_ids"],
                        tokens=self.token_strings(match["token_ids"]),
                        output_tokens=self.token_strings(comp.token_ids),
                        positions=match["positions"],
                        logprobs=_token_logprobs(out, comp, ids) if logprobs else [],
                        finish_reason=comp.finish_reason,
                        layers={key: p["layers"] for key, p in match["reads"].items()},
                        _reads=reads,
                        copied_bytes=match["copied_bytes"],
                        steered_rows=match["steered_rows"],
                        step_rows=match["step_rows"],
                    )
                )
        return Run(traces, prompts=prompts)

    def generate(
        self, prompts: str | Sequence[str], *, max_new_tokens: int = 16, **sampling: Any
    ) -> list[str]:
        """Plain generation with no plan (the hooks stay idle): the texts."""
        engine = self._engine
        prompts, prompt_ids = self._check_prompts(prompts)
        params = self._sampling_params(max_new_tokens, False, None, sampling)
        with engine.lock:
            outs = engine.generate([{"prompt_token_ids": i} for i in prompt_ids], params)
        return [o.outputs[0].text for o in outs]

    def explore(self, prompt: str, **kwargs: Any):
        """An explorer widget on ``prompt``: layer and span pickers, heatmap,
        logit lens and steering panel sharing one selection (ipywidgets)."""
        from vlens.widgets import explore

        return explore(self, prompt, **kwargs)

    def status(self) -> dict[str, Any]:
        """The workers' hook state (rank 0): hooks, pending records, steps."""
        return self._engine.rpc("vlens_status")[0]

    # -- lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Release this session's share of the engine; the engine shuts down
        when its last session closes. Calling it twice is harmless."""
        if self._closed:
            return
        self._closed = True
        with _LIVE_LOCK:
            shared = self._shared
            shared.users -= 1
            if shared.users <= 0:
                for key, value in list(_LIVE.items()):
                    if value is shared:
                        del _LIVE[key]
                shared.engine.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_layers} layers, {self.info['impl']}"
        return f"Session({self.model!r}, {state})"


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
