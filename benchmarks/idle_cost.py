"""Idle cost of vlens's hooks: (a) plain vLLM, the same engine with the
hooks removed in place, against (b) the hooks installed and no plan on any
request. Part of the full benchmark (benchmarks/run.py, `make bench`); this
runs only those two conditions and prints their table (`make bench-idle`).
It leaves docs/performance.md alone (figures go to results-custom.json).

    .venv/bin/python benchmarks/idle_cost.py [--model PATH] [--reps 7]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    import run

    run.set_env()
    run.main(["--only", "a,b", "--no-nnsight", "--no-widgets", *sys.argv[1:]])
