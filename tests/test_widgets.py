"""Widgets driven from Python, on real results.

Views only draw, so they are handed real Runs built from plain tensors by
:mod:`vlens.testing`: set a trait, check the figure's data. What calls the
engine (the controller, the steering panel, the explorer) runs on the
bundled model (``toy_session``); the ``calls`` fixture records what they
asked the Session while the Session's own methods do the work. The browser
drives the same widgets in tests/test_browser.py, the notebooks in
tests/test_run_all.py.
"""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import vlens
from vlens.models import RECIPE
from vlens.lens import LogitLens
from vlens.models.world import sentiment_prompts
from vlens.plots import activation_values, token_set_metric
from vlens.testing import make_run, make_trace
from vlens.widgets import (
    ActivationView,
    CloneReadsToggle,
    Controller,
    LayerPicker,
    LogitLensView,
    Selection,
    SitePicker,
    SteeringPanel,
    TokenSpanPicker,
    explore,
)

N_LAYERS, HIDDEN = 4, 8
SITES = ["attn_out", "mlp_out", "resid_post", "resid_pre"]
WORDS = ["once", "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "."]
PROMPT_IDS, OUTPUT_IDS = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]  # 9 tokens read
PROMPT = "once upon a time, a sad duck lived in a green house near the farm."

engine = pytest.mark.engine


def words(ids) -> list[str]:
    return [WORDS[int(i)] for i in ids]


def random_trace(layers=range(N_LAYERS), *, seed=0, **kw):
    """A trace that read every site in full at ``layers``, with random values."""
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPT_IDS) + len(OUTPUT_IDS) - 1
    reads = {s: torch.randn(len(layers), n, HIDDEN, generator=g) for s in SITES}
    return make_trace(PROMPT_IDS, OUTPUT_IDS, reads=reads, layers=list(layers),
                      token_strings=words, prompt="the cat sat on", **kw)


@pytest.fixture
def run():
    return make_run([random_trace()])


@pytest.fixture
def offline_lens() -> LogitLens:
    g = torch.Generator().manual_seed(0)
    return LogitLens(torch.ones(HIDDEN), torch.randn(len(WORDS), HIDDEN, generator=g), 1e-6)


@pytest.fixture
def calls(toy_session, monkeypatch) -> list[dict]:
    """What the widgets ask the Session: one dict per top-level call (its
    ``name``, positional ``args`` and keywords); the real methods run."""
    log: list[dict] = []
    depth = [0]
    for name in ("trace", "direction", "compare", "stream_compare", "sweep"):
        real = getattr(toy_session, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if depth[0] == 0:  # direction traces inside: one call, not two
                log.append({"name": _name, "args": args, **kwargs})
            depth[0] += 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(toy_session, name, spy)
    return log


def calls_of(calls: list[dict], name: str) -> list[dict]:
    return [c for c in calls if c["name"] == name]


def _z(fig) -> list:
    """The raw values of an activation heatmap (the colours are per layer, log)."""
    return [list(row) for row in fig.data[0].customdata]


def _shape(fig, name: str):
    return next(s for s in fig.layout.shapes if s.name == name)


# -- pickers ------------------------------------------------------------------


def test_layer_picker_one_layer_and_range():
    one = LayerPicker(4, value=2)
    assert one.value == 2 and one.layers == [2]
    one._slider.value = 3  # as a drag in the browser would
    assert one.value == 3
    one.value = 1
    assert one._slider.value == 1
    rng = LayerPicker(6, value=(1, 3))
    assert rng.is_range and rng.layers == [1, 2, 3]
    rng._slider.value = (0, 5)
    assert rng.value == (0, 5)


def test_layer_picker_refuses_layers_that_do_not_exist():
    picker = LayerPicker(4, value=0)
    with pytest.raises(Exception, match="0..3"):
        picker.value = 4
    with pytest.raises(TypeError):
        LayerPicker(4, valu=1)


def test_site_picker():
    picker = SitePicker(SITES)
    assert picker.value == "resid_post" and list(picker.options) == SITES
    with pytest.raises(ValueError, match="mlp_in"):
        SitePicker(SITES, value="mlp_in")
    picker.value = "mlp_out"
    picker.set_sites(["mlp_out", "resid_pre"])  # a run that read other sites
    assert list(picker.options) == ["mlp_out", "resid_pre"] and picker.value == "mlp_out"
    picker.set_sites(["resid_pre", "resid_post"])
    assert picker.value == "resid_post"


def test_token_span_picker_selection_is_a_checked_span():
    picker = TokenSpanPicker(["a", "b", "c", "d"], n_prompt=3)
    assert picker.selection == (0, 0)
    picker.select(1)
    assert picker.selection == (1, 2)
    picker.select(1, 4)
    assert picker.selected_tokens == ["b", "c", "d"]
    with pytest.raises(Exception, match="does not fit"):
        picker.selection = (2, 5)
    picker.selection = [0, 2]  # what the browser sends: a list
    assert picker.selection == (0, 2)
    picker.tokens = ["x"]  # a shorter prompt drops a selection that no longer fits
    assert picker.selection == (0, 0)
    with pytest.raises(TypeError):
        TokenSpanPicker(["a"], selected=(0, 1))


def test_chips_with_roles_carry_a_key_to_their_colours(tmp_path):
    from vlens.widgets import snapshot_html

    picker = TokenSpanPicker(["<s>", "<user>", "hi", "<assistant>", "sure"], n_prompt=4)
    assert picker.legend == []  # a plain prompt: no roles, no key
    picker.roles = [None, None, "user", None, "generated"]
    assert picker.legend == [("role-user", "user"), ("role-none", "template (no role)"),
                             ("role-generated", "generated")]
    page = snapshot_html(picker)
    assert "chips by role:" in page and "<span class='vl-chip role-user'>user</span>" in page
    assert "vl-chip role-user' title='token 2'" in page  # the chip itself, coloured
    js = (Path(vlens.widgets.__file__).parent / "token_span.js").read_text()
    for cls, words in picker.legend:  # the live strip draws the same key
        assert f'["{cls}", "{words}"]' in js


def test_prompt_box_shows_a_conversation_as_messages():
    from vlens.widgets.prompt_box import box_prompt, box_text, prompt_box

    conv = [{"role": "system", "content": "You tell stories."},
            {"role": "user", "content": "A fox.\nBy the river."}]
    shown = box_text(conv)
    assert shown == "system: You tell stories.\nuser: A fox.\nBy the river."
    assert box_prompt(shown) == conv  # typed back, the same conversation
    assert box_prompt(json.dumps(conv)) == conv  # JSON still reads
    assert box_prompt("once upon a time") == "once upon a time"
    ids = {"prompt_token_ids": [1, 2]}
    assert box_prompt(box_text(ids)) == ids
    box = prompt_box(conv)
    assert box.value == shown and box.rows == 3


def test_token_span_picker_front_end_is_an_es_module_file():
    from pathlib import Path

    import vlens.widgets.token_span as module

    picker = TokenSpanPicker(["a"])
    js = Path(module.__file__).with_name("token_span.js")
    source = js.read_text()
    assert str(TokenSpanPicker._esm) == source  # anywidget loads the file beside it
    assert "export default" in source and "shiftKey" in source
    assert "innerHTML" not in source  # tokens go in as text, never markup
    assert "export default" in picker._esm  # synced to the browser as the module text


def test_selection_refuses_what_is_not_a_span_or_a_layer():
    sel = Selection()
    assert (sel.layer, sel.span, sel.site) == (0, (0, 0), "resid_post")
    sel.span = [2, 4]
    assert sel.span == (2, 4)
    with pytest.raises(Exception, match="start <= stop"):
        sel.span = (3, 1)
    with pytest.raises(Exception, match=">= 0"):
        sel.layer = -1


@engine
def test_clone_reads_toggle_switches_the_session_and_shows_bytes(toy_session, monkeypatch):
    monkeypatch.setattr(toy_session, "clone_reads", False)  # put back afterwards
    toggle = CloneReadsToggle(toy_session)
    assert toggle.value is False and "no run" in toggle._label.value
    toggle._button.value = True  # a click
    assert toy_session.clone_reads is True and toggle.value is True
    run = make_run([random_trace(copied_bytes=3000)])
    toggle.show_run(run)
    assert toggle.copied_bytes == run.copied_bytes > 0
    assert "KiB" in toggle._label.value or " B " in toggle._label.value
    toggle.value = False
    assert toy_session.clone_reads is False
    assert "next run: clone reads off" in toggle._label.value


# -- activation view ----------------------------------------------------------


def test_activation_view_draws_its_run_and_replots_on_every_change(run):
    view = ActivationView(run, layer=1)
    t = run[0]
    heat = view.heatmap.data[0]
    assert list(heat.x) == [f"{i}:{tok}" for i, tok in enumerate(t.tokens)]
    assert list(heat.y) == [f"layer {x}" for x in range(N_LAYERS)]
    assert torch.allclose(torch.tensor(_z(view.heatmap)),
                          t.activations("resid_post").norm(dim=-1))
    assert _shape(view.heatmap, "layer").y0 == 0.5  # row 1 outlined
    strip_before = view.strip.data[0].z

    view.layer = 3
    assert _shape(view.heatmap, "layer").y0 == 2.5
    assert view.strip.data[0].z != strip_before
    assert view.layer_picker.value == 3  # picker follows the selection …
    view.layer_picker.value = 2  # … and the selection follows the picker
    assert view.layer == 2 and view.selection.layer == 2

    before = _z(view.heatmap)
    view.site = "mlp_out"
    assert _z(view.heatmap) != before
    assert torch.allclose(torch.tensor(_z(view.heatmap)),
                          t.activations("mlp_out").norm(dim=-1))
    view.quantity = "neuron"
    view.neuron = 5
    assert torch.allclose(torch.tensor(_z(view.heatmap)), t.activations("mlp_out")[..., 5])
    view.span = (1, 3)
    span = _shape(view.heatmap, "span")
    assert (span.x0, span.x1) == (0.5, 2.5)
    assert view.run is run and view.error == ""


def test_activation_view_colours_every_layer_and_can_share_one_scale(run):
    from vlens.plots import colour_values

    view = ActivationView(run)
    norms = run[0].activations("resid_post").norm(dim=-1)
    colours = torch.tensor([list(r) for r in view.heatmap.data[0].z])
    assert (view.per_layer, view.log) == (True, True)  # the default for norms
    assert torch.allclose(colours, colour_values(norms)[0], atol=1e-6)
    assert colours.amax(1).tolist() == [1.0] * N_LAYERS  # every layer reaches its top colour
    view._per_layer.value = False  # the checkboxes, as clicked
    view._log.value = False
    colours = torch.tensor([list(r) for r in view.heatmap.data[0].z])
    assert torch.allclose(colours, norms) and torch.allclose(torch.tensor(_z(view.heatmap)), norms)
    assert ActivationView(run, quantity="neuron").log is False  # signed values: linear


def test_activation_view_shows_a_callback_error_and_keeps_working(run):
    view = ActivationView(run)
    z_norm = _z(view.heatmap)
    view.quantity = "cosine"  # no direction yet: shown, not raised
    assert "direction" in view.error and view._error_label.value == view.error
    assert view._details.layout.display == ""
    assert _z(view.heatmap) == z_norm  # the last good figure stays
    d = torch.randn(HIDDEN)
    view.direction = d
    assert view.error == "" and view._details.layout.display == "none"
    expected = activation_values(run[0].activations("resid_post"), "cosine", direction=d)
    assert torch.allclose(torch.tensor(_z(view.heatmap)), expected, atol=1e-6)


def test_activation_view_of_a_run_that_read_some_layers():
    run = make_run([random_trace(layers=[0, 2])])
    view = ActivationView(run, layer=2)
    assert list(view.heatmap.data[0].y) == ["layer 0", "layer 2"]
    view.layer = 1  # not read: an error in the widget, not an exception
    assert "was not read" in view.error


def test_activation_view_follows_a_new_run(run):
    view = ActivationView(run, site="mlp_out")
    view.span = (2, 9)
    shorter = make_trace([0, 1], [2, 3], reads={"resid_post": torch.randn(N_LAYERS, 3, HIDDEN)},
                         token_strings=words)
    view.run = make_run([shorter])
    assert view.span == (0, 0)  # the old span does not fit the new tokens
    assert view.site == "resid_post" and list(view.site_picker.options) == ["resid_post"]
    assert list(view.heatmap.data[0].x) == ["0:once", "1:the", "2:cat"]
    assert view.error == ""


def test_views_of_one_selection_move_together(run, offline_lens):
    sel = Selection(layer=1)
    a = ActivationView(run, selection=sel)
    b = ActivationView(run, selection=sel, site="attn_out")
    lens_view = LogitLensView(run, selection=sel, token_strings=words, offline_lens=offline_lens)
    assert a.site == b.site == "attn_out"  # one site for all
    a.layer_picker.value = 3
    assert b.layer == 3 and b.layer_picker.value == 3
    assert _shape(b.heatmap, "layer").y0 == 2.5
    grid = lens_view.figure.data
    sel.span = (2, 4)
    for fig in (a.heatmap, b.heatmap):
        assert (_shape(fig, "span").x0, _shape(fig, "span").x1) == (1.5, 3.5)
    assert (_shape(lens_view.figure, "span").y0, _shape(lens_view.figure, "span").y1) == (
        1.5, 3.5)  # the lens has tokens down
    # the lens grid was not built again for a span: the outline moved, on the page too
    assert all(x is y for x, y in zip(lens_view.figure.data, grid, strict=True))
    shown = json.loads(lens_view.figure.figure_json)
    (span,) = [x for x in shown["layout"]["shapes"] if x["name"] == "span"]
    assert (span["y0"], span["y1"]) == (1.5, 3.5) and len(shown["data"]) == len(grid)


@engine
def test_widgets_refuse_misspelled_keywords(run, toy_session, calls):
    for make in (
        lambda: ActivationView(run, layers=2),
        lambda: LogitLensView(run, token_strings=words, layer=1),
        lambda: SteeringPanel(toy_session, PROMPT, scal=2.0),
        lambda: CloneReadsToggle(toy_session, value=True),
        lambda: explore(toy_session, PROMPT, max_tokens=3),
    ):
        with pytest.raises(TypeError):
            make()
    assert calls == []


# -- logit lens ---------------------------------------------------------------


def _cells(fig) -> torch.Tensor:
    """A lens figure's ``z`` back in ``[layers, tokens]`` order (NaN for gaps)."""
    return torch.tensor([[math.nan if v is None else v for v in row]
                         for row in fig.data[0].z]).T


def test_logit_lens_view_lenses_full_activations_offline(run, offline_lens):
    view = LogitLensView(run, token_strings=words, offline_lens=offline_lens)
    t = run[0]
    ids, probs = offline_lens.top(t.activations("resid_post"), k=5)
    heat = view.figure.data[0]
    assert list(heat.x) == [f"layer {x}" for x in range(N_LAYERS)]  # layers across
    assert list(heat.y) == [f"{i}:{tok}" for i, tok in enumerate(t.tokens)]  # tokens down
    assert [list(r) for r in heat.text] == [list(c) for c in
                                            zip(*[words(row) for row in ids[..., 0].tolist()])]
    assert torch.allclose(_cells(view.figure), probs[..., 0])
    assert heat.customdata[0][0].count("<br>") == 4  # the hover lists the top 5
    view.layer_range = (1, 2)
    assert list(view.figure.data[0].x) == ["layer 1", "layer 2"]
    view.span = (0, 2)
    assert _shape(view.figure, "span").y1 == 1.5


def test_logit_lens_view_tracks_one_token_exactly_with_the_offline_lens(run, offline_lens):
    view = LogitLensView(run, token_strings=words, offline_lens=offline_lens)
    acts = run[0].activations("resid_post")
    full = offline_lens.logits(acts).softmax(-1)  # [L, T, vocab]
    view.track_word("dog")  # a word of the run: no tokenizer needed
    assert view.mode == "track" and view.track == WORDS.index("dog")
    assert view.track_source == "exact" and "exact" in view._note.value
    assert torch.allclose(_cells(view.figure), full[..., WORDS.index("dog")], atol=1e-6)
    view.track_quantity = "rank"
    rank = (full > full[..., WORDS.index("dog"), None]).sum(-1) + 1
    heat = view.figure.data[0]
    assert [list(r) for r in heat.text] == [[f"#{int(v)}" for v in col] for col in rank.T]
    view.mode = "top"  # back to the grid, the tracked token kept
    assert view.figure.data[0].colorbar.title.text == "p(top)" and view.track == 8
    from plotly.callbacks import Points

    # a click on the cell of token 2, layer 1 (plotly gives heatmap points as [row, col])
    view._on_click(view.figure.data[0], Points(point_inds=[[2, 1]]), None)
    ids, _ = offline_lens.top(acts, k=1)
    assert view.mode == "track" and view.track == int(ids[1, 2, 0])


def _with_worker_lens(lens: LogitLens, k: int = 3):
    """A trace that read ``resid_post`` in full and, as the worker would have
    computed it, ``lens``'s top ``k`` of the same rows."""
    acts = random_trace().activations("resid_post")
    ids, probs = lens.top(acts, k=k)
    return make_run([make_trace(
        PROMPT_IDS, OUTPUT_IDS, token_strings=words, layers=list(range(N_LAYERS)),
        reads={"resid_post": acts, "resid_post:logit_lens": (ids, probs)})]), acts


def test_logit_lens_view_tracks_exactly_from_the_worker_top_k_without_the_vocabulary(
        offline_lens, monkeypatch):
    run, acts = _with_worker_lens(offline_lens)
    full = offline_lens.logits(acts).softmax(-1)
    view = LogitLensView(run, token_strings=words, offline_lens=offline_lens)
    drawn = view.figure.data[0]
    view.track = WORDS.index("far")  # a click sets the token, then the mode
    assert view.figure.data[0] is drawn  # the top-token grid was not drawn again for it
    whole = []  # whole-vocabulary logits computed from here on
    monkeypatch.setattr(offline_lens, "logits", lambda r: whole.append(r) or LogitLens.logits(
        offline_lens, r))
    view.mode = "track"
    assert view.track_source == "exact" and whole == []
    assert torch.allclose(_cells(view.figure), full[..., WORDS.index("far")], atol=1e-6)
    assert view.tracked_values(WORDS.index("far"), rank=False)[2] is None  # not needed yet
    view.track_quantity = "rank"  # the rank needs every logit: computed now, exactly
    rank = (full > full[..., WORDS.index("far"), None]).sum(-1) + 1
    assert whole and [list(r) for r in view.figure.data[0].text] == [
        [f"#{int(v)}" for v in col] for col in rank.T]


def test_logit_lens_view_computes_the_whole_vocabulary_when_the_top_k_is_another_lens(
        offline_lens):
    other = LogitLens(torch.ones(HIDDEN), offline_lens.unembed * 1.5, 1e-6)  # a logit scale
    run, acts = _with_worker_lens(other)
    assert offline_lens.logsumexp_from_top(acts, *other.top(acts, k=3)) is None
    assert other.logsumexp_from_top(acts, *other.top(acts, k=3)) is not None
    assert offline_lens.logsumexp_from_top(acts, *offline_lens.top(acts, k=1)) is None  # k=1
    view = LogitLensView(run, token_strings=words, offline_lens=offline_lens)
    view.track_word("dog")
    full = offline_lens.logits(acts).softmax(-1)[..., WORDS.index("dog")]
    assert view.track_source == "exact"
    assert torch.allclose(_cells(view.figure), full, atol=1e-6)  # the offline lens's own


def test_logit_lens_view_shows_the_worker_read_and_tracks_within_its_top_k():
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(len(WORDS), generator=g)[:3] for _ in range(2 * 9)])
    ids = ids.reshape(2, 9, 3)
    probs = torch.rand(2, 9, 3, generator=g).sort(-1, descending=True).values
    t = make_trace(PROMPT_IDS, OUTPUT_IDS, reads={"resid_post:logit_lens": (ids, probs)},
                   layers=[1, 3], token_strings=words)
    view = LogitLensView(make_run([t]), token_strings=words, n_layers=N_LAYERS)
    heat = view.figure.data[0]
    assert list(heat.x) == ["layer 1", "layer 3"]
    assert [list(r) for r in heat.text] == [list(c) for c in
                                            zip(*[words(row) for row in ids[..., 0].tolist()])]
    assert torch.allclose(_cells(view.figure), probs[..., 0])
    # tracking: the probability where the token is in the top 3, "–" elsewhere
    target = int(ids[1, 4, 1])
    view.track = target
    view.mode = "track"
    assert view.track_source == "top-3" and "top-3 read only" in view._note.value
    got = _cells(view.figure)
    hit = ids == target
    assert torch.equal(~torch.isnan(got), hit.any(-1))
    assert torch.allclose(got[hit.any(-1)], probs[hit])
    assert "–" in [x for row in view.figure.data[0].text for x in row]
    view.layer_range = (0, 0)  # nothing read there
    assert "no layer in 0..0" in view.error
    plain = make_run([make_trace([0, 1], [2], reads={"mlp_out": torch.zeros(1, 2, HIDDEN)})])
    view.run = plain
    assert "logit_lens=5" in view.error
    with pytest.raises(ValueError, match="tokenize="):
        LogitLensView(make_run([t]), token_strings=words).track_word("zebra")


# -- controller ---------------------------------------------------------------


@engine
def test_controller_traces_every_site_and_layer_with_the_lens(toy_session, calls):
    controller = Controller(toy_session, max_new_tokens=5)
    seen = []
    run = controller.trace(PROMPT, progress=lambda done, total: seen.append((done, total)))
    (call,) = calls
    assert call["name"] == "trace" and call["args"] == ([PROMPT],)
    # every site but the per-head q, k, v, z (no view shows them; the pattern is read)
    wanted = [x for x in toy_session.sites if x not in ("q", "k", "v", "z")]
    assert "attn_pattern" in wanted and len(wanted) == len(toy_session.sites) - 4
    assert call["sites"] == wanted and call["layers"] is None
    assert call["logit_lens"] == 5 and call["max_new_tokens"] == 5
    assert controller.run is run and seen[-1] == (1, 1)
    assert set(run[0].read_keys) == set(wanted) | {"resid_post:logit_lens"}
    assert controller.prompt_tokens(PROMPT) == toy_session.token_strings(
        toy_session.tokenize(PROMPT))
    assert controller.prompt_tokens("  ") == []


# -- steering panel -----------------------------------------------------------

HAPPY, SAD = sentiment_prompts(2)


def _panel(session, **kw) -> SteeringPanel:
    kw.setdefault("positive", HAPPY)
    kw.setdefault("negative", SAD)
    return SteeringPanel(session, PROMPT, layer=2, max_new_tokens=6, **kw)


@engine
def test_steering_panel_run_calls_direction_then_compare(toy_session, calls):
    panel = _panel(toy_session)
    assert calls == []  # nothing runs until asked
    panel._run_button.click()  # starts the run in the background
    assert panel.wait(120)
    assert panel.error == ""
    assert [c["name"] for c in calls] == ["direction", "stream_compare"]
    d = calls[0]
    assert (d["positive"], d["negative"], d["layer"], d["site"]) == (HAPPY, SAD, 2, "resid_post")
    c = calls[1]
    st = c["steer"]
    assert isinstance(st, vlens.Steer)
    assert (st.layer, st.scale, st.site, st.span, st.relative) == (
        2, RECIPE["scale"], "resid_post", "all", True)  # the bundled model's recipe, at the layer asked
    assert c["args"] == ([PROMPT],) and c["max_new_tokens"] == 6
    bars = panel.comparison_figure.data[0]
    frame = panel.comparison.to_frame()
    assert list(bars.x) == frame["position"].tolist()
    expected = (frame["logprob_steered"] - frame["logprob_base"]).tolist()
    assert list(bars.y) == pytest.approx(expected)
    assert panel.live_texts == panel.comparison.texts[0]
    assert "baseline" in panel._texts.value and "steered" in panel._texts.value


@engine
def test_steering_panel_streams_and_ends_with_what_compare_gives(toy_session):
    panel = _panel(toy_session)
    seen: list[str] = []
    panel.observe(lambda change: seen.append(change["new"]), names="live_texts")
    panel.run_comparison()
    assert panel.error == "" and panel.streamed_states >= 3
    assert len(set(seen[:-1])) >= 3  # the texts grew, visibly, before the end
    ref = toy_session.compare([PROMPT], steer=panel.steer(), max_new_tokens=6)
    assert panel.comparison.texts == ref.texts
    assert seen[-1] == ref.texts[0] == panel.live_texts


@engine
def test_steering_panel_scale_reruns_with_a_cached_direction(toy_session, calls):
    panel = _panel(toy_session)
    panel.run_comparison()
    bars_before = list(panel.comparison_figure.data[0].y)
    panel._scale.value = -1.0  # the slider, released: a run in the background
    assert panel.scale == -1.0 and panel.wait(120)
    assert [c["steer"].scale for c in calls_of(calls, "stream_compare")] == [RECIPE["scale"], -1.0]
    assert len(calls_of(calls, "direction")) == 1  # reused
    assert list(panel.comparison_figure.data[0].y) != bars_before
    panel.layer = 1  # a new layer needs a new direction
    panel.run_comparison()
    assert [c["layer"] for c in calls_of(calls, "direction")] == [2, 1]


@engine
def test_steering_panel_span_from_token_chips(toy_session, calls):
    panel = _panel(toy_session)
    assert panel.span_picker.tokens == toy_session.token_strings(toy_session.tokenize(PROMPT))
    panel.span_picker.selection = (1, 3)  # a click and a shift-click
    assert panel.span == (1, 3) and panel.span_mode == "selection"
    panel.run_comparison()
    assert calls_of(calls, "stream_compare")[-1]["steer"].span == (1, 3)
    panel.span_picker.clear()
    assert panel.span_mode == "all"
    panel.span_mode = "generated"
    panel.run_comparison()
    assert calls_of(calls, "stream_compare")[-1]["steer"].span == "generated"


@engine
def test_steering_panel_sweep_and_metric(toy_session, calls):
    panel = _panel(toy_session, scales=(-4, 0, 4, 8), token_set="happy merry")
    panel._sweep_button.click()
    assert panel.wait(120) and panel.error == ""
    (sw,) = calls_of(calls, "sweep")
    assert sw["scales"] == [-4, 0, 4, 8] and sw["args"] == (PROMPT,)
    frame = panel.sweep_result.to_frame()
    line = panel.dose_figure.data[0]
    assert list(line.x) == [-4, 0, 4, 8]
    assert list(line.y) == pytest.approx(frame["kl_mean"].tolist(), nan_ok=True)
    assert "p_token_set" in panel._metric.options
    ids = [toy_session.tokenize(w)[-1] for w in ("happy", "merry")]
    assert panel._sweep_frame["p_token_set"].tolist() == token_set_metric(panel.sweep_result, ids)
    panel.metric = "mean_logprob"
    assert list(panel.dose_figure.data[0].y) == pytest.approx(frame["mean_logprob"].tolist())
    assert panel.dose_figure.layout.yaxis.title.text == "mean_logprob"
    assert len(calls_of(calls, "sweep")) == 1  # a metric change re-plots only


@engine
def test_steering_panel_errors_are_shown(toy_session, calls):
    panel = SteeringPanel(toy_session, PROMPT)
    panel._positive.value = ""  # the recipe's lists, cleared
    panel._run_button.click()
    assert panel.wait(120) and "positive" in panel.error  # no prompt lists
    panel.source = "vector"
    panel._run_button.click()
    assert panel.wait(120) and "vector" in panel.error
    hidden = toy_session.hidden_size
    panel.vector = torch.ones(hidden) * 2
    assert f"norm {2 * math.sqrt(hidden):.3g}" in panel._vector_label.value
    panel._run_button.click()
    assert panel.wait(120) and panel.error == ""
    sent = calls_of(calls, "stream_compare")[-1]["steer"]
    assert sent.relative  # the recipe's default: the vector's direction, |x| sets the size
    assert torch.allclose(sent.vector, panel.vector / panel.vector.norm())
    panel.vector = torch.ones(hidden + 1)  # from another model
    panel._sweep_button.click()
    assert panel.wait(120) and "hidden size" in panel.error and not panel.busy
    assert not panel._run_button.disabled and not panel._sweep_button.disabled


@engine
def test_engine_runs_show_progress(toy_session, calls):
    panel = _panel(toy_session, scales=(0, 2, 4))
    seen = []
    panel._progress.observe(lambda c: seen.append((c["new"], panel._progress.max)),
                            names="value")
    shown = []
    panel._progress_row.layout.observe(lambda c: shown.append(c["new"]), names="display")
    panel.sweep()
    assert (3, 3) in seen  # the bar reached the end of the sweep's 3 requests
    assert shown[0] == "" and shown[-1] == "none"  # shown while running, hidden after
    assert calls_of(calls, "trace") == []
    explore(toy_session, PROMPT, max_new_tokens=2)
    assert callable(calls_of(calls, "trace")[0]["progress"])


@engine
def test_steering_panel_loads_a_saved_vector(toy_session, tmp_path):
    hidden = toy_session.hidden_size
    path = tmp_path / "v.pt"
    torch.save(torch.arange(hidden, dtype=torch.float32), path)
    panel = SteeringPanel(toy_session, PROMPT)
    panel._path.value = str(path)
    panel._load.click()
    assert panel.source == "vector" and torch.equal(panel.vector, torch.arange(float(hidden)))
    assert panel._lists.layout.display == "none"


@engine
def test_steering_panel_defaults_flip_the_sad_example_on_the_bundled_model(toy_session, calls):
    from vlens.models.recipes import toyworld_recipe
    from vlens.models.world import sentiment_of

    recipe = toyworld_recipe()
    panel = SteeringPanel(toy_session)  # nothing set: the model's own recipe
    assert panel.prompt == recipe.example and "recipe" in panel._note.value
    assert (panel.layer, panel.scale, panel.relative) == (recipe.layer, recipe.scale, True)
    assert panel.positive == list(recipe.positive) and panel.negative == list(recipe.negative)
    panel._run_button.click()  # the first click
    assert panel.wait(120) and panel.error == ""
    (cmp,) = calls_of(calls, "stream_compare")
    assert cmp["max_new_tokens"] == recipe.max_new_tokens
    base, steered = panel.comparison.texts[0]
    assert sentiment_of(base) == recipe.example_from, base
    assert sentiment_of(steered) == recipe.example_to, steered


def test_recipe_is_only_for_the_bundled_model(tmp_path):
    from vlens.models import recipes, toyworld_path

    assert recipes.is_toyworld(toyworld_path()) and recipes.is_toyworld(None)
    assert not recipes.is_toyworld(tmp_path)
    r = recipes.toyworld_recipe()
    assert r.scale in r.scales and 0.0 in r.scales and len(r.positive) == len(r.negative) > 0
    assert r.example in r.held_out(r.example_from, 1)


# -- snapshots ----------------------------------------------------------------


def _plots_in(page: str) -> int:
    return page.count("Plotly.newPlot(")


def test_snapshot_of_a_view_is_one_self_contained_page(run, offline_lens, tmp_path):
    from vlens.widgets import save_snapshot, snapshot_html

    view = ActivationView(run, layer=2)
    view.span = (1, 3)
    path = view.snapshot(tmp_path / "activations.html")
    page = path.read_text()
    assert page.startswith("<!doctype html>") and "<script src=" not in page  # nothing fetched
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js inline
    assert _plots_in(page) == 2  # the heatmap and the token strip
    assert "layer: <b>2</b>" in page and "each layer its own colours: <b>on</b>" in page
    assert "resid_post: norm by layer and token" in page  # the figure's title, as drawn
    lens = LogitLensView(run, token_strings=words, offline_lens=offline_lens)
    page = snapshot_html(lens, title="the lens & more")
    assert "<title>the lens &amp; more</title>" in page and _plots_in(page) == 1
    assert "track a token" not in page and "top token" in page  # the mode on screen
    picker = TokenSpanPicker(["<s>", "a", "b"], n_prompt=2, selection=(1, 2))
    chips = snapshot_html(picker)
    assert "&lt;s&gt;" in chips and "vl-chip selected" in chips and "vl-chip generated" in chips
    assert save_snapshot(picker, tmp_path / "chips.html").exists()


# -- explorer -----------------------------------------------------------------


@engine
def test_explore_shares_one_selection(toy_session, calls):
    ex = explore(toy_session, PROMPT, max_new_tokens=4, positive=HAPPY, negative=SAD)
    assert len(calls_of(calls, "trace")) == 1  # one trace feeds every view
    assert ex.error == "" and ex.activation_view.error == "" and ex.logit_lens_view.error == ""
    t = ex.run[0]
    assert ex.span_picker.tokens == t.tokens
    assert ex.span_picker.n_prompt == len(t.prompt_token_ids)
    assert ex.activation_view.run is ex.run and ex.logit_lens_view.run is ex.run
    ids, probs = t.logit_lens("resid_post")  # the lens read in the worker, shown
    lens_grid = ex.logit_lens_view.figure.data[0]
    assert [list(r) for r in lens_grid.text] == [
        list(c) for c in zip(*[toy_session.token_strings(row) for row in ids[..., 0].tolist()])]
    assert torch.allclose(_cells(ex.logit_lens_view.figure), probs[..., 0])

    ex.activation_view.layer_picker.value = 1  # one picker moves every view
    assert ex.layer == 1 and ex.logit_lens_view.layer == 1
    assert _shape(ex.activation_view.heatmap, "layer").y0 == 0.5
    # but not the steering panel: its layer is its own (the recipe's)
    assert ex.steering_panel.layer == ex.steering_panel.layer_picker.value == RECIPE["layer"]

    ex.span_picker.selection = (2, 5)  # clicks on the explorer's chips
    for view in (ex.activation_view, ex.logit_lens_view, ex.steering_panel):
        assert view.span == (2, 5)
    assert _shape(ex.activation_view.heatmap, "span").x0 == 1.5
    assert _shape(ex.logit_lens_view.figure, "span").y1 == 4.5

    ex.steering_panel.span_mode = "selection"  # the chips steer once picked in the panel
    ex.steering_panel.run_comparison()
    assert calls_of(calls, "stream_compare")[-1]["steer"].span == (2, 5)
    assert calls_of(calls, "stream_compare")[-1]["steer"].layer == RECIPE["layer"]
    assert ex.clone_reads_toggle.copied_bytes == ex.steering_panel.comparison.steered.copied_bytes
    assert len(calls_of(calls, "trace")) == 1


@engine
def test_explorer_tracks_exactly_from_the_engine_lens_top_k(toy_session):
    ex = explore(toy_session, PROMPT, max_new_tokens=4)
    view, t = ex.logit_lens_view, ex.logit_lens_view.run[0]
    acts, lens = t.activations("resid_post"), view.offline_lens
    # the worker's lens and the checkpoint's agree: each row's log-sum-exp follows
    lse = lens.logsumexp_from_top(acts, *t.logit_lens("resid_post"))
    assert lse is not None and torch.allclose(lse, lens.logits(acts).logsumexp(-1), atol=1e-4)
    token = view.track_word("happy")
    assert view.tracked_values(token, rank=False)[2] is None  # no whole-vocabulary pass
    full = lens.logits(acts).softmax(-1)[..., token]
    assert view.track_source == "exact"
    assert torch.allclose(_cells(view.figure), full, atol=1e-5)


@engine
def test_explorer_snapshot_has_every_tab_and_needs_no_engine(toy_session, calls, tmp_path):
    ex = explore(toy_session, PROMPT, max_new_tokens=4)
    ex.logit_lens_view.track_word("happy")  # exact, from the checkpoint's lens
    assert ex.logit_lens_view.track_source == "exact"
    ex.steering_panel.run_comparison()
    n_calls = len(calls)
    page = ex.snapshot(tmp_path / "ex.html").read_text()
    assert len(calls) == n_calls  # saving draws what is there, it runs nothing
    for title in ("activations", "logit lens", "attention", "steering"):
        assert f"<h3>{title}" in page
    assert "(the tab on screen)" in page
    # heatmap + strip, the tracked lens, the head grid + one head + one token's
    # row and column, the comparison (the sweep never ran)
    assert _plots_in(page) == 7
    baseline, steered = ex.steering_panel.live_texts
    assert "<b>baseline</b>" in page and "<b>steered</b>" in page
    assert html.escape(baseline) in page and html.escape(steered) in page
    assert page.count("vl-chip") >= ex.run[0].n_tokens


@engine
def test_explorer_trace_button_retraces(toy_session, calls):
    ex = explore(toy_session, PROMPT, max_new_tokens=3)
    ex.span_picker.selection = (0, 2)
    longer = PROMPT + " the sky was grey and the wind was cold."
    ex._prompt.value = longer
    ex._trace_button.click()
    assert ex.wait(120)
    assert [c["args"] for c in calls_of(calls, "trace")] == [([PROMPT],), ([longer],)]
    assert ex.span == (0, 0)
    assert len(ex.span_picker.tokens) == ex.run[0].n_tokens
    assert ex.steering_panel.prompt == longer


@engine
def test_explorer_shows_an_engine_error_and_keeps_working(toy_session):
    ex = explore(toy_session, "   ", max_new_tokens=2)
    assert "prompt 0 is empty" in ex.error and ex.run is None
    ex._prompt.value = PROMPT
    ex._trace_button.click()  # the button works after the failure
    assert ex.wait(120) and ex.error == "" and ex.run is not None
    assert ex.busy is False and ex._progress_row.layout.display == "none"


def test_import_vlens_does_not_load_widget_libraries():
    code = (
        "import sys, vlens\n"
        "heavy = [m for m in ('ipywidgets', 'anywidget', 'plotly', 'vlens.widgets', 'vllm')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert vlens.explore is explore  # reached lazily, from the widgets package


@engine
def test_explore_has_an_attention_tab_fed_by_its_one_trace(toy_session, calls):
    ex = explore(toy_session, PROMPT, max_new_tokens=2)
    assert "attention" in ex.tabs.titles and ex.attention_view.run is ex.run
    (call,) = calls_of(calls, "trace")
    assert "attn_pattern" in call["sites"]
    assert not {"q", "k", "v", "z"} & set(call["sites"])  # nothing no view shows
    assert "attn_pattern" not in ex.activation_view.site_picker.options
    ex.activation_view.layer_picker.value = 2  # the shared layer moves the attention view
    assert ex.attention_view.layer == 2
    assert ex.attention_view.heatmap.layout.title.text == "layer 2, head 0"
    assert ex.error == "" and ex.attention_view.error == ""


# -- feature view -------------------------------------------------------------


def test_contexts_html_tints_each_token_and_escapes_it():
    import pandas as pd

    from vlens.widgets.features import contexts_html

    frame = pd.DataFrame([{"prompt": 2, "position": 5, "activation": 4.0, "start": 4,
                           "tokens": ["<s>", " cat"], "values": [1.0, 4.0]}])
    page = contexts_html(frame, 4.0)
    assert "&lt;s&gt;" in page and "<s>" not in page
    assert "> cat</span>" in page  # a token's own space, as the text reads (not "\u00b7cat")
    assert "rgba(255,127,14,0.250)" in page and "rgba(255,127,14,1.000)" in page
    assert page.count("outline") == 1 and "token 5: 4" in page  # the strongest, outlined
    assert "fires on none" in contexts_html(frame.iloc[:0], 0.0, "feature 3")


def _stories(n: int) -> list[str]:
    import itertools

    from vlens.models import world

    return [st.text for st in itertools.islice(world.story_stream(5, held_out=True), n)]


@engine
def test_feature_view_token_feature_steer_and_clamp(toy_session, tmp_path):
    from vlens.models import toyworld_sae_path, world
    from vlens.widgets import FeatureView

    s, sae = toy_session, vlens.SAE.load(toyworld_sae_path())
    measured = json.loads((toyworld_sae_path() / "measured.json").read_text())
    happy, clamp = measured["features"]["mood=happy"]["feature"], measured["clamp"]["value"]
    stories, sad = _stories(6), world.steering_prompts(world.SAD, 1)[0]
    fv = vlens.FeatureView(s, sae, stories, prompt=sad, max_new_tokens=12,
                           labels={happy: "mood=happy"})
    assert isinstance(fv, FeatureView) and fv.error == "" and fv.feature == -1
    # the same features, read another way: the site's rows, encoded on the client
    rows = s.trace(stories, sites=[sae.site], layers=[sae.layer], max_new_tokens=1)
    enc = [sae.encode(t.activations(sae.site)[0]) for t in rows]
    assert fv.chips.tokens == rows[0].tokens

    fv.chips.select(8)  # as a click on chip 8 would
    assert fv.token == 8 and fv.feature_buttons.value is None
    want = enc[0][8].topk(fv.k)
    got = fv.token_features()
    assert got["feature"].tolist() == want.indices.tolist()
    assert torch.allclose(torch.tensor(got["activation"].tolist()), want.values, atol=1e-3)
    assert [v for _, v in fv.feature_buttons.options] == want.indices.tolist()

    top = int(want.indices[0])
    fv.feature_buttons.value = top  # a click on the token's strongest feature
    assert fv.feature == top and fv.error == ""
    column = [e[:, top] for e in enc]
    best = max(range(len(column)), key=lambda p: float(column[p].max()))
    ctx = fv.contexts()
    assert ctx["prompt"].iloc[0] == best and ctx["position"].iloc[0] == int(column[best].argmax())
    assert abs(ctx["activation"].iloc[0] - float(column[best].max())) < 1e-3
    n_on = sum(int((c > 0).sum()) for c in column)
    assert f"fires on {n_on} of" in fv.histogram.layout.title.text
    assert len(fv.histogram.data[0].x) == n_on and _shape(fv.histogram, "token").x0 > 0
    assert f"token {int(ctx['position'].iloc[0])}:" in fv._contexts.value
    assert max(fv.chips.shade) <= 1 and fv.chips.shade[8] > 0  # chips tinted by the feature
    lens = LogitLens.from_pretrained(s.model)
    logits = lens.unembed @ (sae.decoder(top) * lens.norm_weight)
    frame = fv.logits()
    assert frame[frame.kind == "promoted"]["token_id"].tolist() == logits.topk(10).indices.tolist()
    assert frame[frame.kind == "suppressed"]["token_id"].tolist() == \
        (-logits).topk(10).indices.tolist()
    assert list(fv.logit_figure.data[0].y)[0] == s.token_strings([int(logits.argmax())])[0]

    # steer with the happy feature, streamed: what compare gives for the same Steer
    fv.feature = happy
    assert fv.feature_buttons.value is None and "mood=happy" in fv._header.value
    fv._run_button.click()
    assert fv.wait(120) and fv.error == "" and fv.streamed_states >= 3
    ref = s.compare(sad, steer=vlens.Steer(sae.decoder(happy), sae.layer,
                                           measured["steer"]["scale"], sae.site,
                                           relative=True), max_new_tokens=12)
    assert fv.comparison.texts == ref.texts and fv.live_texts == tuple(ref.texts[0])
    assert fv.live_texts[0] != fv.live_texts[1]
    assert "steered" in fv._texts.value

    fv.mode = "clamp"  # the feature set to a value: a vlens.Clamp
    assert fv._value.layout.display == "" and fv._scale.layout.display == "none"
    # the clamp starts at the value measured.json records (the view's recipe)
    assert fv.mean_norm > 0
    assert fv.value == measured["clamp"]["value"]
    fv.value = clamp
    fv.run_comparison()
    ref = s.compare(sad, clamp=vlens.Clamp(sae, feature=happy, value=clamp), max_new_tokens=12)
    assert fv.comparison.texts == ref.texts and "clamped" in fv._texts.value

    page = fv.snapshot(tmp_path / "features.html").read_text()
    assert _plots_in(page) == 2  # the histogram and the promoted tokens
    assert "mood=happy" in page and "vlens-context" in page and "clamped" in page

    # bad input: a clear VlensError, and a click that cannot run says why
    with pytest.raises(vlens.VlensError, match=r"feature must be in \[0, 1024\)"):
        fv.feature = 1024
    fv.feature = -1
    fv._run_button.click()
    assert fv.wait(120) and "pick a feature first" in fv.error
    with pytest.raises(vlens.VlensError, match="needs a vlens.SAE"):
        vlens.FeatureView(s, "path/to/sae", stories)
    with pytest.raises(vlens.VlensError, match="needs prompts"):
        vlens.FeatureView(s, sae, [])


@engine
def test_feature_view_draws_its_contexts_from_a_harvest(toy_session, tmp_path):
    """``harvest=``: the contexts, histogram and count come from the
    harvest's texts, encoded on the client (each text's first token aside),
    with the tokens the tokenizer gives them."""
    from vlens.models import toyworld_sae_path

    s, sae = toy_session, vlens.SAE.load(toyworld_sae_path())
    texts = _stories(8)
    h = s.harvest(texts, layers=[sae.layer], sites=[sae.site], out=tmp_path / "h",
                  shard_tokens=64)
    fv = vlens.FeatureView(s, sae, texts[:2], harvest=h, feature=0)
    assert fv.harvest is h and fv.error == ""
    column = sae.encode(h.read(sae.site, sae.layer))[:, 0]
    for start, _ in h.spans:
        column[start] = 0
    per_text = [column[a:b] for a, b in h.spans]
    best = max(range(len(texts)), key=lambda t: float(per_text[t].max()))
    ctx = fv.contexts()
    assert ctx["prompt"].iloc[0] == best
    assert ctx["position"].iloc[0] == int(per_text[best].argmax())
    assert abs(ctx["activation"].iloc[0] - float(per_text[best].max())) < 1e-3
    a, b = h.spans[best]
    strings = s.token_strings(h.token_ids[a:b].tolist())
    assert ctx["tokens"].iloc[0] == strings[ctx["start"].iloc[0]:][:len(ctx["tokens"].iloc[0])]
    n_on = int((column > 0).sum())
    assert f"fires on {n_on} of {len(h)} tokens of {len(texts)} texts" in fv._header.value
    assert "text " in fv._contexts.value


def test_contexts_keep_a_byte_level_vocabularys_own_spaces():
    """Tokens that carry their spaces (" whale") sit side by side with them;
    a word-level vocabulary's get a gap each."""
    import pandas as pd

    from vlens.widgets.features import contexts_html

    frame = pd.DataFrame([{"prompt": 0, "position": 1, "activation": 2.0, "start": 0,
                           "tokens": ["The", " whale", "\n"], "values": [0.0, 2.0, 0.0]}])
    page = contexts_html(frame, 2.0, unit="text")
    assert ">The</span>" in page and "> whale</span>" in page and "margin-right:0;" in page
    assert "text 0, token 1" in page and "\u21b5" in page  # a lone newline still drawn
    frame.at[0, "tokens"] = ["the", "whale", "swam"]
    assert "margin-right:0.4em" in contexts_html(frame, 2.0)
