"""Plot builders: plain tensors and frames in, figures out; assert on data,
axes and labels. No engine, no display."""

from __future__ import annotations

import base64
import json
import math

import numpy
import pandas as pd
import plotly.graph_objects as go
import plotly.io
import pytest
import torch

from vlens import plots

TOKENS = ["<s>", "the", "cat", "the", "dog"]


def _shape(fig, name):
    return [s for s in fig.layout.shapes if s.name == name]


# -- reductions ---------------------------------------------------------------


def test_activation_values_quantities():
    g = torch.Generator().manual_seed(0)
    acts = torch.randn(3, 5, 8, generator=g)  # [layers, tokens, hidden]
    d = torch.randn(8, generator=g)
    norm = plots.activation_values(acts, "norm")
    assert norm.shape == (3, 5) and torch.allclose(norm, acts.norm(dim=-1))
    proj = plots.activation_values(acts, "projection", direction=d)
    assert torch.allclose(proj, acts @ (d / d.norm()), atol=1e-6)
    cos = plots.activation_values(acts, "cosine", direction=d * 7)
    assert torch.allclose(cos, torch.nn.functional.cosine_similarity(acts, d, dim=-1),
                          atol=1e-6)
    assert float(cos.abs().max()) <= 1 + 1e-6
    assert torch.equal(plots.activation_values(acts, "neuron", neuron=3), acts[..., 3])
    # one layer [tokens, hidden] works the same
    assert plots.activation_values(acts[0], "norm").shape == (5,)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"quantity": "projection"}, "direction"),
        ({"quantity": "cosine", "direction": torch.ones(3)}, "hidden size 8"),
        ({"quantity": "neuron"}, "neuron="),
        ({"quantity": "neuron", "neuron": 8}, "between 0 and 7"),
        ({"quantity": "mean"}, "norm, projection, cosine, neuron"),
    ],
)
def test_activation_values_say_what_is_missing(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plots.activation_values(torch.zeros(2, 4, 8), **kwargs)


def test_plain_text_escapes_plotly_markup():
    assert plots.plain_text("<s>") == "&lt;s&gt;"
    assert plots.plain_text("a&b <br>") == "a&amp;b &lt;br&gt;"
    fig = plots.logit_lens_grid([["</s>"]], torch.tensor([[0.5]]), ["<s>"], [0])
    assert fig.data[0].text[0][0] == "&lt;/s&gt;" and fig.data[0].y[0] == "0:&lt;s&gt;"


def test_first_divergence():
    from vlens.tokens import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None
    assert not hasattr(plots, "first_divergence")  # one of it: vlens.tokens's


def test_pca_2d_finds_the_spread_axis_with_a_fixed_sign():
    g = torch.Generator().manual_seed(1)
    x = torch.zeros(40, 6)
    x[:, 2] = torch.linspace(-5, 5, 40)  # the main axis
    x[:, 4] = 0.1 * torch.randn(40, generator=g)
    coords, explained = plots.pca_2d(x)
    assert coords.shape == (40, 2)
    assert explained[0] > 0.99 and explained.sum() <= 1 + 1e-6
    assert torch.allclose(coords[:, 0], x[:, 2] - x[:, 2].mean(), atol=1e-2)
    flipped, _ = plots.pca_2d(-x)  # signs fixed by the loadings, not the data
    assert torch.allclose(flipped[:, 0], -coords[:, 0], atol=1e-4)
    one, ex1 = plots.pca_2d(torch.ones(1, 6))  # degenerate: zeros, no NaN
    assert torch.equal(one, torch.zeros(1, 2)) and torch.equal(ex1, torch.zeros(2))


# -- figures ------------------------------------------------------------------


def test_activation_heatmap_axes_labels_and_marks():
    values = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    fig = plots.activation_heatmap(values, TOKENS, [0, 2, 4], quantity="norm",
                                   layer=2, span=(1, 3), n_prompt=4, per_layer=False, log=False)
    assert isinstance(fig, go.Figure)
    (heat,) = fig.data
    assert heat.type == "heatmap"
    # unique (no merged "the") and literal: "<s>" would be read as strike-through markup
    assert list(heat.x) == ["0:&lt;s&gt;", "1:the", "2:cat", "3:the", "4:dog"]
    assert list(heat.y) == ["layer 0", "layer 2", "layer 4"]
    assert [list(r) for r in heat.z] == values.tolist()
    assert [list(r) for r in heat.customdata] == values.tolist()  # the hover: raw values
    assert fig.layout.xaxis.title.text == "token" and fig.layout.yaxis.title.text == "layer"
    assert fig.layout.yaxis.autorange == "reversed"  # layer 0 on top
    assert heat.colorbar.title.text == "norm"
    (span,) = _shape(fig, "span")
    assert (span.x0, span.x1) == (0.5, 2.5)
    (row,) = _shape(fig, "layer")
    assert (row.y0, row.y1) == (0.5, 1.5)  # layer 2 is the second row
    (line,) = _shape(fig, "prompt|generated")
    assert line.x0 == 3.5


def test_activation_heatmap_checks_the_shape_and_keeps_the_old_call():
    with pytest.raises(ValueError, match=r"\[3 layers, 5 tokens\]"):
        plots.activation_heatmap(torch.zeros(5, 3), TOKENS, [0, 1, 2])
    fig = plots.activation_heatmap(torch.zeros(1, 5), TOKENS, [0], quantity="|x|", title="t")
    assert fig.layout.title.text == "t" and fig.layout.shapes == ()


def test_token_strip_wraps_and_marks_generated_tokens():
    vals = torch.tensor([0.5, -1.0, 2.0, 3.0, 4.0])
    fig = plots.token_strip(vals, TOKENS, n_prompt=3, width=2, quantity="proj", span=(2, 4))
    heat = fig.data[0]  # then the cell text, black and white
    assert [list(r) for r in heat.z] == [[0.5, -1.0], [2.0, 3.0], [4.0, None]]
    assert [list(r) for r in heat.text] == [["&lt;s&gt;", "the"], ["cat", "<i>the</i>"],
                                            ["<i>dog</i>", ""]]
    assert heat.customdata[2][0][0] == 4 and heat.customdata[2][0][1] == "generated"
    assert heat.zmid == 0  # negative values: a diverging scale centred on 0
    unsigned = plots.token_strip(vals.abs(), TOKENS).data[0]
    assert unsigned.zmid is None and unsigned.colorscale[0][1] != heat.colorscale[0][1]
    assert heat.colorbar.title.text == "proj"
    spans = _shape(fig, "span")
    assert [(s.x0, s.y0) for s in spans] == [(-0.5, 0.5), (0.5, 0.5)]  # tokens 2 and 3
    assert fig.layout.yaxis.autorange == "reversed"
    with pytest.raises(ValueError, match="4 values for 5 tokens"):
        plots.token_strip(vals[:4], TOKENS)


def test_activation_heatmap_colours_every_layer_by_default():
    # layer 3's norms are 100x the others' and one token is 10x its row:
    # on one linear scale every other cell would be one dark colour
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0],
                           [2.0, 4.0, 6.0, 8.0, 10.0],
                           [100.0, 200.0, 300.0, 400.0, 5000.0]])
    heat = plots.activation_heatmap(values, TOKENS, [0, 1, 3]).data[0]
    z = torch.tensor([list(r) for r in heat.z])
    logs = values.log10()
    expected = (logs - logs.amin(1, keepdim=True)) / (logs.amax(1, keepdim=True)
                                                      - logs.amin(1, keepdim=True))
    assert torch.allclose(z, expected, atol=1e-6)  # default: per layer, log (all positive)
    assert z.amin(1).tolist() == [0, 0, 0] and z.amax(1).tolist() == [1, 1, 1]
    assert float(z[2, 3]) > 0.3  # not flattened by the 5000 next to it (linear: 0.06)
    assert [list(r) for r in heat.customdata] == values.tolist()
    assert "per layer, log" in heat.colorbar.title.text
    assert list(heat.colorbar.ticktext) == ["layer min", "layer max"]
    shared = plots.activation_heatmap(values, TOKENS, [0, 1, 3], per_layer=False).data[0]
    assert torch.allclose(torch.tensor([list(r) for r in shared.z]), logs, atol=1e-6)
    assert "1000" in list(shared.colorbar.ticktext)  # log ticks name the raw values
    plain = plots.activation_heatmap(values, TOKENS, [0, 1, 3], per_layer=False, log=False)
    assert [list(r) for r in plain.data[0].z] == values.tolist()


def test_colour_values_of_signed_values():
    values = torch.tensor([[-2.0, 1.0, 0.5], [10.0, -40.0, 20.0]])
    z, signed, log = plots.colour_values(values)
    assert signed and not log  # log is for positive values unless asked
    assert torch.allclose(z, torch.tensor([[-1.0, 0.5, 0.25], [0.25, -1.0, 0.5]]))
    z, _, log = plots.colour_values(values, log=True, per_layer=False)
    assert log and torch.allclose(z, values.sign() * (1 + values.abs()).log10())
    heat = plots.activation_heatmap(values, TOKENS[:3], [0, 1], quantity="proj").data[0]
    assert heat.zmid == 0 and list(heat.colorbar.ticktext) == ["-max", "0", "+max"]


def test_layer_profile():
    fig = plots.layer_profile(torch.tensor([1.0, 2.0, 4.0]), [0, 1, 2], name="all")
    (line,) = fig.data
    assert list(line.x) == [0, 1, 2] and list(line.y) == [1.0, 2.0, 4.0]
    assert line.name == "all" and fig.layout.xaxis.title.text == "layer"
    # whole layers only: no tick at layer 0.5
    assert fig.layout.xaxis.tickmode == "array" and list(fig.layout.xaxis.tickvals) == [0, 1, 2]


def test_logit_lens_grid_tokens_down_layers_across():
    words = [["a", "b", "c", "d", "e"], ["f", "g", "h", "i", "j"]]
    probs = torch.tensor([[0.1] * 5, [0.9] * 5])
    fig = plots.logit_lens_grid(words, probs, TOKENS, [3, 7], span=(1, 3), n_prompt=4)
    heat = fig.data[0]  # then the cell text, black and white
    assert [list(r) for r in heat.text] == [list(col) for col in zip(*words)]  # [tokens, layers]
    assert heat.z[0][1] == pytest.approx(0.9)
    assert (heat.zmin, heat.zmax) == (0, 1)
    assert list(heat.x) == ["layer 3", "layer 7"] and heat.y[2] == "2:cat"
    assert list(fig.layout.yaxis.tickvals) == list(heat.y)  # every token labelled
    assert fig.layout.yaxis.autorange == "reversed" and fig.layout.xaxis.side == "top"
    assert all(t.textfont.size >= 13 for t in fig.data[1:])  # the cell text's two traces
    assert fig.layout.height >= 22 * len(TOKENS)  # one readable row per token
    (span,) = _shape(fig, "span")
    assert (span.y0, span.y1) == (0.5, 2.5)
    (line,) = _shape(fig, "prompt|generated")
    assert line.y0 == 3.5
    with pytest.raises(ValueError, match="expected"):
        plots.logit_lens_grid(words, probs[:1], TOKENS, [3, 7])


def test_logit_lens_grid_hover_lists_the_top_k_and_cuts_long_words():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 5, 3, generator=g).sort(-1, descending=True).values
    words = [[[f"w{layer}{t}{j}" for j in range(3)] for t in range(5)] for layer in range(2)]
    words[1][4][0] = "a-very-long-token-indeed"
    fig = plots.logit_lens_grid(words, probs, TOKENS, [0, 1])
    heat = fig.data[0]
    assert heat.text[2][1] == "w120"  # top-1 of layer 1 after token 2
    hover = heat.customdata[2][1]
    assert hover.split("<br>") == [f"w12{j}: {float(probs[1, 2, j]):.3f}" for j in range(3)]
    many = plots.logit_lens_grid(words * 20, torch.cat([probs] * 20),
                                 TOKENS, list(range(40)))
    cut = many.data[0].text[4][1]
    assert cut.endswith("…") and len(cut) < len("a-very-long-token-indeed")
    assert "a-very-long-token-indeed" in many.data[0].customdata[4][1]


def test_lens_token_values_from_a_top_k_read():
    ids = torch.tensor([[[5, 7], [7, 5], [1, 2]]])  # [1 layer, 3 tokens, k=2]
    probs = torch.tensor([[[0.6, 0.3], [0.5, 0.2], [0.9, 0.05]]])
    p, rank, floor = plots.lens_token_values(ids, probs, 7)
    assert p[0, :2].tolist() == pytest.approx([0.3, 0.5]) and math.isnan(p[0, 2])
    assert rank[0, :2].tolist() == [2.0, 1.0] and math.isnan(rank[0, 2])
    assert floor[0].tolist() == pytest.approx([0.3, 0.2, 0.05])
    fig = plots.logit_lens_track(p, TOKENS[:3], [4], token="cat", floor=floor, k=2)
    heat = fig.data[0]
    assert [list(r) for r in heat.text] == [["0.30"], ["0.50"], ["–"]]
    assert heat.z[2][0] is None and "not in the top 2: p < 0.050" in heat.customdata[2][0]
    ranks = plots.logit_lens_track(rank, TOKENS[:3], [4], token="cat", quantity="rank")
    assert [list(r) for r in ranks.data[0].text] == [["#2"], ["#1"], ["–"]]
    assert ranks.data[0].z[1][0] == 0  # rank 1 at the bright end (reversed scale)
    with pytest.raises(ValueError, match="'probability' or 'rank'"):
        plots.logit_lens_track(p, TOKENS[:3], [4], token="cat", quantity="logit")


def test_dose_response_one_line_sorted_by_scale():
    frame = pd.DataFrame({"scale": [4.0, -4.0, 0.0], "text": ["x", "y", "z"],
                          "kl_mean": [1.5, 2.0, 0.0], "mean_logprob": [-2, -3, -1]})
    fig = plots.dose_response(frame)
    (line,) = fig.data
    assert list(line.x) == [-4.0, 0.0, 4.0] and list(line.y) == [2.0, 0.0, 1.5]
    assert list(line.text) == ["y", "z", "x"]
    assert fig.layout.xaxis.title.text == "scale" and fig.layout.yaxis.title.text == "kl_mean"
    fig = plots.dose_response(frame, "mean_logprob", title="t")
    assert list(fig.data[0].y) == [-3, -1, -2] and fig.layout.title.text == "t"
    with pytest.raises(ValueError, match="no column 'kl'"):
        plots.dose_response(frame, "kl")


def test_dose_response_one_line_per_group():
    frame = pd.DataFrame({"scale": [0, 1, 0, 1], "layer": [2, 2, 5, 5],
                          "p": [0.1, 0.2, 0.3, 0.4]})
    fig = plots.dose_response(frame, "p", by="layer")
    assert [t.name for t in fig.data] == ["layer 2", "layer 5"]
    assert list(fig.data[1].y) == [0.3, 0.4] and fig.layout.showlegend


def _cells(fig) -> list:
    return _shape(fig, "token cell")


def test_baseline_vs_steered_deltas_and_first_divergence():
    fig = plots.baseline_vs_steered(
        ["a", "b", "c", "d"], ["a", "b", "x", "y"],
        [None, -1.0, -2.0, -1.0], [None, -1.5, -0.5, -1.0],
        positions=[5, 6, 7, 8], n_prompt=6,
    )
    bars, tokens = fig.data
    assert bars.type == "bar" and tokens.type == "scatter" and tokens.mode == "text"
    assert list(bars.x) == [5, 6, 7, 8]
    assert bars.y[0] is None and list(bars.y[1:]) == [-0.5, 1.5, 0.0]  # a gap, JSON-safe
    # one line of two rows: baseline above steered, position by position
    assert list(fig.layout.yaxis2.ticktext) == ["baseline", "steered"]
    assert list(tokens.text) == ["a", "a", "b", "b", "c", "x", "d", "y"]
    assert [c[:2] for c in tokens.customdata][:3] == [["baseline", 5], ["steered", 5],
                                                       ["baseline", 6]]
    assert len(_cells(fig)) == 8
    (div,) = _shape(fig, "first divergence")
    c_x = [c for c, d in zip(_cells(fig), tokens.customdata) if d[1] == 7][0]
    assert div.x0 <= c_x.x0 and c_x.x1 <= div.x1  # position 7, the first "x"
    assert fig.layout.title.text == "baseline vs steered: first divergence at position 7"
    assert len(_shape(fig, "prompt|generated")) == 2  # on the bars and on the rows
    assert fig.layout.yaxis.title.text == "Δ logprob"


def test_baseline_vs_steered_identical_and_ragged():
    same = plots.baseline_vs_steered(["a", "b"], ["a", "b"], [-1, -1], [-1, -1])
    assert _shape(same, "first divergence") == []
    assert same.layout.title.text == "baseline vs steered: no divergence"
    ragged = plots.baseline_vs_steered(["a"], ["a", "b"], [-1], [-1, -2])
    # the shorter side has no cell where its tokens end
    assert list(ragged.data[1].text) == ["a", "a", "b"] and len(_cells(ragged)) == 3
    assert [d[:2] for d in ragged.data[1].customdata][-1] == ["steered", 1]
    assert len(_shape(ragged, "first divergence")) == 1
    # the shorter side's missing logprobs are gaps (None), never NaN: a
    # FigureWidget's comm message is strict JSON, where NaN is invalid
    values = list(ragged.data[0].y)
    assert values.count(None) == 1 and all(v is None or math.isfinite(v) for v in values)


def test_activation_pca_one_trace_per_prompt():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 6, generator=g) + 5
    b = torch.randn(3, 6, generator=g) - 5
    fig = plots.activation_pca(torch.cat([a, b]), ["p0"] * 4 + ["p1"] * 3,
                               hover=list("abcdefg"), layer=3)
    assert [t.name for t in fig.data] == ["p0", "p1"]
    assert len(fig.data[0].x) == 4 and len(fig.data[1].x) == 3
    assert list(fig.data[1].text) == ["e", "f", "g"]
    assert fig.layout.xaxis.title.text.startswith("PC1 (") and "layer 3" in fig.layout.title.text
    # the two clusters separate along PC1
    assert max(fig.data[1].x) < min(fig.data[0].x) or max(fig.data[0].x) < min(fig.data[1].x)
    with pytest.raises(ValueError, match="one group per point"):
        plots.activation_pca(a, ["p0"])


def test_builders_do_not_display(monkeypatch):
    shown = []
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: shown.append(self))
    plots.activation_heatmap(torch.zeros(1, 2), ["a", "b"], [0])
    plots.token_strip([1.0, 2.0], ["a", "b"])
    plots.baseline_vs_steered(["a"], ["b"], [-1], [-2])
    assert shown == []


def test_token_set_metric_is_the_probability_of_the_set():
    from vlens.testing import make_sweep, make_trace

    g = torch.Generator().manual_seed(4)
    prompt, out = [0, 1], [2, 3, 4]  # rows 1, 2, 3 chose the generated tokens
    tables = [torch.randn(1, 4, 6, generator=g).log_softmax(-1) for _ in range(2)]
    traces = [make_trace(prompt, out, reads={"resid_post:vocab_logprobs": lp}, layers=[3])
              for lp in tables]
    sweep = make_sweep("p", [0, 2], traces)
    values = plots.token_set_metric(sweep, [3, 1, 3])
    expected = [float(lp[0, 1:].exp()[:, [1, 3]].sum(-1).mean()) for lp in tables]
    assert values == pytest.approx(expected)
    assert all(0 < v < 1 for v in values)


# -- attention ----------------------------------------------------------------


def _patterns(n_layers=2, heads=3, n=5, seed=0):
    """Causal attention probabilities ``[layers, heads, n, n]``: rows sum to 1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_layers, heads, n, n, generator=g)
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    return scores.softmax(-1)


def test_attention_heads_is_a_grid_of_thumbnails_with_the_pick_outlined():
    p = _patterns()  # 2 layers x 3 heads x 5 tokens
    fig = plots.attention_heads(p, [1, 3], selected=(3, 2))
    (grid,) = fig.data  # one heatmap: the page draws one trace, not one per head
    meta = grid.meta
    assert meta == {"layers": [1, 3], "heads": [0, 1, 2], "tile": 5, "step": 6}
    z = numpy.asarray(grid.z)
    assert z.shape == (2 * 6 - 1, 3 * 6 - 1) and z.dtype == numpy.float32  # no gap after the last
    # the tile of layer 3, head 1 starts at row 6, column 6: its pattern, causal cells empty
    tile = z[6:11, 6:11]
    assert numpy.allclose(tile[numpy.tril_indices(5)], p[1, 1].numpy()[numpy.tril_indices(5)])
    assert numpy.isnan(tile[numpy.triu_indices(5, 1)]).all()
    assert numpy.isnan(z[5, :]).all() and numpy.isnan(z[:, 5]).all()  # the gaps between tiles
    for r, layer in enumerate([1, 3]):  # every tile holds its own head, and a click finds it
        for c in range(3):
            block = z[r * 6:r * 6 + 5, c * 6:c * 6 + 5]
            assert numpy.allclose(block[numpy.tril_indices(5)], p[r, c].numpy()[numpy.tril_indices(5)])
            assert plots.thumbnail_at(meta, r * 6 + 4, c * 6 + 1) == (layer, c)
    assert plots.thumbnail_at(meta, 5, 2) is None and plots.thumbnail_at(meta, 2, 11) is None
    assert plots.thumbnail_at(meta, 20, 2) is None  # past the grid
    assert list(fig.layout.xaxis.ticktext) == ["head 0", "head 1", "head 2"]
    assert list(fig.layout.yaxis.ticktext) == ["layer 1", "layer 3"]
    assert list(fig.layout.xaxis.tickvals) == [2, 8, 14] and fig.layout.yaxis.autorange == "reversed"
    # the outline: around the tile of layer 3 (row 1), head 2 (column 2), in the gaps' middle
    (sel,) = _shape(fig, "selected")
    assert (sel.xref, sel.yref) == ("x", "y")
    assert (sel.x0, sel.x1, sel.y0, sel.y1) == (11.0, 17.0, 5.0, 11.0)
    assert plots.thumbnail_outline([1, 3], [0, 1, 2], (3, 2), tile=5)[0]["x0"] == sel.x0
    assert not _shape(plots.attention_heads(p, [1, 3], selected=(0, 0)), "selected")
    some = plots.attention_heads(p, [1, 3], heads=[0, 2, 5], selected=(1, 5))  # heads= read
    assert plots.thumbnail_at(some.data[0].meta, 0, 13) == (1, 5)
    assert _shape(some, "selected")[0].x0 == 11.0
    assert list(some.layout.xaxis.ticktext) == ["head 0", "head 2", "head 5"]
    with pytest.raises(ValueError, match="2 head names for 3"):
        plots.attention_heads(p, [1, 3], heads=[0, 1])
    with pytest.raises(ValueError, match="layers, heads, tokens, tokens"):
        plots.attention_heads(p[0], [1])
    with pytest.raises(ValueError, match="3 layer names for 2"):
        plots.attention_heads(p, [0, 1, 2])


def test_long_patterns_are_pooled_for_thumbnails():
    p = _patterns(1, 1, 100)
    small = plots.pool_pattern(p, 25)
    assert small.shape == (1, 1, 25, 25)
    assert float(small[0, 0, 0, 0]) == pytest.approx(float(p[0, 0, :4, :4].mean()))
    assert plots.pool_pattern(p, 100) is p
    fig = plots.attention_heads(p, [0], cells=25)
    assert len(fig.data[0].z) == 25 and fig.data[0].meta["tile"] == 25


def test_attention_heatmap_labels_tokens_and_marks_a_token():
    p = _patterns()[0, 0]
    fig = plots.attention_heatmap(p, TOKENS, token=2, n_prompt=4)
    hm = fig.data[0]
    assert list(hm.x) == list(hm.y) == ["0:&lt;s&gt;", "1:the", "2:cat", "3:the", "4:dog"]
    assert hm.z[3][1] == pytest.approx(float(p[3, 1])) and math.isnan(hm.z[1][3])
    assert sum(v for v in hm.z[4] if not math.isnan(v)) == pytest.approx(1, abs=1e-5)
    # the page gets one typed float32 array (plotly.js draws NaN as an empty cell)
    shown = json.loads(plotly.io.to_json(fig))["data"][0]["z"]
    z = numpy.frombuffer(base64.b64decode(shown["bdata"]), dtype=shown["dtype"])
    z = z.reshape(shown["shape"] if isinstance(shown["shape"], list)
                  else [int(n) for n in shown["shape"].split(",")])
    assert math.isnan(z[1, 3]) and z[3, 1] == pytest.approx(float(p[3, 1]))
    (row,) = _shape(fig, "query")
    (col,) = _shape(fig, "key")
    assert (row.y0, row.y1, col.x0, col.x1) == (1.5, 2.5, 1.5, 2.5)
    assert _shape(fig, "prompt|generated")
    assert not _shape(plots.attention_heatmap(p, TOKENS), "query")
    with pytest.raises(ValueError, match=r"expected \[4, 4\]"):
        plots.attention_heatmap(p, TOKENS[:4])


def test_attention_of_token_is_its_row_and_its_column():
    p = _patterns()[1, 2]
    fig = plots.attention_of_token(p, TOKENS, 2)
    to, by = fig.data
    assert (to.name, by.name) == ("attends to", "attended by")
    assert list(to.y[:3]) == pytest.approx(p[2, :3].tolist()) and to.y[3] is None
    assert by.y[1] is None and list(by.y[2:]) == pytest.approx(p[2:, 2].tolist())
    assert "2:cat" in fig.layout.title.text
    with pytest.raises(ValueError, match="0..4"):
        plots.attention_of_token(p, TOKENS, 5)


# -- patching -----------------------------------------------------------------


def test_patching_heatmap_gaps_for_unfinished_cells_and_outlines_a_cell():
    grid = torch.tensor([[1.0, 0.2, math.nan], [0.0, -0.5, 1.7]])
    fig = plots.patching_heatmap(grid, [0, 2], ["0:<s>", "1:cat", "2:sat"], cell=(1, 2))
    hm = fig.data[0]
    assert hm.z[0][2] is None and hm.z[1][2] == pytest.approx(1.7)
    assert list(hm.y) == ["layer 0", "layer 2"] and hm.x[0] == "0:&lt;s&gt;"
    assert hm.zmid == 0 and hm.zmax == pytest.approx(1.7) and hm.zmin == pytest.approx(-1.7)
    assert list(hm.customdata[1][2]) == [1, 2]
    (cell,) = _shape(fig, "cell")
    assert (cell.x0, cell.y0) == (1.5, 0.5)
    assert "5 of 6 cells" in fig.layout.title.text
    heads = plots.patching_heatmap(torch.zeros(2, 4), [0, 1], [f"head {h}" for h in range(4)],
                                   column_title="head")
    assert heads.layout.xaxis.title.text == "head" and heads.data[0].zmax == 1
    with pytest.raises(ValueError, match=r"\[2 layers, 2 positions\]"):
        plots.patching_heatmap(grid, [0, 2], ["a", "b"])


def _cell_text(fig) -> list[str]:
    """Every value a figure writes in its cells (its cell-text traces)."""
    return [t for tr in fig.data if tr.name == "cell text" for row in tr.text for t in row if t]


def test_grids_write_values_only_in_cells_wide_enough_for_them():
    # a 6 x 40 patching grid on a notebook's width: 40 cells of ~17 px each,
    # where "0.00" needs ~38 px, ran its labels together ("0.000.000.00")
    wide = plots.patching_heatmap(torch.rand(6, 40), list(range(6)),
                                  [f"{i}:t" for i in range(40)])
    assert _cell_text(wide) == [] and len(wide.data) == 1
    assert wide.data[0].hovertemplate.endswith("%{z:.3f}<extra></extra>")  # the hover has it
    # a few columns: every value written; a wider plot fits more columns
    narrow = plots.patching_heatmap(torch.full((6, 9), 0.25), list(range(6)),
                                    [f"head {h}" for h in range(9)], column_title="head")
    assert len(_cell_text(narrow)) == 54 and set(_cell_text(narrow)) == {"0.25"}
    assert _cell_text(plots.patching_heatmap(torch.rand(6, 40), list(range(6)),
                                             [f"{i}:t" for i in range(40)], width=2400))
    # the logit lens of one token over 30 layers: no values in 22 px cells
    track = plots.logit_lens_track(torch.full((30, 3), 0.5), ["a", "b", "c"], list(range(30)),
                                   token="x")
    assert _cell_text(track) == [] and len(track.data) == 1
    assert len(_cell_text(plots.logit_lens_track(torch.full((3, 3), 0.5), ["a", "b", "c"],
                                                 [0, 1, 2], token="x"))) == 9
    # the attribution's head grid shares the width with the bars
    from vlens.plots._attribution import attribution_figure

    heads = attribution_figure(torch.zeros(6), torch.zeros(6), torch.full((6, 12), 0.5))
    assert _cell_text(heads) == []
    few = attribution_figure(torch.zeros(2), torch.zeros(2), torch.full((2, 3), 0.5))
    assert len(_cell_text(few)) == 6


def test_next_token_bars_side_by_side_on_the_union_of_tokens():
    fig = plots.next_token_bars(
        {"clean": (["fox", "cat"], [0.9, 0.05]), "corrupt": (["cat", "dog"], [0.8, 0.1]),
         "layer 1, pos 3": (["fox", "cat", "<s>"], [0.5, 0.4, 0.01])},
        top=3, marks=["fox", "cat"])
    assert [t.name for t in fig.data] == ["clean", "corrupt", "layer 1, pos 3"]
    assert list(fig.data[0].x) == ["<b>fox</b>", "<b>cat</b>", "dog"]  # by best probability
    assert list(fig.data[1].y) == [None, 0.8, 0.1]
    assert list(fig.data[2].y) == [0.5, 0.4, None]
    with pytest.raises(ValueError, match="2 tokens for 1"):
        plots.next_token_bars({"clean": (["a", "b"], [1.0])})


# -- features -----------------------------------------------------------------


def test_top_features_keeps_the_k_largest_that_fire():
    row = torch.tensor([0.0, 3.0, -1.0, 7.0, 0.5, 0.0])
    frame = plots.top_features(row, k=3)
    assert frame["feature"].tolist() == [3, 1, 4]
    assert frame["activation"].tolist() == [7.0, 3.0, 0.5]
    # fewer than k fire: only those; nothing fires: an empty frame
    assert plots.top_features(row, k=5)["feature"].tolist() == [3, 1, 4]
    assert plots.top_features(torch.zeros(4), k=2).empty
    with pytest.raises(ValueError, match=r"\[d_sae\]"):
        plots.top_features(torch.zeros(2, 3))


def test_feature_contexts_windows_around_each_prompts_strongest_token():
    tokens = [list("abcdefghij"), list("klmno"), list("pqr")]
    values = [torch.tensor([0, 0, 1, 0, 0, 0, 0, 4.0, 2, 0]),
              torch.tensor([0, 6.0, 0, 0, 0]),
              torch.zeros(3)]  # never fires: no context
    frame = plots.feature_contexts(values, tokens, n=5, before=2, after=1)
    assert frame["prompt"].tolist() == [1, 0]  # strongest first
    assert frame["position"].tolist() == [1, 7] and frame["activation"].tolist() == [6.0, 4.0]
    assert frame["start"].tolist() == [0, 5]  # clipped at the prompt's start
    assert frame["tokens"].tolist() == [list("klm"), list("fghi")]
    assert frame["values"].tolist()[1] == [0.0, 0.0, 4.0, 2.0]
    assert plots.feature_contexts(values, tokens, n=1)["prompt"].tolist() == [1]
    with pytest.raises(ValueError, match="prompt 1"):
        plots.feature_contexts([values[0], torch.zeros(3)], tokens[:2])


def test_feature_logits_through_the_unembedding():
    g = torch.Generator().manual_seed(3)
    unembed, d, gain = (torch.randn(12, 6, generator=g), torch.randn(6, generator=g),
                        torch.rand(6, generator=g) + 0.5)
    frame = plots.feature_logits(d, unembed, k=3, norm_weight=gain,
                                 token_strings=lambda ids: [f"t{i}" for i in ids])
    logits = unembed @ (d * gain)
    order = logits.argsort(descending=True).tolist()
    up, down = frame[frame.kind == "promoted"], frame[frame.kind == "suppressed"]
    assert up["token_id"].tolist() == order[:3]
    assert down["token_id"].tolist() == order[::-1][:3]  # the most suppressed first
    assert torch.allclose(torch.tensor(up["logit"].tolist()), logits[order[:3]])
    assert frame["token"].tolist() == [f"t{i}" for i in frame["token_id"]]
    plain = plots.feature_logits(d, unembed, k=2)
    assert plain[plain.kind == "promoted"]["token_id"].tolist() == \
        (unembed @ d).argsort(descending=True).tolist()[:2]
    with pytest.raises(ValueError, match="vocab"):
        plots.feature_logits(d, unembed[:, :5])


def test_feature_histogram_counts_where_the_feature_fires():
    values = torch.tensor([0.0, 0.0, 2.0, 3.5, 0.0, 1.0])
    fig = plots.feature_histogram(values, feature=7, mark=3.5)
    assert sorted(fig.data[0].x) == [1.0, 2.0, 3.5]
    assert "feature 7" in fig.layout.title.text and "3 of 6 tokens" in fig.layout.title.text
    assert [s.x0 for s in _shape(fig, "token")] == [3.5]
    assert not _shape(plots.feature_histogram(values, mark=0.0), "token")  # a token it skips


def test_promoted_tokens_bars_side_by_side():
    frame = pd.DataFrame({"kind": ["promoted"] * 2 + ["suppressed"] * 2,
                          "token_id": [4, 9, 1, 2], "logit": [2.0, 1.0, -3.0, -0.5],
                          "token": ["<s>", " cat", "dog", "dog"]})
    fig = plots.promoted_tokens(frame)
    up, down = fig.data
    assert list(up.x) == [2.0, 1.0] and list(down.x) == [-3.0, -0.5]
    assert list(up.y) == ["&lt;s&gt;", "\u00b7cat"]  # literal and whitespace visible
    assert list(down.y) == ["dog #1", "dog #2"]  # plotly would merge two "dog"s
    assert list(down.customdata) == [1, 2]
