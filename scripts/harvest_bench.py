"""What a harvest costs beside plain vLLM's prefill of the same texts.

    python scripts/harvest_bench.py [--model NAME] [--texts 96] [--reps 5]
                                    [--out benchmarks/results-harvest.json]

Three conditions, run in a shuffled order in every repetition, on one engine:

* ``plain_prefill``: the texts' token ids through vLLM's ``generate`` with
  one-token generations, vlens's hooks removed (``vlens_teardown``), as the
  benchmark's plain-vLLM rows run;
* ``harvest_one_layer``: ``s.harvest(texts, layers=[middle], sites=("resid_post",))``
  into a fresh folder, the shards written to disk (included in the time);
* ``harvest_every_layer``: the same at every layer.

Each condition in each repetition gets texts no other run has seen (a
number put in front of every text), so neither side reads another's KV from
the prefix cache. Texts: the ``moby-dick`` corpus's paragraphs when the
registry can fetch it (``vlens models get moby-dick``), else the toy world's
stories. Prints each repetition's times, then the median of the paired
ratios to ``plain_prefill`` and the tokens per second, and writes them as
JSON (docs/features.md quotes them; goals: one layer <= 1.1, every layer
<= 1.5).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"harvest_one_layer": 1.1, "harvest_every_layer": 1.5}


def texts_for(n: int) -> tuple[list[str], str]:
    """``n`` texts (longest paragraphs first cut to a few hundred words) and where
    they came from."""
    try:
        from vlens.models import get
        from vlens.models.corpus import paragraphs

        paras = [p for p in paragraphs(get("moby-dick")) if len(p.split()) >= 40]
        return [" ".join(p.split()[:160]) for p in paras[:n]], "moby-dick"
    except Exception as exc:  # noqa: BLE001 - said, then the bundled texts
        print(f"moby-dick unavailable ({exc}); using the toy world's stories", file=sys.stderr)
        import itertools

        from vlens.models import world

        stories = itertools.islice(world.story_stream(5), n)
        return [st.text for st in stories], "toy-world stories"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a registry name or folder (default: bundled)")
    ap.add_argument("--texts", type=int, default=96)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results-harvest.json"))
    args = ap.parse_args()

    import vlens
    from vllm import SamplingParams

    s = vlens.Session(args.model) if args.model else vlens.Session()
    base, source = texts_for(args.texts)
    layer = s.n_layers // 2
    work = Path(tempfile.mkdtemp(prefix="vlens-harvest-bench-"))
    runs = {"plain_prefill": [], "harvest_one_layer": [], "harvest_every_layer": []}
    tokens = {}
    serial = [0]

    def fresh() -> list[str]:
        serial[0] += 1
        return [f"{serial[0]}. {t}" for t in base]

    def plain() -> int:
        ids = [s.tokenize(t) for t in fresh()]
        s.engine.rpc("vlens_teardown")
        try:
            s.engine.generate([{"prompt_token_ids": x} for x in ids],
                              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        finally:
            s.engine.rpc("vlens_setup")
        return sum(map(len, ids))

    def harvest(layers) -> int:
        out = work / f"h{serial[0] + 1}"
        h = s.harvest(fresh(), layers=layers, sites=("resid_post",), out=out,
                      shard_tokens=16384)
        n = len(h.token_ids)
        shutil.rmtree(out)
        return n

    measures = {"plain_prefill": plain,
                "harvest_one_layer": lambda: harvest([layer]),
                "harvest_every_layer": lambda: harvest(None)}
    for name, fn in measures.items():  # a warm-up of each
        fn()
    rng = random.Random(0)
    for rep in range(args.reps):
        order = list(measures)
        rng.shuffle(order)
        for name in order:
            t = time.perf_counter()
            tokens[name] = measures[name]()
            runs[name].append(time.perf_counter() - t)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()),
              flush=True)
    n_layers = s.n_layers
    s.close()
    shutil.rmtree(work, ignore_errors=True)
    out = {"model": args.model or "bundled toy-world model", "texts": len(base),
           "source": source, "layer": layer, "n_layers": n_layers, "reps": args.reps,
           "rows": {}}
    print(f"\n{len(base)} texts ({source}), {tokens['plain_prefill']} tokens; medians of "
          f"{args.reps} paired ratios to plain_prefill")
    for name, times in runs.items():
        ratio = statistics.median(t / p for t, p in zip(times, runs["plain_prefill"]))
        tps = tokens[name] / statistics.median(times)
        goal = GOALS.get(name)
        out["rows"][name] = {"median_s": statistics.median(times), "ratio": ratio,
                             "tokens_per_s": tps, "goal": goal}
        print(f"  {name:22s} {statistics.median(times):7.2f} s  x{ratio:5.2f}  "
              f"{tps:9.0f} tok/s" + (f"  (goal <= {goal})" if goal else ""))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
