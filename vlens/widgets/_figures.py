"""Figures of the panels' results (pure: a result in, a ``go.Figure`` out)."""

from __future__ import annotations

from typing import Any

__all__ = ["comparison_figure"]


def comparison_figure(cmp: Any, what: str) -> Any:
    """Baseline vs its edited run of a one-prompt Comparison (the per-token
    logprob delta and both token rows, the edited row labelled by what was
    done), titled ``what: first divergence …``: the result's own figure."""
    return cmp.figure(0, what=what)
