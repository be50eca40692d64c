"""How long the widgets take to answer on the real engine, from Python with
no browser: a re-plot after a layer change (ActivationView, from a cached
trace; goal < 50 ms), the logit lens's re-plot in top-token and track modes
(< 50 ms), the first streamed token after clicking the steering panel's run
(< 300 ms) and the whole steering re-run (< 1 s). Each printed line ends
with its median. ``make bench`` runs it too (docs/performance.md, "Widget
latencies"); alone, ``make bench-widgets``::

    .venv/bin/python scripts/widget_latency.py [--model PATH] [--repeats 15] [--json FILE]
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local model folder (default: the bundled one)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    res = widget_latency(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
