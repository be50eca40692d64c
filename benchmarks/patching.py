"""Patching benchmark: a layers x positions activation-patching grid
(4 x 40 by default) three ways, in the same process and run:

* batch  -- ``Session.patch``: one call reads clean and corrupt, ONE engine
  call runs every cell as its own request;
* calls  -- the same cell requests, one engine call each (after the same
  read), as a loop over cells would run them on vlens;
* hf     -- a Hugging Face transformers loop: one forward per cell with a
  hook writing the clean row (and the clean and corrupt forwards).

Repetitions are interleaved; the table gives medians and the ratios of
each repetition's times (calls / batch, hf / batch). The three grids are
checked against each other. ``benchmarks/run.py`` (``make bench``) calls
it; alone:

    .venv/bin/python benchmarks/patching.py [--model PATH] [--reps 5]

It writes benchmarks/results-patching.json and rewrites the table between
the ``patching-bench`` markers of docs/methods.md (``--no-doc``: leave it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

BEGIN, END = "<!-- patching-bench:begin -->", "<!-- patching-bench:end -->"


def log(msg: str) -> None:
    print(msg, flush=True)


def prompt_pair(tok, n_tokens: int) -> tuple[str, str, int]:
    """A clean prompt of ``n_tokens`` tokens (BOS included) made of the
    tokenizer's own words, and a corrupt one with the middle word swapped
    for another; returns (clean, corrupt, the swapped token's position).
    Needs a tokenizer that keeps whole words (the bundled model's, vlens's
    tiny models')."""
    special = set(tok.all_special_ids)
    vocab = [w for w, i in sorted(tok.get_vocab().items(), key=lambda x: x[1])
             if w.isalnum() and i not in special]
    words = [vocab[(7 + 13 * i) % len(vocab)] for i in range(n_tokens)]
    ids = tok(" ".join(words))["input_ids"]
    words = words[: len(words) - (len(ids) - n_tokens)]  # n_tokens with BOS
    clean = " ".join(words)
    k = len(words) // 2
    corrupt = " ".join(words[:k] + [next(w for w in vocab if w != words[k])] + words[k + 1:])
    a, b = tok(clean)["input_ids"], tok(corrupt)["input_ids"]
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != n_tokens or len(b) != n_tokens or len(diff) != 1:
        raise SystemExit("this tokenizer does not keep whole words: pass --model with one that does")
    return clean, corrupt, diff[0]


class HFPatch:
    """One forward per cell on the Hugging Face model: resid_post (the
    decoder layer's output) at (layer, position) replaced by the clean run's."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from vlens.protocol.architectures import ARCHITECTURES

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        arch = ARCHITECTURES[self.model.config.architectures[0]]
        obj = self.model
        for part in arch.hf.layers.split("."):
            obj = getattr(obj, part)
        self.layers = obj

    def _last_logprobs(self, ids):
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)

    def grid(self, clean, corrupt, layers, positions, answer):
        torch = self.torch
        got = {}

        def keep(i):
            def hook(m, a, out):
                got[i] = (out[0] if isinstance(out, tuple) else out)[0].clone()
            return hook

        handles = [self.layers[i].register_forward_hook(keep(i)) for i in layers]
        try:
            lp = self._last_logprobs(clean)
        finally:
            for h in handles:
                h.remove()
        a, b = answer
        ld_clean = float(lp[a] - lp[b])
        lp = self._last_logprobs(corrupt)
        ld_corrupt = float(lp[a] - lp[b])
        out = torch.empty(len(layers), len(positions))
        for i, layer in enumerate(layers):
            for j, p in enumerate(positions):
                def write(m, args, o, layer=layer, p=p):
                    (o[0] if isinstance(o, tuple) else o)[0, p] = got[layer][p]
                h = self.layers[layer].register_forward_hook(write)
                try:
                    lp = self._last_logprobs(corrupt)
                finally:
                    h.remove()
                out[i, j] = float(lp[a] - lp[b])
        # a real patching loop normalises too; kept for its cost and for reading
        self.normalised = (out - ld_corrupt) / (ld_clean - ld_corrupt)
        return out  # each cell's logit difference


def one_call_each(s, clean, corrupt, layers, positions, answer):
    """The same cell requests as ``Session.patch`` builds, one engine call
    each (after the same read pass)."""
    from vlens.methods.patching import patch_call

    pc = patch_call(s, clean, corrupt, layers=layers, positions=positions, answer=answer)
    outs = [s._runner.run([req], lambda o, got: o[0], budget=s.read_budget)
            for req in pc.requests]
    return pc.result(outs).diffs


def bench(path: str, reps: int, n_layers: int, n_positions: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    import vlens

    tok = AutoTokenizer.from_pretrained(path)
    clean, corrupt, swapped = prompt_pair(tok, n_positions)
    hf = HFPatch(path)  # before the engine (see hf_steer.py)
    s = vlens.Session(path, reuse=False, max_model_len=256, kv_cache_memory_bytes=256 * 2**20)
    try:
        n_layers = min(n_layers, s.n_layers)
        # the last layers: where a grid on a small model has most to show
        layers = list(range(s.n_layers - n_layers, s.n_layers))
        n = len(s.tokenize(clean))
        positions = list(range(n))
        # the answer: each run's top next token, or (when they agree, as on
        # a made-up word list they may) the clean top against the swapped word
        tops = [s.trace(p, sites=[], max_new_tokens=1)[0].output_token_ids[0]
                for p in (clean, corrupt)]
        answer = tuple(tops) if tops[0] != tops[1] else (tops[0], s.tokenize(corrupt)[swapped])
        s.patch(clean, corrupt, layers=layers, answer=answer)  # warm-up
        times = {"batch": [], "calls": [], "hf": []}
        grids = {}
        for _ in range(reps):
            t0 = time.perf_counter()
            grids["batch"] = s.patch(clean, corrupt, layers=layers, answer=answer).diffs
            times["batch"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            grids["calls"] = one_call_each(s, clean, corrupt, layers, positions, answer)
            times["calls"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            grids["hf"] = hf.grid(s.tokenize(clean), s.tokenize(corrupt), layers, positions,
                                  answer)
            times["hf"].append(time.perf_counter() - t0)
        agree = {k: float((grids[k] - grids["batch"]).abs().max()) for k in ("calls", "hf")}
    finally:
        s.close()
    ratios = {k: [t / b for t, b in zip(times[k], times["batch"])] for k in ("calls", "hf")}
    return {
        "model": path, "layers": layers, "positions": n, "cells": len(layers) * n,
        "swapped_position": swapped, "answer": list(answer), "reps": reps,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "times_s": times,
        "ratio_to_batch": {k: statistics.median(v) for k, v in ratios.items()},
        "max_grid_difference": agree, "torch_threads": torch.get_num_threads(),
    }


def table(res: dict) -> str:
    m, r = res["median_s"], res["ratio_to_batch"]
    cells = res["cells"]
    rows = [
        "| way | median time | per cell | x batch |",
        "|---|---:|---:|---:|",
        f"| `s.patch`: one engine batch of {cells} cells | {m['batch']:.3f} s | "
        f"{1e3 * m['batch'] / cells:.2f} ms | 1.00 |",
        f"| the same cells, one engine call each | {m['calls']:.3f} s | "
        f"{1e3 * m['calls'] / cells:.2f} ms | {r['calls']:.2f} |",
        f"| Hugging Face loop, one forward per cell | {m['hf']:.3f} s | "
        f"{1e3 * m['hf'] / cells:.2f} ms | {r['hf']:.2f} |",
    ]
    agree = res["max_grid_difference"]
    return "\n".join(rows) + (
        f"\n\n{len(res['layers'])} layers x {res['positions']} positions (layers "
        f"{res['layers']}), {res['reps']} interleaved repetitions; 'x batch' is the median of "
        f"each repetition's ratio. The three agree: the largest difference of a cell's logit "
        f"difference from the batch's is {agree['calls']:.1e} (one call each) and "
        f"{agree['hf']:.1e} (Hugging Face). "
        f"Model: `{Path(res['model']).name}`; {res['torch_threads']} torch thread(s).")


def write_doc(doc: Path, res: dict, meta: dict) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to rewrite")
    body = (f"{BEGIN}\n{table(res)}\n\nMeasured {meta['started']} with "
            f"`{meta['command']}` (load average {meta['load_average']} when it began, on "
            f"{os.cpu_count()} cores).\n{END}")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + body + rest.split(END, 1)[1])


def default_model() -> str:
    """The bundled toy-world model, or a stand-in of its shape."""
    import run

    try:
        from vlens.models import toyworld_path

        return str(toyworld_path())
    except FileNotFoundError:
        return str(run._make("toyworld-standin", run.TOYWORLD_SHAPE))


def main(argv: list[str] | None = None) -> dict:
    import run

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local model folder (default: the bundled one)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--positions", type=int, default=40)
    ap.add_argument("--json", type=Path, default=HERE / "results-patching.json")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "methods.md")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args(argv)
    path = args.model or default_model()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load = os.getloadavg()[0]
    log(f"== patching: {args.layers} layers x {args.positions} positions on {path}")
    res = bench(path, args.reps, args.layers, args.positions)
    meta = {"started": started, "load_average": round(load, 2),
            "command": " ".join(["benchmarks/patching.py", *(sys.argv[1:] if argv is None
                                                              else argv)])}
    res["meta"] = {**meta, "machine": run.machine(), "versions": run.versions()}
    args.json.write_text(json.dumps(res, indent=1))
    log(table(res))
    if not args.no_doc:
        write_doc(args.doc, res, meta)
        log(f"wrote {args.doc}")
    return res


if __name__ == "__main__":
    import run

    run.set_env()
    main()
