"""The benchmark conditions on one model, run interleaved in one process.

``measure_model`` takes a live :class:`vlens.Session` and runs every
condition once per repetition, rotating the order each repetition so that no
condition always runs first or last, and keeps for each run its wall time,
the tokens generated, and what the workers' counters (``s.status()``) say
about time spent inside vlens's hooks. Ratios are taken per repetition
against the plain-vLLM run of the same repetition (paired), then the median
over repetitions is reported: on a shared machine the load drifts within
seconds, and pairing cancels most of it.

Conditions (the letters of the project's performance issue):

    a  plain vLLM: the same engine with vlens's hooks removed in place
    b  hooks installed, no plan on any request (idle cost)
    c  steer one layer, every request, one shared vector
    d  steer every layer
    e  steer one layer, each request its own vector
    f  read resid_post of one layer, every token, returned to the client
    g  read resid_post of every layer, reduced to norms in the worker
    h  logit lens top-5 at every layer, in the worker
    i  clone reads on vs off: (f) with clone reads on; and a no-op edit=
       function at one site with clone reads off / on
    j  Hugging Face transformers generate with a steering forward hook
    m  nnsight (transformers backend) steering the same way

Nothing here writes files; ``run.py`` turns the returned dict into the JSON
and the Markdown report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# (condition, relative to, goal): the aims of the performance issue, as time
# ratios (1.00 = as fast as the reference, higher = slower).
GOALS: dict[str, tuple[str, float]] = {
    "b": ("a", 1.02),
    "c": ("a", 1.03),
    "d": ("a", 1.10),
    "e": ("c", 1.05),
    "f": ("a", 1.10),
    "g": ("a", 1.05),
    "h": ("a", 1.10),
}

LABELS: dict[str, str] = {
    "a": "plain vLLM (vlens hooks removed)",
    "b": "vlens hooks installed, no plan",
    "c": "steer 1 layer, every request",
    "d": "steer every layer, every request",
    "e": "steer 1 layer, 32 distinct vectors",
    "f": "read resid_post of 1 layer (full)",
    "g": "read resid_post of every layer, norms",
    "h": "logit lens top-5 at every layer",
    "i_read": "(f) with clone reads on",
    "i_edit_off": "no-op edit= at 1 site, clone reads off",
    "i_edit_on": "no-op edit= at 1 site, clone reads on",
    "j": "HF transformers generate + steering hook",
    "m": "nnsight (transformers backend) steering",
}

# Conditions only some runs have (HF and nnsight are slow: fewer repetitions).
SLOW = ("j", "m")


def noop_edit(rows: torch.Tensor, ctx: Any) -> None:
    """The edit function of (i): looks, changes nothing."""


@dataclass
class Sample:
    """One timed run of one condition."""

    seconds: float
    tokens: int
    # where the time went (seconds): the engine's generate call, the workers'
    # vlens code (layout + hooks, from s.status()), and RPCs to the workers
    generate_s: float = 0.0
    worker_layout_s: float = 0.0
    worker_hook_s: float = 0.0
    steps: int = 0
    steps_planned: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class _Timer:
    """Adds up the wall time of calls to one bound method (benchmark-only
    instrumentation: it wraps the Engine instance's attribute, nothing in
    vlens changes)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.inner = getattr(obj, name)
        self.total = 0.0
        setattr(obj, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t0

    def restore(self) -> None:
        if self.obj.__dict__.get(self.name) is self:
            del self.obj.__dict__[self.name]


def make_prompts(tokenizer: Any, n: int) -> list[str]:
    """``n`` prompts of 7 to 33 words, cycling through ordinary vocabulary
    entries. Deterministic, and the same for every condition."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab_n = len(tokenizer)
    words = []
    for i in range(8, min(vocab_n, 400)):
        if i in special:
            continue
        w = tokenizer.convert_ids_to_tokens(i)
        w = str(w).replace("Ġ", "").replace("▁", "").strip()
        if w and w.isprintable() and " " not in w:
            words.append(w)
        if len(words) >= 96:
            break
    prompts = []
    for i in range(n):
        length = 7 + (i * 5) % 27
        start = (i * 13) % len(words)
        prompts.append(" ".join(words[(start + j) % len(words)] for j in range(length)))
    return prompts


def unit_vectors(n: int, hidden: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, hidden, generator=gen)
    return v / v.norm(dim=-1, keepdim=True)


@dataclass
class Setup:
    """What every condition of one model shares."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    tokens: int  # new tokens per prompt
    layer: int  # the one layer of (c), (e), (f), (i), (j), (m)
    scale: float
    vectors: torch.Tensor  # [n_prompts, hidden]; row 0 is the shared vector


def _status(s: Any) -> dict[str, int]:
    st = s.status()
    return {k: int(st.get(k, 0)) for k in ("layout_ns", "hook_ns", "steps_planned", "steps_seen")}


class Conditions:
    """The runnable conditions of one model. Each ``run_<key>`` returns
    ``(tokens generated, extra figures)``."""

    def __init__(self, s: Any, setup: Setup, *, hf: Any = None, nns: Any = None) -> None:
        import vlens

        self.s = s
        self.setup = setup
        self.hf = hf
        self.nns = nns
        n_layers = s.n_layers
        L, sc, vecs = setup.layer, setup.scale, setup.vectors
        self.shared = vlens.Steer(vecs[0], layer=L, scale=sc)
        self.every_layer = [vlens.Steer(vecs[0], layer=i, scale=sc) for i in range(n_layers)]
        self.distinct = [[vlens.Steer(v, layer=L, scale=sc)] for v in vecs]
        from vllm import SamplingParams

        self.params = SamplingParams(temperature=0.0, max_tokens=setup.tokens, ignore_eos=True)
        self.engine_prompts = [{"prompt_token_ids": ids} for ids in setup.prompt_ids]
        # hooked (site, layer) pairs each condition touches per step: for (k)
        self.sites_touched = {
            "c": 1, "d": n_layers, "e": 1, "f": 1, "g": n_layers, "h": n_layers,
            "i_read": 1, "i_edit_off": 1, "i_edit_on": 1,
        }

    def available(self) -> list[str]:
        keys = ["a", "b", "c", "d", "e", "f", "g", "h", "i_read", "i_edit_off", "i_edit_on"]
        if self.hf is not None:
            keys.append("j")
        if self.nns is not None:
            keys.append("m")
        return keys

    # -- the engine without vlens, and idle ---------------------------------
    def _plain(self, prompts=None, params=None) -> tuple[int, dict]:
        outs = self.s.engine.generate(prompts or self.engine_prompts, params or self.params)
        return sum(len(o.outputs[0].token_ids) for o in outs), {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]
        }

    def run_a(self, **kw) -> tuple[int, dict]:
        return self._plain(**kw)

    def run_b(self, **kw) -> tuple[int, dict]:
        return self._plain(**kw)

    # -- vlens ----------------------------------------------------------------
    def _trace(self, prompts=None, tokens=None, **kw) -> tuple[int, dict]:
        run = self.s.trace(prompts or self.setup.prompts,
                           max_new_tokens=tokens or self.setup.tokens,
                           logprobs=False, ignore_eos=True, **kw)
        extra = {
            "copied_bytes": run.copied_bytes,
            "steered_rows": sum(t.steered_rows for t in run),
            "rows": sum(t.n_tokens for t in run),
            "token_ids": [list(t.output_token_ids) for t in run],
        }
        return sum(len(t.output_token_ids) for t in run), extra

    def run_c(self, **kw):
        return self._trace(sites=[], steer=self.shared, **kw)

    def run_d(self, **kw):
        every = vlens.PerPrompt([self.every_layer] * len(self.setup.prompts))
        return self._trace(sites=[], steer=every, **kw)

    def run_e(self, prompts=None, **kw):
        steer = self.distinct if prompts is None else self.distinct[: len(prompts)]
        return self._trace(prompts=prompts, sites=[], steer=vlens.PerPrompt(steer), **kw)

    def run_f(self, **kw):
        return self._trace(layers=[self.setup.layer], sites=["resid_post"], **kw)

    def run_g(self, **kw):
        return self._trace(layers=None, sites=["resid_post"], reduce="norm", **kw)

    def run_h(self, **kw):
        return self._trace(layers=None, sites=[], logit_lens=5, **kw)

    def _with_clone(self, on: bool, fn: Callable, **kw):
        before = self.s.clone_reads
        self.s.clone_reads = on
        try:
            return fn(**kw)
        finally:
            self.s.clone_reads = before

    def run_i_read(self, **kw):
        return self._with_clone(True, self.run_f, **kw)

    def _edit(self, **kw):
        tokens, extra = self._trace(sites=[], edit=noop_edit,
                                    edit_at=[("resid_post", self.setup.layer)], **kw)
        # what clone reads copy for the edit function: each call's rows once,
        # [rows, hidden] float32 (vlens does not count these in copied_bytes)
        extra["clone_bytes"] = extra["rows"] * self.s.hidden_size * self._elem_size()
        return tokens, extra

    def _elem_size(self) -> int:
        dtype = str(self.s.engine.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return torch.empty(0, dtype=getattr(torch, dtype)).element_size()

    def run_i_edit_off(self, **kw):
        return self._with_clone(False, self._edit, **kw)

    def run_i_edit_on(self, **kw):
        return self._with_clone(True, self._edit, **kw)

    # -- other tools ----------------------------------------------------------
    def run_j(self, **kw):
        return self.hf.run(**kw)

    def run_m(self, **kw):
        return self.nns.run(**kw)


def timed(cond: Conditions, key: str, **kw) -> Sample:
    """One run of condition ``key``, with the worker counters around it."""
    s = cond.s
    engine = s.engine
    vlens_cond = key not in SLOW
    if key == "a":
        engine.rpc("vlens_teardown")
    try:
        st0 = _status(s) if vlens_cond else None
        gen = _Timer(engine, "generate") if vlens_cond else None
        try:
            t0 = time.perf_counter()
            tokens, extra = getattr(cond, f"run_{key}")(**kw)
            seconds = time.perf_counter() - t0
        finally:
            if gen is not None:
                gen.restore()
        sample = Sample(seconds, tokens, extra=extra)
        if vlens_cond:
            st1 = _status(s)
            sample.generate_s = gen.total
            sample.worker_layout_s = (st1["layout_ns"] - st0["layout_ns"]) / 1e9
            sample.worker_hook_s = (st1["hook_ns"] - st0["hook_ns"]) / 1e9
            sample.steps = st1["steps_seen"] - st0["steps_seen"]
            sample.steps_planned = st1["steps_planned"] - st0["steps_planned"]
    finally:
        if key == "a":
            engine.rpc("vlens_setup")
    return sample


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(samples: dict[str, list[Sample]], cond: Conditions, expected_tokens: int) -> dict:
    """Per condition: throughput, paired time ratios, worker figures (k)."""
    out: dict[str, Any] = {}
    a = samples.get("a", [])
    c = samples.get("c", [])
    for key, runs in samples.items():
        if not runs:
            continue
        entry: dict[str, Any] = {
            "label": LABELS[key],
            "reps": len(runs),
            "seconds": [r.seconds for r in runs],
            "tok_s": _summary([r.tok_s for r in runs]),
            "tokens": runs[0].tokens,
            "complete": all(r.tokens == expected_tokens for r in runs),
        }

        def paired(ref: list[Sample], runs: list[Sample] = runs) -> dict[str, float] | None:
            # repetition i of this condition against repetition i of ref
            n = min(len(ref), len(runs))
            if not n:
                return None
            return _summary([runs[i].seconds / ref[i].seconds for i in range(n)])

        if key != "a":
            entry["ratio_to_a"] = paired(a)
        if key in ("e", "j", "m"):
            entry["ratio_to_c"] = paired(c)
        if key == "i_read":
            entry["ratio_to_f"] = paired(samples.get("f", []))
        if key == "i_edit_on":
            entry["ratio_to_i_edit_off"] = paired(samples.get("i_edit_off", []))
        if key == "m" and samples.get("j"):
            entry["ratio_to_j"] = paired(samples["j"])
        if key in GOALS:
            ref, goal = GOALS[key]
            r = entry.get(f"ratio_to_{ref}")
            entry["goal"] = {"relative_to": ref, "max_ratio": goal,
                             "met": None if r is None else r["median"] <= goal}
        if key == "j" and c:
            entry["goal"] = {"relative_to": "c", "min_ratio": 1.0,
                             "met": entry["ratio_to_c"]["median"] > 1.0}
        for name in ("copied_bytes", "clone_bytes", "steered_rows", "rows"):
            if name in runs[0].extra:
                entry[name] = runs[0].extra[name]
        if key not in SLOW:
            steps = sum(r.steps for r in runs)
            planned = sum(r.steps_planned for r in runs)
            layout = sum(r.worker_layout_s for r in runs)
            hook = sum(r.worker_hook_s for r in runs)
            total = sum(r.seconds for r in runs)
            gen = sum(r.generate_s for r in runs)
            sites = cond.sites_touched.get(key, 0)
            entry["worker"] = {
                "steps_per_run": steps / len(runs),
                "planned_steps_per_run": planned / len(runs),
                "sites_per_step": sites,
                "layout_us_per_step": layout / planned * 1e6 if planned else 0.0,
                "hook_us_per_step": hook / planned * 1e6 if planned else 0.0,
                "hook_us_per_site": hook / planned / sites * 1e6 if planned and sites else 0.0,
                "share_layout": layout / total,
                "share_hooks": hook / total,
                "share_client": max(0.0, total - gen) / total,
            }
        out[key] = entry
    return out


def agreement(samples: dict[str, list[Sample]], a: str, b: str) -> dict[str, Any] | None:
    """How many requests generated the same tokens under two conditions (a
    sanity check that the tools steered the same way, not an assertion)."""
    ra, rb = samples.get(a), samples.get(b)
    if not ra or not rb:
        return None
    x, y = ra[0].extra.get("token_ids"), rb[0].extra.get("token_ids")
    if x is None or y is None:
        return None
    same = sum(p == q for p, q in zip(x, y))
    prefix = [next((k for k, (u, v) in enumerate(zip(p, q)) if u != v), len(p)) for p, q in zip(x, y)]
    return {"identical": same, "of": len(x), "median_common_prefix": statistics.median(prefix)}


def measure_model(
    s: Any,
    setup: Setup,
    *,
    reps: int,
    slow_reps: int,
    hf: Any = None,
    nns: Any = None,
    keys: list[str] | None = None,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Warm every condition up, then ``reps`` interleaved repetitions (the
    slow HF and nnsight conditions only in the first ``slow_reps``). Stops
    early, after at least two repetitions, when ``deadline``
    (``time.monotonic()``) would be passed by another one."""
    cond = Conditions(s, setup, hf=hf, nns=nns)
    keys = [k for k in (keys or cond.available()) if k in cond.available()]
    expected = len(setup.prompts) * setup.tokens
    t_warm = time.perf_counter()
    few = setup.prompts[:4]
    few_ids = [{"prompt_token_ids": ids} for ids in setup.prompt_ids[:4]]
    from vllm import SamplingParams

    few_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for key in keys:  # every code path once, small, before any timing
        if key in ("a", "b"):
            timed(cond, key, prompts=few_ids, params=few_params)
        elif key in SLOW:
            getattr(cond, f"run_{key}")(warmup=True)
        else:
            timed(cond, key, prompts=few, tokens=4)
    log(f"    warm-up {time.perf_counter() - t_warm:.1f} s")
    samples: dict[str, list[Sample]] = {k: [] for k in keys}
    rep_times: list[float] = []
    done = 0
    for rep in range(reps):
        this = [k for k in keys if k not in SLOW or rep < slow_reps]
        if deadline is not None and done >= 2 and rep_times:
            projected = max(rep_times[-1], statistics.median(rep_times))
            if time.monotonic() + projected > deadline:
                log(f"    stopping after {done} repetitions: the time budget is spent")
                break
        shift = rep % len(this)
        order = this[shift:] + this[:shift]
        t_rep = time.perf_counter()
        for key in order:
            samples[key].append(timed(cond, key))
        rep_times.append(time.perf_counter() - t_rep)
        done += 1
        a_t = samples["a"][-1].seconds if samples.get("a") else float("nan")
        log(f"    rep {rep + 1}/{reps} ({rep_times[-1]:.0f} s): "
            + ", ".join(f"{k} {samples[k][-1].seconds / a_t:.2f}" for k in order if k != "a"))
    summary = summarise(samples, cond, expected)
    return {
        "conditions": summary,
        "reps_done": done,
        "agreement": {
            "c_vs_j": agreement(samples, "c", "j"),
            "c_vs_m": agreement(samples, "c", "m"),
            "j_vs_m": agreement(samples, "j", "m"),
        },
        "complete": all(v["complete"] for v in summary.values()),
    }
