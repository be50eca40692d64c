"""Invariant 1 on the real engine: a request's reads hold its rows only,
whatever else shares the step (chunked prefills, decode rows, requests with
no plan), on both layouts: native [T, H] and the Transformers backend's
[1, T, H]."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.engine

SITES = ["resid_pre", "resid_post", "attn_out", "mlp_out"]


def _prompt(n_words: int, offset: int) -> str:
    return " ".join(f"w{(offset + 7 * i) % 240}" for i in range(n_words))


# 1 to ~300 words; with max_num_batched_tokens=64 the long ones are chunked
# and share steps with the others' decode rows.
PROMPTS = [_prompt(n, k) for k, n in enumerate([1, 5, 37, 120, 299, 64])]
BACKGROUND = [_prompt(90, 3), _prompt(2, 5)]


@pytest.fixture(params=["native", "transformers"])
def session(request):
    return request.getfixturevalue(
        "llama_session" if request.param == "native" else "llama_tf_session"
    )


def test_each_request_reads_only_its_rows(session):
    assert session.info["impl"] in ("native", "transformers")
    together = session.trace(
        PROMPTS, sites=SITES, max_new_tokens=6, background=BACKGROUND
    )
    assert len(together) == len(PROMPTS)
    assert len(together.background_texts) == len(BACKGROUND)
    status = session.status()
    assert status["records"] == 0  # nothing left behind in the worker
    for trace, prompt in zip(together, PROMPTS):
        alone = session.trace(prompt, sites=SITES, max_new_tokens=6)[0]
        assert trace.token_ids == alone.token_ids
        n_prompt = len(session.tokenize(prompt))
        assert trace.n_tokens == n_prompt + 6 - 1
        assert trace.positions == list(range(trace.n_tokens))
        for site in SITES:
            a, b = trace.activations(site), alone.activations(site)
            assert a.shape == (session.n_layers, trace.n_tokens, session.hidden_size)
            assert a.dtype == torch.float32
            diff = (a - b).abs().max().item()
            assert diff <= 1e-4, f"{site}: max abs diff {diff}"


def test_both_backends_read_the_same_values(llama_session, llama_tf_session):
    prompts = PROMPTS[:3]
    native = llama_session.trace(prompts, sites=SITES, max_new_tokens=4)
    tf = llama_tf_session.trace(prompts, sites=SITES, max_new_tokens=4)
    assert llama_session.info["impl"] == "native"
    assert llama_tf_session.info["impl"] == "transformers"
    for a, b in zip(native, tf):
        assert a.token_ids == b.token_ids
        for site in SITES:
            diff = (a.activations(site) - b.activations(site)).abs().max().item()
            assert diff <= 1e-4, f"{site}: {diff}"


def test_samples_of_one_prompt_are_separate_traces(llama_session):
    run = llama_session.trace(
        [PROMPTS[1], PROMPTS[2]], layers=[1], n=3, temperature=1.0, max_new_tokens=5
    )
    assert [(t.index, t.sample) for t in run] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for t in run:
        assert t.n_tokens == len(t.prompt_token_ids) + len(t.output_token_ids) - 1
        assert t.token_ids == t.prompt_token_ids + t.output_token_ids[:-1]
        assert t.activations().shape[1] == t.n_tokens
    # samples that generated different tokens read different rows
    outs = {tuple(t.output_token_ids) for t in run if t.index == 0}
    assert len(outs) > 1


def test_frame_has_one_row_per_request_site_layer_token(llama_session):
    run = llama_session.trace(PROMPTS[:2], layers=[0, 2], sites=["resid_post", "mlp_out"], max_new_tokens=3)
    df = run.to_frame()
    expected = sum(t.n_tokens for t in run) * 2 * 2
    assert len(df) == expected
    one = df[(df.request == 1) & (df.site == "mlp_out") & (df.layer == 2)]
    assert one.token.tolist() == run[1].tokens
    norms = run[1]["mlp_out", 2].norm(dim=-1)
    assert torch.allclose(torch.tensor(one.norm.values, dtype=torch.float32), norms)
