"""Per-step worker cost at 32 requests and at a wide batch (issue 15, (k)).

One engine, one plan: ``resid_pre``, ``resid_post``, ``attn_out`` and
``mlp_out`` read at layers 2 and 6 (4 sites x 2 layers), reduced to norms in
the worker, 32 new tokens per request, all requests in one engine batch.
From the worker's counters (``s.status()``) it prints, per request count,
one JSON line of medians over repetitions: over every planned step and over
decode steps alone, the layout µs per step, the hook µs per hooked site, of
that the reads' own arithmetic (``reduce_ns``: the sums and norms) and the
rest, vlens's own work.

Then controls, from the same runs again with timers: one constant piece of
vlens's Python timed alone (``StepLog.put``: two assignments, once per
read, inside the forward; median µs per call), which says how much slower
the same instructions run when the batch is wider (the model's bigger
activations evict the interpreter's data from the caches between layers);
and each reduction (the norm) timed where it runs, then run a second time at
once on the same rows ("first" against "again": what the first touch after
the model's layers costs). A random Llama made on the spot
(``--hidden``, default 128, 8 layers), or ``--model PATH``; one torch
thread; ``--compiled`` for vLLM's compiled mode. To compare two checkouts,
run it once with each on ``PYTHONPATH``::

    PYTHONPATH=. .venv/bin/python benchmarks/step_cost.py --reps 3 --sizes 32,256
    .venv/bin/python benchmarks/step_cost.py --model benchmarks/.models/llama-h512-l8 --compiled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

SITES = ["resid_pre", "resid_post", "attn_out", "mlp_out"]
LAYERS = [2, 6]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="32,256", help="request counts, comma separated")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the random Llama")
    ap.add_argument("--model", default=None, help="a local model folder instead")
    ap.add_argument("--compiled", action="store_true", help="vLLM's compiled mode")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    work = tempfile.mkdtemp(prefix="vlens-step-cost-")
    for var, sub in (("VLLM_CACHE_ROOT", "cache"), ("VLLM_RPC_BASE_PATH", "rpc"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ.setdefault(var, os.path.join(work, sub))
        os.makedirs(os.environ[var], exist_ok=True)
    import torch

    torch.set_num_threads(1)
    import vlens
    from suite import per_step
    from vlens.worker import hooks as hooks_mod
    from vlens.worker.records import StepLog
    from vlens.tiny import make_tiny_model

    sizes = [int(x) for x in args.sizes.split(",")]
    path = args.model or make_tiny_model(os.path.join(work, "model"), "llama",
                                         hidden=args.hidden, layers=8, seed=1)
    # a KV cache and scheduler that hold the widest batch at once (no waves)
    s = vlens.Session(str(path), kv_cache_memory_bytes=1200 * 2**20, max_model_len=256,
                      max_num_seqs=max(sizes), max_num_batched_tokens=8192, dtype="float32",
                      enforce_eager=not args.compiled)
    words = "the cat sat on a mat and then it ran far away from home".split()
    base = [" ".join(words[: 3 + (i % 10)]) for i in range(32)]
    hooked = len(SITES) * len(LAYERS)

    def figures(a: dict, b: dict, prefix: str, steps_key: str) -> dict:
        d = {k: b[prefix + k] - a[prefix + k] for k in ("layout_ns", "hook_ns", "reduce_ns")}
        f = per_step(b[steps_key] - a[steps_key], d["layout_ns"], d["hook_ns"],
                     d["reduce_ns"], hooked)  # what make bench's table computes
        return {"steps": b[steps_key] - a[steps_key], "layout_us": f["layout_us_per_step"],
                "site_us": f["hook_us_per_site"], "arithmetic_us": f["reduce_us_per_site"],
                "own_us": f["overhead_us_per_site"]}

    def run(n: int) -> dict:
        prompts = [base[i % len(base)] for i in range(n)]
        a = s.status()
        t = time.perf_counter()
        s.trace(prompts, layers=LAYERS, sites=SITES, reduce="norm", max_new_tokens=args.tokens)
        wall = time.perf_counter() - t
        b = s.status()
        if b["steps_planned"] - a["steps_planned"] > args.tokens + 1:
            raise SystemExit(f"{n} requests did not run as one batch: raise the KV cache")
        return {"wall": wall, "all": figures(a, b, "", "steps_planned"),
                "decode": figures(a, b, "decode_", "decode_steps")}

    run(4)  # warm-up
    res: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            res[n].append(run(n))

    # the controls, in separate runs (the timers' own cost never enters the
    # figures above): StepLog.put timed alone, and each reduction timed at
    # its first run in the forward and run again at once on the same rows
    put, reduce_rows = StepLog.put, hooks_mod.reduce_rows
    spent = {"put": [], "first": [], "again": []}

    def timed_put(self, *a, **k):
        t0 = time.perf_counter_ns()
        put(self, *a, **k)
        spent["put"].append(time.perf_counter_ns() - t0)

    def timed_reduce(*a, **k):
        t0 = time.perf_counter_ns()
        out = reduce_rows(*a, **k)
        t1 = time.perf_counter_ns()
        reduce_rows(*a, **k)
        spent["first"].append(t1 - t0)
        spent["again"].append(time.perf_counter_ns() - t1)
        return out

    control: dict[int, list[dict]] = {n: [] for n in sizes}
    try:
        for _ in range(args.reps):
            for n in sizes:
                got = {}
                # one timer per run, so neither disturbs the other
                for patch, keys in (((timed_put, reduce_rows), ("put",)),
                                    ((put, timed_reduce), ("first", "again"))):
                    StepLog.put, hooks_mod.reduce_rows = patch
                    for v in spent.values():
                        v.clear()
                    run(n)
                    got.update({k: statistics.median(spent[k]) / 1e3 for k in keys})
                control[n].append(got)
    finally:
        StepLog.put, hooks_mod.reduce_rows = put, reduce_rows

    def med(rows: list[dict], part: str, key: str) -> float:
        return round(statistics.median(r[part][key] for r in rows), 1)

    keys = ("steps", "layout_us", "site_us", "arithmetic_us", "own_us")
    for n in sizes:
        rows = res[n]
        print(json.dumps({
            "n": n, "wall": round(statistics.median(r["wall"] for r in rows), 3),
            **{part: {k: med(rows, part, k) for k in keys} for part in ("all", "decode")},
            "control_us": {k: round(statistics.median(c[k] for c in control[n]), 2)
                           for k in ("put", "first", "again")},
        }))
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        def ratio(part: str, key: str) -> float:
            return round(med(res[hi], part, key) / med(res[lo], part, key), 2)
        print(json.dumps({
            "growth": f"{hi} / {lo}",
            **{part: {k: ratio(part, k) for k in keys[1:]} for part in ("all", "decode")},
            "control": {k: round(statistics.median(c[k] for c in control[hi])
                                 / statistics.median(c[k] for c in control[lo]), 2)
                        for k in ("put", "first", "again")},
        }))
    s.close()


if __name__ == "__main__":
    main()
