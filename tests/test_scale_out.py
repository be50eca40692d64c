"""The same API out of process and with tensor parallelism.

vLLM reads its process settings once per process, so each mode runs in a
fresh Python: the isolation, HF-parity and steering-isolation tests re-run
unchanged with the engine core out of process (``mp``) and with
``tensor_parallel_size=2`` (``tp2``; see VLENS_TEST_ENGINE in conftest), and
a TP=2 engine's reads are compared with this process's TP=1 reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
SELECTED = [
    "tests/test_isolation.py::test_each_request_reads_only_its_rows",
    "tests/test_parity.py",
    "tests/test_steering.py::test_steering_one_request_changes_only_that_request",
]
# compiled mode also re-runs vLLM's recompute paths (preemption, prefix cache)
SELECTED_COMPILED = SELECTED + [
    "tests/test_recompute.py::test_a_loaded_engine_gives_every_request_what_it_gets_alone",
    "tests/test_recompute.py::test_steer_only_requests_under_preemption_and_the_prefix_cache",
    "tests/test_recompute.py::test_steer_only_traces_on_a_warm_prefix_cache_match_a_cold_run",
]


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLENS_TEST"))}
    env["VLENS_TEST_ENGINE"] = mode
    return env


@pytest.mark.parametrize("mode", ["mp", "tp2", "compiled"])
def test_isolation_parity_and_steering_pass_unchanged(mode):
    selected = SELECTED_COMPILED if mode == "compiled" else SELECTED
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected],
        cwd=ROOT, env=_env(mode), capture_output=True, text=True, timeout=1200,
    )
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) >= (10 if mode == "compiled" else 7), tail
    assert " failed" not in out.stdout and " skipped" not in out.stdout, tail


_TP2_SCRIPT = r"""
import json, os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
import vlens

def main():
    model, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    s = vlens.Session(model, tensor_parallel_size=2, max_num_batched_tokens=64,
                      max_model_len=512, kv_cache_memory_bytes=64 * 2**20)
    vec = torch.linspace(-1, 1, s.hidden_size)
    st = vlens.Steer(vec, layer=1, scale=3.0)
    sites = ["resid_pre", "resid_post", "attn_out", "mlp_out"]
    plain = s.trace(prompts, sites=sites, max_new_tokens=5, logit_lens=3)
    steered = s.trace(prompts, sites=["resid_post"], steer=st, max_new_tokens=5)
    torch.save({
        "plain": [{k: t.activations(k) for k in sites} | {"ids": t.output_token_ids,
                   "lens": t.logit_lens()[0], "lp": t.logprobs} for t in plain],
        "steered": [{"resid_post": t.activations(), "ids": t.output_token_ids} for t in steered],
        "info": s.info,
    }, out)
    s.close()

if __name__ == "__main__":
    main()
"""


def test_tp2_reads_equal_tp1_reads(llama_session, tiny_llama, tmp_path):
    prompts = ["w1 w2 w3", " ".join(f"w{i}" for i in range(90)), "w7"]
    out_file = tmp_path / "tp2.pt"
    script = tmp_path / "tp2_reads.py"
    script.write_text(_TP2_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_llama), json.dumps(prompts), str(out_file)],
        cwd=ROOT, env=_env("tp2"), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = torch.load(out_file)
    sites = ["resid_pre", "resid_post", "attn_out", "mlp_out"]
    plain = llama_session.trace(prompts, sites=sites, max_new_tokens=5, logit_lens=3)
    vec = torch.linspace(-1, 1, llama_session.hidden_size)
    import vlens

    steered = llama_session.trace(prompts, sites=["resid_post"],
                                  steer=vlens.Steer(vec, layer=1, scale=3.0), max_new_tokens=5)
    for a, b in zip(plain, tp2["plain"]):
        assert a.output_token_ids == b["ids"]
        assert torch.equal(a.logit_lens()[0], b["lens"])
        for site in sites:
            diff = (a.activations(site) - b[site]).abs().max().item()
            assert diff <= 1e-4, f"{site}: TP=2 differs from TP=1 by {diff}"
    for a, b in zip(steered, tp2["steered"]):
        assert a.output_token_ids == b["ids"]
        assert (a.activations() - b["resid_post"]).abs().max().item() <= 1e-4
    assert any(a.output_token_ids != p.output_token_ids for a, p in zip(steered, plain))
