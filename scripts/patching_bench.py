"""The patching benchmark: a layers x positions activation-patching grid
(4 x 40 by default) three ways, interleaved over repetitions: ``Session.patch``
(one engine batch of every cell), the same cell requests one engine call
each, and a Hugging Face loop (one forward per cell, the clean row written by
``vlens.testing.hf_steering_hook``). The grids are checked against each
other; the table between the ``patching-bench`` markers of docs/methods.md
is rewritten (``--no-doc``: left alone). ``make bench`` runs it too.

Then the prefix cache (``--cache-tokens``, 0: skipped): the last
``--cache-layers`` layers x every position of a longer prompt (256 tokens,
32-token KV blocks) on an
engine with prefix caching, where every cell reads the corrupt run's
blocks before its position (vlens/engine/prefix_cache.py), against an
engine without it; their time and prompt rows computed, interleaved.

    .venv/bin/python scripts/patching_bench.py [--model PATH] [--reps 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from vlens.testing import hf_steering_hook

BEGIN, END = "<!-- patching-bench:begin -->", "<!-- patching-bench:end -->"


def prompt_pair(tok, n_tokens: int) -> tuple[str, str, int]:
    """A clean prompt of ``n_tokens`` tokens (BOS included) of the tokenizer's
    own words, a corrupt one with the middle word swapped, the swapped position."""
    special = set(tok.all_special_ids)
    vocab = [w for w, i in sorted(tok.get_vocab().items(), key=lambda x: x[1])
             if w.isalnum() and i not in special]
    words = [vocab[(7 + 13 * i) % len(vocab)] for i in range(n_tokens)]
    words = words[: len(words) - (len(tok(" ".join(words))["input_ids"]) - n_tokens)]
    k = len(words) // 2
    clean = " ".join(words)
    corrupt = " ".join(words[:k] + [next(w for w in vocab if w != words[k])] + words[k + 1:])
    a, b = tok(clean)["input_ids"], tok(corrupt)["input_ids"]
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != n_tokens or len(b) != n_tokens or len(diff) != 1:
        raise SystemExit("this tokenizer does not keep whole words: pass --model with one that does")
    return clean, corrupt, diff[0]


class HFPatch:
    """One forward per cell: resid_post at (layer, position) set to the clean run's."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        from vlens.protocol.architectures import ARCHITECTURES

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        obj = self.model
        for part in ARCHITECTURES[self.model.config.architectures[0]].hf.layers.split("."):
            obj = getattr(obj, part)
        self.layers = obj

    def _diff(self, ids, answer, hooks=()) -> float:
        try:
            with torch.no_grad():
                lp = self.model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        finally:
            for h in hooks:
                h.remove()
        return float(lp[answer[0]] - lp[answer[1]])

    def grid(self, clean, corrupt, layers, positions, answer) -> torch.Tensor:
        got = {}

        def keep(i):
            def fn(x):
                got[i] = x[0].clone()
                return x
            return fn

        ld_clean = self._diff(clean, answer, [hf_steering_hook(self.layers[i], keep(i)) for i in layers])
        ld_corrupt = self._diff(corrupt, answer)
        out = torch.empty(len(layers), len(positions))
        for i, layer in enumerate(layers):
            for j, p in enumerate(positions):
                def write(x, layer=layer, p=p):
                    x[0, p] = got[layer][p]
                    return x
                out[i, j] = self._diff(corrupt, answer, [hf_steering_hook(self.layers[layer], write)])
        self.normalised = (out - ld_corrupt) / (ld_clean - ld_corrupt)  # a real loop does this too
        return out


def bench(path: str, reps: int, n_layers: int, n_positions: int) -> dict:
    from transformers import AutoTokenizer

    import vlens
    from vlens.calls import Call
    from vlens.methods.patching import patch_call

    clean, corrupt, swapped = prompt_pair(AutoTokenizer.from_pretrained(path), n_positions)
    hf = HFPatch(path)  # before the engine
    s = vlens.Session(path, reuse=False, max_model_len=256, kv_cache_memory_bytes=256 * 2**20)
    try:
        layers = list(range(s.n_layers - min(n_layers, s.n_layers), s.n_layers))  # the last ones
        ids = {p: s.tokenize(p) for p in (clean, corrupt)}
        positions = list(range(len(ids[clean])))
        tops = [s.trace(p, sites=[], max_new_tokens=1)[0].output_token_ids[0] for p in (clean, corrupt)]
        answer = tuple(tops) if tops[0] != tops[1] else (tops[0], ids[corrupt][swapped])

        def calls():  # the cell requests of Session.patch, one engine call each
            first = patch_call(s, clean, corrupt, layers=layers, span=positions, answer=answer)
            stage: dict = {}
            read_cells = first.assemble  # returns the cell stage; keep it instead of running it
            first.assemble = lambda o, got, runs: stage.setdefault("cells", read_cells(o, got, runs)) and None
            runner = s._runner  # a benchmark of the engine calls themselves
            runner.run(first, budget=s.read_budget)
            cells = stage["cells"]
            outs = [runner.run(Call([r], lambda o, got, runs: o[0]), budget=s.read_budget)
                    for r in cells.requests]
            return cells.partial(outs, runner).diffs

        ways = {"batch": lambda: s.patch(clean, corrupt, layers=layers, answer=answer).diffs,
                "calls": calls,
                "hf": lambda: hf.grid(ids[clean], ids[corrupt], layers, positions, answer)}
        ways["batch"]()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in ways}
        grids = {}
        for _ in range(reps):
            for k, fn in ways.items():
                t0 = time.perf_counter()
                grids[k] = fn()
                times[k].append(time.perf_counter() - t0)
    finally:
        s.close()
    ratios = {k: [t / b for t, b in zip(times[k], times["batch"])] for k in ("calls", "hf")}
    return {"model": path, "layers": layers, "positions": len(positions),
            "cells": len(layers) * len(positions), "swapped_position": swapped,
            "answer": list(answer), "reps": reps,
            "median_s": {k: statistics.median(v) for k, v in times.items()}, "times_s": times,
            "ratio_to_batch": {k: statistics.median(v) for k, v in ratios.items()},
            "max_grid_difference": {k: float((grids[k] - grids["batch"]).abs().max())
                                    for k in ("calls", "hf")},
            "torch_threads": torch.get_num_threads()}


def bench_cache(path: str, reps: int, n_layers: int, n_tokens: int, block: int) -> dict:
    """``s.patch`` of the last ``n_layers`` x every position of an
    ``n_tokens`` prompt on an engine with prefix caching (cells on the
    cache) and on one without, ``reps`` interleaved repetitions."""
    from transformers import AutoTokenizer

    import vlens

    clean, corrupt, _ = prompt_pair(AutoTokenizer.from_pretrained(path), n_tokens)
    opts = dict(reuse=False, max_model_len=n_tokens + 64, block_size=block,
                kv_cache_memory_bytes=256 * 2**20)
    engines = {"cache": vlens.Session(path, **opts),
               "no_cache": vlens.Session(path, enable_prefix_caching=False, **opts)}
    try:
        s = engines["cache"]
        layers = list(range(s.n_layers - min(n_layers, s.n_layers), s.n_layers))
        tops = [s.trace(p, sites=[], max_new_tokens=1)[0].output_token_ids[0] for p in (clean, corrupt)]
        answer = tuple(tops) if tops[0] != tops[1] else (tops[0], (tops[0] + 1) % s.info["vocab_size"])
        times: dict[str, list[float]] = {k: [] for k in engines}
        got = {}
        for e in engines.values():  # warm-up
            e.patch(clean, corrupt, site="resid_pre", layers=layers, answer=answer)
        for _ in range(reps):
            for k, e in engines.items():
                t0 = time.perf_counter()
                got[k] = e.patch(clean, corrupt, site="resid_pre", layers=layers, answer=answer)
                times[k].append(time.perf_counter() - t0)
        marks = s.engine.prefix_marks
    finally:
        for e in engines.values():
            e.close()
    ratios = [t / b for t, b in zip(times["cache"], times["no_cache"])]
    return {"tokens": n_tokens, "block_size": block, "layers": layers, "reps": reps,
            "cells": len(layers) * n_tokens, "prefix_marks": marks,
            "median_s": {k: statistics.median(v) for k, v in times.items()}, "times_s": times,
            "time_ratio": statistics.median(ratios),
            "rows_computed": {k: p.rows_computed for k, p in got.items()},
            "rows_cached": {k: p.rows_cached for k, p in got.items()},
            "rows_ratio": got["cache"].rows_computed / got["no_cache"].rows_computed,
            "max_grid_difference": float((got["cache"].diffs - got["no_cache"].diffs).abs().max())}


def cache_table(c: dict) -> str:
    m, rows, hits = c["median_s"], c["rows_computed"], c["rows_cached"]
    return "\n".join([
        "| prefix cache | median time | prompt rows computed | rows read from the cache |",
        "|---|---:|---:|---:|",
        f"| off: every cell computes its whole prompt | {m['no_cache']:.3f} s | "
        f"{rows['no_cache']:,} | {hits['no_cache']:,} |",
        f"| on: cells read the corrupt run's blocks | {m['cache']:.3f} s | "
        f"{rows['cache']:,} | {hits['cache']:,} |"]) + (
        f"\n\n`resid_pre`, {len(c['layers'])} layers x {c['tokens']} positions ({c['cells']} cells) "
        f"of a {c['tokens']}-token prompt, KV blocks of {c['block_size']} tokens, {c['reps']} "
        f"interleaved repetitions: time {c['time_ratio']:.2f} x (median of the paired ratios), "
        f"prompt rows {c['rows_ratio']:.2f} x; the grids differ by at most "
        f"{c['max_grid_difference']:.1e} in a cell's logit difference.")


def table(res: dict) -> str:
    m, r, cells = res["median_s"], res["ratio_to_batch"], res["cells"]
    agree = res["max_grid_difference"]
    return "\n".join([
        "| way | median time | per cell | x batch |", "|---|---:|---:|---:|",
        f"| `s.patch`: one engine batch of {cells} cells | {m['batch']:.3f} s | "
        f"{1e3 * m['batch'] / cells:.2f} ms | 1.00 |",
        f"| the same cells, one engine call each | {m['calls']:.3f} s | "
        f"{1e3 * m['calls'] / cells:.2f} ms | {r['calls']:.2f} |",
        f"| Hugging Face loop, one forward per cell | {m['hf']:.3f} s | "
        f"{1e3 * m['hf'] / cells:.2f} ms | {r['hf']:.2f} |"]) + (
        f"\n\n{len(res['layers'])} layers x {res['positions']} positions (layers "
        f"{res['layers']}), {res['reps']} interleaved repetitions; 'x batch' is the median of "
        f"each repetition's ratio. The three agree: the largest difference of a cell's logit "
        f"difference from the batch's is {agree['calls']:.1e} (one call each) and "
        f"{agree['hf']:.1e} (Hugging Face). "
        f"Model: `{Path(res['model']).name}`; {res['torch_threads']} torch thread(s).") + (
        f"\n\n{cache_table(res['prefix_cache'])}" if res.get("prefix_cache") else "")


def write_doc(doc: Path, res: dict, started: str, command: str, load: float) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{table(res)}\n\nMeasured {started} with `{command}` (load "
                   f"average {load} when it began, on {os.cpu_count()} cores).\n{END}"
                   + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> dict:
    from datetime import UTC, datetime

    from vlens.models import toyworld_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local model folder (default: the bundled one)")
    for flag, default in (("reps", 5), ("layers", 4), ("positions", 40)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--cache-tokens", type=int, default=256,
                    help="prompt length of the prefix-cache grid (0: skip it)")
    ap.add_argument("--cache-block", type=int, default=32, help="its KV block size")
    ap.add_argument("--cache-layers", type=int, default=2, help="its layers (the last ones)")
    ap.add_argument("--no-doc", action="store_true", help="leave docs/methods.md alone")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the benchmark: one thread on a shared CPU
    started, load = datetime.now(UTC).isoformat(timespec="seconds"), round(os.getloadavg()[0], 2)
    res = bench(args.model or str(toyworld_path()), args.reps, args.layers, args.positions)
    if args.cache_tokens:
        res["prefix_cache"] = bench_cache(args.model or str(toyworld_path()), args.reps,
                                          args.cache_layers, args.cache_tokens, args.cache_block)
    print(table(res), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if not args.no_doc:
        command = " ".join(["scripts/patching_bench.py", *(sys.argv[1:] if argv is None else argv)])
        write_doc(Path(__file__).resolve().parents[1] / "docs" / "methods.md", res, started, command, load)
    return res


if __name__ == "__main__":
    main()
