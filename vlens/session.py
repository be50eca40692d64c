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

from vlens.errors import ClosedError, EngineError, VlensError
from vlens.plan import PLAN_KEY, make_plan
from vlens.results import Run, Trace, decode_tensor

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
        if not isinstance(sites, (list, tuple)) or not sites:
            raise VlensError(f"sites must be a site name or a list of them, got {sites!r}")
        known = self.sites
        for s in sites:
            if s not in known:
                raise VlensError(
                    f"unknown site {s!r}: this model has {', '.join(known)}"
                )
        return list(dict.fromkeys(sites))

    def _sampling_params(
        self, max_new_tokens: int, logprobs: bool, plan: dict | None, sampling: dict
    ):
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
        try:
            return SamplingParams(
                max_tokens=max_new_tokens,
                logprobs=0 if logprobs else None,
                prompt_logprobs=0 if logprobs else None,
                skip_reading_prefix_cache=True if plan else None,
                extra_args={PLAN_KEY: plan} if plan else None,
                **args,
            )
        except Exception as exc:  # vLLM's own validation errors vary by version
            raise VlensError(f"bad sampling settings {sampling!r}: {exc}") from None

    # -- running ------------------------------------------------------------
    def trace(
        self,
        prompts: str | Sequence[str],
        *,
        layers: int | Sequence[int] | None = None,
        sites: str | Sequence[str] = ("resid_post",),
        max_new_tokens: int = 16,
        logprobs: bool = True,
        background: Sequence[str] = (),
        **sampling: Any,
    ) -> Run:
        """Generate from each prompt and read ``sites`` at ``layers``.

        Greedy unless sampling settings say otherwise (``temperature``,
        ``top_p``, ``seed``, ``n`` … go to vLLM's ``SamplingParams``). All
        prompts run in one engine batch; every request reads only its own
        rows. Returns a :class:`~vlens.results.Run` with one trace per
        request (``n`` per prompt when ``n > 1``).

        ``background`` prompts run in the same engine batch with no plan,
        as other users' traffic would; their generated texts are in
        ``run.background_texts``.
        """
        engine = self._engine
        prompts, prompt_ids = self._check_prompts(prompts)
        layers = self._check_layers(layers)
        sites = self._check_sites(sites)
        reads = {site: layers for site in sites}
        call = f"{self._name}-{next(self._calls)}"
        tags = [f"{call}-{i}" for i in range(len(prompts))]
        params = [
            self._sampling_params(max_new_tokens, logprobs, make_plan(tag, reads), sampling)
            for tag in tags
        ]
        engine_prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        if background:
            _, bg_ids = self._check_prompts(list(background))
            plain = self._sampling_params(max_new_tokens, False, None, sampling)
            params += [plain] * len(bg_ids)
            engine_prompts += [{"prompt_token_ids": ids} for ids in bg_ids]
        with engine.lock:
            try:
                outputs = engine.generate(engine_prompts, params)
                collected = engine.rpc("vlens_collect", tags)[0]
            except BaseException:
                try:
                    engine.rpc("vlens_drop", tags)
                except Exception:
                    pass
                raise
        run = self._build_run(prompts, prompt_ids, tags, outputs, collected, logprobs)
        run.background_texts = [o.outputs[0].text for o in outputs[len(prompts) :]]
        return run

    def _build_run(self, prompts, prompt_ids, tags, outputs, collected, logprobs) -> Run:
        traces = []
        for i, (prompt, ids, tag, out) in enumerate(zip(prompts, prompt_ids, tags, outputs)):
            records = list(collected.get(tag, []))
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
                acts = {site: decode_tensor(p) for site, p in match["reads"].items()}
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
                        positions=match["positions"],
                        logprobs=_token_logprobs(out, comp, ids) if logprobs else [],
                        finish_reason=comp.finish_reason,
                        layers={s: p["layers"] for s, p in match["reads"].items()},
                        _acts=acts,
                        copied_bytes=match["copied_bytes"],
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
