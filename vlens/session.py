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

import torch

from vlens.errors import ClosedError, EngineError, VlensError
from vlens.plan import PLAN_KEY, REDUCTIONS, Edit, Plan, Read, Write, read_key
from vlens._wire import decode_tensor, encode_tensor as encode_vector
from vlens.results import Run, Trace
from vlens.steering import Comparison, Steer, Sweep, edit_salt, kl_per_position, vector_id

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


class Session:
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
        """Each id as readable text (decoded one by one)."""
        tok = self.tokenizer
        return [tok.decode([int(i)]) for i in ids]

    # -- input checks -------------------------------------------------------
    def _check_prompts(self, prompts: Any) -> tuple[list[str], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise VlensError(
                f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
            )
        if not prompts:
            raise VlensError("prompts is empty: pass at least one prompt string")
        ids = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise VlensError(
                    f"prompt {i} is a {type(p).__name__}, not a string: pass text"
                )
            if not p.strip():
                raise VlensError(f"prompt {i} is empty: give it at least one word")
            toks = self.tokenize(p)
            if len(toks) >= self.max_model_len:
                raise VlensError(
                    f"prompt {i} is {len(toks)} tokens long but the engine's "
                    f"max_model_len is {self.max_model_len}: shorten it to under "
                    f"{self.max_model_len} tokens, or start the Session with a larger "
                    "max_model_len="
                )
            ids.append(toks)
        return list(prompts), ids

    def _check_layers(self, layers: Any) -> list[int]:
        n = self.n_layers
        if layers is None:
            return list(range(n))
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if isinstance(layers, range):
            layers = list(layers)
        if not isinstance(layers, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers
        ):
            raise VlensError(
                f"layers must be None (all), an int or a list of ints, got {layers!r}"
            )
        if not layers:
            raise VlensError(f"layers is empty: pick from 0 to {n - 1}, or None for all")
        bad = [x for x in layers if not 0 <= x < n]
        if bad:
            raise VlensError(
                f"layer {bad[0]} does not exist: this model has {n} layers, "
                f"numbered 0 to {n - 1}"
            )
        return list(dict.fromkeys(layers))

    def _check_sites(self, sites: Any) -> list[str]:
        if isinstance(sites, str):
            sites = [sites]
        if not isinstance(sites, (list, tuple)):
            raise VlensError(f"sites must be a site name or a list of them, got {sites!r}")
        known = self.sites
        for s in sites:
            if s not in known:
                raise VlensError(
                    f"unknown site {s!r}: this model has {', '.join(known)}"
                )
        return list(dict.fromkeys(sites))

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

    def _check_steer(self, st: Any, prompt_len: int, max_new_tokens: int) -> Steer:
        if not isinstance(st, Steer):
            raise VlensError(f"steer entries must be vlens.Steer objects, got {type(st).__name__}")
        n = self.n_layers
        if not 0 <= st.layer < n:
            raise VlensError(
                f"Steer layer {st.layer} does not exist: this model has {n} layers, "
                f"numbered 0 to {n - 1}"
            )
        if st.site not in self._writable():
            raise VlensError(
                f"Steer site {st.site!r} cannot be written: use one of {', '.join(self._writable())}"
            )
        if st.vector.shape[0] != self.hidden_size:
            raise VlensError(
                f"Steer vector has {st.vector.shape[0]} elements but this model's hidden "
                f"size is {self.hidden_size}: compute it on this model (s.direction)"
            )
        if isinstance(st.span, tuple):
            total = prompt_len + max_new_tokens - 1  # rows the request will run
            if st.span[1] > total:
                raise VlensError(
                    f"Steer span {st.span} reaches past the sequence: this request runs "
                    f"{total} tokens ({prompt_len} prompt + {max_new_tokens - 1} fed back), "
                    f"positions 0 to {total - 1}"
                )
        return st

    def _writable(self) -> list[str]:
        from vlens.sites import WRITABLE

        return [x for x in WRITABLE if x in self.sites]

    def _steers_per_prompt(self, steer: Any, n_prompts: int) -> list[list[Steer]]:
        """One Steer, a list of Steers (all applied to every prompt), or one
        entry per prompt (a Steer, a list of Steers, or None)."""
        if steer is None:
            return [[] for _ in range(n_prompts)]
        if isinstance(steer, Steer):
            return [[steer] for _ in range(n_prompts)]
        if isinstance(steer, (list, tuple)):
            if all(isinstance(x, Steer) for x in steer):
                return [list(steer) for _ in range(n_prompts)]
            if len(steer) != n_prompts:
                raise VlensError(
                    f"steer has {len(steer)} per-prompt entries for {n_prompts} prompts: "
                    "give one entry (a Steer, a list of Steers, or None) per prompt, "
                    "or one Steer / a list of Steers for all"
                )
            out = []
            for i, x in enumerate(steer):
                if x is None:
                    out.append([])
                elif isinstance(x, Steer):
                    out.append([x])
                elif isinstance(x, (list, tuple)) and all(isinstance(y, Steer) for y in x):
                    out.append(list(x))
                else:
                    raise VlensError(f"steer entry {i} is {x!r}: use a Steer, a list of Steers, or None")
            return out
        raise VlensError(f"steer must be a vlens.Steer, a list of them, or None; got {type(steer).__name__}")

    def _ship_vectors(self, steers: Iterable[Steer]) -> None:
        engine = self._engine
        have = engine.__dict__.setdefault("vector_ids", set())
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

    def _plan(self, tag: str, index: int, prompt_len: int, reads: list[Read],
              steers: list[Steer], edit_ids: list[tuple[str, int, str]]) -> Plan | None:
        writes = tuple(
            Write(st.site, st.layer, st.id, float(st.scale), *st.positions(prompt_len))
            for st in steers
        )
        edits = tuple(Edit(site, layer, fid) for site, layer, fid in edit_ids)
        if not reads and not writes and not edits:
            return None
        return Plan(tag=tag, reads=tuple(reads), writes=writes, edits=edits,
                    clone=self._clone_reads, prompt_len=prompt_len, index=index)

    # -- running ------------------------------------------------------------
    def _execute(self, items: list[tuple[list[int], Plan | None, Any]]) -> tuple[list, dict]:
        """Run ``(prompt ids, plan, SamplingParams)`` items in ONE generate
        call; return vLLM's outputs and what the workers read, by tag."""
        engine = self._engine
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
                outputs = engine.generate(prompts, [sp for _, _, sp in items])
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
          other users' traffic would (``run.background_texts``).
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
        items = []
        for i, (ids, steers) in enumerate(zip(prompt_ids, per_prompt)):
            plan = self._plan(f"{call}-{i}", i, len(ids), reads, steers, edit_ids)
            if plan is None:  # nothing to read or write: still traced for tokens
                plan = Plan(tag=f"{call}-{i}", clone=self._clone_reads,
                            prompt_len=len(ids), index=i)
            items.append((ids, plan, self._sampling_params(max_new_tokens, logprobs, plan, sampling)))
        if background:
            _, bg_ids = self._check_prompts(list(background))
            plain = self._sampling_params(max_new_tokens, False, None, sampling)
            items += [(ids, None, plain) for ids in bg_ids]
        try:
            outputs, collected = self._execute(items)
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
        if not edit_at:
            raise VlensError("edit= needs edit_at=[(site, layer), ...]: where to call it")
        pairs = []
        for pair in edit_at:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise VlensError(f"edit_at entries are (site, layer) pairs, got {pair!r}")
            site, layer = pair
            if site not in self.sites:
                raise VlensError(f"unknown edit site {site!r}: this model has {', '.join(self.sites)}")
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
                    )
                )
        return Run(traces, prompts=prompts)

    # -- steering -------------------------------------------------------------
    def direction(
        self,
        positive: Sequence[str],
        negative: Sequence[str],
        *,
        layer: int,
        site: str = "resid_post",
        position: str = "last",
    ) -> torch.Tensor:
        """Difference of means: ``mean(positive) - mean(negative)`` of ``site``
        at ``layer``, ``[hidden]`` float32. ``position="last"`` takes each
        prompt's last token, ``"mean"`` the mean over its tokens (the BOS row,
        the same for every prompt, left out)."""
        if position not in ("last", "mean"):
            raise VlensError(f"position must be 'last' or 'mean', got {position!r}")
        for name, group in (("positive", positive), ("negative", negative)):
            if isinstance(group, str) or not isinstance(group, (list, tuple)) or not group:
                raise VlensError(f"{name} must be a non-empty list of prompt strings")
        layer = self._check_layers([layer])[0]
        self._check_sites([site])
        run = self.trace(list(positive) + list(negative), layers=[layer], sites=[site],
                         max_new_tokens=1, logprobs=False)
        bos = self.tokenizer.bos_token_id
        means = []
        for t in run:
            rows = t.activations(site)[0]  # [prompt tokens, hidden]
            if position == "last":
                means.append(rows[-1])
            else:
                skip = 1 if bos is not None and t.token_ids[0] == bos and len(rows) > 1 else 0
                means.append(rows[skip:].mean(0))
        stacked = torch.stack(means)
        k = len(positive)
        return stacked[:k].mean(0) - stacked[k:].mean(0)

    def compare(
        self,
        prompts: str | Sequence[str],
        *,
        steer: Any,
        max_new_tokens: int = 16,
        **sampling: Any,
    ) -> Comparison:
        """Baseline and steered generations of the same prompts in ONE engine
        batch: both texts, per-token logprobs, KL per position, first
        divergence."""
        prompts, prompt_ids = self._check_prompts(prompts)
        per_prompt = self._steers_per_prompt(steer, len(prompts))
        if not any(per_prompt):
            raise VlensError("compare needs a steer= (nothing would differ)")
        for ids, steers in zip(prompt_ids, per_prompt):
            for st in steers:
                self._check_steer(st, len(ids), max_new_tokens)
        self._ship_vectors(st for steers in per_prompt for st in steers)
        last = self.n_layers - 1
        reads = [Read("resid_post", (last,), "logprobs")]
        call = f"{self._name}-{next(self._calls)}"
        items = []
        for arm, steers_list in (("b", [[] for _ in prompts]), ("s", per_prompt)):
            for i, (ids, steers) in enumerate(zip(prompt_ids, steers_list)):
                plan = self._plan(f"{call}-{arm}{i}", i, len(ids), reads, steers, [])
                items.append((ids, plan, self._sampling_params(max_new_tokens, True, plan, sampling)))
        outputs, collected = self._execute(items)
        n = len(prompts)
        plans = [it[1] for it in items]
        base = self._build_run(prompts, prompt_ids, plans[:n], outputs[:n], collected, True)
        steered = self._build_run(prompts, prompt_ids, plans[n:], outputs[n:], collected, True)
        kl = [self._generated_kl(b, s_) for b, s_ in zip(base, steered)]
        return Comparison(base, steered, kl)

    @staticmethod
    def _generated_kl(base: Trace, steered: Trace) -> torch.Tensor:
        """KL at each generated position: the distributions that chose each
        generated token (rows prompt_len - 1 onwards)."""
        start = len(base.prompt_token_ids) - 1
        b = base.vocab_logprobs()[0, start:]
        s_ = steered.vocab_logprobs()[0, start:]
        return kl_per_position(b, s_)

    def sweep(
        self,
        prompt: str,
        *,
        steer: Steer,
        scales: Sequence[float],
        max_new_tokens: int = 16,
        **sampling: Any,
    ) -> Sweep:
        """``steer`` at each of ``scales`` on one prompt, all in ONE batch
        (plus an unsteered baseline when 0 is not among the scales)."""
        if not isinstance(prompt, str):
            raise VlensError("sweep takes one prompt string")
        if not isinstance(steer, Steer):
            raise VlensError("sweep takes one vlens.Steer as steer=")
        if not isinstance(scales, (list, tuple)) or not scales:
            raise VlensError("scales must be a non-empty list of numbers")
        variants = [steer.with_scale(float(x)) for x in scales]  # validates each
        _, (ids,) = self._check_prompts([prompt])
        self._check_steer(steer, len(ids), max_new_tokens)
        self._ship_vectors([steer])
        last = self.n_layers - 1
        reads = [Read("resid_post", (last,), "logprobs")]
        call = f"{self._name}-{next(self._calls)}"
        has_zero = any(float(x) == 0.0 for x in scales)
        items = []
        for j, st in enumerate(variants):
            steers = [] if st.scale == 0 else [st]
            plan = self._plan(f"{call}-{j}", 0, len(ids), reads, steers, [])
            items.append((ids, plan, self._sampling_params(max_new_tokens, True, plan, sampling)))
        if not has_zero:
            plan = self._plan(f"{call}-base", 0, len(ids), reads, [], [])
            items.append((ids, plan, self._sampling_params(max_new_tokens, True, plan, sampling)))
        outputs, collected = self._execute(items)
        plans = [it[1] for it in items]
        run = self._build_run([prompt] * len(items), [ids] * len(items), plans, outputs,
                              collected, True)
        traces = list(run)
        baseline = traces[[float(x) for x in scales].index(0.0)] if has_zero else traces[-1]
        steered = Run(traces[: len(scales)], prompts=[prompt] * len(scales))
        kl = [self._generated_kl(baseline, t) for t in steered]
        return Sweep(prompt, [float(x) for x in scales], steered, baseline, kl)

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
