"""vlens's performance benchmark: one command, every figure in
docs/performance.md.

    make bench                                   # = .venv/bin/python benchmarks/run.py
    .venv/bin/python benchmarks/run.py --model PATH [--reps 5]   # any local model
    .venv/bin/python benchmarks/run.py --device-check [--model PATH]  # on a GPU
    make gpu-check                               # the GPU check: install, tests, this

By default it measures the bundled toy-world model and a larger random-weight
Llama that it makes on first use (hidden 512, 8 layers, vocabulary 4096;
kept in benchmarks/.models/). Per model it starts the engines of
benchmarks/engines.py -- plain vLLM at its defaults (a*, compiled), vlens
eager, vlens compiled, vlens eager with prefix caching off -- and runs every
condition of benchmarks/conditions.py on them, interleaved over repetitions
in one process; then writes benchmarks/results.json and rewrites
docs/performance.md from it. It keeps to a time budget (``--budget``, 14
minutes by default): when another repetition would not fit, it stops after
the ones it has (never fewer than 2). ``--no-compiled`` leaves out the
compiled engines (each compiles for ~30 s on CPU), ``--no-cache-off`` the
second engine, ``--no-long`` the shared-preamble conditions (p).

The SAE conditions (sae, sae*, sae_hf: conditions.py) can run alone, on the
512 x 8 model (made on the spot if this checkout has none yet), into their
own file, which the report shows when the main run has none of them::

    .venv/bin/python benchmarks/run.py --model benchmarks/.models/llama-h512-l8 \
        --only sae,sae_comp,sae_hf --json benchmarks/results-sae.json \
        --no-nnsight --no-widgets --no-serve --no-patching
    .venv/bin/python benchmarks/run.py --render-only

``--device-check`` is the GPU run: a ~0.5B random-weight Qwen2-shaped model
(made on the spot unless ``--model`` names one), bfloat16, 3 repetitions,
CUDA graphs for the compiled engines, without nnsight unless it is
installed; it writes benchmarks/results-gpu.json and adds its figures to
docs/performance.md beside the CPU ones. ``--model`` alone writes
benchmarks/results-custom.json and prints the tables, leaving the doc alone
unless ``--doc`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from machine import LoadWatch, machine, versions  # noqa: E402


def set_env() -> None:
    """Process environment for a benchmark run (explicit settings win).

    One torch thread for every tool, on CPU: on a small machine shared with
    other work, two OpenMP threads wait on each other at every parallel op
    whenever another process holds a core (plain vLLM ran 32 x 64 tokens
    ~14x slower with 2 threads than with 1 while this benchmark was
    written). Must run before torch is imported; HF runs in this process and
    nnsight's subprocess inherits it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "--device-check" not in sys.argv:
        os.environ.setdefault("OMP_NUM_THREADS", "1")

MODELS_DIR = HERE / ".models"
LARGE = {"arch": "llama", "hidden": 512, "layers": 8, "heads": 8, "intermediate": 1376, "vocab": 4096}
# the bundled model's shape (scripts/train_toyworld.py), for a stand-in when
# the trained weights are not in this checkout
TOYWORLD_SHAPE = {"arch": "llama", "hidden": 384, "layers": 6, "heads": 12, "intermediate": 768, "vocab": 133}
# Qwen2.5-0.5B's shape, random weights: the GPU check's default model
HALF_B = {"arch": "qwen2", "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
              "vocab": 151936}


def log(msg: str) -> None:
    print(msg, flush=True)


# -- models ----------------------------------------------------------------------
def _config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    out = {k: text.get(k) for k in keys}
    out["architectures"] = cfg.get("architectures")
    out["dtype"] = text.get("dtype") or text.get("torch_dtype")
    try:
        from safetensors import safe_open

        n = 0
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                n += sum(_numel(st.get_slice(k).get_shape()) for k in st.keys())
        out["parameters"] = n
    except Exception:
        pass
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _make(name: str, shape: dict) -> Path:
    from vlens.tiny import make_tiny_model

    shape = dict(shape)
    arch = shape.pop("arch")
    t0 = time.perf_counter()
    path = make_tiny_model(MODELS_DIR / name, arch, **shape)
    log(f"  model {name}: {time.perf_counter() - t0:.1f} s")
    return path


def default_models() -> list[dict]:
    models = []
    try:
        from vlens.models import toyworld_path

        models.append({"name": "bundled toy-world", "path": str(toyworld_path()), "note": None})
    except FileNotFoundError:
        path = _make("toyworld-standin", TOYWORLD_SHAPE)
        models.append({
            "name": "toy-world shape (stand-in)", "path": str(path),
            "note": "the bundled toy-world model was not in this checkout; a random-weight "
                    "model of its shape (hidden 384, 6 layers, 12 heads, MLP 768) stood in",
        })
    path = _make("llama-h512-l8", LARGE)
    models.append({"name": "random Llama, hidden 512 x 8 layers", "path": str(path), "note": None})
    return models


# -- one model ---------------------------------------------------------------------
def bench_model(spec: dict, args: argparse.Namespace, deadline: float,
                nns_python: str | None) -> dict:
    import engines
    import suite
    import torch
    from transformers import AutoTokenizer

    import vlens

    path = spec["path"]
    log(f"\n== {spec['name']} ({path})")
    result: dict = {"name": spec["name"], "path": path, "note": spec.get("note"),
                    "config": _config(Path(path))}
    tok = AutoTokenizer.from_pretrained(path)
    prompts = suite.make_prompts(tok, args.prompts)
    ids = [list(tok(p)["input_ids"]) for p in prompts]
    n_layers = result["config"]["num_hidden_layers"]
    hidden = result["config"]["hidden_size"]
    setup = suite.Setup(prompts=prompts, prompt_ids=ids, tokens=args.tokens,
                        layer=n_layers // 2, scale=args.scale,
                        vectors=suite.unit_vectors(args.prompts, hidden))
    result["prompt_tokens"] = {"min": min(map(len, ids)), "max": max(map(len, ids)),
                               "total": sum(map(len, ids))}
    device = "cuda" if args.device_check else "cpu"
    dtype_name = args.dtype or ("bfloat16" if args.device_check
                                else result["config"].get("dtype") or "float32")
    dtype = getattr(torch, dtype_name)

    hf = nns = hf_sae = None
    errors: dict[str, str] = {}
    if any(k.startswith("sae") for k in args.keys):
        from hf_sae import make_sae

        setup.sae_path = make_sae(MODELS_DIR / f"sae-4096-h{hidden}-l{setup.layer}", hidden,
                                  setup.layer)
    if "sae_hf" in args.keys:
        from hf_sae import HFSae

        try:
            hf_sae = HFSae(path, ids, setup.sae_path, layer=setup.layer, tokens=args.tokens,
                           device=device, dtype=dtype)
        except Exception as exc:
            errors["sae_hf"] = _short(exc)
    if "j" in args.keys:
        # before the engine: vLLM's Transformers backend (not used here) would
        # patch these classes; loading first is safe either way
        from hf_steer import HFSteer

        try:
            hf = HFSteer(path, ids, setup.vectors[0], layer=setup.layer, scale=setup.scale,
                         tokens=args.tokens, device=device, dtype=dtype)
        except Exception as exc:
            errors["j"] = _short(exc)
    if "m" in args.keys and nns_python:
        from nnsight_bench import NnsightWorker

        try:
            nns = NnsightWorker(nns_python, model=path, prompt_ids=ids,
                                vector=setup.vectors[0].tolist(), layer=setup.layer,
                                scale=setup.scale, tokens=args.tokens, device=device,
                                dtype=dtype_name, log_path=MODELS_DIR / "nnsight-worker.log")
            result["nnsight_worker"] = nns.info
        except Exception as exc:
            errors["m"] = _short(exc)
            nns = None

    if args.long_prompts:
        long_p, long_ids = suite.long_prompts(tok, prompts, block=128)
        if max(map(len, long_ids)) + args.long_tokens <= args.max_model_len:
            setup.long_prompts, setup.long_ids = long_p, long_ids
            setup.long_tokens = args.long_tokens
            result["long_prompt_tokens"] = {"min": min(map(len, long_ids)),
                                            "max": max(map(len, long_ids))}
        else:
            log(f"  (p) skipped: its prompts ({max(map(len, long_ids))} tokens) and "
                f"{args.long_tokens} new tokens do not fit max_model_len {args.max_model_len}")
    setup.wide, setup.k_tokens = args.wide, args.k_tokens

    base_kwargs: dict = {"max_model_len": args.max_model_len, "dtype": dtype_name}
    if args.device_check:
        # several engines share the GPU: each gets a slice of its memory
        base_kwargs["gpu_memory_utilization"] = args.gpu_share
    kv_base = args.kv_cache_mb * 2**20
    kv_wide = max(kv_base, engines.kv_bytes_for(result["config"], args.wide,
                                                result["prompt_tokens"]["max"] + args.k_tokens,
                                                dtype))

    def kwargs_for(role: str) -> dict:
        kw = dict(base_kwargs)
        if not args.device_check:
            kw["kv_cache_memory_bytes"] = kv_wide if role in ("eager", "comp") else kv_base
        if role == "off":
            kw["enable_prefix_caching"] = False
        if role == "comp":
            kw["enforce_eager"] = False
        return kw

    roles = ["eager"] + ([] if args.no_compiled else ["comp"]) + ([] if args.no_cache_off else ["off"])
    sessions: dict = {}
    plain = floor = None
    result["engines"] = {}
    try:
        if not args.no_compiled and "a_star" in args.keys:
            # (a*) first: nothing of vlens is in the process's worker classes yet
            kw = kwargs_for("plain")
            plain = engines.Plain(path, **kw)
            result["engines"]["plain"] = {"kwargs": kw, "start_s": plain.start_s,
                                          "compiled": plain.compiled}
            log(f"  (a*) plain vLLM up in {plain.start_s} s (compiled: {plain.compiled})")
        for role in roles:
            kw = kwargs_for(role)
            t0 = time.perf_counter()
            sessions[role] = vlens.Session(path, reuse=False, **kw)
            start = round(time.perf_counter() - t0, 1)
            result["engines"][role] = {"kwargs": kw, "start_s": start,
                                       "hooks": sessions[role].status().get("hooks")}
            log(f"  vlens {role} engine up in {start} s")
        s = sessions["eager"]
        result["engine_start_s"] = result["engines"]["eager"]["start_s"]
        result["engine_kwargs"] = result["engines"]["eager"]["kwargs"]
        result["engine_env"] = dict(engines.engine_of(s).env)
        result["torch_threads"] = torch.get_num_threads()
        result["hooks"] = result["engines"]["eager"]["hooks"]
        assert [s.tokenize(p) for p in prompts] == ids, "the engine tokenises the prompts differently"
        if "h_floor" in args.keys:
            floor = engines.LensFloor(result["config"], result["prompt_tokens"]["total"],
                                      len(prompts), args.tokens, dtype, device)
        log(f"  {len(prompts)} prompts of {result['prompt_tokens']['min']}-"
            f"{result['prompt_tokens']['max']} tokens, {args.tokens} new tokens each; "
            f"steering layer {setup.layer}")
        measured = suite.measure_model(sessions, setup, reps=args.reps, slow_reps=args.slow_reps,
                                       plain=plain, floor=floor, hf=hf, nns=nns, hf_sae=hf_sae,
                                       keys=args.keys,
                                       deadline=deadline, log=log)
        errors.update(measured.pop("failed", {}))
        result.update(measured)
    finally:
        for sess in sessions.values():
            sess.close()
        if plain is not None:
            plain.close()
        for h in (hf, hf_sae):
            if h is not None:
                h.close()
        if nns is not None:
            nns.close()
    result["errors"] = errors
    result["steer"] = {"layer": setup.layer, "scale": setup.scale, "site": "resid_post",
                       "span": "all"}
    return result


# -- (s) connected clients -----------------------------------------------------------
def serve_throughput(model: str | None, timeout: int) -> dict:
    """(s): run benchmarks/serve.py (1, 4 and 16 clients of ``vlens serve``
    against the same calls on an in-process Session) in its own process."""
    import subprocess
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="vlens-bench-")) / "serve.json"
    cmd = [sys.executable, str(HERE / "serve.py"), "--json", str(out),
           *(["--model", model] if model else [])]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "why": f"no result within {timeout} s"}
    if r.returncode != 0 or not out.exists():
        return {"status": "failed", "error": _last_line(r.stderr or r.stdout)}
    return {"status": "ran", "seconds": round(time.perf_counter() - t0, 1),
            **json.loads(out.read_text())}


# -- (l) widget latency --------------------------------------------------------------
def widget_latency(model: str, timeout: int, repeats: int = 5) -> dict:
    """(l): run benchmarks/widget_latency.py (the widgets' own benchmark,
    written with the widgets) when it is in the checkout, on the first
    model, and keep the lines it prints (each ends with a median)."""
    import re
    import subprocess

    script = HERE / "widget_latency.py"
    if not script.exists():
        return {"status": "pending", "why": "benchmarks/widget_latency.py is not in this checkout"}
    t0 = time.perf_counter()
    cmd = [sys.executable, str(script), "--model", model, "--repeats", str(repeats)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "why": f"no result within {timeout} s"}
    lines = [x.strip() for x in r.stdout.splitlines() if "median" in x]
    figures = []
    for line in lines:
        m = re.search(r"median ([0-9.]+) ms", line)
        figures.append({"line": line, "median_ms": float(m.group(1)) if m else None})
    res = {"status": "ran" if r.returncode == 0 else "failed", "exit": r.returncode,
           "seconds": round(time.perf_counter() - t0, 1), "figures": figures,
           "command": " ".join(["benchmarks/widget_latency.py", *cmd[2:]])}
    if r.returncode != 0:
        res["error"] = _last_line(r.stderr)
    return res


def patching_grid(model: str, args: argparse.Namespace) -> dict:
    """benchmarks/patching.py on the first model: a 4 x 40 patching grid as
    one batch, one call per cell and a Hugging Face loop. It rewrites its
    table in docs/methods.md only when this run rewrites docs/performance.md."""
    import patching

    log("\n== patching grid")
    argv = ["--model", model, "--reps", str(max(2, min(args.reps, 5)))]
    if args.doc != ROOT / "docs" / "performance.md":  # a partial or test run: figures aside
        argv += ["--no-doc", "--json", str(args.json.with_name("results-patching-custom.json"))]
    try:
        return patching.main(argv)
    except Exception as exc:  # the other figures stand; say why this one is missing
        return {"status": "failed", "error": _short(exc)}


def _short(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def _last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:400] if lines else ""


# -- main --------------------------------------------------------------------------
ALL_KEYS = ["a", "a_star", "b", "c", "d", "e", "f", "g", "h", "h_floor", "i_read", "i_edit_off",
            "i_edit_on", "j", "m", "b_comp", "c_comp", "f_comp", "g_comp", "h_comp",
            "a_off", "c_off", "f_off", "p_a", "p_c", "p_f", "p_a_off", "p_c_off", "p_f_off",
            "k32", "k256", "k32_comp", "k256_comp", "sae", "sae_comp", "sae_hf"]
COMPILED_KEYS = ["a_star"] + [k for k in ALL_KEYS if k.endswith("_comp")]


def _references(keys: list[str]) -> list[str]:
    """``keys`` plus the references their ratios need, in ALL_KEYS order."""
    want = set(keys) | {"a"}
    if want & set(COMPILED_KEYS):
        want.add("a_star")
    if want & {"h", "h_comp"}:
        want.add("h_floor")
    if any(k.endswith("_off") and k != "i_edit_off" for k in want):
        want |= {"a_off"} | ({"p_a_off"} if any(k.startswith("p_") for k in want) else set())
    if any(k.startswith("p_") for k in want):
        want.add("p_a")
    if want & {"k32", "k256"}:
        want |= {"k32", "k256"}
    if want & {"k32_comp", "k256_comp"}:
        want |= {"k32_comp", "k256_comp"}
    if "sae_hf" in want:  # the SAELens way against vlens's read of the same features
        want.add("sae")
    return [k for k in ALL_KEYS if k in want]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="local model folder (repeatable); default: bundled + larger random Llama")
    ap.add_argument("--device-check", action="store_true",
                    help="the GPU run: ~0.5B model, bfloat16, 3 reps, results-gpu.json")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7; GPU 3)")
    ap.add_argument("--slow-reps", type=int, default=3,
                    help="repetitions of the slow HF (j) and nnsight (m) conditions")
    ap.add_argument("--scale", type=float, default=4.0, help="steering scale (unit vectors)")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--dtype", default=None, help="engine and HF dtype (default: the model's)")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated conditions (default all: {','.join(ALL_KEYS)})")
    ap.add_argument("--no-nnsight", action="store_true", help="skip (m) and the vLLM probe")
    ap.add_argument("--no-widgets", action="store_true", help="skip (l), the widget latencies")
    ap.add_argument("--no-serve", action="store_true",
                    help="skip (s), connected clients of vlens serve against in-process")
    ap.add_argument("--no-patching", action="store_true",
                    help="skip the patching grid (benchmarks/patching.py)")
    ap.add_argument("--kv-cache-mb", type=int, default=512,
                    help="KV cache of each CPU engine (raised where the wide batch needs more)")
    ap.add_argument("--no-compiled", action="store_true",
                    help="skip the compiled engines: (a*) and the *_comp conditions")
    ap.add_argument("--no-cache-off", action="store_true",
                    help="skip the second table (prefix caching off)")
    ap.add_argument("--no-long", action="store_true", help="skip (p), the shared preamble")
    ap.add_argument("--long-tokens", type=int, default=16, help="new tokens per prompt of (p)")
    ap.add_argument("--wide", type=int, default=256, help="requests in (k256), the wide batch")
    ap.add_argument("--k-tokens", type=int, default=32, help="new tokens per request of (k)")
    ap.add_argument("--gpu-share", type=float, default=0.18,
                    help="gpu_memory_utilization of each engine in --device-check")
    ap.add_argument("--budget", type=float, default=840.0,
                    help="seconds the whole run may take (repetitions are cut to fit)")
    ap.add_argument("--json", type=Path, default=None, help="where the figures go")
    ap.add_argument("--doc", type=Path, default=None, help="the Markdown report to rewrite")
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite the doc")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the doc from the JSON files, run nothing")
    args = ap.parse_args(argv)
    keys = ALL_KEYS if not args.only else [k.strip() for k in args.only.split(",")]
    unknown = set(keys) - set(ALL_KEYS)
    if unknown:
        ap.error(f"unknown conditions {sorted(unknown)}; known: {ALL_KEYS}")
    if args.no_compiled:
        keys = [k for k in keys if k not in COMPILED_KEYS]
    if args.no_cache_off:
        keys = [k for k in keys if not (k.endswith("_off") and k != "i_edit_off")]
    if args.no_long:
        keys = [k for k in keys if not k.startswith("p_")]
    args.keys = _references(keys)  # every ratio is paired with its references
    args.no_compiled = not set(args.keys) & set(COMPILED_KEYS)
    args.no_cache_off = not any(k.endswith("_off") and k != "i_edit_off" for k in args.keys)
    args.long_prompts = any(k.startswith("p_") for k in args.keys)
    if args.reps is None:
        args.reps = 3 if args.device_check else 7
    # a partial run (another model, some conditions) leaves the committed
    # figures alone unless told where to write
    partial = bool(args.model or args.only) and not args.device_check
    if args.json is None:
        args.json = HERE / ("results-gpu.json" if args.device_check
                            else "results-custom.json" if partial else "results.json")
    if args.doc is None and not partial and not args.no_doc:
        args.doc = ROOT / "docs" / "performance.md"
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    import report

    if args.render_only:
        cpu = args.json if args.json.name != "results-gpu.json" else HERE / "results.json"
        gpu = args.json if args.device_check else HERE / "results-gpu.json"
        report.write(args.doc, cpu, gpu)
        log(f"wrote {args.doc}")
        return None
    t_start = time.monotonic()
    deadline = t_start + args.budget
    watch = LoadWatch()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    exe = sys.executable
    if exe.startswith(str(ROOT)):
        exe = os.path.relpath(exe, ROOT)
    command = " ".join(shlex.quote(x) for x in [exe, os.path.relpath(__file__, ROOT),
                                                *(sys.argv[1:] if argv is None else argv)])
    log(f"vlens benchmark, {started}; load average {os.getloadavg()[0]:.2f}; "
        f"budget {args.budget:.0f} s")
    MODELS_DIR.mkdir(exist_ok=True)
    if args.model:
        for m in args.model:  # a default model named by its path is made here when missing
            if not Path(m).exists() and Path(m).resolve() == (MODELS_DIR / "llama-h512-l8").resolve():
                _make("llama-h512-l8", LARGE)
        models = [{"name": Path(m).name, "path": str(Path(m).resolve()), "note": None}
                  for m in args.model]
    elif args.device_check:
        models = [{"name": "random Qwen2, 0.5B shape", "path": str(_make("qwen2-0.5b", HALF_B)),
                   "note": "Qwen2.5-0.5B's shape with random weights"}]
    else:
        models = default_models()

    nns_python, nns_note = None, None
    want_nns = not args.no_nnsight and ("m" in args.keys)
    if want_nns:
        from nnsight_bench import ensure_env

        if args.device_check:  # the GPU machine reaches no package index
            import importlib.util

            if importlib.util.find_spec("nnsight") is not None:
                nns_python = sys.executable
            else:
                nns_note = "nnsight is not installed on this machine"
        else:
            nns_python, nns_note = ensure_env(log=log)
    if nns_python is None:
        args.keys = [k for k in args.keys if k != "m"]

    results = {
        "meta": {
            "started": started,
            "command": command,
            "argv": sys.argv[1:] if argv is None else argv,
            "machine": machine(),
            "versions": versions(),
            "settings": {"prompts": args.prompts, "tokens": args.tokens, "reps": args.reps,
                         "slow_reps": args.slow_reps, "scale": args.scale,
                         "sampling": "greedy, ignore_eos", "budget_s": args.budget,
                         "wide": args.wide, "k_tokens": args.k_tokens,
                         "long_tokens": args.long_tokens, "keys": args.keys},
            "device": "gpu" if args.device_check else "cpu",
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "models": [],
    }
    if nns_python:
        results["meta"]["versions"]["nnsight"] = nns_note
    # the rest of the budget, shared between the models (the larger gets more)
    weights = [1.0] + [2.0] * (len(models) - 1)
    reserve = 60.0 if want_nns and nns_python else 0.0
    reserve += 60.0 if (HERE / "widget_latency.py").exists() and not args.no_widgets else 0.0
    reserve += 90.0 if not args.no_serve and not args.device_check else 0.0
    reserve += 45.0 if not args.no_patching and not args.device_check else 0.0
    for i, spec in enumerate(models):
        left = deadline - time.monotonic() - reserve
        share = left * weights[i] / sum(weights[i:])
        results["models"].append(bench_model(spec, args, time.monotonic() + share, nns_python))

    if want_nns:
        if nns_python:
            from nnsight_bench import probe_vllm

            log("\n== nnsight's vLLM backend on this machine")
            probe = probe_vllm(nns_python, models[0]["path"],
                               log_path=MODELS_DIR / "nnsight-vllm-probe.log")
            log(f"  {probe}")
            results["nnsight_vllm"] = probe
        else:
            results["nnsight_vllm"] = {"ran": False, "error": nns_note}
            results["nnsight_note"] = nns_note
    if args.no_widgets:
        results["widgets"] = {"status": "skipped", "why": "--no-widgets"}
    else:
        log("\n== widget latencies (l)")
        results["widgets"] = widget_latency(models[0]["path"],
                                            timeout=int(max(90, deadline - time.monotonic())))
        log(f"  {results['widgets'].get('status')}")

    if args.no_serve or args.device_check:
        results["serve"] = {"status": "skipped", "why": "--no-serve" if args.no_serve
                            else "not part of the GPU check"}
    else:
        log("\n== connected clients (s)")
        results["serve"] = serve_throughput(models[0]["path"],
                                            timeout=int(max(180, deadline - time.monotonic())))
        log(f"  {results['serve'].get('status')}")
    if args.no_patching or args.device_check:
        results["patching"] = {"status": "skipped",
                               "why": "--no-patching" if args.no_patching else "CPU only"}
    else:
        results["patching"] = patching_grid(models[0]["path"], args)

    results["meta"]["load"] = watch.finish()
    results["meta"]["wall_s"] = round(time.monotonic() - t_start, 1)
    results["complete"] = all(m.get("complete") for m in results["models"])
    args.json.write_text(json.dumps(results, indent=1))
    log(f"\nwrote {args.json} ({results['meta']['wall_s']:.0f} s)")
    print(report.tables(results))
    if args.doc is not None:
        cpu = args.json if not args.device_check else HERE / "results.json"
        gpu = args.json if args.device_check else HERE / "results-gpu.json"
        report.write(args.doc, cpu, gpu)
        log(f"wrote {args.doc}")
    return results


if __name__ == "__main__":
    set_env()
    main()
