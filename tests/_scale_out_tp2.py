"""TP=2 reads against TP=1 reads, run inside test_scale_out.py's tp2 child.

Not a ``test_*.py`` file, so the main run never collects it: the tp2 child
names it on its command line (pytest collects a file it is given), where
``llama_session`` is the TP=2 engine the re-run isolation and steering tests
share. The parent wrote what its TP=1 ``llama_session`` reads for the same
calls (:func:`reads`) to the file in VLENS_TP1_READS; every request must
read the same here.
"""

from __future__ import annotations

import os

import pytest
import torch

import vlens

pytestmark = pytest.mark.engine

SITES = ["resid_pre", "resid_post", "attn_out", "mlp_out"]
# a short prompt, one chunked over two prefill steps (max_num_batched_tokens=64), one word
PROMPTS = ["w1 w2 w3", " ".join(f"w{i}" for i in range(90)), "w7"]


def reads(session) -> dict:
    """Every site at every layer, the logit lens and logprobs of a plain
    run, and the steered run's residual stream, for :data:`PROMPTS`."""
    plain = session.trace(PROMPTS, sites=SITES, max_new_tokens=5, logit_lens=3)
    st = vlens.Steer(torch.linspace(-1, 1, session.hidden_size), layer=1, scale=3.0)
    steered = session.trace(PROMPTS, sites=["resid_post"], steer=st, max_new_tokens=5)
    return {
        "plain": [{site: t.activations(site) for site in SITES}
                  | {"ids": t.output_token_ids, "lens": t.logit_lens()[0]} for t in plain],
        "steered": [{"resid_post": t.activations(), "ids": t.output_token_ids}
                    for t in steered],
    }


def test_tp2_reads_equal_tp1_reads(llama_session):
    engine = llama_session.engine.llm.llm_engine
    assert engine.vllm_config.parallel_config.tensor_parallel_size == 2
    tp1 = torch.load(os.environ["VLENS_TP1_READS"])
    tp2 = reads(llama_session)
    for a, b in zip(tp1["plain"], tp2["plain"], strict=True):
        assert a["ids"] == b["ids"]
        assert torch.equal(a["lens"], b["lens"])
        for site in SITES:
            diff = (a[site] - b[site]).abs().max().item()
            assert diff <= 1e-4, f"{site}: TP=2 differs from TP=1 by {diff}"
    for a, b in zip(tp1["steered"], tp2["steered"], strict=True):
        assert a["ids"] == b["ids"]
        assert (a["resid_post"] - b["resid_post"]).abs().max().item() <= 1e-4
    # the steer changed what was generated, so the steered comparison means something
    assert any(s["ids"] != p["ids"] for s, p in zip(tp2["steered"], tp2["plain"]))
