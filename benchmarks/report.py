"""Stored results (benchmarks/results.py) -> docs/performance.md. The prose
is benchmarks/report.md: named blocks (``<!-- name -->``) whose ``{field}``
placeholders are filled here with the run's tables and figures."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from .conditions import REGISTRY, STEP_GOALS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
R = "ratio_to_"
A, A_STAR = "plain_vllm", "plain_vllm_compiled"
MAIN = ["plain_vllm", "plain_vllm_compiled", "hooks_idle", "steer_one_layer", "steer_every_layer",
        "steer_distinct_vectors", "read_one_layer", "norms_every_layer", "logit_lens_every_layer",
        "read_one_layer_clone", "noop_edit", "noop_edit_clone", "hf_steer", "nnsight_steer"]
MAIN_GOALS = ["hooks_idle", "steer_one_layer", "steer_every_layer", "steer_distinct_vectors",
              "read_one_layer", "norms_every_layer", "logit_lens_every_layer", "hf_steer"]
WORKER = [n for n, c in REGISTRY.items() if not c.plain]
COMPILED_MAIN = ["hooks_idle_compiled", "steer_one_layer_compiled", "read_one_layer_compiled",
                 "norms_every_layer_compiled", "logit_lens_every_layer_compiled"]
SHOWN = {A_STAR: "a*", "floor_compiled": "floor*", "floor": "floor"}


def tag(name: str) -> str:
    return REGISTRY[name].tag if name in REGISTRY else SHOWN.get(name, name)


@functools.cache
def blocks() -> dict[str, str]:
    parts = re.split(r"^<!-- ([\w-]+) -->\n", (HERE / "report.md").read_text(), flags=re.M)
    return {parts[i]: parts[i + 1].rstrip("\n") for i in range(1, len(parts), 2)}


def fill(text: str, **fields: object) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: str(fields[m[1]]) if m[1] in fields else m[0], text)


def fmt_ratio(r: dict | None) -> str:
    return f"**{r['median']:.2f}** ({r['min']:.2f}–{r['max']:.2f})" if r else "–"


def fmt_rate(t: dict | None) -> str:
    return f"{t['median']:,.0f} ({t['min']:,.0f}–{t['max']:,.0f})" if t else "–"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def goal_cell(e: dict) -> str:
    g = e.get("goal")
    if not g:
        return ""
    ref = tag(g["relative_to"])
    want = f"≤ {g['max_ratio']:.2f} × ({ref})" if "max_ratio" in g else f"slower than ({ref})"
    return want if g["met"] is None else f"{want}: {'met' if g['met'] else '**missed**'}"


def table(head: str, rows: list[list[str]]) -> str:
    """A Markdown table: its header row is report.md's block ``head-<head>``."""
    line = blocks()[f"head-{head}"]
    return "\n".join([line, "|" + " --- |" * (line.count("|") - 1),
                      *["| " + " | ".join(r) + " |" for r in rows]])


def cond_table(m: dict, names, head: str, cells, rows=()) -> str:
    """A row per condition that ran (its tag, label and ``cells(name, entry, conditions)``),
    a "did not run" row per one that failed; "" when none."""
    c, rows = m["conditions"], list(rows)
    for n in names:
        e, why = c.get(n), (m.get("errors") or {}).get(n)
        if e:
            rows.append([f"({tag(n)})", e["label"], *cells(n, e, c)])
        elif why:
            width = blocks()[f"head-{head}"].count("|") - 1
            rows.append([f"({tag(n)})", REGISTRY[n].label, f"did not run: {why}"] + [""] * (width - 3))
    return table(head, rows) if rows else ""


def _r(e: dict | None, ref: str, one: bool = False) -> str:
    return "1" if one else fmt_ratio((e or {}).get(R + ref))


def _other(n: str, e: dict) -> str:
    return "; ".join(f"to ({tag(ref)}{', off' if ref == 'noop_edit' else ''}): {fmt_ratio(e[R + ref])}"
                     for ref in ("steer_one_layer", "read_one_layer", "noop_edit", "hf_steer")
                     if e.get(R + ref))


def model_table(m: dict) -> str:
    return cond_table(m, MAIN, "main", lambda n, e, c: [
        fmt_rate(e["tok_s"]), _r(e, A, n == A), _r(e, A_STAR, n == A_STAR), _other(n, e), goal_cell(e)])


def compiled_table(m: dict) -> str:
    def cells(n, e, c):
        eager = c.get(n.removesuffix("_compiled")) if n != A_STAR else c.get(A)
        return [fmt_rate(e["tok_s"]), _r(e, A_STAR, n == A_STAR), _r(e, A),
                _r(eager, A_STAR) if eager and n != A_STAR else "–", goal_cell(e)]

    return cond_table(m, [A_STAR, *COMPILED_MAIN], "compiled", cells)


def sae_table(m: dict) -> str:
    return cond_table(m, ("sae_features", "sae_features_compiled", "sae_hf"), "sae", lambda n, e, c: [
            fmt_rate(e["tok_s"]), _r(e, A), _r(e, A_STAR), _r(c.get("sae_hf"), n, n == "sae_hf"),
            goal_cell(e)])


def floor_table(m: dict) -> str:
    fl = m["conditions"].get("logit_lens_floor")
    if not fl:
        return ""
    secs = sorted(fl["seconds"])[len(fl["seconds"]) // 2]
    first = ["(h, floor)", f"the unembedding products alone: {(fl.get('macs') or 0) / 1e9:,.1f} G "
             f"multiply-adds, {secs:.2f} s (median)", _r(fl, A), "–", ""]

    def cells(n, e, c):
        if n.endswith("compiled"):
            return [_r(e, A), _r(e, "floor_compiled"), goal_cell(e)]
        ok = (e.get(R + "floor") or {}).get("median", 9) <= 1.10
        return [_r(e, A), _r(e, "floor"), "≤ 1.10 × (floor): " + ("met" if ok else "**missed**")]

    return cond_table(m, ("logit_lens_every_layer", "logit_lens_every_layer_compiled"),
                      "floor", cells, rows=[first])


def off_table(m: dict) -> str:
    off = "plain_vllm_cache_off"
    return cond_table(m, (off, "steer_one_layer_cache_off", "read_one_layer_cache_off"), "cache-off",
                      lambda n, e, c: [
            fmt_rate(e["tok_s"]), _r(e, off, n == off),
            _r(c.get(n.removesuffix("_cache_off")), A, n == off or not c.get(n.removesuffix("_cache_off"))),
            _r(e, A)])


def preamble_table(m: dict) -> str:
    def cells(n, e, c):
        same = "preamble_plain_cache_off" if n.endswith("_cache_off") else "preamble_plain"
        cached = e.get("cached_tokens")
        return [fmt_rate(e["tok_s"]), _r(e, same, n == same),
                _r(e, "preamble_plain", n == "preamble_plain"), "–" if cached is None else f"{cached:,}"]

    return cond_table(m, [n for n, c in REGISTRY.items() if c.needs == "preamble"], "preamble", cells)


def step_table(m: dict) -> str:
    rows = []
    for mode, x in (m.get("step_costs") or {}).items():
        for steps, view in (("every planned step", x), ("decode steps", x.get("decode"))):
            if view:
                rows.append(_step_row(mode, steps, x["sites_per_step"], view))
    return table("step", rows) if rows else ""


def _step_row(mode: str, steps: str, sites: int, x: dict) -> list[str]:
    g, ok = STEP_GOALS, x["goals"]

    def pair(a: float | None, b: float | None) -> str:
        if a is None or b is None:
            return "–"
        return f"{a:,.0f} → {b:,.0f}" + (f" ({b / a:.2f}×)" if a else "")

    def mark(k: str) -> str:
        return "met" if ok[k] else "**missed**"

    over = x.get("overhead_us") or {}
    return [mode, steps, f"{sites}", pair(x["at_32"]["layout_us"], x["wide"]["layout_us"]),
            pair(x["at_32"]["site_us"], x["wide"]["site_us"]),
            f"{x['growth_layout']:.2f} / {x['growth_site']:.2f}"
            if x["growth_layout"] and x["growth_site"] else "–",
            pair(x["at_32"].get("reduce_us"), x["wide"].get("reduce_us")),
            pair(over.get("at_32"), over.get("wide")),
            f"layout ≤ {g['layout_us']:.0f}: {mark('layout')}; site ≤ {g['site_us']:.0f}: "
            f"{mark('site')}; growth ≤ {g['growth']:.1f}: {mark('growth')}"]


def worker_table(m: dict) -> str:
    def cells(n, e, c):
        w = e["worker"]
        return [f"{w['steps_per_run']:.0f}", f"{w['sites_per_step']}", f"{w['layout_us_per_step']:,.0f}",
                f"{w['hook_us_per_step']:,.0f}", f"{w['hook_us_per_site']:,.0f}", pct(w["share_hooks"]),
                pct(w["share_layout"]), pct(w["share_client"])]

    return cond_table(m, [n for n in WORKER if "worker" in m["conditions"].get(n, {})], "worker", cells)


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def clone_table(m: dict) -> str:
    c, rows = m["conditions"], []
    for off, on, what in (("read_one_layer", "read_one_layer_clone", "read 1 layer (f)"),
                          ("noop_edit", "noop_edit_clone", "no-op `edit=` at 1 site")):
        if c.get(off) and c.get(on):
            edit = off == "noop_edit"
            rows += [[f"{what}, clone reads off", fmt_rate(c[off]["tok_s"]), "1",
                      _bytes(c[off].get("copied_bytes")), "0 B" if edit else "–"],
                     [f"{what}, clone reads on", fmt_rate(c[on]["tok_s"]), _r(c[on], off),
                      _bytes(c[on].get("copied_bytes")), _bytes(c[on].get("clone_bytes")) if edit else "–"]]
    return table("clone", rows) if rows else ""


# the tables after each model's main one, in the doc's order (titles and prose: report.md)
TABLES = {"compiled": compiled_table, "sae": sae_table, "floor": floor_table, "step": step_table,
          "preamble": preamble_table, "cache-off": off_table}


def tables(results: dict) -> str:
    """The per-model tables alone (printed at the end of a run)."""
    parts = []
    for m in results["models"]:
        parts.append(f"\n{m['name']}\n" + model_table(m))
        parts += ["\n" + t for t in (fn(m) for fn in TABLES.values()) if t]
        parts.append("\n" + worker_table(m))
    return "\n".join(parts)


def macs_per_token(cfg: dict) -> tuple[float, float]:
    """(the model's multiply-adds per token, the unembedding's); attention left out."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    layer = h * (h + 2 * kv * (h // heads)) + h * h + 3 * h * inter
    return cfg["num_hidden_layers"] * layer + v * h, v * h


def _missed_models(name: str, r: dict) -> str:
    """A line per model that missed ``name``'s goal, with the run's own figures."""
    b, parts = blocks(), []
    for m in r["models"]:
        e, cfg = m["conditions"].get(name) or {}, m["config"]
        if e.get("goal", {}).get("met") is not False:
            continue
        w, ref, g = e.get("worker") or {}, e["goal"]["relative_to"], e["goal"]
        x = e.get(R + ref)
        line = fill(b["missed-line"], model=m["name"], ratio=f"{x['median']:.2f}", ref=tag(ref))
        if "max_ratio" in g:  # whether the miss is outside the noise: the whole range past the goal
            line += fill(b["verdict-noise" if x["min"] <= g["max_ratio"] else "verdict-all"],
                         min=f"{x['min']:.2f}", max=f"{x['max']:.2f}")
        if w and name != "hooks_idle":
            line += fill(b["missed-worker"], hooks=pct(w["share_hooks"]), layout=pct(w["share_layout"]),
                         site=f"{w['hook_us_per_site']:,.0f}", step=f"{w['layout_us_per_step']:,.0f}",
                         client=pct(w["share_client"]))
        if name == "logit_lens_every_layer":
            model, unembed = macs_per_token(cfg)
            line += fill(b["missed-floor"], floor=f"{1 + cfg['num_hidden_layers'] * unembed / model:.2f}",
                         vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"])
        parts.append(f"* {line}")
    return "\n".join(parts)


def _meta(r: dict) -> list[str]:
    meta = r["meta"]
    mach, ver, load, st = meta["machine"], meta["versions"], meta.get("load", {}), meta["settings"]
    during = load.get("load1_during") or {}
    return fill(blocks()["meta"], **{k: st[k] for k in ("prompts", "tokens", "sampling", "reps",
                                                          "slow_reps")},
                command=meta["command"], make_bench="" if meta.get("argv") else " (what `make bench` runs)",
                started=meta["started"], minutes=f"{meta['wall_s'] / 60:.1f}", cpus=mach.get("cpus"),
                cpu=mach.get("cpu", mach.get("machine")), memory=mach.get("memory_gib", "?"),
                gpu=f", GPU {mach['gpu']}" if mach.get("gpu") else ", no GPU", platform=mach.get("platform"),
                python=mach.get("python"), modified=" (vlens working tree modified)"
                if ver.get("vlens_tree") == "modified" else "",
                versions=", ".join(f"{k} {v}" for k, v in ver.items() if k not in ("python", "vlens_tree")),
                before=", ".join(map(str, load.get("loadavg_before", []))),
                after=", ".join(map(str, load.get("loadavg_after", []))), median=during.get("median"),
                min=during.get("min"), max=during.get("max"), others=load.get("cpu_seconds_other_processes"),
                busy=load.get("other_processes_cores_busy"), own=load.get("cpu_seconds_this_benchmark"),
                omp=meta.get("omp_num_threads"), budget=f"{st['budget_s']:.0f}").splitlines()


def _model_line(m: dict) -> str:
    cfg = m["config"]
    size = f"{cfg['parameters'] / 1e6:.1f}M parameters, " if cfg.get("parameters") else ""
    return (f"{(cfg.get('architectures') or ['?'])[0]}, {size}hidden {cfg['hidden_size']}, "
            f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads, MLP "
            f"{cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, {cfg.get('dtype')}")


def _engines_line(m: dict) -> str:
    names = {"plain": "(a*) `vllm.LLM`", "eager": "vlens eager", "compiled": "vlens compiled",
             "cache_off": "vlens eager, caching off"}
    return "; ".join(f"{names.get(role, role)}: `{'vllm.LLM' if role == 'plain' else 'vlens.Session'}(path, "
                     + ", ".join(f"{k}={v!r}" for k, v in e["kwargs"].items()) + f")`, started in "
                     f"{e['start_s']} s" + (f", {e['hooks']} hooks" if e.get("hooks") else "")
                     for role, e in (m.get("engines") or {}).items())


def _agreement(m: dict) -> str:
    out = [f"{what} generated the same tokens as {other} for {a['identical']} of {a['of']} prompts "
           f"(median common prefix {a['median_common_prefix']:.0f} tokens)"
           for key, what, other in (("c_vs_j", "Hugging Face (j)", "vlens's (c)"),
                                    ("c_vs_m", "nnsight (m)", "vlens's (c)"),
                                    ("j_vs_m", "nnsight (m)", "Hugging Face (j)"))
           if (a := (m.get("agreement") or {}).get(key))]
    return "; ".join(out) + "." if out else ""


def _section(r: dict, b: dict) -> list[str]:
    out, st = _meta(r), r["meta"]["settings"]
    for m in r["models"]:
        long, p = m.get("long_prompt_tokens"), m["prompt_tokens"]
        out += [""] + fill(b["model"], name=m["name"], shape=_model_line(m), engines=_engines_line(m),
                           threads=m.get("torch_threads"), pmin=p["min"], pmax=p["max"],
                           env=", ".join(f"`{k}={v}`" for k, v in m.get("engine_env", {}).items()),
                           long=f"; (p) prompts of {long['min']}–{long['max']} tokens" if long else "",
                           **m["steer"], reps=m["reps_done"], incomplete="" if m.get("complete")
                           else " (**some runs did not produce every token**)").splitlines()
        if m.get("note"):
            out += ["", f"Note: {m['note']}."]
        out += ["", model_table(m), ""]
        for key, fn in TABLES.items():
            if t := fn(m):
                out += [fill(b[f"table-{key}"], wide=st.get("wide", 256), k_tokens=st.get("k_tokens", 32),
                             prompts=st["prompts"], layers=m.get("k_layers")), "", t, ""]
        if clone_table(m):
            out += ["Clone reads (i):", "", clone_table(m), ""]
        if _agreement(m):
            out += [fill(b["agreement"], agreement=_agreement(m)), ""]
        out += ["Inside the worker (k), from `s.status()` counters (rank 0), per planned step:",
                "", worker_table(m), ""]
    return out


def _goal(e: dict, short: bool) -> str:
    """A goal summary cell: the median ratio (and its reference) and the verdict."""
    g = e.get("goal") or {}
    ref = g.get("relative_to", "")
    r = e.get(R + ref)
    return f"{r['median']:.2f}{'' if short else f' × ({tag(ref)})'}: " \
        f"{'met' if g['met'] else '**missed**'}" if r else "–"


def goal_table(r: dict) -> str:
    lines = ["| goal | " + " | ".join(m["name"] for m in r["models"]) + " |",
             "| --- |" + " --- |" * len(r["models"])]
    for n in MAIN_GOALS + COMPILED_MAIN[1:] + ["sae_features_compiled"]:
        cells = [_goal(m["conditions"].get(n) or {}, n not in MAIN_GOALS) for m in r["models"]]
        goal = REGISTRY[n].goal
        want = f"≤ {goal[1]:.2f} × ({tag(goal[0])})" if goal else "slower than (c)"
        if n != "sae_features_compiled" or set(cells) != {"–"}:
            lines.append(f"| ({tag(n)}) {want} | " + " | ".join(cells) + " |")
    cells = []
    for m in r["models"]:
        x = (m.get("step_costs") or {}).get("compiled")
        cell = [f"{steps}: {v['wide']['layout_us']:,.0f} µs layout, {v['wide']['site_us']:,.0f} µs / site, "
                + ("met" if all(v["goals"].values()) else "**missed**")
                for steps, v in (("every step", x), ("decode", (x or {}).get("decode"))) if v]
        cells.append("; ".join(cell) if x else "–")
    lines.append(f"| (k) wide batch, compiled: layout ≤ {STEP_GOALS['layout_us']:.0f} µs, "
                 f"≤ {STEP_GOALS['site_us']:.0f} µs / site, ≤ {STEP_GOALS['growth']}× the 32-request "
                 "figures | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _missed(r: dict, b: dict) -> str:
    missed = [tag(n) for n in MAIN_GOALS
              if any((m["conditions"].get(n) or {}).get("goal", {}).get("met") is False
                     for m in r["models"])]
    if not missed:
        return ""
    names = {tag(n): n for n in MAIN_GOALS}
    themes = [b["fix-layout"]] if set(missed) & set("cde") else []
    themes += [b["fix-reads"]] if set(missed) & set("fgh") else []
    themes += [b["fix-client"]] if set(missed) & set("cdefg") else []
    return "\n\n".join([b["missed"], *[fill(b[f"missed-{k}"], models=_missed_models(names[k], r))
                                      for k in missed],
                         fill(b["changed"], themes="\n\n".join([*themes, b["fix-ops"]]))]) + "\n\n"


def _serve(s: dict | None, b: dict) -> list[str]:
    out = ["### Connected clients (s)", ""]
    if not s or s.get("status") != "ran":
        why = (s or {}).get("why") or (s or {}).get("error") or "not measured in this run"
        return out + [f"`python -m benchmarks serve`: {why}.", ""]
    t = table("serve", [[str(r[k]) for k in ("clients", "remote_tok_s", "local_tok_s", "ratio")]
                        for r in s["rows"]])
    return out + [fill(b["serve"], seconds=s.get("seconds"), model=s["model"],
                       calls=s["calls_per_client"], call=s["call"], table=t,
                       note=f" ({s['note']})" if s.get("note") else ""), ""]


def _extras(r: dict, b: dict) -> list[str]:
    p = r.get("nnsight_vllm")  # a probe of earlier runs
    out = ["### nnsight's vLLM backend", "", (f"Did not run on this machine: it failed at {p['stage']} with "
                                            f"`{p['error']}` (after {p['seconds']} s). " if p else "")
           + b["nnsight-vllm"], "", *_serve(r.get("serve"), b), "### Widget latencies (l)", ""]
    w = r.get("widgets") or {}
    if w.get("figures"):
        command = re.sub(r"(?<![\w.])/[^\s`]*?/(vlens|benchmarks|tests|scripts)/", r"\1/",
                         w.get("command") or "")
        out += [f"From `{command}` ({w.get('seconds')} s, run after the other "
                "conditions, in its own process):", ""]
        out += [f"* {f['line']}" for f in w["figures"]] + [""]
        if w.get("status") != "ran":
            out += [f"It then failed: `{w.get('error')}`.", ""]
    else:
        out += [f"The widget latencies: {w.get('status')}: `{w.get('error') or w.get('why')}`.", ""]
    return out


def _sae(sae: dict | None, cpu: dict | None, b: dict) -> list[str]:
    """The SAE conditions from their own run, when the main run has none of them."""
    if not sae or (cpu and any(n.startswith("sae") for m in cpu["models"] for n in m["conditions"])):
        return []
    out = [b["sae-run"], "", *_meta(sae)]
    for m in sae["models"]:
        out += ["", f"{m['name']}: {_model_line(m)}. Engines: {_engines_line(m)}. "
                f"**{m['reps_done']} repetitions** done.", "", b["table-sae"].split("\n\n", 1)[1], "",
                sae_table(m)]
        model, _ = macs_per_token(m["config"])
        enc = m["config"]["hidden_size"] * 4096
        comp = m["conditions"].get("sae_features_compiled") or {}
        w = comp.get("worker") or {}
        gap = (comp.get(R + A_STAR) or {}).get("median", 1.0) - 1.0
        out += ["", fill(b["sae-encoder"], encoder=f"{enc / 1e6:.1f}", model=f"{model / 1e6:.1f}",
                         share=pct(enc / model), hooks=pct(w.get("share_hooks", 0)),
                         layout=pct(w.get("share_layout", 0)), client=pct(w.get("share_client", 0)),
                         gap=pct(gap))]
    return out + [""]


def compiled_mode() -> str:
    """docs/compiled-mode.md, its headings one level down, so the report is one page."""
    lines = (ROOT / "docs" / "compiled-mode.md").read_text().splitlines()
    body = "\n".join("#" + x if x.startswith("## ") else x for x in lines[1:])
    return ("## Compiled mode (the design, from docs/compiled-mode.md)\n\n"
            + body.strip().replace("](performance.md)", "](#cpu-figures)") + "\n")


def render(cpu: dict | None, gpu: dict | None, sae: dict | None = None) -> str:
    b = blocks()
    pending = "Pending: no results of `make bench` yet."
    text = fill(b["page"], goal_table=goal_table(cpu) if cpu else pending,
                missed_goals=_missed(cpu, b) if cpu else "", compiled_mode=compiled_mode(),
                cpu_figures="\n".join(_section(cpu, b) + _sae(sae, cpu, b) + _extras(cpu, b))
                if cpu else pending + "\n",
                gpu_figures="\n".join(_section(gpu, b)) if gpu else b["gpu-pending"] + "\n")
    return text.rstrip() + "\n"


def write(doc: Path, results: Path, cpu: str = "main") -> None:
    """Render the newest ``cpu`` (and gpu, sae) runs of ``results`` into ``doc``."""
    from .results import latest

    doc.write_text(render(latest(results, cpu), latest(results, "gpu"), latest(results, "sae")))
