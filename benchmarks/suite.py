"""The benchmark conditions on one model, run interleaved in one process.

``measure_model`` takes the model's live engines (engines.py) and runs every
condition (conditions.py) once per repetition, rotating the order each
repetition so that no condition always runs first or last, and keeps for
each run its wall time, the tokens generated, and what the workers' counters
(``s.status()``) say about time spent inside vlens's hooks. Ratios are taken
per repetition against the reference runs of the same repetition (paired),
then the median over repetitions is reported: on a shared machine the load
drifts within seconds, and pairing cancels most of it.

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
from conditions import FEW, LABELS, PLAIN, Conditions, Setup, noop_edit  # noqa: F401
from engines import engine_of

# (condition, relative to, goal): the aims of the performance issues, as
# time ratios (1.00 = as fast as the reference, higher = slower). "floor":
# (a) plus the lens's unembedding products; "floor_star": (a*) plus them.
GOALS: dict[str, tuple[str, float]] = {
    "b": ("a", 1.02),
    "c": ("a", 1.03),
    "d": ("a", 1.10),
    "e": ("c", 1.05),
    "f": ("a", 1.10),
    "g": ("a", 1.05),
    "h": ("a", 1.10),
    "c_comp": ("a_star", 1.03),
    "f_comp": ("a_star", 1.05),
    "g_comp": ("a_star", 1.10),
    "h_comp": ("floor_star", 1.10),
    "sae_comp": ("a_star", 1.10),
}
# per step at the wide batch, compiled: layout and per-site
# microseconds, and how much either may grow from 32 requests
STEP_GOALS = {"layout_us": 150.0, "site_us": 40.0, "growth": 1.5}


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
    worker_reduce_s: float = 0.0  # of worker_hook_s: the reads' arithmetic (sums, norms...)
    steps: int = 0
    steps_planned: int = 0
    # the same worker figures over decode steps alone (one new row per request)
    decode: dict[str, int] = field(default_factory=dict)
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


def long_prompts(tokenizer: Any, prompts: list[str], block: int = 128) -> tuple[list[str], list[list[int]]]:
    """(p)'s prompts: one shared preamble that fills at least one whole KV
    block of ``block`` tokens (only whole blocks are cached), then each of
    ``prompts``. Returns the texts and their token ids."""
    words = make_prompts(tokenizer, 40)
    preamble = ""
    i = 0
    while len(tokenizer(preamble)["input_ids"]) < block + 2:
        preamble = (preamble + " " + words[i % len(words)]).strip()
        i += 1
    texts = [preamble + " " + p for p in prompts]
    return texts, [list(tokenizer(x)["input_ids"]) for x in texts]


def unit_vectors(n: int, hidden: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, hidden, generator=gen)
    return v / v.norm(dim=-1, keepdim=True)


# the worker's counters over decode steps alone (s.status())
DECODE_KEYS = ("decode_steps", "decode_layout_ns", "decode_hook_ns", "decode_reduce_ns")


def _status(s: Any) -> dict[str, int]:
    st = s.status()
    return {k: int(st.get(k, 0)) for k in ("layout_ns", "hook_ns", "reduce_ns", "steps_planned",
                                        "steps_seen", *DECODE_KEYS)}



def timed(cond: Conditions, key: str, **kw) -> Sample:
    """One run of condition ``key``, with the worker counters around it."""
    s = cond.session(key)
    engine = engine_of(s) if s is not None else None
    counted = key not in PLAIN and s is not None
    teardown = key in PLAIN and s is not None  # plain vLLM on a vlens engine
    if teardown:
        engine.rpc("vlens_teardown")
    try:
        st0 = _status(s) if counted else None
        gen = _Timer(engine, "generate") if counted else None
        try:
            t0 = time.perf_counter()
            tokens, extra = cond.run(key, **kw)
            seconds = time.perf_counter() - t0
        finally:
            if gen is not None:
                gen.restore()
        sample = Sample(seconds, tokens, extra=extra)
        if counted:
            st1 = _status(s)
            sample.generate_s = gen.total
            sample.worker_layout_s = (st1["layout_ns"] - st0["layout_ns"]) / 1e9
            sample.worker_hook_s = (st1["hook_ns"] - st0["hook_ns"]) / 1e9
            sample.worker_reduce_s = (st1["reduce_ns"] - st0["reduce_ns"]) / 1e9
            sample.steps = st1["steps_seen"] - st0["steps_seen"]
            sample.steps_planned = st1["steps_planned"] - st0["steps_planned"]
            sample.decode = {k: st1[k] - st0[k] for k in DECODE_KEYS}
    finally:
        if teardown:
            engine.rpc("vlens_setup")
    return sample


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# paired references beyond (a) and (a*): condition -> references
EXTRA_REFS: dict[str, tuple[str, ...]] = {
    "e": ("c",), "j": ("c",), "m": ("c", "j"), "i_read": ("f",), "i_edit_on": ("i_edit_off",),
    "a_off": ("a",), "c_off": ("a_off",), "f_off": ("a_off",),
    "p_c": ("p_a",), "p_f": ("p_a",), "p_a_off": ("p_a",),
    "p_c_off": ("p_a_off", "p_a", "p_c"), "p_f_off": ("p_a_off", "p_a", "p_f"),
    "sae_hf": ("sae", "sae_comp", "j"),
}


def _paired(runs: list[Sample], ref: list[Sample]) -> dict[str, float] | None:
    """Repetition i of this condition against repetition i of ``ref``."""
    n = min(len(ref), len(runs))
    if not n:
        return None
    return _summary([runs[i].seconds / ref[i].seconds for i in range(n)])


def _to_floor(runs: list[Sample], base: list[Sample], floor: list[Sample]) -> dict | None:
    """Against the lens's arithmetic floor: the plain run plus the
    unembedding products alone, of the same repetition."""
    n = min(len(runs), len(base), len(floor))
    if not n:
        return None
    return _summary([runs[i].seconds / (base[i].seconds + floor[i].seconds) for i in range(n)])


def summarise(samples: dict[str, list[Sample]], cond: Conditions) -> dict:
    """Per condition: throughput, paired time ratios, worker figures (k)."""
    out: dict[str, Any] = {}
    a, a_star, floor = samples.get("a", []), samples.get("a_star", []), samples.get("h_floor", [])
    for key, runs in samples.items():
        if not runs:
            continue
        expected = cond.expected_tokens(key)
        entry: dict[str, Any] = {
            "label": LABELS[key],
            "reps": len(runs),
            "seconds": [r.seconds for r in runs],
            "tok_s": _summary([r.tok_s for r in runs]) if expected else None,
            "tokens": runs[0].tokens,
            "complete": all(r.tokens == expected for r in runs),
        }
        if key != "a" and key != "h_floor":
            entry["ratio_to_a"] = _paired(runs, a)
        if key != "a_star" and key != "h_floor":
            entry["ratio_to_a_star"] = _paired(runs, a_star)
        for ref in EXTRA_REFS.get(key, ()):
            entry[f"ratio_to_{ref}"] = _paired(runs, samples.get(ref, []))
        if key == "h":
            entry["ratio_to_floor"] = _to_floor(runs, a, floor)
        if key == "h_comp":
            entry["ratio_to_floor_star"] = _to_floor(runs, a_star, floor)
        if key == "h_floor":
            entry["ratio_to_a"] = _summary([1 + f.seconds / x.seconds for f, x in zip(runs, a)]) \
                if a else None  # (a) + products, as a ratio to (a)
            entry["macs"] = runs[0].extra.get("macs")
        if key in GOALS:
            ref, goal = GOALS[key]
            r = entry.get(f"ratio_to_{ref}")
            entry["goal"] = {"relative_to": ref, "max_ratio": goal,
                             "met": None if r is None else r["median"] <= goal}
        if key == "j" and samples.get("c"):
            entry["goal"] = {"relative_to": "c", "min_ratio": 1.0,
                             "met": entry["ratio_to_c"]["median"] > 1.0}
        for name in ("copied_bytes", "clone_bytes", "steered_rows", "rows", "cached_tokens",
                     "encoded_rows"):
            if name in runs[0].extra:
                entry[name] = runs[0].extra[name]
        if key not in PLAIN:
            entry["worker"] = _worker(runs, cond.sites_touched.get(key, 0))
        out[key] = entry
    return out


def _worker(runs: list[Sample], sites: int) -> dict[str, Any]:
    steps = sum(r.steps for r in runs)
    planned = sum(r.steps_planned for r in runs)
    layout = sum(r.worker_layout_s for r in runs)
    hook = sum(r.worker_hook_s for r in runs)
    reduce = sum(r.worker_reduce_s for r in runs)
    total = sum(r.seconds for r in runs)
    gen = sum(r.generate_s for r in runs)
    out: dict[str, Any] = {
        "steps_per_run": steps / len(runs),
        "planned_steps_per_run": planned / len(runs),
        "sites_per_step": sites,
        **per_step(planned, layout * 1e9, hook * 1e9, reduce * 1e9, sites),
        "share_layout": layout / total,
        "share_hooks": hook / total,
        "share_client": max(0.0, total - gen) / total,
    }
    d = {k: sum(r.decode.get(k, 0) for r in runs) for k in DECODE_KEYS}
    if d["decode_steps"]:  # the steady state: decode steps alone
        out["decode"] = {"steps_per_run": d["decode_steps"] / len(runs),
                         **per_step(d["decode_steps"], d["decode_layout_ns"],
                                     d["decode_hook_ns"], d["decode_reduce_ns"], sites)}
    return out


def per_step(steps: int, layout_ns: float, hook_ns: float, reduce_ns: float,
              sites: int) -> dict[str, float]:
    """Microseconds per planned step (layout, hooks) and per hooked site (all
    of it; the reads' own arithmetic; the rest, which is vlens's), from the
    worker's counters (also benchmarks/step_cost.py's figures)."""
    if not steps:
        return {"layout_us_per_step": 0.0, "hook_us_per_step": 0.0, "hook_us_per_site": 0.0,
                "reduce_us_per_site": 0.0, "overhead_us_per_site": 0.0}
    per_site = steps * sites if sites else None
    return {
        "layout_us_per_step": layout_ns / steps / 1e3,
        "hook_us_per_step": hook_ns / steps / 1e3,
        "hook_us_per_site": hook_ns / per_site / 1e3 if per_site else 0.0,
        # a norm over 8x the rows costs 8x; what vlens adds around it should not grow
        "reduce_us_per_site": reduce_ns / per_site / 1e3 if per_site else 0.0,
        "overhead_us_per_site": (hook_ns - reduce_ns) / per_site / 1e3 if per_site else 0.0,
    }


def step_costs(summary: dict) -> dict[str, Any] | None:
    """The per-step table: layout and per-site microseconds at
    32 requests and at the wide batch, per engine, with the goals; over
    every planned step, and (``decode``) over decode steps alone."""
    out: dict[str, Any] = {}
    for mode, suffix in (("eager", ""), ("compiled", "_comp")):
        k32, wide = summary.get(f"k32{suffix}"), summary.get(f"k256{suffix}")
        if not k32 or not wide:
            continue
        w32, ww = k32["worker"], wide["worker"]
        out[mode] = {**_step_view(w32, ww), "sites_per_step": w32["sites_per_step"]}
        if w32.get("decode") and ww.get("decode"):
            out[mode]["decode"] = _step_view(w32["decode"], ww["decode"])
    return out or None


def _step_view(w32: dict, ww: dict) -> dict[str, Any]:
    """32 requests against the wide batch: the figures, their growth, goals."""
    def growth(key: str) -> float | None:
        return ww[key] / w32[key] if w32.get(key) else None

    def at(w: dict) -> dict[str, float]:
        return {"layout_us": w["layout_us_per_step"], "site_us": w["hook_us_per_site"],
                "reduce_us": w.get("reduce_us_per_site"),
                "steps": w.get("planned_steps_per_run", w.get("steps_per_run"))}

    g = STEP_GOALS
    growth_layout, growth_site = growth("layout_us_per_step"), growth("hook_us_per_site")
    return {
        "at_32": at(w32), "wide": at(ww),
        "growth_layout": growth_layout, "growth_site": growth_site,
        "overhead_us": {"at_32": w32.get("overhead_us_per_site"),
                        "wide": ww.get("overhead_us_per_site"),
                        "growth": growth("overhead_us_per_site")},
        "goals": {
            "layout": ww["layout_us_per_step"] <= g["layout_us"],
            "site": ww["hook_us_per_site"] <= g["site_us"],
            "growth": growth_layout is not None and growth_site is not None
            and max(growth_layout, growth_site) <= g["growth"],
        },
    }


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


def _warm_up(cond: Conditions, key: str, setup: Setup) -> None:
    """Every code path once, small (4 prompts x 4 tokens), before any timing."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    base = cond.base(key)
    long = base.startswith("p_")
    ids = (setup.long_ids if long else setup.prompt_ids)[:4]
    texts = (setup.long_prompts if long else setup.prompts)[:4]
    if key in ("j", "m", "sae_hf"):
        getattr(cond, f"run_{key}")(warmup=True)
    elif key == "h_floor":
        cond.run(key)
    elif key in PLAIN:
        timed(cond, key, prompts=[{"prompt_token_ids": x} for x in ids], params=params)
    elif base == "b":
        timed(cond, key, prompts=[{"prompt_token_ids": x} for x in ids], params=params)
    else:
        timed(cond, key, prompts=texts, tokens=4)


def measure_model(
    sessions: dict[str, Any],
    setup: Setup,
    *,
    reps: int,
    slow_reps: int,
    plain: Any = None,
    floor: Any = None,
    hf: Any = None,
    nns: Any = None,
    hf_sae: Any = None,
    keys: list[str] | None = None,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Warm every condition up, then ``reps`` interleaved repetitions (the
    slow HF and nnsight conditions and the per-step ones only in the first
    ``slow_reps``). Stops early, after at least two repetitions, when
    ``deadline`` (``time.monotonic()``) would be passed by another one."""
    cond = Conditions(sessions, setup, plain=plain, floor=floor, hf=hf, nns=nns, hf_sae=hf_sae)
    keys = [k for k in (keys or cond.available()) if k in cond.available()]
    t_warm = time.perf_counter()
    failed: dict[str, str] = {}
    for key in keys:
        try:
            _warm_up(cond, key, setup)
        except Exception as exc:  # reported as "did not run", the others go on
            failed[key] = _short(exc)
            log(f"    ({key}) failed in its warm-up: {failed[key]}")
    keys = [k for k in keys if k not in failed]
    log(f"    warm-up {time.perf_counter() - t_warm:.1f} s")
    samples: dict[str, list[Sample]] = {k: [] for k in keys}
    rep_times: list[float] = []
    done = 0
    for rep in range(reps):
        this = [k for k in keys if k not in FEW or rep < slow_reps]
        if deadline is not None and done >= 2 and rep_times:
            projected = max(rep_times[-1], statistics.median(rep_times))
            if time.monotonic() + projected > deadline:
                log(f"    stopping after {done} repetitions: the time budget is spent")
                break
        shift = rep % len(this)
        order = this[shift:] + this[:shift]
        t_rep = time.perf_counter()
        for key in order:
            if key in failed:
                continue
            try:
                samples[key].append(timed(cond, key))
            except Exception as exc:
                failed[key] = f"in repetition {rep + 1}: {_short(exc)}"
                log(f"    ({key}) failed: {failed[key]}")
        rep_times.append(time.perf_counter() - t_rep)
        done += 1
        log(f"    rep {rep + 1}/{reps} ({rep_times[-1]:.0f} s): "
            + ", ".join(f"{k} {samples[k][-1].seconds:.2f}s" for k in order if k not in failed))
    summary = summarise({k: v for k, v in samples.items() if v}, cond)
    return {
        "conditions": summary,
        "reps_done": done,
        "step_costs": step_costs(summary),
        "k_layers": cond.k_layers,
        "agreement": {
            "c_vs_j": agreement(samples, "c", "j"),
            "c_vs_m": agreement(samples, "c", "m"),
            "j_vs_m": agreement(samples, "j", "m"),
            "c_vs_c_comp": agreement(samples, "c", "c_comp"),
        },
        "failed": failed,
        "complete": all(v["complete"] for v in summary.values()),
    }


def _short(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]
