"""How long the widgets take to answer, on the real engine.

Prints two medians:

* **re-plot after a layer change** -- an ActivationView holding a cached
  trace redraws its heatmap and token strip (goal: < 50 ms). No engine call.
* **logit-lens re-plot** -- a LogitLensView of a whole story (60+ tokens,
  top 5 read in the worker) redraws after a layer-range change, in top-token
  mode and in track-a-token mode (goal: < 50 ms). No engine call.
* **first streamed token** -- a click on the steering panel's run button:
  time until its texts box first changes (the first engine step's tokens of
  baseline and steered; goal: < 300 ms), measured on the kernel side.
* **steering re-run** -- a SteeringPanel with its direction computed runs
  baseline vs steered for one prompt x 16 new tokens (goal: < 1 s). One
  streamed ``session.stream_compare`` call plus the redraw.

Both are measured from Python with no browser attached: what the kernel
spends before the figure message leaves. Usage::

    python benchmarks/widget_latency.py [--model PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model folder (default: bundled)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    import vlens
    from vlens.models.world import example_prompts, sentiment_prompts
    from vlens.lens import LogitLens
    from vlens.widgets import ActivationView, LogitLensView, SteeringPanel

    t0 = time.perf_counter()
    with vlens.Session(args.model) as s:
        print(f"engine: {s.model} ({s.n_layers} layers, hidden {s.hidden_size}), "
              f"started in {time.perf_counter() - t0:.1f} s")
        prompt = example_prompts(1)[0]

        view = ActivationView(s.trace([prompt], layers=None, sites=s.sites, max_new_tokens=16))
        if view.error:
            raise SystemExit(f"activation view failed: {view.error}")
        layers = list(range(s.n_layers))
        replot = []
        for i in range(args.repeats * 2):
            target = layers[(layers.index(view.layer) + 1) % len(layers)]
            t = time.perf_counter()
            view.layer = target
            replot.append(time.perf_counter() - t)
        assert view.error == "", view.error
        n_tokens = view.run[0].n_tokens
        print(f"re-plot after a layer change ({n_tokens} tokens x {s.n_layers} layers, "
              f"from the cached run): median {_median_ms(replot):.1f} ms "
              f"(goal < 50 ms; {len(replot)} changes)")

        lens = LogitLensView(
            s.trace([prompt], layers=None, sites=["resid_post"], logit_lens=5, max_new_tokens=48),
            token_strings=s.token_strings, offline_lens=LogitLens.from_pretrained(s.model))
        ranges = [(0, s.n_layers - 1), (1, s.n_layers - 1)]
        for mode in ("top", "track"):
            lens.mode = mode
            times = []
            for i in range(args.repeats * 2):
                t = time.perf_counter()
                lens.layer_range = ranges[i % 2]
                times.append(time.perf_counter() - t)
            assert lens.error == "", lens.error
            print(f"logit-lens re-plot after a layer change, {mode} mode "
                  f"({lens.run[0].n_tokens} tokens): median {_median_ms(times):.1f} ms "
                  f"(goal < 50 ms; {len(times)} changes)")

        happy, sad = sentiment_prompts(16)
        panel = SteeringPanel(s, prompt, positive=happy, negative=sad,
                              layer=s.n_layers // 2, max_new_tokens=16)
        panel.run_comparison()  # computes and caches the direction
        steer, first = [], []
        for i in range(args.repeats):
            shown: list[float] = []
            watch = lambda change, shown=shown: shown.append(time.perf_counter())  # noqa: E731
            panel.observe(watch, names="live_texts")
            t = time.perf_counter()
            panel._run_button.click()  # what a click on "run" does: the run goes on
            panel.wait()  # in the background; this waits for its end
            steer.append(time.perf_counter() - t)
            panel.unobserve(watch, names="live_texts")
            first.append(shown[0] - t)
            panel.scale = 0.5 + 0.5 * (i % 4)  # the next run at another scale (auto_run)
            panel.wait()
        assert panel.error == "", panel.error
        print(f"first streamed token after clicking run (1 prompt x 16 new tokens, baseline + "
              f"steered): median {_median_ms(first):.0f} ms (goal < 300 ms; {len(first)} runs)")
        print(f"steering re-run (1 prompt x 16 new tokens, baseline + steered in one batch): "
              f"median {_median_ms(steer):.0f} ms (goal < 1000 ms; {len(steer)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
