"""benchmarks/results*.json -> docs/performance.md.

Everything in the doc that is a number comes from the JSON of a run; the
prose around it (what each condition is, where the time goes when a goal is
missed) is written here. ``run.py --render-only`` re-renders without
running anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import report_tables as rt
from report_text import (
    CLIENT_FIX, CLONE_TEXT, COMPILED_MODE, COMPILED_TABLE_TEXT, DEV, FLOOR_TEXT, GOALS_TEXT,
    GPU_PENDING, INTRO, LAYOUT_FIX, NNSIGHT_VLLM, NOISE, OFF_TEXT, OPS_FIX, PREAMBLE_TEXT, READS_FIX,
    SAE_TEXT, STEP_DESIGN, STEP_TEXT,
)
from suite import GOALS, LABELS

# the main table (eager engine, prefix caching on); the goals of the first
# performance issue are over these keys
ORDER = ["a", "a_star", "b", "c", "d", "e", "f", "g", "h", "i_read", "i_edit_off", "i_edit_on",
         "j", "m"]
MAIN_GOALS = ["b", "c", "d", "e", "f", "g", "h", "j"]
# every condition that runs vlens code (the worker table)
WORKER_ORDER = ["b", "c", "d", "e", "f", "g", "h", "i_read", "i_edit_off", "i_edit_on",
                "b_comp", "c_comp", "f_comp", "g_comp", "h_comp", "c_off", "f_off",
                "p_c", "p_f", "p_c_off", "p_f_off", "k32", "k256", "k32_comp", "k256_comp",
                "sae", "sae_comp"]
LETTER = {"i_read": "i", "i_edit_off": "i", "i_edit_on": "i", "a_star": "a*"}


def macs_per_token(cfg: dict) -> tuple[float, float]:
    """(the model's multiply-adds per token, the unembedding's), from its
    config; attention over the (short) context is left out."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = h // heads
    layer = h * (h + 2 * kv * head_dim) + h * h + 3 * h * inter
    return cfg["num_hidden_layers"] * layer + v * h, v * h


def lens_floor(cfg: dict) -> float:
    """Time ratio (h) could not go below if time followed multiply-adds: the
    logit lens at every layer runs the unembedding once more per layer."""
    model, unembed = macs_per_token(cfg)
    return 1 + cfg["num_hidden_layers"] * unembed / model


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _verdict(e: dict) -> str:
    """Whether a miss is outside the noise: the whole range past the goal."""
    g, ref = e["goal"], e["goal"]["relative_to"]
    r = e.get(f"ratio_to_{ref}")
    if r and r["min"] <= g["max_ratio"]:
        return (f"Its range ({r['min']:.2f}–{r['max']:.2f}) reaches below the goal: some "
                "repetitions met it, so part of this miss is the machine's noise.")
    return f"Every repetition missed it ({r['min']:.2f}–{r['max']:.2f})." if r else ""


def _w(m: dict, key: str) -> dict:
    return (m["conditions"].get(key) or {}).get("worker") or {}


def _analysis(key: str, r: dict) -> str | None:
    """What a missed goal costs and where, with the run's own figures."""
    models = [m for m in r["models"]
              if (m["conditions"].get(key) or {}).get("goal", {}).get("met") is False]
    if not models:
        return None
    head = {"b": "(b) idle hooks", "c": "(c) steering one layer", "d": "(d) steering every layer",
            "e": "(e) a vector per request", "f": "(f) reading one layer",
            "g": "(g) norms of every layer", "h": "(h) logit lens at every layer",
            "j": "(j) Hugging Face slower than (c)"}[key]
    parts = []
    for m in models:
        e = m["conditions"][key]
        w = _w(m, key)
        ref = e["goal"]["relative_to"]
        ratio = e.get(f"ratio_to_{ref}", {}).get("median")
        line = f"**{m['name']}**: {ratio:.2f} × ({ref}). {_verdict(e)}" if "max_ratio" in e["goal"] \
            else f"**{m['name']}**: {ratio:.2f} × ({ref})."
        if w and key != "b":
            line += (f" Inside vlens's worker: hooks {_pct(w['share_hooks'])} and step layout "
                     f"{_pct(w['share_layout'])} of the wall time ({w['hook_us_per_site']:,.0f} µs "
                     f"per hooked site and {w['layout_us_per_step']:,.0f} µs of layout per step); "
                     f"client side {_pct(w['share_client'])}.")
        if key == "h":
            line += (f" If time followed multiply-adds, the floor for this shape would be "
                     f"{lens_floor(m['config']):.2f}: the unembedding "
                     f"({m['config']['vocab_size']} × {m['config']['hidden_size']}) once more "
                     f"for each of {m['config']['num_hidden_layers']} layers.")
        parts.append(line)
    text = [f"### {head}", "", *[f"* {p}" for p in parts], ""]
    if key == "b":
        text.append(
            "vlens keeps 5 hooks per layer plus 2 on the model installed (pre-hooks on "
            "the decoder layer for `resid_pre` and `positions`, post-hooks on the layer, "
            "its attention and its MLP); with no plan each returns after one attribute "
            "check, but torch then runs those modules through its slower `_call_impl` "
            "path. In py-spy profiles of (b) 0.1 % of the samples were in vlens's hook "
            "functions and ~2 % in torch's `_call_impl` (which (a) also pays for "
            "vLLM's own modules); ten alternating a/b repetitions of the 512 × 8 model "
            f"gave {DEV['b_ratio_10']:.3f}. On the toy model a step is only ~5 ms, so the "
            "same microseconds weigh more. What is left to take: install a site's hooks "
            "only when a plan first asks for that site (and remove them after a while "
            "idle), so an idle engine runs vLLM's own fast path.")
    elif key in ("c", "d", "e"):
        text.append("Where it goes: the step layout and the write index built every step "
                    "(now one tensor each; below), and Python work between the model's "
                    "small kernels. The write itself (`add_rows`: `index_select` of the "
                    "vectors, a multiply, one `index_add_`) is small.")
        if key == "c":
            text.append("")
            text.append(
                "On the toy model every traced call pays a fixed price before it steers "
                "anything: before token text was cached, a `trace` whose plan reads and "
                f"writes nothing cost {DEV['t0']:.3f} × (a) in ten interleaved repetitions, "
                f"{DEV['t0_cached']:.3f} with the cache (then a patch in the benchmark "
                f"process, now in vlens); (c) cost {DEV['c']:.3f}, and {DEV['c_cached']:.3f} "
                "with the cache. Of what remains, "
                "the step layout and the write index are most; a last few percent could not "
                "be pinned on any vlens function (in profiles the model's own kernels ran "
                "slightly longer in planned runs: on a model whose kernels take microseconds, "
                "Python work between them costs more than its own samples show).")
    elif key == "f":
        text.append("Where it goes: the per-step gather and copy of the rows read, and "
                    "collecting them after the run (below).")
    elif key == "g":
        text.append(
            "Where it goes: a gather, a norm and a split per layer per step (reads are now "
            "batched over requests; below), plus appending each request's chunk. On the toy "
            "model a decode step is a few milliseconds, so even these small operations at "
            "every layer show.")
    elif key == "h":
        text.append(
            "The lens (`lens_logits`, vlens/protocol/sites.py) first ran once per request per layer "
            "per step: in a decode step the unembedding ran as 32 matrix-vector products, "
            "each reading the whole unembedding matrix (py-spy: ~60 % of all samples of (h) "
            "in the `onednn_mm` of `compute_logits`). It now runs once per (site, layer) per "
            "step over the gathered rows of every reading request, and takes the top-k from "
            "the logits (`logits.topk(k)`, probabilities `exp(top - logsumexp(logits))`) "
            "instead of a softmax of the whole vocabulary; in a prototype that cut the hook "
            f"time of (h) from {DEV['h_hook_s'][0]} s to {DEV['h_hook_s'][1]} s and the run "
            f"from {DEV['h_run_s'][0]} s to {DEV['h_run_s'][1]} s (ratio ~2.9 → ~1.75) with "
            "the same top-5 ids. What is left is the floor above: the lens at "
            "every layer is arithmetic the model itself does not do, and for a vocabulary "
            "8× the hidden size it adds ~60 % of the model's multiply-adds (on the toy "
            "model, whose unembedding is tiny, the per-request overhead is all of it). "
            "The 1.10 goal "
            "is within reach for a few layers (`logit_lens=` with `layers=[...]`), not for "
            "every layer of such a model, on any device where the unembedding costs "
            "what it does here.")
    elif key == "j":
        text.append(
            "On a model this small, vLLM's own per-step work (scheduling, input "
            "preparation, output processing, in Python) is most of a step, and "
            "transformers' `generate` loop is leaner: compare (j) with (a), which has no "
            "vlens in it at all. vlens adds only the (c)/(a) ratio on top of vLLM. On the "
            "larger model, where the forward pass dominates, (j) is slower than (c).")
    return "\n".join(text)


def _fmt_ratio(r: dict | None) -> str:
    if not r:
        return "–"
    return f"**{r['median']:.2f}** ({r['min']:.2f}–{r['max']:.2f})"


def _fmt_rate(t: dict | None) -> str:
    return rt.fmt_rate(t)


def _goal(entry: dict) -> str:
    return rt.goal_cell(entry)


def _bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def model_table(m: dict) -> str:
    c = m["conditions"]
    lines = [
        ("| | condition | tok/s, median (min–max) | time ratio to (a), median (min–max) "
         "| to (a*) | other ratio | goal |"),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in ORDER:
        e = c.get(key)
        if e is None:
            if key in m.get("errors", {}):
                lines.append(f"| ({LETTER.get(key, key)}) | {LABELS[key]} | did not run: "
                             f"{m['errors'][key]} | | | | |")
            continue
        other = []
        for ref in ("c", "f", "i_edit_off", "j"):
            r = e.get(f"ratio_to_{ref}")
            if r and not (key == "e" and ref == "a"):
                other.append(f"to ({LETTER.get(ref, ref)}{'' if ref in 'cfj' else ', off'}): {_fmt_ratio(r)}")
        lines.append(
            f"| ({LETTER.get(key, key)}) | {e['label']} | {_fmt_rate(e['tok_s'])} | "
            f"{_fmt_ratio(e.get('ratio_to_a')) if key != 'a' else '1'} | "
            f"{_fmt_ratio(e.get('ratio_to_a_star')) if key != 'a_star' else '1'} | {'; '.join(other)} | "
            f"{_goal(e)} |"
        )
    return "\n".join(lines)


def worker_table(m: dict) -> str:
    c = m["conditions"]
    lines = [
        ("| | condition | steps / run | hooked sites / step | layout µs / step | hooks µs / step "
        "| µs / hooked site | in the worker hooks | layout | client side |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in WORKER_ORDER:
        e = c.get(key)
        if not e or "worker" not in e:
            continue
        w = e["worker"]
        lines.append(
            f"| ({rt.tag(key)}) | {e['label']} | {w['steps_per_run']:.0f} | "
            f"{w['sites_per_step']} | {w['layout_us_per_step']:,.0f} | {w['hook_us_per_step']:,.0f} | "
            f"{w['hook_us_per_site']:,.0f} | {100 * w['share_hooks']:.1f} % | "
            f"{100 * w['share_layout']:.1f} % | {100 * w['share_client']:.1f} % |"
        )
    return "\n".join(lines)


def clone_table(m: dict) -> str:
    c = m["conditions"]
    rows = []
    f, on = c.get("f"), c.get("i_read")
    if f and on:
        rows.append(f"| read 1 layer (f), clone reads off | {_fmt_rate(f['tok_s'])} | 1 | "
                    f"{_bytes(f.get('copied_bytes'))} | – |")
        rows.append(f"| read 1 layer (f), clone reads on | {_fmt_rate(on['tok_s'])} | "
                    f"{_fmt_ratio(on.get('ratio_to_f'))} | {_bytes(on.get('copied_bytes'))} | – |")
    off, eon = c.get("i_edit_off"), c.get("i_edit_on")
    if off and eon:
        rows.append(f"| no-op `edit=` at 1 site, clone reads off | {_fmt_rate(off['tok_s'])} | 1 | "
                    f"{_bytes(off.get('copied_bytes'))} | 0 B |")
        rows.append(f"| no-op `edit=` at 1 site, clone reads on | {_fmt_rate(eon['tok_s'])} | "
                    f"{_fmt_ratio(eon.get('ratio_to_i_edit_off'))} | {_bytes(eon.get('copied_bytes'))} | "
                    f"{_bytes(eon.get('clone_bytes'))} |")
    if not rows:
        return ""
    return "\n".join([
        "| (i) | tok/s, median (min–max) | time ratio on/off | `run.copied_bytes` | bytes the clones copy |",
        "| --- | --- | --- | --- | --- |", *rows])


def _agreement(m: dict) -> str:
    out = []
    for key, what, other in (("c_vs_j", "Hugging Face (j)", "vlens's (c)"),
                             ("c_vs_m", "nnsight (m)", "vlens's (c)"),
                             ("j_vs_m", "nnsight (m)", "Hugging Face (j)")):
        a = (m.get("agreement") or {}).get(key)
        if a:
            out.append(f"{what} generated the same tokens as {other} for "
                       f"{a['identical']} of {a['of']} prompts (median common prefix "
                       f"{a['median_common_prefix']:.0f} tokens)")
    return "; ".join(out) + "." if out else ""


def tables(results: dict) -> str:
    """The per-model tables alone (printed at the end of a run)."""
    parts = []
    for m in results["models"]:
        parts.append(f"\n{m['name']}\n" + model_table(m))
        for table in (rt.compiled_table(m), rt.sae_table(m), rt.floor_table(m), rt.off_table(m),
                      rt.preamble_table(m), rt.step_table(m), worker_table(m)):
            if table:
                parts.append("\n" + table)
    return "\n".join(parts)


def _model_line(m: dict) -> str:
    cfg = m["config"]
    params = cfg.get("parameters")
    size = f"{params / 1e6:.1f}M parameters, " if params else ""
    return (f"{(cfg.get('architectures') or ['?'])[0]}, {size}hidden {cfg['hidden_size']}, "
            f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads, MLP "
            f"{cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, {cfg.get('dtype')}")


def _meta(r: dict) -> list[str]:
    meta = r["meta"]
    mach, ver, load, st = meta["machine"], meta["versions"], meta.get("load", {}), meta["settings"]
    during = load.get("load1_during") or {}
    v = ", ".join(f"{k} {val}" for k, val in ver.items() if k not in ("python", "vlens_tree"))
    lines = [
        f"* **Command**: `{meta['command']}`"
        + (" (what `make bench` runs)" if not meta.get("argv") else "")
        + f", started {meta['started']}, "
        f"**{meta['wall_s'] / 60:.1f} minutes** wall time in all.",
        f"* **Machine**: {mach.get('cpu', mach.get('machine'))}, {mach.get('cpus')} cores, "
        f"{mach.get('memory_gib', '?')} GiB"
        + (f", GPU {mach['gpu']}" if mach.get("gpu") else ", no GPU")
        + f"; {mach.get('platform')}; Python {mach.get('python')}.",
        f"* **Versions**: {v}" + (" (vlens working tree modified)" if ver.get("vlens_tree") == "modified" else "") + ".",
        (f"* **How busy the machine was**: load average (1, 5, 15 min) "
        f"{', '.join(map(str, load.get('loadavg_before', [])))} before and "
        f"{', '.join(map(str, load.get('loadavg_after', [])))} after; 1-minute load during the run "
        f"{during.get('median')} median ({during.get('min')}–{during.get('max')}). Other processes used "
        f"{load.get('cpu_seconds_other_processes')} CPU-seconds while it ran (on average "
        f"{load.get('other_processes_cores_busy')} of the {mach.get('cpus')} cores); this benchmark "
        f"{load.get('cpu_seconds_this_benchmark')}."),
        f"* **Threads**: `OMP_NUM_THREADS={meta.get('omp_num_threads')}`.",
        (f"* **Workload**: {st['prompts']} prompts × {st['tokens']} new tokens, {st['sampling']}; "
        f"{st['reps']} interleaved repetitions asked for (HF and nnsight: {st['slow_reps']}), "
        f"within a {st['budget_s']:.0f} s budget."),
    ]
    return lines


def _engines_line(m: dict) -> str:
    """How each engine of the model was built, and how long it took to start."""
    names = {"plain": "(a*) `vllm.LLM`", "eager": "vlens eager", "comp": "vlens compiled",
             "off": "vlens eager, caching off"}
    parts = []
    for role, e in (m.get("engines") or {}).items():
        kw = ", ".join(f"{k}={v!r}" for k, v in e["kwargs"].items())
        what = "vllm.LLM(path, " if role == "plain" else "vlens.Session(path, "
        hooks = f", {e['hooks']} hooks" if e.get("hooks") else ""
        parts.append(f"{names.get(role, role)}: `{what}{kw})`, started in {e['start_s']} s{hooks}")
    return "; ".join(parts)


def _section(r: dict, gpu: bool) -> list[str]:
    out = _meta(r)
    for m in r["models"]:
        engines = _engines_line(m) or (
            f"`vlens.Session(path, {', '.join(f'{k}={v!r}' for k, v in m['engine_kwargs'].items())})`"
            f", started in {m['engine_start_s']} s, {m.get('hooks')} hooks")
        long = m.get("long_prompt_tokens")
        out += ["", f"### {m['name']}", "",
                f"{_model_line(m)}. Engines: {engines}. "
                f"Torch threads {m.get('torch_threads')}; environment "
                f"{', '.join(f'`{k}={v}`' for k, v in m.get('engine_env', {}).items())}. "
                f"Prompts of {m['prompt_tokens']['min']}–{m['prompt_tokens']['max']} tokens"
                + (f"; (p) prompts of {long['min']}–{long['max']} tokens" if long else "") + ". "
                f"Steering: a unit vector × {m['steer']['scale']} at `{m['steer']['site']}` of layer "
                f"{m['steer']['layer']}, every token. **{m['reps_done']} repetitions** done"
                + ("" if m.get("complete") else " (**some runs did not produce every token**)") + "."]
        if m.get("note"):
            out += ["", f"Note: {m['note']}."]
        out += ["", model_table(m), ""]
        for title, table, text in (
                ("vlens compiled, against plain vLLM at its defaults (a*)", rt.compiled_table(m),
                 COMPILED_TABLE_TEXT),
                ("SAE features (sae), and the SAELens way", rt.sae_table(m), SAE_TEXT),
                ("The logit lens against its arithmetic floor", rt.floor_table(m), FLOOR_TEXT),
                ("Per step, at 32 requests and at the wide batch (k)", rt.step_table(m),
                 STEP_TEXT.format(wide=r["meta"]["settings"].get("wide", 256),
                                  k_tokens=r["meta"]["settings"].get("k_tokens", 32),
                                  prompts=r["meta"]["settings"]["prompts"],
                                  layers=m.get("k_layers"))),
                ("A shared preamble, where the prefix cache can hit (p)", rt.preamble_table(m),
                 PREAMBLE_TEXT),
                ("Prefix caching off (the setting of earlier runs)", rt.off_table(m), OFF_TEXT)):
            if table:
                out += [f"#### {title}", "", text, "", table, ""]
        ct = clone_table(m)
        if ct:
            out += ["Clone reads (i):", "", ct, ""]
        agr = _agreement(m)
        if agr:
            out += [f"Same steering in every tool: {agr} (A sanity check, not a test: "
                    "vLLM's float32 kernels round differently from transformers', "
                    "and a small trained model has near-ties in its greedy choices: without "
                    "any steering, vLLM and HF agreed on "
                    f"{DEV['unsteered_agree']} of 32 prompts of the toy model while this "
                    "benchmark was written. The random model's logits have no such ties.)", ""]
        out += ["Inside the worker (k), from `s.status()` counters (rank 0), per planned step:",
                "", worker_table(m), ""]
    return out


def _goal_summary(r: dict) -> list[str]:
    lines = ["| goal | " + " | ".join(m["name"] for m in r["models"]) + " |",
             "| --- |" + " --- |" * len(r["models"])]
    for key in MAIN_GOALS:
        cells = []
        for m in r["models"]:
            e = m["conditions"].get(key)
            if not e or not e.get("goal"):
                cells.append("–")
                continue
            g = e["goal"]
            ref = g["relative_to"]
            ratio = e.get(f"ratio_to_{ref}")
            mark = "met" if g["met"] else "**missed**"
            cells.append(f"{ratio['median']:.2f} × ({ref}): {mark}" if ratio else "–")
        want = (f"≤ {GOALS[key][1]:.2f} × ({GOALS[key][0]})" if key in GOALS
                else "slower than (c)")
        lines.append(f"| ({key}) {want} | " + " | ".join(cells) + " |")
    return lines + rt.compiled_goal_rows(r)


def _missed(r: dict) -> list[str]:
    missed = []
    for key in MAIN_GOALS:
        for m in r["models"]:
            g = (m["conditions"].get(key) or {}).get("goal")
            if g and g["met"] is False:
                missed.append(key)
                break
    return missed


def render(cpu: dict | None, gpu: dict | None, sae: dict | None = None) -> str:
    out = [INTRO]
    if cpu:
        out += [GOALS_TEXT, *_goal_summary(cpu), ""]
        missed = _missed(cpu)
        if missed:
            out += ["## Where the time goes (goals missed)", "",
                    ("For each missed goal: the run's figures, what the profiles showed, what "
                    "was changed, and what is left. (Profiles: py-spy on a run of each "
                    "condition. The changes marked done are in the code measured above; "
                    "'prototype' figures were taken on a scratch patch before they landed.)"),
                    ""]
            for key in missed:
                text = _analysis(key, cpu)
                if text:
                    out += [text, ""]
            themes = []
            if set(missed) & {"c", "d", "e"}:
                themes += ["**The write index, every step.** " + LAYOUT_FIX, ""]
            if set(missed) & {"f", "g", "h"}:
                themes += ["**Reads, batched per step.** " + READS_FIX, ""]
            if set(missed) & {"c", "d", "e", "f", "g"}:
                themes += ["**Tokens as text, cached.** " + CLIENT_FIX, ""]
            themes += ["**Compiled mode: the operators' dispatch.** " + OPS_FIX, ""]
            if themes:
                out += ["### What was changed, and what is left", ""] + themes
        out += [CLONE_TEXT, ""]
        out += [STEP_DESIGN, ""]
        out += [COMPILED_MODE, ""]
        out += ["## CPU figures", ""] + _section(cpu, gpu=False)
        out += sae_section(sae, cpu)
        out += _extras(cpu)
    else:
        out += ["## CPU figures", "", "Pending: no `benchmarks/results.json` yet.", ""]
    out += ["## GPU figures", ""]
    if gpu:
        out += _section(gpu, gpu=True)
    else:
        out += [GPU_PENDING]
    out += [NOISE]
    return "\n".join(out).rstrip() + "\n"


def _extras(r: dict) -> list[str]:
    out = ["### nnsight's vLLM backend", ""]
    p = r.get("nnsight_vllm")
    if not p:
        out += ["Not tried in this run.", ""]
    elif p.get("ran"):
        out += [(f"nnsight's `VLLM` built an engine on this machine and steered a request "
                f"({p.get('seconds')} s)."), ""]
    else:
        stage = f" at {p['stage']}" if p.get("stage") else ""
        out += [f"Did not run on this machine: it failed{stage} with `{p.get('error')}` "
                f"(after {p.get('seconds', '?')} s). " + NNSIGHT_VLLM, ""]
    out += _serve_section(r.get("serve"))
    out += ["### Widget latencies (l)", ""]
    w = r.get("widgets") or {}
    if w.get("status") == "pending":
        out += [(f"Pending: {w.get('why')}. When that script lands, `make bench` runs it "
                "(`benchmarks/widget_latency.py --json FILE`) and puts its figures here."), ""]
    elif w.get("figures"):
        out += [(f"From `{_portable(w.get('command'))}` ({w.get('seconds')} s, run after the other "
                "conditions, in its own process):"), ""]
        out += [f"* {f['line']}" for f in w["figures"]] + [""]
        if w.get("status") != "ran":
            out += [f"It then failed: `{w.get('error')}`.", ""]
    else:
        out += [f"`benchmarks/widget_latency.py` {w.get('status')}: `{w.get('error') or w.get('why')}`.", ""]
    return out


def _portable(command: str | None) -> str:
    """A recorded command with the measuring machine's checkout paths made
    relative to the repository (the page is read on other machines)."""
    return re.sub(r"(?<![\w.])/[^\s`]*?/(vlens|benchmarks|tests|scripts)/", r"\1/", command or "")


def _serve_section(s: dict | None) -> list[str]:
    """(s): throughput of 1, 4 and 16 clients of `vlens serve` (benchmarks/serve.py)."""
    out = ["### Connected clients (s)", ""]
    if not s or s.get("status") != "ran":
        why = (s or {}).get("why") or (s or {}).get("error") or "not measured in this run"
        return out + [f"`benchmarks/serve.py`: {why}.", ""]
    out += [(f"`benchmarks/serve.py` ({s.get('seconds')} s): {s['model']}, each client making "
             f"{s['calls_per_client']} calls ({s['call']}) in its own thread, through its own "
             "`vlens.connect` to one `vlens serve` on loopback, then the same calls on one "
             "in-process Session (which runs one batch at a time). Tokens generated per "
             "second, all clients together:"), "",
            "| clients | connected (tok/s) | in-process (tok/s) | connected / in-process |",
            "| --- | --- | --- | --- |"]
    out += [f"| {r['clients']} | {r['remote_tok_s']} | {r['local_tok_s']} | {r['ratio']} |"
            for r in s["rows"]]
    note = f" ({s['note']})" if s.get("note") else ""
    return out + ["", ("One client pays for HTTP and the server's checks; several clients' "
                       f"calls share the engine's steps, where in-process calls queue{note}."),
                  ""]


def sae_section(sae: dict | None, cpu: dict | None) -> list[str]:
    """The SAE conditions from their own short run (``results-sae.json``),
    when the main CPU run has none of them."""
    if not sae or (cpu and any(k.startswith("sae") for m in cpu["models"]
                               for k in m["conditions"])):
        return []
    out = ["### SAE features (sae): a separate short run", "",
           ("The main run above predates the SAE conditions; these figures come from a run "
            "of those conditions alone (with their references (a) and (a*), paired per "
            "repetition as everywhere here):"), "", *_meta(sae)]
    for m in sae["models"]:
        out += ["", f"{m['name']}: {_model_line(m)}. Engines: {_engines_line(m)}. "
                f"**{m['reps_done']} repetitions** done.", "", SAE_TEXT, "", rt.sae_table(m)]
        model, _ = macs_per_token(m["config"])
        enc = m["config"]["hidden_size"] * 4096
        comp = (m["conditions"].get("sae_comp") or {}).get("worker") or {}
        ratio = ((m["conditions"].get("sae_comp") or {}).get("ratio_to_a_star") or {})
        gap = ratio.get("median", 1.0) - 1.0
        out += ["", (f"The encoder alone is {enc / 1e6:.1f} M multiply-adds per token against "
                     f"the model's {model / 1e6:.1f} M ({_pct(enc / model)}). On a CPU it runs on "
                     "the kernel the engine's own linear layers use (vLLM's oneDNN product, the "
                     "encoder packed once when the SAE reaches the worker: "
                     "vlens/worker/gemm.py), about twice as fast as `torch.addmm` for this "
                     "shape, and a decode step's few rows wait to be encoded 256 at a time "
                     "(vlens/worker/features.py; the rows left waiting at the end are encoded "
                     "when the records are collected, in the client's share). The workers' "
                     "counters put the hooks (gather, encode and top-k) at "
                     f"{_pct(comp.get('share_hooks', 0))} of (sae*)'s time, the step's layout at "
                     f"{_pct(comp.get('share_layout', 0))} and the client at "
                     f"{_pct(comp.get('share_client', 0))}, against a median gap to (a*) of "
                     f"{_pct(gap)} in this run.")]
    return out + [""]


def write(doc: Path, cpu_json: Path, gpu_json: Path) -> None:
    cpu = json.loads(cpu_json.read_text()) if cpu_json.exists() else None
    gpu = json.loads(gpu_json.read_text()) if gpu_json.exists() else None
    sae_json = cpu_json.with_name("results-sae.json")
    sae = json.loads(sae_json.read_text()) if sae_json.exists() else None
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(cpu, gpu, sae))


def load(path: Path) -> Any:
    return json.loads(Path(path).read_text())
