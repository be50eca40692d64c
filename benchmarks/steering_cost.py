"""Cost of steering: (a) plain vLLM, (c) every request steered with one
shared vector at one layer, (e) every request with its own vector (goal:
(e) <= 1.05 x (c)). Part of the full benchmark (benchmarks/run.py,
`make bench`); this runs only those conditions and prints their table. It
leaves docs/performance.md alone (figures go to results-custom.json).

    .venv/bin/python benchmarks/steering_cost.py [--model PATH] [--reps 7]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    import run

    run.set_env()
    run.main(["--only", "a,c,e", "--no-nnsight", "--no-widgets", *sys.argv[1:]])
