"""Cost of steering, measured side by side in one process (interleaved reps):

  plain     -- no plan on any request
  shared    -- every request steered with the same vector at one layer
  distinct  -- every request steered with its own vector at one layer

Prints median throughput and the time ratios distinct/shared (goal <= 1.05)
and shared/plain.

    .venv/bin/python benchmarks/steering_cost.py [--model PATH] [--reps 5]
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
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import torch

    import vlens

    s = vlens.Session(args.model)
    words = s.tokenizer.convert_ids_to_tokens(list(range(8, 40)))
    prompts = [" ".join(words[i % 7 : i % 7 + 6]) for i in range(args.prompts)]
    layer = s.n_layers // 2
    gen = torch.Generator().manual_seed(0)
    vecs = torch.randn(args.prompts, s.hidden_size, generator=gen)
    vecs = vecs / vecs.norm(dim=-1, keepdim=True)
    shared = vlens.Steer(vecs[0], layer=layer, scale=2.0)
    distinct = [vlens.Steer(v, layer=layer, scale=2.0) for v in vecs]
    conditions = {"plain": None, "shared": shared, "distinct": distinct}
    n_tok = args.prompts * args.tokens

    def one(steer) -> float:
        t0 = time.perf_counter()
        if steer is None:
            s.generate(prompts, max_new_tokens=args.tokens, ignore_eos=True)
        else:
            # a list of one Steer per prompt: each request its own vector
            per = steer if isinstance(steer, list) else [steer] * args.prompts
            per = [[x] for x in per]
            run = s.trace(prompts, sites=[], steer=per, max_new_tokens=args.tokens,
                          logprobs=False, ignore_eos=True)
            assert all(t.steered_rows > 0 for t in run)
        return n_tok / (time.perf_counter() - t0)

    for steer in conditions.values():  # warm up every path (and the prefix cache)
        one(steer)
    rates: dict[str, list[float]] = {k: [] for k in conditions}
    for _ in range(args.reps):
        for name, steer in conditions.items():
            rates[name].append(one(steer))
    status = s.status()
    s.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"model: {args.model or 'bundled toy-world'}; {args.prompts} prompts x {args.tokens} "
          f"tokens, greedy, ignore_eos, steer at layer {layer}; {args.reps} interleaved reps")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus")
    for k, v in rates.items():
        print(f"  {k:>9}: median {med[k]:8.1f} tok/s  (min {min(v):.1f}, max {max(v):.1f})")
    print(f"  time ratio distinct/shared: {med['shared'] / med['distinct']:.3f}  (goal <= 1.05)")
    print(f"  time ratio shared/plain:    {med['plain'] / med['shared']:.3f}")
    steps = max(status["steps_planned"], 1)
    print(f"  worker: layout {status['layout_ns'] / steps / 1e3:.1f} us/planned step, "
          f"hooks {status['hook_ns'] / steps / 1e3:.1f} us/planned step")


if __name__ == "__main__":
    main()
