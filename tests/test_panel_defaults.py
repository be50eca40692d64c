"""A panel runs what it says it will run: the recipe, unless the user changed
a setting in the panel itself.

A student explores (moves the explorer's layer slider, clicks chips) and
then presses **run** in the steering panel: the steer sent is the recipe's
layer and span, and the panel's settings line said so beforehand. Picking
"selection" in the panel is what makes the chips its span. The save and
reset buttons are pressed as a user would. The engine is the bundled model
(``toy_session``); ``sent`` records what the widgets asked the Session
while its real methods do the work.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import vlens
from vlens.models.recipes import toyworld_recipe
from vlens.testing import make_run, make_trace
from vlens.widgets import ActivationView, SteeringPanel, explore

PROMPT = "once upon a time, a sad duck lived in a green house near the farm."

engine = pytest.mark.engine


@pytest.fixture
def sent(toy_session, monkeypatch) -> list[dict]:
    """The Session's ``direction`` and ``stream_compare`` calls the widgets
    make (name and keywords), the real methods running."""
    log: list[dict] = []
    for name in ("direction", "stream_compare"):
        real = getattr(toy_session, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            log.append({"name": _name, "args": args, **kwargs})
            return _real(*args, **kwargs)

        monkeypatch.setattr(toy_session, name, spy)
    return log


def _last_steer(sent: list[dict]) -> vlens.Steer:
    return [c for c in sent if c["name"] == "stream_compare"][-1]["steer"]


def _run(panel: SteeringPanel) -> None:
    panel._run_button.click()
    assert panel.wait(300)
    assert panel.error == ""


@engine
def test_exploring_does_not_change_the_steering_recipe(toy_session, sent):
    recipe = toyworld_recipe()
    ex = explore(toy_session, PROMPT, max_new_tokens=4)
    panel = ex.steering_panel
    assert (panel.layer, panel.span_mode) == (recipe.layer, recipe.span)
    other = recipe.layer - 1
    ex.activation_view.layer_picker.value = other  # the student explores
    ex.span_picker.selection = (2, 5)               # and clicks chips
    assert ex.layer == other and ex.activation_view.layer == other
    assert panel.layer == recipe.layer and panel.layer_picker.value == recipe.layer
    assert panel.span_mode == recipe.span
    line = panel.settings_text
    assert f"layer {recipe.layer} " in line and f"span {recipe.span} " in line
    assert f"scale {recipe.scale:g} relative" in line and "changed" not in line
    assert line in html_text(panel._settings.value)  # what the panel shows

    _run(panel)
    st = _last_steer(sent)
    assert (st.layer, st.span, st.scale, st.relative, st.site) == (
        recipe.layer, recipe.span, recipe.scale, recipe.relative, recipe.site)
    assert [c["layer"] for c in sent if c["name"] == "direction"] == [recipe.layer]

    # "selection", picked in the panel: now the chips are its span
    panel._span_mode.value = "selection"
    assert "span selection [2, 5) (changed" in panel.settings_text
    _run(panel)
    assert _last_steer(sent).span == (2, 5)
    ex.span_picker.selection = (1, 2)  # followed while "selection" is picked
    assert "span selection [1, 2)" in panel.settings_text
    _run(panel)
    assert _last_steer(sent).span == (1, 2)

    # a layer moved in the panel itself is used, and said to differ
    panel.layer_picker.value = other
    assert f"layer {other} (changed; recipe: {recipe.layer})" in panel.settings_text
    ex.activation_view.layer_picker.value = 0
    assert panel.layer == other  # the explorer's slider still leaves it alone
    _run(panel)
    assert _last_steer(sent).layer == other


@engine
def test_reset_to_recipe_puts_every_setting_back(toy_session, sent):
    recipe = toyworld_recipe()
    panel = SteeringPanel(toy_session, max_new_tokens=4, auto_run=False)
    first = panel.settings_text
    assert panel._reset_button.description == "reset to recipe"
    panel.layer_picker.value = 1
    panel._scale.value = -1.0
    panel._relative.value = False
    panel._positive.value = "a happy fox"
    panel.span_picker.selection = (0, 3)  # the panel's own chips: its span now
    assert panel.span_mode == "selection"
    changed = panel.settings_text
    assert changed != first and changed.count("changed") == 4  # layer, span, scale, lists
    panel._reset_button.click()
    assert panel.settings_text == first
    assert (panel.layer, panel.scale, panel.relative, panel.span_mode) == (
        recipe.layer, recipe.scale, recipe.relative, recipe.span)
    assert panel.positive == list(recipe.positive)
    assert panel.layer_picker.value == recipe.layer and panel._scale.value == recipe.scale
    assert panel.prompt == recipe.example  # the prompt is the user's: it stays
    _run(panel)
    st = _last_steer(sent)
    assert (st.layer, st.scale, st.span) == (recipe.layer, recipe.scale, recipe.span)


@engine
def test_save_button_writes_the_snapshot_and_says_where(toy_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default file goes to the notebook's folder
    panel = SteeringPanel(toy_session, max_new_tokens=4)
    assert panel._save_row.layout.display != "none"
    panel._save_button.click()
    assert panel.error == ""
    path = panel.saved_path
    assert path is not None and path.parent == tmp_path and path.name.startswith(
        "steering-panel-")
    page = path.read_text()
    assert page.startswith("<!doctype html>") and "runs with:" in page
    assert "saved to" not in page  # the save row is not part of what is saved
    assert str(path) in html_text(panel._save_label.value)

    ex = explore(toy_session, PROMPT, max_new_tokens=2)
    # one save button per page: the explorer's; its tabs are saved with it
    assert ex._save_row.layout.display != "none"
    assert all(p._save_row.layout.display == "none" for p in ex._inner_panels())
    target = ex.save(tmp_path / "explorer.html")
    assert target == ex.saved_path and "<h3>steering" in target.read_text()


def test_every_view_has_a_save_button(tmp_path):
    """No engine: a view over a Run made from plain tensors."""
    import torch

    g = torch.Generator().manual_seed(0)
    reads = {"resid_post": torch.randn(2, 4, 8, generator=g)}
    run = make_run([make_trace([0, 1, 2], [3, 4], reads=reads, layers=[0, 1],
                               token_strings=lambda ids: [f"t{i}" for i in ids])])
    view = ActivationView(run, layer=1)
    path = view.save(tmp_path / "view.html")
    assert path.exists() and "Plotly.newPlot" in path.read_text()
    assert "view.html" in view._save_label.value
    from vlens.widgets import FeatureView
    from vlens.widgets._base import Panel

    assert issubclass(FeatureView, Panel)  # its save button comes from Panel


def html_text(markup: str) -> str:
    """The text of a bit of HTML (tags dropped, entities read)."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", markup))


@engine
def test_patching_view_says_what_it_will_patch(toy_session):
    from vlens.widgets import PatchingView

    plain = PatchingView(toy_session, clean=PROMPT, corrupt=PROMPT, auto_run=False)
    assert plain.settings_text == ("runs with: site resid_post · layers every · span all · "
                                   "per position · answer: each run's top next token")
    some = PatchingView(toy_session, clean=PROMPT, corrupt=PROMPT, auto_run=False,
                        layers=[1, 2], heads="all", span="prompt",
                        answer=(" happy", " sad"))
    line = html_text(some._settings.value)
    assert line == some.settings_text
    assert "layers [1, 2]" in line and "span prompt" in line and "heads all" in line
    assert "answer (' happy', ' sad')" in line
    assert some._settings.layout.display != "none" and some.patching is None  # nothing ran
