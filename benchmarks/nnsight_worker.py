"""nnsight steering the same weights the same way (condition nnsight_steer).

nnsight is not a vlens dependency: it lives in ``benchmarks/.venv-nnsight``
(``make nnsight-venv``, never committed), whose ``.pth`` puts vlens's venv
behind it, so torch, transformers and vLLM are the very installs the other
conditions use. ``NnsightWorker`` starts this file under that venv and asks
it for one timed run at a time over stdin/stdout (so its runs interleave with
the others). The steering, in nnsight's words::

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
from pathlib import Path
from typing import Any

VENV = Path(__file__).resolve().parent / ".venv-nnsight"
MARK = "@@nnsight "


def _last(text: str) -> str:
    """The exception line of a traceback (vLLM prefixes "[rank0]: "), else the last line."""
    lines = [x.split("]:", 1)[-1].strip() for x in (text or "").splitlines() if x.strip()]
    return next((x[:400] for x in reversed(lines) if "Error" in x.split(":", 1)[0]),
                lines[-1][:400] if lines else "(no output)")


def python() -> tuple[str | None, str]:
    """The nnsight venv's python and nnsight's version, or None and why not."""
    py = VENV / "bin" / "python"
    r = subprocess.run([str(py), "-c", "import nnsight; print(nnsight.__version__)"],
                       capture_output=True, text=True) if py.exists() else None
    if r is None or r.returncode:
        return None, f"no nnsight in {VENV} (`make nnsight-venv` makes it)" + (
            f": {_last(r.stderr)}" if r else "")
    return str(py), r.stdout.strip()


class NnsightWorker:
    """The client: one timed run per request to this file's ``--serve`` loop."""

    def __init__(self, python: str, log_path: Path | None = None, **setup: Any) -> None:
        self._log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen([python, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        self.info = self._ask({"cmd": "setup", **setup})

    def _ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        while line := self.proc.stdout.readline():
            if line.startswith(MARK):
                reply = json.loads(line[len(MARK):])
                if "error" in reply:
                    raise RuntimeError(f"nnsight worker: {reply['error']}")
                return reply
        raise RuntimeError(f"the nnsight worker died (exit {self.proc.wait()}); see {self._log.name}")

    def run(self, warmup: bool = False) -> tuple[int, dict]:
        reply = self._ask({"cmd": "run", "warmup": warmup})
        return reply["tokens"], {"token_ids": reply["token_ids"]}

    def close(self) -> None:
        try:
            self._ask({"cmd": "quit"})
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
        self._log.close()


# -- the subprocess, under the nnsight venv ---------------------------------------
def _reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _serve() -> None:
    import nnsight
    import torch
    from nnsight import TransformersModel

    st: dict = {}
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                return _reply({"bye": True})
            if msg["cmd"] == "setup":
                dtype, device = getattr(torch, msg["dtype"]), msg["device"]
                where = {} if device == "cpu" else {"device_map": device}  # cuda needs accelerate
                model = TransformersModel(msg["model"], task="text-generation", dispatch=True,
                                          dtype=dtype, **where)
                tok = model.tokenizer
                st.update(model=model, msg=msg, device=device,
                          delta=(torch.tensor(msg["vector"]) * float(msg["scale"])).to(device, dtype),
                          pad=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
                _reply({"nnsight": nnsight.__version__, "threads": torch.get_num_threads(),
                        "padding_side": tok.padding_side})
                continue
            model, layer = st["model"], int(st["msg"]["layer"])
            prompts, n = st["msg"]["prompt_ids"], int(st["msg"]["tokens"])
            if msg.get("warmup"):
                prompts, n = prompts[:4], 4
            with model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=st["pad"]) as tracer:
                for _ in tracer.iter[:n]:  # each forward pass of generate: prefill + n - 1
                    out = model.model.layers[layer].output
                    (out[0] if isinstance(out, tuple) else out)[:] += st["delta"]
                ids = tracer.result.save()
            if st["device"] != "cpu":
                torch.cuda.synchronize()
            new = ids[:, max(len(p) for p in prompts):]
            _reply({"tokens": int(new.numel()), "token_ids": new.tolist()})
        except Exception as exc:  # the client raises it
            _reply({"error": f"{type(exc).__name__}: {exc}"[:600]})


if __name__ == "__main__":
    _serve()
