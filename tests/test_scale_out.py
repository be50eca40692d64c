"""The same API out of process and with tensor parallelism.

vLLM reads its process settings once per process, so each mode runs in a
fresh Python: the isolation, HF-parity and steering-isolation tests re-run
unchanged with ``tensor_parallel_size=2`` and the engine core out of process
(``tp2``; see VLENS_TEST_ENGINE in conftest) and in vLLM's compiled mode
(``compiled``, with the recompute tests too), on the engines each mode
changes (SELECTED). The tp2 run's Llama engine also reads what this
process's TP=1 engine reads (tests/_scale_out_tp2.py).

The core out of process with one worker (``VLENS_TEST_ENGINE=mp``) is not a
run of its own here: ``tp2`` puts the core out of process too
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), and every vlens path that differs
out of process (``Engine.in_process``: the quiet start, the step lock, the
frozen heap, the prefix-cache marks, the shutdown; the RPCs through the core
client) is the same with one worker or two. Its three tests are a subset of
tp2's (the native Llama's isolation, parity and steering isolation);
conftest keeps the mode, to run those three by hand with
``VLENS_TEST_ENGINE=mp``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
ISOLATION = "tests/test_isolation.py::test_each_request_reads_only_its_rows"
PARITY = "tests/test_parity.py::test_sites_match_transformers"
STEERING = "tests/test_steering.py::test_steering_one_request_changes_only_that_request"
RECOMPUTE = [
    "tests/test_recompute.py::test_a_loaded_engine_gives_every_request_what_it_gets_alone",
    "tests/test_recompute.py::test_steer_only_requests_under_preemption_and_the_prefix_cache",
    "tests/test_recompute.py::test_steer_only_traces_on_a_warm_prefix_cache_match_a_cold_run",
]
# Each engine a child starts costs most of its time, so each mode re-runs
# the tests on the engines whose code paths the mode changes.
SELECTED = {
    # TP=2 shards each differently: native Llama, Qwen2's two KV heads (one
    # per rank) and the Transformers backend (its own tp plan); the TP=2 Llama
    # engine also reads what this process's TP=1 engine reads
    # (tests/_scale_out_tp2.py). Its engine core is out of process, for
    # every model and backend.
    "tp2": [ISOLATION, PARITY, STEERING, "tests/_scale_out_tp2.py"],
    # compiled graphs differ by backend: native and Transformers-backend
    # Llama, and vLLM's recompute paths (preemption, the prefix cache)
    "compiled": [ISOLATION, f"{PARITY}[llama_session-tiny_llama]",
                 f"{PARITY}[llama_tf_session-tiny_llama]", STEERING, *RECOMPUTE],
}
PASSES = {"tp2": 8, "compiled": 9}


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLENS_TEST"))}
    env["VLENS_TEST_ENGINE"] = mode
    return env


@pytest.mark.parametrize("mode", ["tp2", "compiled"])
def test_isolation_parity_and_steering_pass_unchanged(mode, request, tmp_path):
    env = _env(mode)
    if mode == "tp2":
        # what this process's TP=1 engine reads, for tests/_scale_out_tp2.py
        from _scale_out_tp2 import reads

        env["VLENS_TP1_READS"] = str(tmp_path / "tp1.pt")
        torch.save(reads(request.getfixturevalue("llama_session")), env["VLENS_TP1_READS"])
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTED[mode]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) == PASSES[mode], tail
    assert " failed" not in out.stdout and " skipped" not in out.stdout, tail
