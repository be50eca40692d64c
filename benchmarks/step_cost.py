"""Per-step worker cost at 32 requests and at a wide batch (issue 15, (k)).

One engine, one plan: ``resid_pre``, ``resid_post``, ``attn_out`` and
``mlp_out`` read at layers 2 and 6 (4 sites x 2 layers), reduced to norms in
the worker, 32 new tokens per request, all requests in one engine batch.
From the worker's counters (``layout_ns``, ``hook_ns``, ``steps_planned`` in
``s.status()``) it prints, per request count, the median over repetitions of
the layout µs per planned step and the hook µs per step per hooked site, one
JSON line each. A random Llama (hidden 128, 8 layers) made on the spot, one
torch thread. To compare two checkouts, run it once with each on
``PYTHONPATH``::

    PYTHONPATH=. .venv/bin/python benchmarks/step_cost.py --reps 3 --sizes 32,256
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
    from vlens.tiny import make_tiny_model

    sizes = [int(x) for x in args.sizes.split(",")]
    path = make_tiny_model(os.path.join(work, "model"), "llama", hidden=128, layers=8, seed=1)
    # a KV cache and scheduler that hold the widest batch at once (no waves)
    s = vlens.Session(str(path), kv_cache_memory_bytes=640 * 2**20, max_model_len=256,
                      max_num_seqs=max(sizes), max_num_batched_tokens=4096)
    words = "the cat sat on a mat and then it ran far away from home".split()
    base = [" ".join(words[: 3 + (i % 10)]) for i in range(32)]

    def run(n: int) -> dict:
        prompts = [base[i % len(base)] for i in range(n)]
        a = s.status()
        t = time.perf_counter()
        s.trace(prompts, layers=LAYERS, sites=SITES, reduce="norm", max_new_tokens=args.tokens)
        wall = time.perf_counter() - t
        b = s.status()
        steps = b["steps_planned"] - a["steps_planned"]
        hooked = len(SITES) * len(LAYERS)
        return {"steps": steps, "wall": wall,
                "layout_us": (b["layout_ns"] - a["layout_ns"]) / 1e3 / steps,
                "site_us": (b["hook_ns"] - a["hook_ns"]) / 1e3 / steps / hooked}

    run(4)  # warm-up
    res: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            res[n].append(run(n))
    for n in sizes:
        rows = res[n]
        print(json.dumps({
            "n": n, "steps": rows[0]["steps"],
            **{k: statistics.median(r[k] for r in rows) for k in ("layout_us", "site_us", "wall")},
            "all_layout": [round(r["layout_us"]) for r in rows],
            "all_site": [round(r["site_us"]) for r in rows],
        }))
    s.close()


if __name__ == "__main__":
    main()
