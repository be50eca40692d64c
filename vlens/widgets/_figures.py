"""Figures of the panels' results (pure: a result in, a ``go.Figure`` out)."""

from __future__ import annotations

from typing import Any

from vlens.plots import baseline_vs_steered

__all__ = ["comparison_figure"]


def comparison_figure(cmp: Any, what: str) -> Any:
    """Baseline vs steered of a one-prompt Comparison: the per-token
    logprob delta and both token rows, titled ``what: first divergence …``."""
    frame = cmp.to_frame()  # one prompt: one row per generated position
    base = cmp.baseline[0]
    # a shorter generation leaves None where its tokens end
    tb = [x if isinstance(x, str) else "" for x in frame["token_base"]]
    ts = [x if isinstance(x, str) else "" for x in frame["token_steered"]]
    i = cmp.first_divergence[0]
    positions = frame["position"].tolist()
    return baseline_vs_steered(
        tb, ts, frame["logprob_base"].tolist(), frame["logprob_steered"].tolist(),
        positions=positions,
        divergence=None if i is None else positions[i],
        n_prompt=len(base.prompt_token_ids),
        title=(what + ": " + ("no divergence" if i is None
                              else f"first divergence at position {positions[i]}")),
    )
