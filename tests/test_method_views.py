"""The attention view, the patching view and the steering panel's
ablation mode (issue 13), driven from Python.

The attention view draws plain pattern tensors (it only draws), then real
traces of the bundled model (``toy_session``); the patching view and the
ablation mode call the Session and are checked against the Session's own
answers (``s.patch``, ``s.trace(ablate=...)``). The browser drives the same
views in tests/test_browser.py, the notebooks 05 and 06 in
tests/test_run_all.py.
"""

from __future__ import annotations

import html
import json

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import vlens
from plotly.callbacks import Points

from vlens.plots import plain_text
from vlens.testing import make_run, make_trace
from vlens.widgets import AttentionView, PatchingView, SteeringPanel

engine = pytest.mark.engine

ANIMAL = ("once upon a time, a sad duck lived in a green house near the farm. sadly, the sky was grey "
          "and the wind was cold. its friend the fox came to say goodbye. the")


@pytest.fixture
def run():
    """A run that read no attention: a residual stream of random values."""
    g = torch.Generator().manual_seed(0)
    reads = {"resid_post": torch.randn(2, 4, 8, generator=g)}
    return make_run([make_trace([0, 1, 2], [3, 4], reads=reads)])


def causal_patterns(n_layers=2, heads=3, n=5, seed=0):
    """Attention probabilities ``[layers, heads, n, n]``, causal, rows summing to 1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_layers, heads, n, n, generator=g)
    return scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")).softmax(-1)


def test_attention_view_picks_a_head_from_its_thumbnail_and_a_token_by_hover():
    p = causal_patterns()
    view = AttentionView(n_layers=4)
    view.show(p, ["<s>", "the", "cat", "the", "dog"], layers=[1, 3], n_prompt=4)
    assert (view.layer, view.head, view.token) == (1, 0, -1)  # moved to a read layer
    assert len(view.thumbnails.data) == 1 and view.heatmap.layout.title.text == "layer 1, head 0"
    assert view.thumbnails.data[0].meta["layers"] == [1, 3]  # one tiled heatmap, 2 x 3 tiles
    assert torch.equal(view.pattern(), p[0, 0])

    # a click on the thumbnail of layer 3, head 2 (tile row 1, column 2; the
    # tiles are 5 cells and 1 apart): one draw of the head's figures, and the
    # grid's outline moved (the grid not built again)
    grid, drawn = view.thumbnails.data, []
    view.heatmap.observe(lambda c: drawn.append(json.loads(c["new"])["layout"]["title"]),
                         names=["figure_json"])
    view._on_thumbnail(view.thumbnails.data[0], Points(point_inds=[[5, 2]]), None)  # a gap
    assert (view.layer, view.head) == (1, 0) and drawn == []
    view._on_thumbnail(view.thumbnails.data[0], Points(point_inds=[[6 + 4, 12 + 0]]), None)
    assert (view.layer, view.head) == (3, 2) and view.layer_picker.value == 3
    assert [t["text"] for t in drawn] == ["layer 3, head 2"]
    assert view.heatmap.layout.title.text == "layer 3, head 2"
    assert view.heatmap.data[0].z[4][2] == pytest.approx(float(p[1, 2, 4, 2]))
    assert all(a is b for a, b in zip(view.thumbnails.data, grid, strict=True))
    for shapes in (view.thumbnails.layout.shapes,
                   json.loads(view.thumbnails.figure_json)["layout"]["shapes"]):
        (sel,) = [s for s in shapes if s["name"] == "selected"]
        assert (sel["x0"], sel["y0"]) == (11.0, 5.0)  # around tile (1, 2)
    assert json.loads(view.thumbnails.figure_json)["data"][0]["meta"]["heads"] == [0, 1, 2]
    # the same tensor shown under other layer numbers: the grid is built again
    view.show(p, ["<s>", "the", "cat", "the", "dog"], layers=[0, 2], n_prompt=4)
    assert view.thumbnails.data[0].meta["layers"] == [0, 2]
    view.show(p, ["<s>", "the", "cat", "the", "dog"], layers=[1, 3], n_prompt=4)

    # the pointer over chip 2 picks token 2: its row and column, and the chips' tint
    view.chips.hovered = 2
    assert view.token == 2
    assert {s.name for s in view.heatmap.layout.shapes} >= {"query", "key"}
    to, by = view.token_figure.data
    assert list(to.y[:3]) == pytest.approx(p[1, 2, 2, :3].tolist())
    assert list(by.y[2:]) == pytest.approx(p[1, 2, 2:, 2].tolist())
    assert view.chips.shade[:3] == pytest.approx(p[1, 2, 2, :3].tolist())
    assert view.chips.shade[3:] == [0.0, 0.0]  # a causal head cannot look ahead

    # a click on a heatmap cell picks its query row; the head box too
    view._on_cell(view.heatmap.data[0], Points(point_inds=[[4, 1]]), None)
    assert view.token == 4
    view._head.value = 1
    assert view.head == 1 and view.heatmap.layout.title.text == "layer 3, head 1"
    assert view.error == ""


def test_attention_view_says_what_is_wrong_and_keeps_working(run):
    view = AttentionView(n_layers=4)
    with pytest.raises(ValueError, match=r"\[layers, heads, 3, 3\]"):
        view.show(torch.zeros(1, 2, 4, 4), ["a", "b", "c"])
    view.show(causal_patterns(2, 2, 3), ["a", "b", "c"], layers=[0, 2])
    view.layer = 1  # not read: shown in the widget, not raised
    assert "layer 1 has no attention pattern" in view.error and "[0, 2]" in view.error
    view.layer = 2
    assert view.error == "" and view.heatmap.layout.title.text == "layer 2, head 0"
    view.show(causal_patterns(1, 2, 3), ["a", "b", "c"], heads=[1, 3])  # heads= read
    assert view.heads == [1, 3] and view.head == 1
    view.head = 3
    assert view.heatmap.layout.title.text == "layer 0, head 3" and view.error == ""
    view.head = 2
    assert "head 2 has no attention pattern" in view.error and "[1, 3]" in view.error
    view.run = run  # a run that read no attention
    assert "sites=['attn_pattern']" in view.error
    with pytest.raises(TypeError):
        AttentionView(n_layers=4, head_count=2)
    with pytest.raises(ValueError, match="n_layers="):
        AttentionView()


# -- on the bundled model -------------------------------------------------------


@engine
def test_attention_view_on_a_real_trace_shows_the_copy_head(toy_session):
    from vlens.models import COPY_HEAD

    run = toy_session.trace(ANIMAL, sites=["attn_pattern"], layers=None, max_new_tokens=1)
    t = run[0]
    view = AttentionView(run)
    assert view.layers == list(range(toy_session.n_layers)) and view.tokens == t.tokens
    n_heads = toy_session.info["n_heads"]
    grid = view.thumbnails.data[0]
    assert len(view.thumbnails.data) == 1 and grid.meta["layers"] == view.layers
    assert len(grid.meta["heads"]) == n_heads
    layer, head = COPY_HEAD
    step = grid.meta["step"]
    view._on_thumbnail(grid, Points(point_inds=[[layer * step + 1, head * step]]), None)
    assert (view.layer, view.head) == COPY_HEAD
    assert torch.equal(view.pattern(), t.attention(layer)[head])
    view.chips.hovered = t.n_tokens - 1  # the token before the second mention
    to = list(view.token_figure.data[0].y)
    first = t.tokens.index("duck")
    assert max(range(len(to)), key=lambda j: to[j] or 0) == first  # it looks back at the duck
    assert to[first] > 0.5 and view.chips.shade[first] == pytest.approx(to[first])
    assert view.error == ""
    # a trace of one head: the view numbers it as read
    one = toy_session.trace(ANIMAL, sites=["attn_pattern"], layers=[layer], heads=[head],
                            max_new_tokens=1)
    small = AttentionView(one, heads=[head])
    assert (small.layers, small.heads, small.head) == ([layer], [head], head)
    assert torch.allclose(small.pattern(), t.attention(layer)[head], atol=1e-6)
    meta = small.thumbnails.data[0].meta
    assert (meta["layers"], meta["heads"]) == ([layer], [head]) and small.error == ""


@engine
def test_steering_panel_ablation_mode_knocks_out_heads(toy_session):
    from vlens.models import COPY_HEAD

    layer, head = COPY_HEAD
    panel = SteeringPanel(toy_session, ANIMAL, layer=layer, max_new_tokens=6)
    assert panel._mode.layout.display == ""  # the model has a z site: the toggle shows
    # a steering direction is [hidden]-wide: no per-head site and no pattern to steer at
    assert not {"q", "k", "v", "z", "attn_pattern"} & set(panel.site_picker.options)
    panel._mode.value = "ablate"  # the toggle, as clicked
    assert panel.mode == "ablate" and panel._ablate_row.layout.display == ""
    assert panel._scale_row.layout.display == "none" and panel._lists.layout.display == "none"
    panel._run_button.click()
    assert panel.wait(120) and "pick at least one head" in panel.error  # shown, not raised
    panel.head_picker._buttons[head].value = True  # a click on the head's button
    assert panel.ablate_heads == [head]
    ab = panel.ablation()
    assert (ab.site, ab.layer, list(ab.heads), ab.kind, ab.span) == (
        "z", layer, [head], "zero", "all")
    assert panel.site_picker.layout.display == "none"  # always z in this mode
    # The bundled model copies the animal with a team of redundant heads of
    # one layer (notebook 06): one head out, another copies. Click every head
    # of the layer that looks at the first mention, as notebook 06 does.
    t = toy_session.trace(ANIMAL, sites=["attn_pattern"], layers=[layer], max_new_tokens=1)[0]
    first, pattern = t.tokens.index("duck"), t.attention(layer)  # [heads, T, T]
    looking = [h for h in range(pattern.shape[0]) if float(pattern[h][-1, first]) >= 0.5]
    assert head in looking
    for h in looking:
        panel.head_picker._buttons[h].value = True
    assert sorted(panel.ablate_heads) == looking
    ab = panel.ablation()
    panel._run_button.click()
    assert panel.wait(120) and panel.error == "" and panel.streamed_states >= 2
    base, ablated = panel.comparison.texts[0]
    # the plain run and the ablated one equal what trace gives for each
    ref = toy_session.trace([ANIMAL, ANIMAL], max_new_tokens=6, layers=[0], reduce="norm",
                            ablate=vlens.PerPrompt([None, ab]))
    assert (base, ablated) == tuple(ref.texts)
    assert base.split()[0] == "duck" and ablated.split()[0] != "duck"  # the copy fails
    assert "ablated" in panel._texts.value and "knocked out" in \
        panel.comparison_figure.layout.title.text
    panel.mode = "steer"  # back: the steering controls again
    assert panel._scale_row.layout.display == "" and panel._ablate_row.layout.display == "none"


@engine
def test_patching_view_streams_the_grid_and_shows_a_clicked_cell(toy_session):
    corrupt = ANIMAL.replace("sad duck", "sad cat")
    seen: list[int] = []
    view = PatchingView(toy_session, auto_run=False, site="resid_pre", layers=[0, 1])
    view.observe(lambda c: seen.append(c["new"]), names="cells_done")
    view.run(ANIMAL, corrupt)
    ref = toy_session.patch(ANIMAL, corrupt, site="resid_pre", layers=[0, 1])
    total = ref.grid.numel()
    assert view.error == "" and view.cells_done == total
    assert seen == sorted(seen) and seen[-1] == total and view.streamed_states >= 2
    assert torch.allclose(view.patching.grid, ref.grid, atol=1e-4)  # the stream ends at patch's
    hm = view.heatmap.data[0]
    assert torch.allclose(torch.tensor([list(r) for r in hm.z]), ref.grid, atol=1e-4)
    assert list(hm.x) == [plain_text(c) for c in ref.columns]  # "<s>" shown as text
    assert list(hm.y) == ["layer 0", "layer 1"]

    first = ref.columns.index("8:duck")
    view._on_click(hm, Points(point_inds=[[0, first]]), None)  # a click: layer 0, the duck
    assert view.cell == (0, first)
    assert [s.name for s in view.heatmap.layout.shapes] == ["cell"]
    clean, cor, cell = view.bars.data
    assert (clean.name, cor.name, cell.name) == ("clean", "corrupt", "layer 0, 8:duck")
    dist = view.distributions()
    assert dist["clean"][0][0] == "duck" and dist["corrupt"][0][0] == "cat"
    assert dist["layer 0, 8:duck"][0][0] == "duck"  # patching the word restores it
    assert "duck" in view._summary.value and "cat" in view._summary.value

    view._corrupt.value = "a short corrupt prompt"  # typed; a different length
    view._run_button.click()  # said in the widget, not raised
    assert view.wait(120) and "same length" in view.error and view.patching is not None


@engine
def test_patching_view_of_a_result_and_its_argument_checks(toy_session):
    corrupt = ANIMAL.replace("sad duck", "sad cat")
    result = toy_session.patch(ANIMAL, corrupt, site="z", heads="all")
    view = PatchingView(result)
    assert view.session is None and view.cells_done == result.grid.numel()
    assert list(view.heatmap.data[0].x) == [f"head {h}" for h in range(toy_session.info["n_heads"])]
    assert view.heatmap.layout.xaxis.title.text == "head"
    view.cell = (0, 2)  # set from Python: the same as a click
    assert view.cell_name() == "layer 0, head 2" and len(view.bars.data) == 3
    view._run_button.click()
    assert view.wait(120) and "given a result, not a session" in view.error
    with pytest.raises(TypeError, match="site"):
        PatchingView(result, site="z")


@engine
def test_attribution_view_draws_the_heads_and_reads_a_clicked_one(toy_session):
    from vlens.widgets import AttributionView

    view = AttributionView(toy_session, ANIMAL, "duck", "fox")
    ref = toy_session.logit_attribution(ANIMAL, answer="duck", wrong="fox")
    a = view.attribution
    assert view.error == "" and a.answer_text == ["duck"] and a.wrong_text == ["fox"]
    assert torch.allclose(a.heads, ref.heads, atol=1e-5)
    heat = next(t for t in view.figure.data if t.type == "heatmap")
    assert torch.allclose(torch.tensor([list(r) for r in heat.z], dtype=torch.float32),
                          ref.heads[0].float(), atol=1e-4)
    assert view.head == (-1, -1) and view.head_text() == ""
    view._on_click(heat, Points(point_inds=[[0, 5]]), None)  # a click: layer 0, head 5
    assert view.head == (0, 5)
    value = float(ref.heads[0, 0, 5])
    assert f"layer 0, head 5 writes {value:+.4f}" in view.head_text()
    assert html.escape(view.head_text()) in view._picked.value
    # a result alone is shown, and its run button says what it needs
    shown = AttributionView(ref)
    assert shown.session is None and len(shown.figure.data) == len(view.figure.data)
    view._answer.value = "duck duck"  # two tokens: said in the widget, not raised
    view._run_button.click()
    assert view.wait(120) and "one token" in view.error and view.attribution is a


@engine
def test_the_explorer_attributes_its_first_generated_token_when_the_dla_tab_opens(toy_session):
    from vlens.widgets import explore

    ex = explore(toy_session, ANIMAL, max_new_tokens=2)
    view = ex.attribution_view
    assert view.attribution is None  # nothing runs until the tab is opened
    titles = list(ex.tabs.titles)
    ex.tabs.selected_index = titles.index("DLA")
    assert view.wait(120) and view.error == ""
    first = ex.run[0].output_token_ids[0]
    assert view.attribution.answer == [first]
    assert float(view.attribution.total[0]) == pytest.approx(
        float(view.attribution.logit_diff[0]), rel=1e-4)
