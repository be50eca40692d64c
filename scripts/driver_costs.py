"""What the engine driver's choices cost, measured side by side.

1. Reads in-process against the engine core in its own process (what
   vLLM's ``AsyncLLM`` always does): the same traced call on the bundled
   model, every layer of ``resid_post`` read, median seconds of ``--reps``
   runs, and the ratio.
2. Callers that overlap share engine steps: four calls made at once from
   four threads against the same four calls one after another.

    .venv/bin/python scripts/driver_costs.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PROMPTS = [f"once upon a time the {w} went to the" for w in
           ("cat", "dog", "fox", "duck", "owl", "bear", "frog", "hen")] * 2


def _one_mode(reps: int) -> dict:
    import vlens

    s = vlens.Session(reuse=False)
    kw = dict(layers=None, sites=["resid_post"], max_new_tokens=16)
    s.trace(PROMPTS, **kw)  # warm
    reads, plain = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        s.trace(PROMPTS, **kw)
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s.generate(PROMPTS, max_new_tokens=16)
        plain.append(time.perf_counter() - t0)
    out = {"reads": statistics.median(reads), "plain": statistics.median(plain)}
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1":
        chunks = [PROMPTS[i::4] for i in range(4)]
        serial, overlap = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            for c in chunks:
                s.trace(c, **kw)
            serial.append(time.perf_counter() - t0)
            threads = [threading.Thread(target=s.trace, args=(c,), kwargs=kw) for c in chunks]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            overlap.append(time.perf_counter() - t0)
        out["serial"], out["overlap"] = statistics.median(serial), statistics.median(overlap)
    s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_one_mode(args.reps)), flush=True)
        return
    got = {}
    for mode, mp in (("in-process", "0"), ("engine core in its own process", "1")):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=mp)
        text = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)],
                              env=env, capture_output=True, text=True, check=True).stdout
        got[mode] = json.loads(text.split("RESULT ", 1)[1])
    a, b = got["in-process"], got["engine core in its own process"]
    print(f"{len(PROMPTS)} prompts x 16 tokens, every layer of resid_post read; "
          f"medians of {args.reps}")
    print("| engine | traced (s) | plain generate (s) | traced / plain |")
    print("| --- | --- | --- | --- |")
    for mode, r in got.items():
        print(f"| {mode} | {r['reads']:.3f} | {r['plain']:.3f} | {r['reads'] / r['plain']:.2f} |")
    print(f"reads across processes / in-process: {b['reads'] / a['reads']:.2f}")
    print(f"four calls at once / one after another (in-process): "
          f"{a['overlap']:.3f} s / {a['serial']:.3f} s = {a['overlap'] / a['serial']:.2f}")


if __name__ == "__main__":
    main()
