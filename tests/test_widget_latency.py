"""scripts/widget_latency.py's ``--views`` table, the parts that need no
engine: prompts cut to an exact token count, and the goal of each row.
(The table itself runs on the real model: docs/widgets.md, "Views at a
real model's size".)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "widget_latency.py"
_spec = importlib.util.spec_from_file_location("widget_latency", _PATH)
wl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wl)


def _words(text: str) -> list[str]:
    return text.split(" ")


def test_a_prompt_is_cut_to_exactly_n_tokens():
    text = " ".join(f"w{i}" for i in range(100))
    words = {"tokenize": _words, "decode": " ".join}
    cut = wl.cut_prompt(text, 64, lambda p: len(_words(p)), **words)
    assert cut == " ".join(f"w{i}" for i in range(64))
    # an engine that adds a token to every prompt (a BOS): the cut one shorter
    cut = wl.cut_prompt(text, 64, lambda p: 1 + len(_words(p)), **words)
    assert len(_words(cut)) == 63
    with pytest.raises(SystemExit, match="has 100 tokens; 200 are needed"):
        wl.cut_prompt(text, 200, lambda p: len(_words(p)), **words)


def test_the_goal_is_the_engine_call_with_slack():
    assert wl.goal_s(10.0) == pytest.approx(13.3) and wl.goal_s(0.0) == pytest.approx(0.3)
    assert wl.VIEW_LENGTHS == (64, 200)
