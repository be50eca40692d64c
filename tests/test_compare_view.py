"""The compare view: two real Runs side by side, the first divergence marked.

Runs come from the bundled model (``toy_session``): a steered comparison,
whose two replies part somewhere, and a run beside itself, which never
parts.
"""

from __future__ import annotations

import html

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import vlens
from vlens.models.recipes import toyworld_recipe
from vlens.widgets import CompareView

engine = pytest.mark.engine


@engine
def test_compare_view_marks_where_two_runs_part(toy_session, tmp_path):
    recipe = toyworld_recipe()
    prompts = [recipe.example, recipe.held_out(recipe.example_from, 2)[1]]
    cmp = toy_session.compare(prompts, steer=recipe.steer(toy_session), max_new_tokens=24)
    view = CompareView(cmp.baseline, cmp.steered, labels=("plain", "steered"))
    assert vlens.CompareView is CompareView
    assert view.error == "" and view._picker.layout.display != "none"  # two prompts: a picker
    for i in range(len(prompts)):
        view._picker.value = i  # the slider, moved
        a, b = cmp.baseline[i], cmp.steered[i]
        at = cmp.first_divergence[i]
        assert view.index == i and view.divergence == at and at is not None
        assert view.texts == (a.text, b.text)
        shown = view._texts.value
        assert "<b>plain</b>" in shown and "<b>steered</b>" in shown
        assert shown.count("<mark") == 2  # one mark in each column
        # before the mark: the tokens both replies share
        same = "".join(a.output_tokens[:at])
        assert html.escape(same) + "<mark" in shown
        assert f"generated token {at}:" in view._where.value
        assert repr(a.output_tokens[at]) in view._where.value
        assert view._prompt.value == prompts[i]
    page = view.save(tmp_path / "compare.html").read_text()
    assert "<b>plain</b>" in page and "<mark" in page


@engine
def test_compare_view_of_a_conversation_and_of_equal_runs(toy_session, monkeypatch):
    # the story model has no chat template: a plain one, for this test only
    monkeypatch.setattr(toy_session, "chat_template",
                        "{% for m in messages %}{{ m['content'] }} {% endfor %}", raising=False)
    conv = [{"role": "user", "content": "tell me a story about a cat."}]
    run = toy_session.trace([conv], max_new_tokens=8)
    view = CompareView(run, run, labels=("this", "again"))
    assert view.divergence is None and "<mark" not in view._texts.value
    assert "the same" in view._where.value
    assert view._prompt.value == "user: tell me a story about a cat."  # a message, not JSON
    assert view._picker.layout.display == "none"  # one prompt: nothing to pick
    with pytest.raises(ValueError, match="same number|same prompts"):
        CompareView(run, toy_session.trace(["a", "b"], max_new_tokens=1))
    with pytest.raises(ValueError, match="labels"):
        CompareView(run, run, labels=("one",))
