"""Idle cost of vlens's hooks: generation throughput with the hooks
installed but no plan on any request, against the same engine with the
hooks removed. Runs interleaved A/B in one process and prints medians and
the ratio.

    .venv/bin/python benchmarks/idle_cost.py [--model PATH] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="local model folder (default: bundled)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    from vllm import SamplingParams

    import vlens

    s = vlens.Session(args.model)
    engine = s._engine
    words = s.tokenizer.convert_ids_to_tokens(list(range(8, 40)))
    prompts = [{"prompt_token_ids": s.tokenize(" ".join(words[i % 7 : i % 7 + 6]))} for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def one() -> float:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        dt = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.prompts * args.tokens
        return args.prompts * args.tokens / dt

    one()  # warm up
    rates: dict[str, list[float]] = {"no hooks": [], "hooks, no plan": []}
    for _ in range(args.reps):
        for label in rates:
            if label == "no hooks":
                engine.rpc("vlens_teardown")
            else:
                engine.rpc("vlens_setup")
            rates[label].append(one())
    engine.rpc("vlens_setup")
    status = s.status()
    s.close()

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"model: {args.model or 'bundled toy-world'}; {args.prompts} prompts x "
          f"{args.tokens} tokens, greedy, ignore_eos; {args.reps} interleaved reps")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus; env: "
          + ", ".join(f"{k}={os.environ.get(k)}" for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")))
    for k, v in rates.items():
        print(f"  {k:>15}: median {med[k]:8.1f} tok/s  (min {min(v):.1f}, max {max(v):.1f})")
    ratio = med["no hooks"] / med["hooks, no plan"]
    print(f"  time ratio hooks/no-hooks (median): {ratio:.3f}  (1.00 = no cost)")
    print(f"  worker: {status['hooks']} hooks, {status['steps_planned']} planned steps")


if __name__ == "__main__":
    main()
