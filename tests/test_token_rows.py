"""Token figures a class can read from the back row (issue 38): every token
its own cell with its whitespace visible, text that contrasts with its cell
(WCAG ratio >= 4.5), 13 px text or more, long runs wrapped into lines,
titles that carry their numbers, the edited row named for what was done,
and ``.figure()`` on every result a view draws. Pure: plain tensors and
the test-kit's traces, no engine."""

from __future__ import annotations

import math

import plotly.graph_objects as go
import pytest
import torch

import vlens
from vlens import plots
from vlens.plots._cells import colour_at, contrast_ratio, text_colour
from vlens.results import Comparison, Sweep, kl_per_position, run_label
from vlens.results.patching import Patching
from vlens.testing import make_run, make_trace

from _helpers import wcag_contrast  # noqa: I001 - the tests' own reference

STORY = " the wind was bitter and cold . the duck sat by the pond".split(" ")[1:]
STORY = [" " + w for w in STORY]


def _cells(fig) -> list:
    return [s for s in fig.layout.shapes if s.name == "token cell"]


def _row_pairs(fig) -> list[tuple[str, str, str]]:
    """(text, text colour, cell colour) of each token cell of a token-rows figure."""
    text = next(t for t in fig.data if t.type == "scatter" and t.mode == "text")
    cells = _cells(fig)
    assert len(cells) == len(text.text)
    return list(zip(text.text, text.textfont.color, (c.fillcolor for c in cells)))


def _heat_pairs(fig) -> list[tuple[str, str, str]]:
    """(text, text colour, cell colour) of every labelled heatmap cell: the
    cell colour from the base heatmap's colour scale, at plotly's place."""
    base = fig.data[0]
    out = []
    for t in fig.data[1:]:
        if t.type != "heatmap" or t.texttemplate is None:
            continue
        for zrow, trow, brow in zip(t.z, t.text, base.z):
            for z, text, value in zip(zrow, trow, brow):
                if text:
                    assert z == value  # a label trace repaints the base's own value
                    cell = colour_at(base.colorscale, value, base.zmin, base.zmax,
                                     reverse=bool(base.reversescale))
                    out.append((text, t.textfont.color, cell))
    return out


def _comparison(base_out, steered_out, label="steered"):
    prompt = [1, 2, 3]
    tb = make_trace(prompt, base_out, logprobs=[None, -1.0, -1.0] + [-0.2] * len(base_out))
    ts = make_trace(prompt, steered_out,
                    logprobs=[None, -1.0, -1.0] + [-3.0 + 0.3 * i for i in range(len(steered_out))])
    return Comparison(make_run([tb]), make_run([ts]), label=label)


def test_text_colour_reaches_4_5_on_every_colour_of_a_scale():
    for name in ("Blues", "RdBu", "Viridis", "Greys"):
        scale = go.Heatmap(colorscale=name).colorscale
        for i in range(101):
            cell = colour_at(scale, i / 100, 0.0, 1.0)
            assert wcag_contrast(text_colour(cell), cell) >= 4.5, (name, i, cell)
    assert text_colour("#08306b") == "#ffffff" and text_colour("#f7fbff") == "#000000"
    assert contrast_ratio("#000000", "#ffffff") == pytest.approx(21.0)
    # the middle grey plotly's own "auto" colour fails on
    assert wcag_contrast("#444444", "#808080") < 4.5 <= wcag_contrast(text_colour("#808080"), "#808080")


def test_cell_labels_take_the_colour_each_cell_picks_on_its_own():
    """cell_text_traces parses the scale once for the whole grid: every
    cell still gets what text_colour(colour_at(...)) picks for it alone."""
    from vlens.plots._cells import EMPTY, cell_text_traces

    values = [[i / 400 + j / 40 for j in range(40)] for i in range(10)]
    values[3][5], values[4][6] = None, math.nan  # empty cells: the background's text
    for name, reverse, lo, hi in (("Blues", False, 0.0, 1.0), ("Viridis", True, -0.5, 0.7),
                                  ("RdBu", False, 0.3, 0.3)):
        heat = go.Heatmap(z=values, colorscale=name, reversescale=reverse, zmin=lo, zmax=hi)
        text = [[f"{r},{c}" for c in range(40)] for r in range(10)]
        black, white = cell_text_traces(heat, text)
        for r in range(10):
            for c in range(40):
                want = text_colour(colour_at(heat.colorscale, values[r][c], lo, hi,
                                             reverse=reverse))
                got = {black.textfont.color: black.text[r][c],
                       white.textfont.color: white.text[r][c]}
                assert got[want] == text[r][c] and "" in got.values(), (name, r, c)
    assert colour_at(heat.colorscale, None, 0, 1) == EMPTY


def test_token_text_is_intact_with_its_whitespace_visible():
    fig = plots.baseline_vs_steered([" the", "\n", "", "<s>"], [" the", "\t", " a", "<s>"],
                                    [-1.0] * 4, [-1.0] * 4)
    texts = [t for t, _, _ in _row_pairs(fig)]
    assert texts == ["·the", "·the", "↵", "⇥", "∅", "·a", "&lt;s&gt;", "&lt;s&gt;"]
    hover = fig.data[1].customdata
    assert [h[2] for h in hover[:2]] == ["·the", "·the"] and hover[0][1] == 0


def test_every_token_cell_contrasts_4_5_with_its_text():
    lp = [-(i % 9) * 0.8 for i in range(len(STORY))]
    fig = plots.baseline_vs_steered(STORY, STORY[::-1], lp, lp[::-1])
    pairs = _row_pairs(fig)
    assert len(pairs) == 2 * len(STORY)
    assert {c for _, c, _ in pairs} == {"#000000", "#ffffff"}  # both are needed
    for text, colour, cell in pairs:
        assert wcag_contrast(colour, cell) >= 4.5, (text, colour, cell)


@pytest.mark.parametrize("make", [
    lambda: plots.logit_lens_grid([["a", "b", "c"]] * 2, torch.tensor([[0.05, 0.5, 0.95]] * 2),
                                  ["x", "y", "z"], [0, 1]),
    lambda: plots.logit_lens_track(torch.tensor([[0.1, math.nan, 0.9]] * 2), ["x", "y", "z"],
                                   [0, 1], token="a"),
    lambda: plots.patching_heatmap(torch.tensor([[1.0, 0.5, -0.3], [0.0, math.nan, 0.8]]),
                                   [0, 1], ["0:a", "1:b", "2:c"]),
    lambda: plots.token_strip(torch.tensor([0.1, -2.0, 3.0, 0.0, 1.5]), list("abcde"), width=3),
], ids=["lens-grid", "lens-track", "patching", "token-strip"])
def test_every_labelled_heatmap_cell_contrasts_4_5(make):
    fig = make()
    pairs = _heat_pairs(fig)
    assert len(pairs) >= 5
    for text, colour, cell in pairs:
        assert wcag_contrast(colour, cell) >= 4.5, (text, colour, cell)
    assert fig.data[0].texttemplate is None  # the base draws no text of its own colour


def _token_figures() -> dict[str, go.Figure]:
    pattern = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5).unsqueeze(1)
    return {
        "comparison": plots.baseline_vs_steered(STORY, STORY, [-1.0] * 12, [-2.0] * 12),
        "lens": plots.logit_lens_grid([["a", "b"]], torch.tensor([[0.2, 0.8]]), ["x", "y"], [0]),
        "patching": plots.patching_heatmap(torch.zeros(2, 3), [0, 1], ["0:a", "1:b", "2:c"]),
        "attention": plots.attention_heatmap(pattern, list("abcd"), token=1),
        "attention-token": plots.attention_of_token(pattern, list("abcd"), 1),
        "activations": plots.activation_heatmap(torch.rand(2, 4), list("abcd"), [0, 1]),
        "strip": plots.token_strip(torch.rand(4), list("abcd")),
        "next-token": plots.next_token_bars({"clean": (["a"], [0.5])}),
    }


@pytest.mark.parametrize("name", list(_token_figures()))
def test_token_figures_write_13_px_or_more_and_take_the_page_width(name):
    fig = _token_figures()[name]
    lay = fig.layout
    assert lay.font.size >= 13 and lay.title.font.size >= 13
    assert lay.width is None and lay.autosize  # the page's width, never a fixed one
    assert lay.height is not None and lay.height >= 150  # set, from what it holds
    sizes = [a.font.size for a in lay.annotations]
    sizes += [t.textfont.size for t in fig.data if getattr(t, "textfont", None) is not None
              and t.textfont.size is not None]
    sizes += [ax.tickfont.size for ax in (lay.xaxis, lay.yaxis) if ax.tickfont.size is not None]
    assert all(s is None or s >= 13 for s in sizes), sizes


def test_a_long_run_wraps_into_lines_of_whole_cells():
    n = 60
    toks = [" " + chr(97 + i % 26) for i in range(n)]
    fig = plots.baseline_vs_steered(toks, toks, [-1.0] * n, [-1.0] * n,
                                    positions=list(range(10, 10 + n)), per_line=24)
    short = plots.baseline_vs_steered(toks[:10], toks[:10], [-1.0] * 10, [-1.0] * 10)
    starts = [a.text for a in fig.layout.annotations if a.name == "line start"]
    assert starts == ["position 10", "position 34", "position 58"]  # 24, 24 and 12 tokens
    assert list(fig.layout.yaxis2.ticktext) == ["baseline", "steered"] * 3
    # every cell as wide as the short figure's: the cells do not shrink
    width = {round(c.x1 - c.x0, 6) for c in _cells(fig)}
    assert width == {round(c.x1 - c.x0, 6) for c in _cells(short)} and len(width) == 1
    assert fig.layout.height > short.layout.height + 150  # the height follows the lines
    hover = fig.data[1].customdata
    assert [h[:3] for h in hover[-2:]] == [["baseline", 69, "·h"], ["steered", 69, "·h"]]
    assert "position %{customdata[1]}" in fig.data[1].hovertemplate


def test_a_comparison_figure_names_its_divergence_and_its_edit():
    cmp = _comparison([7, 8, 9, 10], [7, 8, 5, 6], label="ablated")
    fig = cmp.figure()
    assert fig.layout.title.text == "baseline vs ablated: first divergence at position 5"
    assert list(fig.layout.yaxis2.ticktext) == ["baseline", "ablated"]
    assert {d[0] for d in fig.data[1].customdata} == {"baseline", "ablated"}
    assert list(fig.data[0].x) == [3, 4, 5, 6]  # positions after the 3 prompt tokens
    bars = fig.data[0].y
    assert bars[0] == pytest.approx(-3.0 - -0.2)
    same = _comparison([7, 8], [7, 8]).figure(what="scale 4 at layer 2")
    assert same.layout.title.text == "scale 4 at layer 2: no divergence"
    assert list(same.layout.yaxis2.ticktext) == ["baseline", "steered"]


def test_run_label_says_what_the_edits_did():
    vec = torch.ones(8)
    assert run_label(vlens.Steer(vec, 1, 2.0)) == "steered"
    assert run_label([vlens.Ablate("z", 1, heads=[0])]) == "ablated"
    assert run_label(vlens.PerPrompt([None, vlens.Ablate("resid_post", 0)])) == "ablated"
    assert run_label([vlens.Steer(vec, 1, 2.0), vlens.Ablate("resid_post", 0)]) == "edited"
    from vlens.models import toyworld_sae_path

    sae = vlens.SAE.load(toyworld_sae_path())
    assert run_label(vlens.Clamp(sae, 0, 3.0)) == "clamped"


def test_every_result_a_view_draws_has_a_figure():
    cmp = _comparison([7, 8, 9], [7, 5, 9])
    assert "first divergence at position 4" in cmp.figure().layout.title.text
    tables = torch.randn(2, 1, 3, 6, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    traces = [make_trace([1, 2], out, logprobs=lp, reads={"resid_post:vocab_logprobs": table})
              for out, lp, table in zip(([3, 4], [3, 5]), ([None, -1.0, -0.5, -0.5],
                                                            [None, -1.0, -0.5, -2.5]), tables)]
    sweep = Sweep(["p"], [0.0, 4.0], [make_run([t]) for t in traces], make_run(traces[:1]))
    fig = sweep.figure("kl_mean")
    kl = kl_per_position(tables[0, 0, 1:], tables[1, 0, 1:])
    assert len(fig.data) == 1 and list(fig.data[0].y) == pytest.approx([0.0, float(kl.mean())])
    assert "2 scales" in fig.layout.title.text and fig.layout.font.size >= 13
    grid = torch.tensor([[1.0, math.nan], [0.25, 0.0]])
    p = Patching("resid_post", [0, 1], [3, 4], None, [" duck", "\n"], (5, 6), (" duck", " cat"),
                 grid, grid.clone())
    pf = p.figure()
    assert "3 of 4 cells" in pf.layout.title.text and list(pf.data[0].x) == ["3:·duck", "4:↵"]
    assert all(wcag_contrast(c, cell) >= 4.5 for _, c, cell in _heat_pairs(pf))
