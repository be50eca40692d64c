"""vlens.testing builds the same result objects a Session returns, and
refuses shapes a Session would never have produced."""

from __future__ import annotations

import pytest
import torch

from vlens.results import Run, Trace
from vlens.results import Comparison, Sweep, kl_per_position
from vlens.testing import make_comparison, make_run, make_sweep, make_trace


def test_make_trace_is_a_trace_as_a_session_gives_it():
    acts = torch.randn(2, 4, 3)
    t = make_trace([7, 8], [9, 10, 11], reads={"resid_post": acts}, layers=[1, 3],
                   token_strings=lambda ids: [f"w{i}" for i in ids], prompt="p",
                   logprobs=[None, -1.0, -2.0, -0.5, -0.1])
    assert isinstance(t, Trace)
    assert t.token_ids == [7, 8, 9, 10] and t.n_tokens == 4  # the last token is never fed back
    assert t.tokens == ["w7", "w8", "w9", "w10"] and t.output_tokens == ["w9", "w10", "w11"]
    assert t.text == "w9w10w11" and t.positions == [0, 1, 2, 3]
    assert t.read_keys == ["resid_post"] and t.layers == {"resid_post": [1, 3]}
    assert torch.equal(t.activations("resid_post"), acts)
    assert torch.equal(t.layer("resid_post", 3), acts[1])
    assert torch.allclose(t.norms("resid_post"), acts.norm(dim=-1))
    with pytest.raises(KeyError, match="mlp_out"):
        t.activations("mlp_out")


def test_make_trace_holds_reduced_reads_and_the_logit_lens():
    ids, probs = torch.zeros(3, 2, 5, dtype=torch.long), torch.rand(3, 2, 5)
    t = make_trace([1], [2, 3], reads={
        "resid_post:logit_lens": (ids, probs), "mlp_out:norm": torch.ones(1, 2)},
        layers={"mlp_out:norm": [2]})
    got_ids, got_probs = t.logit_lens("resid_post")
    assert torch.equal(got_ids, ids) and torch.equal(got_probs, probs)
    assert t.layers == {"resid_post:logit_lens": [0, 1, 2], "mlp_out:norm": [2]}
    assert torch.equal(t.norms("mlp_out"), torch.ones(1, 2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"reads": {"resid_post": torch.zeros(2, 5, 3)}}, r"\[n_layers_read, 4 tokens"),
        ({"reads": {"resid_post": torch.zeros(2, 4, 3)}, "layers": [0]}, "holds 2 layers"),
        ({"logprobs": [None, -1.0]}, "one per prompt and output token"),
    ],
)
def test_make_trace_refuses_shapes_a_session_would_not_give(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_trace([1, 2], [3, 4, 5], **kwargs)


def _logprob_trace(seed: int, out: list[int]) -> Trace:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(1, 2 + len(out) - 1, 6, generator=g).log_softmax(-1)
    return make_trace([0, 1], out, reads={"resid_post:logprobs": table}, layers=[3],
                      logprobs=[None] + [-1.0] * (1 + len(out)), prompt="p")


def test_make_comparison_computes_the_kl_a_session_would():
    base, steered = _logprob_trace(0, [2, 3, 4]), _logprob_trace(1, [2, 5, 4])
    cmp = make_comparison(make_run([base]), make_run([steered]))
    assert isinstance(cmp, Comparison) and isinstance(cmp.baseline, Run)
    expected = kl_per_position(base.vocab_logprobs()[0, 1:], steered.vocab_logprobs()[0, 1:])
    assert torch.allclose(cmp.kl[0], expected) and len(cmp.kl[0]) == 3
    assert cmp.first_divergence == [1]
    assert cmp.to_frame()["kl"].tolist() == pytest.approx(expected.tolist())
    with pytest.raises(ValueError, match="1 baseline traces but 2"):
        make_comparison(make_run([base]), make_run([steered, steered]))


def test_make_sweep_takes_the_baseline_at_scale_zero():
    traces = [_logprob_trace(s, [2, 3]) for s in range(3)]
    sweep = make_sweep("p", [-1, 0, 1], traces)
    assert isinstance(sweep, Sweep) and sweep.baseline is traces[1]
    frame = sweep.to_frame()
    assert frame["scale"].tolist() == [-1.0, 0.0, 1.0]
    assert frame["kl_mean"][1] == pytest.approx(0.0, abs=1e-6) and frame["kl_mean"][0] > 0
    with pytest.raises(ValueError, match="no scale is 0"):
        make_sweep("p", [1, 2], traces[:2])
    assert make_sweep("p", [1, 2], traces[:2], baseline=traces[2]).baseline is traces[2]
