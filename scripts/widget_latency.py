"""How long the widgets take to answer on the real engine, from Python with
no browser: a re-plot after a layer change (ActivationView, from a cached
trace; goal < 50 ms), the logit lens's re-plot in top-token and track modes
(< 50 ms), the first streamed token after clicking the steering panel's run
(< 300 ms) and the whole steering re-run (< 1 s). Each printed line ends
with its median. ``make bench`` runs it too (docs/performance.md, "Widget
latencies"); alone, ``make bench-widgets``::

    .venv/bin/python scripts/widget_latency.py [--model PATH] [--repeats 15] [--json FILE]

``--views`` measures instead the click-to-draw time of the views on 64- and
200-token prompts cut from the moby-dick corpus (docs/widgets.md, "Views at
a real model's size"): the explorer's trace and span click, the logit lens
view, the attention view and the patching view, each beside the engine time
of the call it makes (the same Session call with the same arguments, timed
alone). Goal per row: click-to-draw <= 1.3 x engine + 0.3 s::

    VLENS_HOME=... .venv/bin/python scripts/widget_latency.py \\
        --model smollm2-135m-instruct --views --repeats 3 --json FILE
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path


def _timed(times: list[float], fn) -> None:
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)


def _many(n: int, fn) -> list[float]:
    """``fn``'s time, ``n`` times."""
    times: list[float] = []
    for _ in range(n):
        _timed(times, fn)
    return times


def _ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def widget_latency(args: argparse.Namespace) -> dict:
    import vlens
    from vlens.lens import LogitLens
    from vlens.models.world import example_prompts, sentiment_prompts
    from vlens.widgets import ActivationView, LogitLensView, SteeringPanel

    lines, n = [], args.repeats
    with vlens.Session(args.model) as s:
        prompt = example_prompts(1)[0]
        view = ActivationView(s.trace([prompt], layers=None, sites=s.sites, max_new_tokens=16))
        if view.error:
            raise SystemExit(f"activation view failed: {view.error}")
        replot: list[float] = []
        for _ in range(2 * n):
            _timed(replot, lambda: setattr(view, "layer", (view.layer + 1) % s.n_layers))
        assert view.error == "", view.error
        lines.append(f"re-plot after a layer change ({view.run[0].n_tokens} tokens x {s.n_layers} "
                     f"layers, from the cached run): median {_ms(replot):.1f} ms "
                     f"(goal < 50 ms; {len(replot)} changes)")
        lens = LogitLensView(
            s.trace([prompt], layers=None, sites=["resid_post"], logit_lens=5, max_new_tokens=48),
            token_strings=s.token_strings, offline_lens=LogitLens.from_pretrained(s.model))
        ranges = [(0, s.n_layers - 1), (1, s.n_layers - 1)]
        for mode in ("top", "track"):
            lens.mode, times = mode, []
            for i in range(2 * n):
                _timed(times, lambda i=i: setattr(lens, "layer_range", ranges[i % 2]))
            assert lens.error == "", lens.error
            lines.append(f"logit-lens re-plot after a layer change, {mode} mode "
                         f"({lens.run[0].n_tokens} tokens): median {_ms(times):.1f} ms "
                         f"(goal < 50 ms; {len(times)} changes)")
        happy, sad = sentiment_prompts(16)
        panel = SteeringPanel(s, prompt, positive=happy, negative=sad, layer=s.n_layers // 2,
                              max_new_tokens=16)
        panel.run_comparison()  # computes and caches the direction
        steer, first = [], []
        for i in range(n):
            shown: list[float] = []
            watch = lambda change, shown=shown: shown.append(time.perf_counter())  # noqa: E731
            panel.observe(watch, names="live_texts")
            t = time.perf_counter()
            panel._run_button.click()  # what a click on "run" does; the run goes on in the
            panel.wait()  # background, this waits for its end
            steer.append(time.perf_counter() - t)
            panel.unobserve(watch, names="live_texts")
            first.append(shown[0] - t)
            panel.scale = 0.5 + 0.5 * (i % 4)  # the next run at another scale (auto_run)
            panel.wait()
        assert panel.error == "", panel.error
        lines += [f"first streamed token after clicking run (1 prompt x 16 new tokens, baseline + "
                  f"steered): median {_ms(first):.0f} ms (goal < 300 ms; {len(first)} runs)",
                  f"steering re-run (1 prompt x 16 new tokens, baseline + steered in one batch): "
                  f"median {_ms(steer):.0f} ms (goal < 1000 ms; {len(steer)} runs)"]
    for line in lines:
        print(line, flush=True)
    return {"command": "scripts/widget_latency.py" + (f" --model {args.model}" if args.model else "")
            + f" --repeats {n}",
            "figures": [{"line": x, "median_ms": float(re.search(r"median ([0-9.]+) ms", x)[1])}
                        for x in lines]}


#: the prompt lengths of the views table, in tokens
VIEW_LENGTHS = (64, 200)


def goal_s(engine_s: float) -> float:
    """The click-to-draw goal of a view whose click makes an engine call of
    ``engine_s`` seconds (0 for a click that only redraws)."""
    return 1.3 * engine_s + 0.3


def cut_prompt(text: str, n: int, count, decode, tokenize) -> str:
    """The start of ``text`` that the engine runs as exactly ``n`` tokens:
    ``count(prompt)`` is the engine's token count, ``tokenize``/``decode``
    the tokenizer's (a cut may re-tokenize one longer or shorter: the
    neighbouring cuts are tried)."""
    ids = tokenize(text)
    if len(ids) < n + 8:
        raise SystemExit(f"the corpus text has {len(ids)} tokens; {n} are needed")
    for cut in (n, n - 1, n + 1, n - 2, n + 2, n - 3, n + 3):
        prompt = decode(ids[:cut])
        if count(prompt) == n:
            return prompt
    raise SystemExit(f"no cut of the corpus text is exactly {n} tokens")


def corrupt_of(s, clean: str, n: int) -> str:
    """``clean`` with one word of its last 40 tokens swapped for another,
    the same ``n`` tokens long, predicting a different next token (so
    patching has a logit difference to restore)."""
    ids = s.prompts([clean])[0].ids
    top = s.trace([clean], layers=[0], reduce="norm", max_new_tokens=1)[0].output_token_ids[0]
    words = s.token_strings(ids)
    for word in (" whale", " night", " captain", " sea", " fire"):
        swap = s.tokenize(word)
        if len(swap) != 1:
            continue
        tries = [s.tokenizer.decode([*ids[:k], swap[0], *ids[k + 1:]])
                 for k in range(n - 1, max(0, n - 41), -1)
                 if ids[k] != swap[0] and words[k].startswith(" ")]
        tries = [x for x in tries if len(s.prompts([x])[0].ids) == n]
        if not tries:
            continue
        out = s.trace(tries, layers=[0], reduce="norm", max_new_tokens=1)  # one batch
        for corrupt, t in zip(tries, out):
            if t.output_token_ids[0] != top:
                return corrupt
    raise SystemExit(f"no one-word swap of the {n}-token prompt changes its next token")


def view_latency(args: argparse.Namespace) -> dict:
    """The click-to-draw table (``--views``): one row per (view, action,
    prompt length) with the engine call's median beside it."""
    from plotly.callbacks import Points

    import vlens
    from vlens.lens import LogitLens
    from vlens.models import corpus
    from vlens.widgets import AttentionView, Explorer, LogitLensView, PatchingView
    from vlens.widgets.selection import PER_HEAD_SITES, TOP_K

    n, new = args.repeats, 16
    folder = args.corpus or vlens.models.get("moby-dick")
    text = " ".join(corpus.paragraphs(folder)[5:60])
    rows: list[dict] = []

    def row(view: str, action: str, tokens: int, engine: list[float], click: list[float]
            ) -> None:
        e = statistics.median(engine) if engine else 0.0
        c = statistics.median(click)
        rows.append({"view": view, "action": action, "tokens": tokens, "engine_s": round(e, 3),
                     "click_to_draw_s": round(c, 3), "ratio": round(c / e, 2) if e else None,
                     "goal_s": round(goal_s(e), 3), "met": c <= goal_s(e), "repeats": len(click)})
        r = rows[-1]
        print(f"{view:<13} {action:<24} {tokens:>4}  engine {e:7.2f} s  click-to-draw {c:7.2f} s"
              f"  ratio {'-' if r['ratio'] is None else r['ratio']:>5}  goal {r['goal_s']:6.2f} s"
              f"  {'met' if r['met'] else 'NOT met'}", flush=True)

    def paired(engine_fn, click_fn, repeats: int = n) -> tuple[list[float], list[float]]:
        engine: list[float] = []
        click: list[float] = []
        for _ in range(repeats):
            _timed(engine, engine_fn)
            _timed(click, click_fn)
        return engine, click

    with vlens.Session(args.model) as s:
        def count(prompt: str) -> int:
            return len(s.prompts([prompt])[0].ids)

        offline = LogitLens.from_pretrained(s.model)
        explorer_sites = [x for x in s.sites if x not in PER_HEAD_SITES]
        for n_tok in VIEW_LENGTHS:
            clean = cut_prompt(text, n_tok, count, s.tokenizer.decode, s.tokenize)
            corrupt = corrupt_of(s, clean, n_tok)

            # the explorer: the trace button (every site, every layer, the lens's top 5)
            ex = Explorer(s, clean, max_new_tokens=new)
            ex.logit_lens_view.offline_lens = offline  # loaded at first use otherwise
            assert ex.error == "" and len(ex.run[0].prompt_token_ids) == n_tok, ex.error

            def trace_click() -> None:
                ex._trace_button.click()  # what a click on "trace" does: a background run
                assert ex.wait(600) and ex.error == "", ex.error

            row("explorer", "trace click", n_tok, *paired(
                lambda: s.trace([clean], layers=None, sites=explorer_sites, logit_lens=TOP_K,
                                max_new_tokens=new), trace_click))
            spans = iter([(i, i + 3) for i in range(1, 4 * n, 2)])

            def span_click() -> None:
                ex.span_picker.selection = next(spans)  # what a drag over the chips sets
                assert ex.wait(600) and ex.error == "", ex.error

            click: list[float] = []
            for _ in range(n):
                _timed(click, span_click)
            row("explorer", "span click", n_tok, [], click)
            del ex

            # the logit lens view: a trace of resid_post with the lens's top 5, drawn
            def lens_trace():
                return s.trace([clean], layers=None, sites=["resid_post"], logit_lens=TOP_K,
                               max_new_tokens=new)

            lens = LogitLensView(lens_trace(), token_strings=s.token_strings,
                                 tokenize=s.tokenize, offline_lens=offline)

            def lens_draw() -> None:
                lens.run = lens_trace()
                assert lens.error == "" and lens.figure.data, lens.error

            row("logit lens", "trace, then draw", n_tok, *paired(lens_trace, lens_draw))
            ids = [i for i in dict.fromkeys(lens.run[0].token_ids) if i != lens.track]
            picks = iter(ids)

            def track_click() -> None:
                lens.track = next(picks)  # what a click on a top-token cell does
                lens.mode = "track"
                assert lens.error == "" and lens.track_source == "exact", lens.error

            click = []
            for _ in range(n):
                lens.mode = "top"
                _timed(click, track_click)
            row("logit lens", "cell click (track)", n_tok, [], click)
            del lens

            # the attention view: a trace of attn_pattern at every layer, drawn
            def attn_trace():
                return s.trace([clean], layers=None, sites=["attn_pattern"], max_new_tokens=new)

            attn = AttentionView(attn_trace())

            def attn_draw() -> None:
                attn.run = attn_trace()
                assert attn.error == "" and attn.heatmap.data, attn.error

            row("attention", "trace, then draw", n_tok, *paired(attn_trace, attn_draw))
            heads = iter([(1 + i % (s.n_layers - 1), (i + 1) % len(attn.heads))
                          for i in range(n)])

            def thumbnail_click() -> None:
                layer, head = next(heads)
                grid = attn.thumbnails.data[0]  # a click on the thumbnail's first cell
                step = int(grid.meta["step"])
                cell = [attn.layers.index(layer) * step, attn.heads.index(head) * step]
                attn._on_thumbnail(grid, Points(point_inds=[cell]), None)
                assert attn.error == "" and (attn.layer, attn.head) == (layer, head), attn.error

            row("attention", "thumbnail click", n_tok, [], _many(n, thumbnail_click))
            del attn

            # the patching view: a grid of 6 layers x the last 8 positions
            options = {"layers": sorted({*range(0, s.n_layers, 6), s.n_layers - 1}),
                       "span": list(range(n_tok - 8, n_tok))}
            patch = PatchingView(s, clean=clean, corrupt=corrupt, auto_run=False, **options)

            def patch_click() -> None:
                patch._run_button.click()  # what a click on "patch" does: a background run
                assert patch.wait(600) and patch.error == "", patch.error
                assert patch.cells_done == patch.patching.grid.numel()

            row("patching", f"patch click ({len(options['layers'])}x8 grid)", n_tok, *paired(
                lambda: s.patch(clean, corrupt, **options), patch_click))
            cells = iter([(i % len(options["layers"]), (2 * i) % 8) for i in range(1, n + 1)])

            def cell_click() -> None:
                patch.cell = next(cells)  # what a click on a grid cell does
                assert patch.error == "", patch.error

            row("patching", "cell click", n_tok, [], _many(n, cell_click))
            del patch
    model = args.model or "the bundled model"
    return {"command": "scripts/widget_latency.py --views"
            + (f" --model {args.model}" if args.model else "") + f" --repeats {n}",
            "model": model, "new_tokens": new, "goal": "click_to_draw_s <= 1.3 x engine_s + 0.3",
            "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local model folder or registry name (default: the bundled one)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--views", action="store_true",
                    help="the click-to-draw table of the views on 64- and 200-token prompts")
    ap.add_argument("--corpus", type=Path,
                    help="--views: a prepared corpus folder (default: moby-dick's)")
    args = ap.parse_args(argv)
    res = view_latency(args) if args.views else widget_latency(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
