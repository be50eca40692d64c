"""vlens.testing builds the same result objects a Session returns, and
refuses shapes a Session would never have produced."""

from __future__ import annotations

import pytest
import torch

from vlens.results import Run, Trace
from vlens.errors import VlensError
from vlens.results import Comparison, Sweep, generated_kl, kl_per_position
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
    assert t.read_keys == ["resid_post"] and t.layers_read("resid_post") == [1, 3]
    assert torch.equal(t.activations("resid_post"), acts)
    assert torch.equal(t.activations("resid_post", layer=3), acts[1])
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
    assert t.layers_read("resid_post:logit_lens") == [0, 1, 2]
    assert t.layers_read("resid_post") == [0, 1, 2]  # its only read: the lens
    assert t.layers_read("mlp_out") == t.layers_read("mlp_out:norm") == [2]
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
    return make_trace([0, 1], out, reads={"resid_post:vocab_logprobs": table}, layers=[3],
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
    assert isinstance(sweep, Sweep) and isinstance(sweep.baseline, Run)
    assert sweep.baseline[0] is traces[1] and sweep.prompts == ["p"]
    assert [run[0] for run in sweep.runs] == traces
    frame = sweep.to_frame()
    assert frame["scale"].tolist() == [-1.0, 0.0, 1.0] and frame["prompt"].tolist() == [0, 0, 0]
    assert frame["kl_mean"][1] == pytest.approx(0.0, abs=1e-6) and frame["kl_mean"][0] > 0
    with pytest.raises(ValueError, match="no scale is 0"):
        make_sweep("p", [1, 2], traces[:2])
    assert make_sweep("p", [1, 2], traces[:2], baseline=traces[2]).baseline[0] is traces[2]


def test_a_sweep_of_two_prompts_has_a_row_and_a_line_per_prompt():
    a = [_logprob_trace(s, [2, 3]) for s in range(3)]  # prompt 0 at scales -1, 0, 1
    b = [_logprob_trace(10 + s, [4, 5, 6]) for s in range(3)]  # prompt 1
    sweep = make_sweep(["p", "q"], [-1, 0, 1], [[x, y] for x, y in zip(a, b)], label="happy")
    assert sweep.baseline[1] is b[1] and len(sweep.kl) == 3 and len(sweep.kl[0]) == 2
    assert torch.allclose(sweep.kl[2][1], generated_kl(b[1], b[2]))
    frame = sweep.to_frame()
    assert frame["prompt"].tolist() == [0, 0, 0, 1, 1, 1]
    assert frame["scale"].tolist() == [-1.0, 0.0, 1.0] * 2
    assert frame["n_generated"].tolist() == [2, 2, 2, 3, 3, 3]
    assert frame["kl_mean"][4] == pytest.approx(0.0, abs=1e-6)
    assert frame["kl_mean"][3] == pytest.approx(float(generated_kl(b[1], b[0]).mean()))
    fig = sweep.figure("kl_mean")
    assert [tr.name for tr in fig.data] == ["prompt 0", "prompt 1"]
    assert list(fig.data[1].y) == pytest.approx(frame["kl_mean"][3:].tolist())
    assert fig.layout.title.text.startswith("happy: ") and "2 prompts" in fig.layout.title.text
    one = sweep.figure("kl_mean", prompt=1)
    assert len(one.data) == 1 and list(one.data[0].y) == list(fig.data[1].y)
    with pytest.raises(VlensError, match="prompt index"):
        sweep.figure(prompt=2)
    with pytest.raises(VlensError, match="one trace per prompt"):
        Sweep(["p", "q"], [0.0], [make_run([a[0]])], make_run([a[0], b[0]]))


def test_a_trace_is_read_by_layer_number():
    acts = torch.randn(2, 3, 4)
    t = make_trace([1, 2, 3], [4], reads={
        "resid_post": acts, "resid_post:norm": acts.norm(dim=-1),
        "resid_post:vocab_logprobs": torch.randn(2, 3, 6).log_softmax(-1),
        "resid_post:logit_lens": (torch.zeros(2, 3, 2, dtype=torch.long), torch.rand(2, 3, 2))},
        layers=[2, 5])
    assert t.layers_read("resid_post") == [2, 5]
    assert torch.equal(t.activations("resid_post", layer=5), acts[1])
    assert torch.equal(t["resid_post", 5], acts[1]) and torch.equal(t["resid_post"], acts)
    assert torch.equal(t.norms("resid_post", layer=2), acts[0].norm(dim=-1))
    assert torch.equal(t.vocab_logprobs(layer=5), t.vocab_logprobs()[1])
    ids, probs = t.logit_lens(layer=2)
    assert ids.shape == probs.shape == (3, 2) and torch.equal(probs, t.logit_lens()[1][0])
    with pytest.raises(VlensError, match=r"layer 3 of 'resid_post' was not read.*\[2, 5\]"
                                         r".*trace\(\.\.\., layers=\[2, 3, 5\]\)"):
        t.activations("resid_post", layer=3)
    with pytest.raises(VlensError, match="was not read"):
        t["resid_post", 0]
    with pytest.raises(VlensError, match=r"t\[site, layer\]"):
        t[0]
    with pytest.raises(VlensError, match=r"t\[site, layer\]"):
        t["resid_post", "5"]
    with pytest.raises(KeyError, match="mlp_out"):
        t["mlp_out", 2]


def test_per_head_reads_and_attention_by_layer_number():
    z, pattern = torch.randn(2, 3, 4, 5), torch.rand(2, 4, 3, 3)
    t = make_trace([1, 2, 3], [4], reads={"z": z, "attn_pattern": pattern}, layers=[1, 3])
    assert torch.equal(t.activations("z", layer=3, split_heads=True), z[1])  # [T, heads, hd]
    assert t.activations("z", layer=3, split_heads=True).shape == (3, 4, 5)
    assert torch.equal(t.attention(1), pattern[0])
    with pytest.raises(VlensError, match="head site"):
        t.activations("attn_pattern", layer=1, split_heads=True)
    with pytest.raises(VlensError, match=r"layer 2 of 'attn_pattern' was not read.*\[1, 3\]"):
        t.attention(2)


def test_the_old_names_say_what_replaced_them():
    t = make_trace([1, 2], [3], reads={"resid_post": torch.randn(1, 2, 4)})
    with pytest.raises(TypeError, match=r"t\.activations\(site, layer=L\) or t\[site, L\]"):
        t.layer("resid_post", 0)
    with pytest.raises(TypeError, match="split_heads=True"):
        t.heads("z", 0)
    with pytest.raises(TypeError, match=r"t\.layers_read\(site\)"):
        t.layers  # noqa: B018
