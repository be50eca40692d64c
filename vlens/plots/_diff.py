"""The figure of a model diff: one text's tokens coloured by KL(tuned || base)
above a layer x token heatmap of the activation difference."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from vlens.plots._cells import readable
from vlens.plots._common import token_labels
from vlens.plots._token_rows import GAP_PX, PER_LINE, ROW_PX, TokenRow, add_token_rows, \
    cell_lines, named_scale

__all__ = ["diff_figure", "diff_texts"]

#: KL cells: white (the models agree) to dark red
KL_COLOURS = "Reds"


def diff_figure(tokens: Sequence[str], kl: Sequence[float], grid: Sequence[Sequence[float]],
                layers: Sequence[int], *, n_prompt: int | None = None, value: str = "norm",
                site: str = "resid_post", title: str | None = None,
                per_line: int = PER_LINE) -> go.Figure:
    """``tokens`` ``[T]`` as one row of cells coloured by ``kl`` ``[T]`` (KL
    after each token, white 0 to dark red at the largest), over a heatmap
    ``grid`` ``[layers, T]`` (``layers``: their numbers) of the activation
    difference at ``site``: ``value`` ``"norm"`` (of tuned - base) or
    ``"cosine"`` (of the two activations, -1 … 1). ``n_prompt`` marks where
    the prompt ends."""
    from plotly.subplots import make_subplots

    n = len(tokens)
    if len(kl) != n or any(len(row) != n for row in grid) or len(grid) != len(layers):
        raise ValueError(f"{n} tokens need kl [{n}] and grid [{len(layers)}, {n}]")
    kl = [None if v is None or math.isnan(v) else float(v) for v in kl]
    top = max([v for v in kl if v is not None] + [1e-6])
    n_lines = len(cell_lines([[t] for t in tokens], per_line)[1])
    rows_px = n_lines * (ROW_PX + GAP_PX) + 10
    heat_px, spacing_px = max(160, 28 * len(layers)), 60
    total = rows_px + spacing_px + heat_px
    fig = make_subplots(rows=2, cols=1, vertical_spacing=spacing_px / total,
                        row_heights=[rows_px / total, heat_px / total])
    hover = ["" if v is None else f"KL {v:.4f}" for v in kl]
    add_token_rows(fig, [TokenRow("KL", list(tokens), kl, hover)], list(range(n)),
                   colorscale=named_scale(KL_COLOURS), zmin=0.0, zmax=top, value_name="KL",
                   subplot={"row": 1, "col": 1}, n_prompt=n_prompt, per_line=per_line)
    cosine = value == "cosine"
    fig.add_trace(go.Heatmap(
        z=[list(map(float, row)) for row in grid], x=token_labels(list(tokens)),
        y=[f"L{x}" for x in layers], name=f"{site} {value}",
        colorscale="RdBu" if cosine else "Viridis", zmin=-1 if cosine else None,
        zmax=1 if cosine else None,
        colorbar={"title": {"text": "cosine" if cosine else "|Δ|"}, "len": heat_px / total,
                  "y": 0, "yanchor": "bottom"},
        hovertemplate="layer %{y}, token %{x}<br>" + ("cosine" if cosine else "|tuned − base|")
                      + " %{z:.3f}<extra></extra>",
    ), row=2, col=1)
    if n_prompt is not None and 0 < n_prompt < n:
        fig.add_shape(type="line", xref="x2", yref="y2 domain", x0=n_prompt - 0.5,
                      x1=n_prompt - 0.5, y0=0, y1=1, line={"color": "grey", "dash": "dot"},
                      name="prompt|generated")
    fig.update_xaxes(showticklabels=n <= 40, row=2, col=1)
    fig.update_yaxes(title_text="layer", row=2, col=1)
    readable(fig, title or f"KL(tuned ‖ base) and the activation difference at {site}",
             height=total + 90, top=70)
    fig.update_layout(showlegend=False, margin={"b": 20, "l": 90, "r": 20})
    return fig


def diff_texts(tokens: Sequence[Sequence[str]], kl: Sequence[Sequence[float]],
               labels: Sequence[str], *, n_prompt: int | None = None,
               divergence: int | None = None, title: str | None = None,
               per_line: int = PER_LINE) -> go.Figure:
    """Two (or more) texts of the same prompt as rows of cells over the same
    positions, each token coloured by ``kl`` (its text's KL(tuned || base)
    after it; one scale for all rows, white 0 to dark red at the largest).
    ``divergence`` (a position) is outlined across the rows, ``n_prompt``
    marks where the prompt ends."""
    if len(tokens) != len(kl) or len(tokens) != len(labels):
        raise ValueError("one list of kl values and one label per text")
    n = max(len(t) for t in tokens)
    kl = [[None if v is None or math.isnan(v) else float(v) for v in row] for row in kl]
    top = max([v for row in kl for v in row if v is not None] + [1e-6])
    rows = [TokenRow(label, list(t), row, ["" if v is None else f"KL {v:.4f}" for v in row])
            for label, t, row in zip(labels, tokens, kl)]
    columns = [[t[i] if i < len(t) else None for t in tokens] for i in range(n)]
    n_lines = len(cell_lines(columns, per_line)[1])
    height = n_lines * (len(rows) * ROW_PX + GAP_PX) + 10
    fig = go.Figure()
    add_token_rows(fig, rows, list(range(n)), colorscale=named_scale(KL_COLOURS), zmin=0.0,
                   zmax=top, value_name="KL", mark=divergence, n_prompt=n_prompt,
                   per_line=per_line)
    readable(fig, title or "each text coloured by KL(tuned ‖ base) after each token",
             height=height + 90, top=70)
    fig.update_layout(showlegend=False, margin={"b": 20, "l": 90, "r": 20})
    return fig
