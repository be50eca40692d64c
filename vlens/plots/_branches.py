"""A generation and its branches as rows of tokens, one row per run."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from vlens.plots._cells import readable
from vlens.plots._token_rows import GAP_PX, PER_LINE, ROW_PX, TokenRow, add_token_rows, \
    cell_lines, named_scale

__all__ = ["branch_rows"]


def branch_rows(labels: Sequence[str], tokens: Sequence[Sequence[str]],
                logprobs: Sequence[Sequence[float | None]], starts: Sequence[int | None], *,
                title: str | None = None, per_line: int = PER_LINE) -> go.Figure:
    """Rows of generated tokens over the same positions: the run as it went
    and each branch (``labels`` ``[rows]``; ``tokens`` and ``logprobs``
    ``[rows][generated]``). A branch row shows its tokens from its branch
    point on (``starts`` ``[rows]``: a generated position, None for the
    whole row), so the rows read as a tree; each cell is coloured by the
    token's probability (white 0 to dark blue 1). When every branch starts
    at one position, that column is outlined."""
    n = max((len(t) for t in tokens), default=0)
    rows = []
    for label, toks, lps, start in zip(labels, tokens, logprobs, starts):
        first = 0 if start is None else start
        shown = [tok if first <= i < len(toks) else None for i, tok in enumerate(toks)]
        probs = [None if lp is None else math.exp(lp) for lp in lps]
        hover = ["" if p is None else f"p {p:.3f}" for p in probs]
        rows.append(TokenRow(label, shown + [None] * (n - len(shown)), probs, hover))
    points = {s for s in starts if s is not None}
    mark = points.pop() if len(points) == 1 else None
    fig = go.Figure()
    n_lines = len(cell_lines([[r.tokens[i] for r in rows] for i in range(n)], per_line)[1])
    add_token_rows(fig, rows, list(range(n)), colorscale=named_scale("Blues"), zmin=0.0,
                   zmax=1.0, value_name="p", mark=mark, per_line=per_line)
    height = n_lines * (len(rows) * ROW_PX + GAP_PX) + 110
    where = "" if mark is None else f" at generated position {mark}"
    readable(fig, title or f"{len(rows) - 1} branches{where}", height=height, top=70)
    fig.update_layout(showlegend=False, margin={"b": 20, "l": 160, "r": 20})
    return fig
