"""python -m benchmarks COMMAND [options]

  run      every condition (``list``) on the bundled model and a random 512 x 8 Llama,
           interleaved, into benchmarks/results.jsonl, then docs/performance.md (``make bench``)
  report   docs/performance.md from benchmarks/results.jsonl, running nothing (``make report``)
  list     the conditions: name, tag in the tables, engine, label
  openai   steered chat via the openai client, vlens serve against vllm serve
  serve    connected clients of vlens serve against one in-process Session

``run --only NAME,...`` and ``run --model PATH`` (a folder or a registry name: ``make bench``
ends with ``--model smollm2-135m-instruct``) write benchmarks/results-custom.jsonl and leave
the doc alone; ``run --device-check`` is the GPU run (a random 0.5B Qwen2-shaped model,
bfloat16, 3 repetitions). ``run`` also runs scripts/widget_latency.py and
scripts/patching_bench.py (docs/methods.md's grid), each in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS, DOC = HERE / "results.jsonl", HERE.parent / "docs" / "performance.md"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run, rep, _ = (sub.add_parser(x) for x in ("run", "report", "list"))
    run.add_argument("--model", action="append",
                     help="local model folder or registry name, e.g. smollm2-135m-instruct (repeatable)")
    run.add_argument("--only", help="comma-separated condition names (see `list`)")
    run.add_argument("--dtype", help="engine and HF dtype (default: the model's)")
    run.add_argument("--sae", help="the SAE of the (sae) rows: a path or registry name, e.g. "
                     "smollm2-135m-instruct-sae (default: a random 4096-wide one at the middle layer)")
    run.add_argument("--out", type=Path, help="the JSONL file the lines are appended to")
    run.add_argument("--doc", type=Path, help="the report to rewrite afterwards")
    flags = {"run": {"prompts": 32, "tokens": 64, "reps": None, "slow-reps": 3, "max-model-len": 256,
                     "kv-cache-mb": 512, "long-tokens": 16, "wide": 256, "k-tokens": 32, "scale": 4.0,
                     "gpu-share": 0.18, "budget": 840.0, "device-check": False, "no-nnsight": False,
                     "no-widgets": False, "no-serve": False, "no-patching": False, "no-methods": False,
                     "no-compiled": False, "no-cache-off": False, "no-long": False},
             "openai": {"concurrency": "1,8,32", "calls": 2, "min-calls": 16, "tokens": 32,
                        "repeats": 3, "eager": False, "vllm-defaults": False},
             "serve": {"clients": "1,4,16", "calls": 8, "tokens": 16, "kv-cache-mb": 256}}
    for name, opts in flags.items():
        p = run if name == "run" else sub.add_parser(name)
        for flag, default in opts.items():
            if default is False:
                p.add_argument(f"--{flag}", action="store_true")
            else:
                p.add_argument(f"--{flag}", type=type(default) if default is not None else int,
                               default=default)
        if name != "run":
            p.add_argument("--model", help="local model folder (default: the bundled one)")
            p.add_argument("--json", type=Path, help="also write the figures here")
    rep.add_argument("--results", type=Path, default=RESULTS)
    rep.add_argument("--doc", type=Path, default=DOC)
    return ap


def parse(argv: list[str]) -> argparse.Namespace:
    from .conditions import CACHE_OFF, COMPILED, NAMES, PREAMBLE, with_references

    args = _parser().parse_args(argv)
    if args.command != "run":
        return args
    names = NAMES if not args.only else [n.strip() for n in args.only.split(",")]
    if set(names) - set(NAMES):
        _parser().error(f"unknown conditions {sorted(set(names) - set(NAMES))}; see `list`")
    drop = {n for group, skip in ((COMPILED, args.no_compiled), (CACHE_OFF, args.no_cache_off),
                                  (PREAMBLE, args.no_long), (["nnsight_steer"], args.no_nnsight))
            if skip for n in group}
    args.names = [n for n in with_references([n for n in names if n not in drop]) if n not in drop]
    if args.sae and "sae_hf" in args.names:
        _parser().error("sae_hf encodes with the random standard SAE it writes; leave it out "
                        "(--only) when --sae names another")
    args.reps = args.reps or (3 if args.device_check else 7)
    partial = bool(args.model or args.only) and not args.device_check
    args.suite = "gpu" if args.device_check else "custom" if partial else "main"
    args.out = args.out or (HERE / "results-custom.jsonl" if partial else RESULTS)
    args.doc = args.doc or (None if partial else DOC)
    return args


def main(argv: list[str] | None = None) -> object:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "--device-check" not in argv:  # one torch thread on a shared CPU (docs/performance.md)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse(argv)
    from . import report

    if args.command == "list":
        from .conditions import REGISTRY

        for c in REGISTRY.values():
            print(f"{c.name:34} ({c.tag}) {c.engine:9} {c.label}")
        return None
    if args.command == "report":
        report.write(args.doc, args.results)
        return print(f"wrote {args.doc}")
    if args.command == "run":
        from .results import read, summarise_run
        from .runner import run

        out = run(args, argv[1:])
        summary = summarise_run(read(out)[args.suite][-1])
        print(report.tables(summary))
        if args.doc is not None:
            report.write(args.doc, out, "main" if args.suite == "gpu" else args.suite)
            print(f"wrote {args.doc}")
        return summary
    from . import clients

    res = (clients.openai_throughput if args.command == "openai" else clients.serve)(args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
