"""JSONL results -> the figures the report shows. A results file holds runs;
each run is a ``run`` line (the machine, versions, settings, command), one
``measurement`` line per timed run of one condition, a ``model`` line per
model (its config, engines, errors, agreement), ``result`` lines (nnsight's
vLLM backend, widgets, connected clients, patching) and an ``end`` line
(load, wall time). Ratios are paired per repetition, then summarised as
median (min-max)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .conditions import REGISTRY, STEP_GOALS

DECODE = ("decode_steps", "decode_layout_ns", "decode_hook_ns", "decode_reduce_ns")


def read(path: Path) -> dict[str, list[dict]]:
    """The runs of a JSONL file by suite, newest last: {suite: [run lines...]}."""
    runs: dict[str, list[dict]] = {}
    by_id: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            by_id.setdefault(d["run"], []).append(d)
    for lines in by_id.values():
        runs.setdefault(lines[0].get("suite", "main"), []).append(lines)
    return runs


def latest(path: Path, suite: str) -> dict | None:
    """The newest run of ``suite`` in ``path``, summarised (None: none)."""
    if not Path(path).exists():
        return None
    runs = read(path).get(suite)
    return summarise_run(runs[-1]) if runs else None


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _paired(runs: list[dict], ref: list[dict], floor: list[dict] | None = None) -> dict | None:
    """Repetition i against repetition i of ``ref`` (plus the lens's floor's, if given)."""
    n = min(len(ref), len(runs), len(floor) if floor is not None else len(runs))
    return _summary([runs[i]["seconds"] / (ref[i]["seconds"] + (floor[i]["seconds"] if floor else 0))
                     for i in range(n)]) if n else None


def per_step(steps: float, layout_ns: float, hook_ns: float, reduce_ns: float,
             sites: int) -> dict[str, float]:
    """Microseconds per planned step (layout, hooks) and per hooked site."""
    if not steps:
        return {k: 0.0 for k in ("layout_us_per_step", "hook_us_per_step", "hook_us_per_site",
                                 "reduce_us_per_site", "overhead_us_per_site")}
    per_site = steps * sites if sites else None
    return {"layout_us_per_step": layout_ns / steps / 1e3, "hook_us_per_step": hook_ns / steps / 1e3,
            "hook_us_per_site": hook_ns / per_site / 1e3 if per_site else 0.0,
            "reduce_us_per_site": reduce_ns / per_site / 1e3 if per_site else 0.0,
            "overhead_us_per_site": (hook_ns - reduce_ns) / per_site / 1e3 if per_site else 0.0}


def worker(runs: list[dict]) -> dict[str, Any]:
    """The workers' counters over a condition's runs."""
    n, sites = len(runs), runs[0].get("sites", 0)

    def tot(k: str) -> float:
        return sum(r["counters"].get(k, 0) for r in runs)

    total, planned = sum(r["seconds"] for r in runs), tot("steps_planned")
    out: dict[str, Any] = {
        "steps_per_run": tot("steps") / n, "planned_steps_per_run": planned / n,
        "sites_per_step": sites,
        **per_step(planned, tot("layout_s") * 1e9, tot("hook_s") * 1e9, tot("reduce_s") * 1e9, sites),
        "share_layout": tot("layout_s") / total, "share_hooks": tot("hook_s") / total,
        "share_client": max(0.0, total - tot("generate_s")) / total}
    d = {k: tot(k) for k in DECODE}
    if d["decode_steps"]:
        out["decode"] = {"steps_per_run": d["decode_steps"] / n,
                         **per_step(d["decode_steps"], d["decode_layout_ns"], d["decode_hook_ns"],
                                    d["decode_reduce_ns"], sites)}
    return out


def summarise(samples: dict[str, list[dict]]) -> dict[str, dict]:
    """Per condition: throughput, paired time ratios, goals, worker figures."""
    out: dict[str, dict] = {}
    get = samples.get
    a, a_star, floor = get("plain_vllm", []), get("plain_vllm_compiled", []), get("logit_lens_floor", [])
    for name, runs in samples.items():
        c = REGISTRY[name]
        e: dict[str, Any] = {"label": c.label, "reps": len(runs),
                             "seconds": [r["seconds"] for r in runs],
                             "tok_s": _summary([r["tokens"] / r["seconds"] for r in runs])
                             if runs[0]["tokens"] else None,
                             "tokens": runs[0]["tokens"], "complete": all(r["complete"] for r in runs)}
        if name not in ("plain_vllm", "logit_lens_floor"):
            e["ratio_to_plain_vllm"] = _paired(runs, a)
        if name not in ("plain_vllm_compiled", "logit_lens_floor"):
            e["ratio_to_plain_vllm_compiled"] = _paired(runs, a_star)
        for ref in c.refs:
            e[f"ratio_to_{ref}"] = _paired(runs, get(ref, []))
        if name == "logit_lens_every_layer":
            e["ratio_to_floor"] = _paired(runs, a, floor)
        if name == "logit_lens_every_layer_compiled":
            e["ratio_to_floor_compiled"] = _paired(runs, a_star, floor)
        if name == "logit_lens_floor":
            e["ratio_to_plain_vllm"] = _summary([1 + f["seconds"] / x["seconds"]
                                                 for f, x in zip(runs, a)]) if a else None
            e["macs"] = runs[0]["extra"].get("macs")
        if c.goal:
            r = e.get(f"ratio_to_{c.goal[0]}")
            e["goal"] = {"relative_to": c.goal[0], "max_ratio": c.goal[1],
                         "met": None if r is None else r["median"] <= c.goal[1]}
        if name == "hf_steer" and get("steer_one_layer"):
            e["goal"] = {"relative_to": "steer_one_layer", "min_ratio": 1.0,
                         "met": e["ratio_to_steer_one_layer"]["median"] > 1.0}
        e.update({k: v for k, v in runs[0]["extra"].items() if k != "macs"})
        if not c.plain:
            e["worker"] = worker(runs)
        out[name] = e
    return out


def _view(w32: dict, ww: dict) -> dict[str, Any]:
    """32 requests against the wide batch: the figures, their growth, goals."""
    def growth(key: str) -> float | None:
        return ww[key] / w32[key] if w32.get(key) else None

    def at(w: dict) -> dict[str, float]:
        return {"layout_us": w["layout_us_per_step"], "site_us": w["hook_us_per_site"],
                "reduce_us": w.get("reduce_us_per_site"),
                "steps": w.get("planned_steps_per_run", w.get("steps_per_run"))}

    gl, gs = growth("layout_us_per_step"), growth("hook_us_per_site")
    g = STEP_GOALS
    return {"at_32": at(w32), "wide": at(ww), "growth_layout": gl, "growth_site": gs,
            "overhead_us": {"at_32": w32.get("overhead_us_per_site"),
                            "wide": ww.get("overhead_us_per_site")},
            "goals": {"layout": ww["layout_us_per_step"] <= g["layout_us"],
                      "site": ww["hook_us_per_site"] <= g["site_us"],
                      "growth": gl is not None and gs is not None and max(gl, gs) <= g["growth"]}}


def step_costs(summary: dict) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for mode, suffix in (("eager", ""), ("compiled", "_compiled")):
        k32, wide = summary.get(f"step_cost_32{suffix}"), summary.get(f"step_cost_wide{suffix}")
        if k32 and wide:
            w32, ww = k32["worker"], wide["worker"]
            out[mode] = {**_view(w32, ww), "sites_per_step": w32["sites_per_step"]}
            if w32.get("decode") and ww.get("decode"):
                out[mode]["decode"] = _view(w32["decode"], ww["decode"])
    return out or None


def summarise_run(lines: list[dict]) -> dict:
    """One run's lines -> {meta, models: [...], <result name>: ...}."""
    head = next(x for x in lines if x["kind"] == "run")
    end = next((x for x in lines if x["kind"] == "end"), {})
    meta = {k: v for k, v in head.items() if k not in ("kind", "run", "suite")}
    meta.update(load=end.get("load", {}), wall_s=end.get("wall_s"))
    out: dict[str, Any] = {"meta": meta, "models": []}
    for m in (x for x in lines if x["kind"] == "model"):
        samples: dict[str, list[dict]] = {}
        for x in lines:
            if x["kind"] == "measurement" and x["model"] == m["model"]:
                samples.setdefault(x["condition"], []).append(x)
        for runs in samples.values():
            runs.sort(key=lambda x: x["rep"])
        conds = summarise(samples)
        model = {k: v for k, v in m.items() if k not in ("kind", "run")}
        model.update(name=m["model"], conditions=conds, step_costs=step_costs(conds),
                     complete=all(v["complete"] for v in conds.values()))
        out["models"].append(model)
    for x in lines:
        if x["kind"] == "result":
            out[x["name"]] = {k: v for k, v in x.items() if k not in ("kind", "run", "name")}
    return out
