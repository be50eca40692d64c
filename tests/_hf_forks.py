"""The Hugging Face reference scripts (tests/_hf_*.py), each run in a fresh
process forked from one that has imported torch and transformers already.

Each reference runs in a process of its own, never in a test process: vLLM
patches Hugging Face's model classes in any process where it has built a
Transformers-backend engine, and a test process holds engines. A fresh
Python costs about 7 s of CPU before the script's first line (torch and
transformers' model classes), and the suite ran 26 of them. Here one
process per test process (started at its first use, never importing vLLM)
imports them once, and each script runs in a child forked from it: a
process of its own as before, with nothing of the others' state, its
output and exit status its own, at a fork's cost. It forks before torch has
run anything, so no thread pool is copied half-made.

``run_script(script, *args)`` stands in for ``subprocess.run([sys.executable,
script, *args], capture_output=True, text=True, env=...)`` with the tests
folder and the checkout on the script's path, and returns the same
``CompletedProcess``; ``run_code(code, *args)`` for ``python -c code args``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PATHS = [str(ROOT), str(ROOT / "tests")]

#: imported once by the server, before any fork (what the scripts import)
_PRELOAD = ("torch", "safetensors.torch", "transformers.models.auto.modeling_auto",
            "transformers.models.auto.tokenization_auto", "vlens.protocol.architectures",
            "vlens.testing")

_lock = threading.Lock()
_server: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(_PATHS))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ready = proc.stdout.readline()
    if ready.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the reference fork server did not start: {ready!r}")
    return proc


def run_script(script: str | os.PathLike, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` as ``__main__`` with ``args`` in a forked fresh process."""
    global _server
    with _lock, tempfile.TemporaryDirectory(prefix="vlens-hf-") as tmp:
        if _server is None or _server.poll() is not None:
            _server = _start()
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        _server.stdin.write(json.dumps({"script": str(script), "args": [str(a) for a in args],
                                        "stdout": str(out), "stderr": str(err)}) + "\n")
        _server.stdin.flush()
        reply = _server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the reference fork server ended (exit {_server.wait(10)}) "
                               f"while running {script}")
        rc = json.loads(reply)["rc"]
        return subprocess.CompletedProcess([sys.executable, str(script), *args], rc,
                                           out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def run_code(code: str, *args: str) -> subprocess.CompletedProcess:
    """``run_script`` for a script given as text (``python -c code args``)."""
    with tempfile.TemporaryDirectory(prefix="vlens-hf-code-") as tmp:
        script = Path(tmp) / "reference.py"
        script.write_text(code)
        return run_script(script, *args)


def _child(job: dict) -> None:
    """In the forked process: the job's output files as fds 1 and 2, then
    the script as ``__main__``; never returns."""
    import runpy
    import traceback

    code = 0
    try:
        for fd, name in ((1, job["stdout"]), (2, job["stderr"])):
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        null = os.open(os.devnull, os.O_RDONLY)  # not the server's job pipe
        os.dup2(null, 0)
        os.close(null)
        sys.argv = [job["script"], *job["args"]]
        sys.path[:0] = [str(Path(job["script"]).parent)]
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as exc:  # as Python ends: None is 0, a message goes to stderr as 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _serve() -> None:
    """Import what every reference script needs, then fork one child per
    job line on stdin and answer its exit status on stdout."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)

    reply = sys.stdout
    print("ready", file=reply, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        reply.flush()
        pid = os.fork()
        if pid == 0:
            _child(job)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc}), file=reply, flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
