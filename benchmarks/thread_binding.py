"""Which CPU thread setting should vlens default to? Each setting runs in a
fresh process (vLLM reads these variables once, at engine start); the
settings are interleaved over reps and medians printed.

    .venv/bin/python benchmarks/thread_binding.py [--model PATH] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "auto (vLLM default)": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    "nobind, OMP_NUM_THREADS=2": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"},
}

CHILD = r"""
import json, os, sys, time
import vlens
from vllm import SamplingParams
s = vlens.Session(sys.argv[1] if sys.argv[1] != "-" else None)
e = s.engine
words = s.tokenizer.convert_ids_to_tokens(list(range(8, 40)))
prompts = [{"prompt_token_ids": s.tokenize(" ".join(words[i % 7 : i % 7 + 6]))} for i in range(32)]
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
e.generate(prompts[:4], p)
t0 = time.perf_counter(); e.generate(prompts, p); dt = time.perf_counter() - t0
print("RESULT", json.dumps({"tok_s": 32 * 64 / dt}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="-")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=240)
    args = ap.parse_args()
    rates: dict[str, list[float]] = {k: [] for k in SETTINGS}
    for _ in range(args.reps):
        for name, extra in SETTINGS.items():
            env = {k: v for k, v in os.environ.items()
                   if k not in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
            env.update(extra, VLLM_LOGGING_LEVEL="ERROR")
            try:
                out = subprocess.run([sys.executable, "-c", CHILD, args.model], env=env,
                                     capture_output=True, text=True, timeout=args.timeout)
                line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
                rates[name].append(json.loads(line.split(" ", 1)[1])["tok_s"])
            except (subprocess.TimeoutExpired, StopIteration):
                rates[name].append(0.0)  # did not finish in time
    print(f"32 prompts x 64 tokens, {args.reps} reps, each in a fresh process "
          f"({os.cpu_count()} cpus); 0 = did not finish within {args.timeout} s")
    for name, v in rates.items():
        print(f"  {name:>28}: median {statistics.median(v):8.1f} tok/s  ({', '.join(f'{x:.0f}' for x in v)})")


if __name__ == "__main__":
    main()
