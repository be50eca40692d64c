"""The saliency figure: a prompt's tokens as rows of cells, one row per
attribution method, coloured by each token's share toward the target."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from vlens.plots._cells import readable
from vlens.plots._token_rows import GAP_PX, ROW_PX, TokenRow, add_token_rows, cell_lines, named_scale

__all__ = ["saliency_strip"]

#: signed attributions: red against the target, blue toward it, white none
SCALE = "RdBu"


def saliency_strip(tokens: Sequence[str], rows: dict[str, Sequence[float]], *,
                   title: str = "saliency") -> go.Figure:
    """``tokens`` ``[n]`` drawn once per entry of ``rows`` (``{method name:
    values [n]}``), each cell coloured by its value on one diverging scale
    centred on 0 (each row scaled to its own largest magnitude, so rows of
    different units compare by shape). The hover gives the value."""
    n = len(tokens)
    if not rows or any(len(v) != n for v in rows.values()):
        raise ValueError(f"each row needs {n} values, one per token")
    token_rows = []
    for name, values in rows.items():
        vals = [float(v) for v in values]
        reach = max(abs(v) for v in vals) or 1.0
        token_rows.append(TokenRow(name, list(tokens), [v / reach for v in vals],
                                   [f"{name} {v:.4g}" for v in vals]))
    fig = go.Figure()
    n_lines = len(cell_lines([[t] * len(rows) for t in tokens])[1])
    add_token_rows(fig, token_rows, list(range(n)), colorscale=named_scale(SCALE),
                   zmin=-1.0, zmax=1.0, value_name="share")
    height = n_lines * (len(rows) * ROW_PX + GAP_PX) + 40
    readable(fig, title, height=height + 90, top=70)
    fig.update_layout(showlegend=False, margin={"b": 20, "l": 150, "r": 20})
    return fig
