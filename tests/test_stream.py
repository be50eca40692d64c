"""Streaming: generation step by step through the real engine.

``Session.stream`` and ``Session.stream_compare`` yield partial results
after every engine step and the finished result last; the finished result
must be what ``trace`` / ``compare`` give, and closing a stream early must
leave the engine as clean as an interrupted call does.
"""

from __future__ import annotations

import torch

import vlens
from vlens.results import Comparison

PROMPTS = ["w1 w2 w3", " ".join(f"w{i}" for i in range(80)), "w9"]


def _steer(s):
    d = torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(5))
    return vlens.Steer(d, layer=1, scale=3.0)


def test_stream_grows_token_by_token_and_ends_with_the_trace(llama_session):
    s = llama_session
    kw = dict(layers=[0, 2], sites=["resid_post", "mlp_out"], max_new_tokens=6,
              steer=vlens.PerPrompt([None, _steer(s), None]), logit_lens=2)
    states = list(s.stream(PROMPTS, **kw))
    partial, final = states[:-1], states[-1]
    lengths = [[len(t.output_token_ids) for t in run] for run in partial]
    assert len({tuple(x) for x in lengths}) >= 3  # at least three distinct partial states
    for earlier, later in zip(lengths, lengths[1:]):
        assert all(a <= b for a, b in zip(earlier, later))
    assert all(t.finish_reason is None for t in partial[0])
    assert all(not t.read_keys for run in partial for t in run)
    ref = s.trace(PROMPTS, **kw)
    assert [t.output_token_ids for t in final] == [t.output_token_ids for t in ref]
    for a, b in zip(final, ref):
        assert a.token_ids == b.token_ids and a.steered_rows == b.steered_rows
        for site in ("resid_post", "mlp_out"):
            assert torch.allclose(a.activations(site), b.activations(site), atol=1e-5)
        assert torch.equal(a.logit_lens()[0], b.logit_lens()[0])
    # each partial state's text is a prefix of the final one
    for run in partial:
        for t in run:
            assert final[t.index].output_token_ids[: len(t.output_token_ids)] == t.output_token_ids


def test_stream_compare_ends_with_what_compare_gives(llama_session):
    s = llama_session
    st = _steer(s)
    states = list(s.stream_compare(PROMPTS[:2], steer=st, max_new_tokens=5))
    final = states[-1]
    assert isinstance(final, Comparison)
    base, steered = states[-2]
    assert len(base) == len(steered) == 2
    ref = s.compare(PROMPTS[:2], steer=st, max_new_tokens=5)
    assert final.steered.texts == ref.steered.texts and final.baseline.texts == ref.baseline.texts
    for a, b in zip(final.kl, ref.kl):
        assert torch.allclose(a, b, atol=1e-5)


def test_closing_a_stream_early_leaves_the_engine_clean(llama_session):
    s = llama_session
    stream = s.stream(PROMPTS, layers=[1], max_new_tokens=12, edit=lambda r, c: r * 1.0,
                      edit_at=[("mlp_out", 1)])
    next(stream)
    next(stream)
    stream.close()
    status = s.status()
    assert status["records"] == 0 and status["plans"] == 0 and status["edit_fns"] == 0
    assert s.engine.unfinished() == 0
    run = s.trace(PROMPTS[:1], layers=[1], max_new_tokens=3)
    assert run[0].activations().shape[1] == run[0].n_tokens
