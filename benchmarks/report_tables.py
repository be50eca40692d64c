"""The tables of docs/performance.md beyond the main one: vlens compiled
against plain vLLM at its defaults (a*), the logit lens against its
arithmetic floor, prefix caching off, the shared preamble (p), and the
per-step cost at two batch sizes (k). Numbers only come from the JSON of a
run; report.py places the tables and writes the prose around them."""

from __future__ import annotations

from suite import GOALS, STEP_GOALS


def tag(key: str) -> str:
    """How a condition key is shown: c -> c, a_star -> a*, c_comp -> c*,
    c_off -> c, off; p_c -> p: c; k256 -> k, wide; i_read -> i."""
    if key == "a_star":
        return "a*"
    if key == "h_floor":
        return "h, floor"
    if key.startswith("i_"):
        return "i"
    if key.startswith("k"):
        return f"k, {'32' if key.startswith('k32') else 'wide'}{', compiled' if key.endswith('_comp') else ''}"
    if key.endswith("_comp"):
        return key[:-5] + "*"
    prefix = ""
    if key.startswith("p_"):
        prefix, key = "p: ", key[2:]
    if key.endswith("_off"):
        return f"{prefix}{key[:-4]}, off"
    return prefix + key


def fmt_ratio(r: dict | None) -> str:
    if not r:
        return "–"
    return f"**{r['median']:.2f}** ({r['min']:.2f}–{r['max']:.2f})"


def fmt_rate(t: dict | None) -> str:
    if not t:
        return "–"
    return f"{t['median']:,.0f} ({t['min']:,.0f}–{t['max']:,.0f})"


def goal_cell(entry: dict) -> str:
    g = entry.get("goal")
    if not g:
        return ""
    ref = {"a_star": "a*", "floor_star": "floor*", "floor": "floor"}.get(g["relative_to"], g["relative_to"])
    want = f"≤ {g['max_ratio']:.2f} × ({ref})" if "max_ratio" in g else f"slower than ({ref})"
    if g["met"] is None:
        return want
    return f"{want}: {'met' if g['met'] else '**missed**'}"


def _failed(m: dict, key: str, width: int) -> list[str] | None:
    """A row saying why a condition did not run (None if it was not tried)."""
    why = (m.get("errors") or {}).get(key)
    if not why:
        return None
    from conditions import LABELS

    return [f"({tag(key)})", LABELS.get(key, key), f"did not run: {why}"] + [""] * (width - 3)


def _condition_rows(m: dict, keys, width: int, make_row) -> list[list[str]]:
    """One row per condition in ``keys``: ``make_row(key, entry)`` for those
    that ran, a "did not run" row for those that failed, none otherwise."""
    rows = []
    for key in keys:
        e = m["conditions"].get(key)
        row = make_row(key, e) if e else _failed(m, key, width)
        if row:
            rows.append(row)
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def compiled_table(m: dict) -> str:
    c = m["conditions"]

    def row(key, e):
        eager = c.get(key[:-5]) if key.endswith("_comp") else c.get("a")
        return [f"({tag(key)})", e["label"], fmt_rate(e["tok_s"]),
                "1" if key == "a_star" else fmt_ratio(e.get("ratio_to_a_star")),
                fmt_ratio(e.get("ratio_to_a")),
                fmt_ratio(eager.get("ratio_to_a_star")) if eager and key != "a_star" else "–",
                goal_cell(e)]

    rows = _condition_rows(m, ["a_star", "b_comp", "c_comp", "f_comp", "g_comp", "h_comp"], 7, row)
    if not rows:
        return ""
    return _table(["", "condition", "tok/s, median (min–max)", "time ratio to (a*)",
                   "to (a), eager", "the eager vlens run to (a*)", "goal"], rows)


def sae_table(m: dict) -> str:
    """(sae): each token's top 32 features of a 4096-wide SAE read in the
    worker, eager and compiled, and the SAELens way (Hugging Face + encode)."""
    c = m["conditions"]

    def row(key, e):
        hf = c.get("sae_hf") or {}
        vs_hf = {"sae": "ratio_to_sae", "sae_comp": "ratio_to_sae_comp"}.get(key)
        return [f"({tag(key)})", e["label"], fmt_rate(e["tok_s"]),
                fmt_ratio(e.get("ratio_to_a")), fmt_ratio(e.get("ratio_to_a_star")),
                fmt_ratio(hf.get(vs_hf)) if vs_hf else "1", goal_cell(e)]

    rows = _condition_rows(m, ("sae", "sae_comp", "sae_hf"), 7, row)
    if not rows:
        return ""
    return _table(["", "condition", "tok/s, median (min–max)", "time ratio to (a)",
                   "to (a*)", "(sae_hf)'s time over this", "goal"], rows)


def floor_table(m: dict) -> str:
    c = m["conditions"]
    fl = c.get("h_floor")
    if not fl:
        return ""
    rows = []
    secs = sorted(fl["seconds"])[len(fl["seconds"]) // 2]
    macs = fl.get("macs") or 0
    rows.append(["(h, floor)", f"the unembedding products alone: {macs / 1e9:,.1f} G multiply-adds, "
                 f"{secs:.2f} s (median)", fmt_ratio(fl.get("ratio_to_a")), "–", ""])
    for key, ref in (("h", "floor"), ("h_comp", "floor_star")):
        e = c.get(key)
        if not e:
            continue
        rows.append([f"({tag(key)})", e["label"], fmt_ratio(e.get("ratio_to_a")),
                     fmt_ratio(e.get(f"ratio_to_{ref}")),
                     goal_cell(e) if key == "h_comp" else "≤ 1.10 × (floor): "
                     + ("met" if (e.get("ratio_to_floor") or {}).get("median", 9) <= 1.10 else "**missed**")])
    return _table(["", "what", "time ratio to (a)", "to its floor", "goal"], rows)


def off_table(m: dict) -> str:
    c = m["conditions"]

    def row(key, e):
        on = c.get(key[:-4])
        return [f"({tag(key)})", e["label"], fmt_rate(e["tok_s"]),
                "1" if key == "a_off" else fmt_ratio(e.get("ratio_to_a_off")),
                fmt_ratio(on.get("ratio_to_a")) if on and key != "a_off" else "1",
                fmt_ratio(e.get("ratio_to_a"))]

    rows = _condition_rows(m, ("a_off", "c_off", "f_off"), 6, row)
    if not rows:
        return ""
    return _table(["", "condition (prefix caching off)", "tok/s, median (min–max)",
                   "time ratio to (a, off)", "the same with caching on, to (a)",
                   "time ratio to (a), caching on"], rows)


def preamble_table(m: dict) -> str:
    def row(key, e):
        same = "p_a_off" if key.endswith("_off") else "p_a"
        cached = e.get("cached_tokens")
        return [f"({tag(key)})", e["label"], fmt_rate(e["tok_s"]),
                "1" if key == same else fmt_ratio(e.get(f"ratio_to_{same}")),
                "1" if key == "p_a" else fmt_ratio(e.get("ratio_to_p_a")),
                "–" if cached is None else f"{cached:,}"]

    rows = _condition_rows(m, ("p_a", "p_c", "p_f", "p_a_off", "p_c_off", "p_f_off"), 6, row)
    if not rows:
        return ""
    return _table(["", "condition", "tok/s, median (min–max)", "time ratio to plain, same caching",
                   "to (p: a), caching on", "prompt tokens vlens saw as cached"], rows)


def step_table(m: dict) -> str:
    sc = m.get("step_costs") or {}
    rows = []
    for mode in ("eager", "compiled"):
        x = sc.get(mode)
        if not x:
            continue
        for steps, view in (("every planned step", x), ("decode steps", x.get("decode"))):
            if view:
                rows.append(_step_row(mode, steps, x["sites_per_step"], view))
    if not rows:
        return ""
    return _table(["engine", "steps", "hooked sites / step", "layout µs / step, 32 → wide",
                   "µs / hooked site, 32 → wide", "growth wide ÷ 32 (layout / site)",
                   "of which the reads' arithmetic, 32 → wide",
                   "the rest (vlens's own), 32 → wide", "goals at the wide batch"], rows)


def _step_row(mode: str, steps: str, sites: int, x: dict) -> list[str]:
    g, ok = STEP_GOALS, x["goals"]

    def pair(a: float | None, b: float | None) -> str:
        if a is None or b is None:
            return "–"
        return f"{a:,.0f} → {b:,.0f}" + (f" ({b / a:.2f}×)" if a else "")

    over = x.get("overhead_us") or {}
    return [
        mode, steps, f"{sites}",
        pair(x["at_32"]["layout_us"], x["wide"]["layout_us"]),
        pair(x["at_32"]["site_us"], x["wide"]["site_us"]),
        f"{x['growth_layout']:.2f} / {x['growth_site']:.2f}"
        if x["growth_layout"] and x["growth_site"] else "–",
        pair(x["at_32"].get("reduce_us"), x["wide"].get("reduce_us")),
        pair(over.get("at_32"), over.get("wide")),
        "layout ≤ {:.0f}: {}; site ≤ {:.0f}: {}; growth ≤ {:.1f}: {}".format(
            g["layout_us"], "met" if ok["layout"] else "**missed**",
            g["site_us"], "met" if ok["site"] else "**missed**",
            g["growth"], "met" if ok["growth"] else "**missed**"),
    ]


def compiled_goal_rows(r: dict) -> list[str]:
    """Rows of the goal summary for the compiled-mode targets, one cell per model."""
    out = []
    for key in ("c_comp", "f_comp", "g_comp", "h_comp", "sae_comp"):
        ref, goal = GOALS[key]
        cells = []
        for m in r["models"]:
            e = m["conditions"].get(key)
            ratio = (e or {}).get(f"ratio_to_{ref}")
            if not ratio:
                cells.append("–")
                continue
            mark = "met" if e["goal"]["met"] else "**missed**"
            cells.append(f"{ratio['median']:.2f}: {mark}")
        if key == "sae_comp" and set(cells) == {"–"}:
            continue  # a run without the SAE conditions (their own run: report.sae_section)
        shown = {"a_star": "a*", "floor_star": "floor*"}[ref]
        out.append(f"| ({tag(key)}) ≤ {goal:.2f} × ({shown}) | " + " | ".join(cells) + " |")
    cells = []
    for m in r["models"]:
        x = (m.get("step_costs") or {}).get("compiled")
        if not x:
            cells.append("–")
            continue
        cell = []
        for steps, view in (("every step", x), ("decode", x.get("decode"))):
            if view:
                ok = all(view["goals"].values())
                cell.append(f"{steps}: {view['wide']['layout_us']:,.0f} µs layout, "
                            f"{view['wide']['site_us']:,.0f} µs / site, "
                            + ("met" if ok else "**missed**"))
        cells.append("; ".join(cell))
    out.append(f"| (k) wide batch, compiled: layout ≤ {STEP_GOALS['layout_us']:.0f} µs, "
               f"≤ {STEP_GOALS['site_us']:.0f} µs / site, ≤ {STEP_GOALS['growth']}× the 32-request "
               "figures | " + " | ".join(cells) + " |")
    return out
