"""Condition (m): nnsight steering the same weights the same way.

nnsight is not a vlens dependency, so it lives in its own virtual
environment, ``benchmarks/.venv-nnsight`` (never committed). That venv holds
nnsight and whatever it needs that vlens's venv lacks; a ``.pth`` file puts
vlens's venv behind it, so torch, transformers and vLLM are the very same
installs the other conditions use (nnsight pins none of them).

Two ways in:

* ``NnsightWorker`` (the client, in the benchmark's process) starts this file
  as a subprocess under the nnsight venv and asks it for one timed run at a
  time over stdin/stdout, so its runs interleave with the vlens conditions
  like any other condition (the machine does one thing at a time);
* ``probe_vllm`` starts this file with ``--probe-vllm``: does nnsight's vLLM
  backend build an engine here and steer one request? The answer (or the
  error) goes into the report.

The steering itself, in nnsight's words (transformers backend)::

    with model.generate(prompt_ids, max_new_tokens=64, min_new_tokens=64,
                        do_sample=False) as tracer:
        for _ in tracer.iter[:64]:          # every forward pass of generate
            model.model.layers[L].output[:] += scale * vector
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-nnsight"
MARK = "@@nnsight "


# -- the venv ------------------------------------------------------------------
def _site_packages(prefix: Path) -> Path:
    v = sys.version_info
    return prefix / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


def ensure_env(venv: Path = VENV, log=print) -> tuple[str | None, str]:
    """The nnsight venv's python (made on first use), or None and why not."""
    py = venv / "bin" / "python"
    ok = [str(py), "-c", "import nnsight, sys; print(nnsight.__version__)"]
    if py.exists():
        r = subprocess.run(ok, capture_output=True, text=True)
        if r.returncode == 0:
            return str(py), r.stdout.strip()
    t0 = time.perf_counter()
    log(f"  making {venv} (nnsight over vlens's venv) ...")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)],
                       check=True, capture_output=True, text=True)
        base = Path(sys.prefix)
        # addsitedir also runs the base venv's own .pth files (the editable vlens)
        _site_packages(venv).mkdir(parents=True, exist_ok=True)
        (_site_packages(venv) / "_vlens_base.pth").write_text(
            f"import site; site.addsitedir({str(_site_packages(base))!r})\n"
        )
        r = subprocess.run([str(py), "-m", "pip", "install", "--quiet",
                            "--disable-pip-version-check", "nnsight"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return None, "pip install nnsight failed: " + _last_line(r.stderr or r.stdout)
        r = subprocess.run(ok, capture_output=True, text=True)
        if r.returncode != 0:
            return None, "nnsight installed but does not import: " + _last_line(r.stderr)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not make the nnsight venv: {exc}"
    log(f"  nnsight {r.stdout.strip()} ready in {time.perf_counter() - t0:.0f} s")
    return str(py), r.stdout.strip()


def _last_line(text: str) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1].strip()[:400] if lines else "(no output)"


def _error_line(text: str) -> str:
    """The exception line of a traceback (the last line naming an Error)."""
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    for line in reversed(lines):
        body = line.split("]:", 1)[-1].strip()  # vLLM prefixes "[rank0]: "
        if "Error" in body.split(":", 1)[0] or "Exception" in body.split(":", 1)[0]:
            return body[:400]
    return _last_line(text)


# -- the client ----------------------------------------------------------------
class NnsightWorker:
    """Runs (m) in a subprocess, one timed run per request."""

    def __init__(self, python: str, *, model: str, prompt_ids: list[list[int]],
                 vector: list[float], layer: int, scale: float, tokens: int,
                 device: str = "cpu", dtype: str = "float32", log_path: Path | None = None) -> None:
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)
        self.info = self._ask({"cmd": "setup", "model": model, "prompt_ids": prompt_ids,
                               "vector": vector, "layer": layer, "scale": scale,
                               "tokens": tokens, "device": device, "dtype": dtype})

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the nnsight worker died (exit {self.proc.wait()}); "
                                   f"see {self._log.name}")
            if line.startswith(MARK):
                reply = json.loads(line[len(MARK):])
                if "error" in reply:
                    raise RuntimeError(f"nnsight worker: {reply['error']}")
                return reply

    def run(self, warmup: bool = False) -> tuple[int, dict]:
        reply = self._ask({"cmd": "run", "warmup": warmup})
        return reply["tokens"], {"token_ids": reply["token_ids"]}

    def close(self) -> None:
        try:
            self._ask({"cmd": "quit"})
        except Exception:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def probe_vllm(python: str, model: str, *, timeout: int = 240,
               log_path: Path | None = None) -> dict[str, Any]:
    """Try nnsight's vLLM backend on this machine, in a fresh process."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([python, str(Path(__file__).resolve()), "--probe-vllm", model],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ran": False, "error": f"no answer within {timeout} s", "seconds": timeout}
    if log_path is not None:
        log_path.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    for line in r.stdout.splitlines():
        if line.startswith(MARK):
            out = json.loads(line[len(MARK):])
            out["seconds"] = round(time.perf_counter() - t0, 1)
            return out
    return {"ran": False, "error": _error_line(r.stderr or r.stdout),
            "seconds": round(time.perf_counter() - t0, 1)}


# -- the subprocess ---------------------------------------------------------------
def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Server:
    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        import nnsight
        import torch
        from nnsight import TransformersModel

        dtype = getattr(torch, msg["dtype"])
        device = msg["device"]
        where = {} if device == "cpu" else {"device_map": device}  # cuda needs accelerate
        self.model = TransformersModel(msg["model"], task="text-generation", dispatch=True,
                                       dtype=dtype, **where)
        self.prompt_ids = msg["prompt_ids"]
        self.tokens = int(msg["tokens"])
        self.layer = int(msg["layer"])
        self.delta = (torch.tensor(msg["vector"]) * float(msg["scale"])).to(device, dtype)
        self.device = device
        tok = self.model.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return {"nnsight": nnsight.__version__, "threads": torch.get_num_threads(),
                "padding_side": tok.padding_side}

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        import torch

        model, delta, layer = self.model, self.delta, self.layer
        prompts, n = self.prompt_ids, self.tokens
        if msg.get("warmup"):
            prompts, n = prompts[:4], 4
        with model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=self.pad) as tracer:
            for _ in tracer.iter[:n]:  # each forward pass of generate: prefill + n - 1
                out = model.model.layers[layer].output
                if isinstance(out, tuple):
                    out[0][:] += delta
                else:
                    out[:] += delta
            ids = tracer.result.save()
        if self.device != "cpu":
            torch.cuda.synchronize()
        return self._count(ids, prompts)

    def _count(self, ids: Any, prompts: list[list[int]]) -> dict[str, Any]:
        width = max(len(p) for p in prompts)
        new = ids[:, width:]
        return {"tokens": int(new.numel()), "token_ids": new.tolist()}


def _serve() -> None:
    server = _Server()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                _reply({"bye": True})
                return
            _reply(getattr(server, msg["cmd"])(msg))
        except Exception as exc:  # the client raises it
            import traceback

            traceback.print_exc()
            _reply({"error": f"{type(exc).__name__}: {exc}"[:600]})


def _probe(model: str) -> None:
    """Build nnsight's VLLM on ``model`` and steer two short requests."""
    # the same engine environment vlens gives its own engines
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                       ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(key, value)
    import torch

    stage = "import nnsight.modeling.vllm"
    try:
        from nnsight.modeling.vllm import VLLM

        stage = "VLLM(model, dispatch=True) (build the engine)"
        m = VLLM(model, dispatch=True, max_model_len=256, gpu_memory_utilization=0.3)
        hidden = int(m.config.hidden_size) if hasattr(m, "config") else None
        stage = "a steered trace"
        with m.trace(temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
            for prompt in ([1, 10, 11, 12], [1, 20, 21]):
                with tracer.invoke(prompt):
                    for _ in tracer.iter[:4]:
                        out = m.model.layers[0].output
                        target = out[1] if isinstance(out, tuple) else out
                        target[:] += torch.ones(hidden or target.shape[-1]).to(target)
        _reply({"ran": True, "error": None})
    except BaseException as exc:  # report whatever happened
        _reply({"ran": False, "stage": stage, "error": f"{type(exc).__name__}: {exc}"[:400]})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve()
    elif sys.argv[1:2] == ["--probe-vllm"]:
        _probe(sys.argv[2])
    else:
        sys.exit(__doc__)
