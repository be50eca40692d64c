"""Patching figures: the layer x position (or layer x head) grid of a
patching experiment, and next-token distributions side by side.

The grid's metric is normalised: 1 where patching the clean activation
into the corrupt run restores the clean answer's logit difference, 0 where
it leaves the corrupt run's. Cells that have not finished are ``NaN`` and
drawn empty, so a grid filling in is the same figure with fewer gaps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from vlens.plots._cells import FONT_PX, PLOT_PX, cell_text_traces, labels_fit, readable
from vlens.plots._common import as_float, plain_text

__all__ = ["next_token_bars", "patching_heatmap"]

OUTLINE = {"color": "#111111", "width": 3}
#: up to this many cells the grid writes each value in its cell (when it fits)
LABELLED_CELLS = 400
#: what the layer labels and the colour bar take of the figure's width (px)
AXES_PX = 200


def patching_heatmap(
    grid: object,
    layers: Sequence[int],
    columns: Sequence[str],
    *,
    cell: tuple[int, int] | None = None,
    column_title: str = "position",
    metric: str = "restored",
    title: str | None = None,
    width: int | None = None,
) -> go.Figure:
    """Heatmap of ``grid`` ``[n_layers, n_columns]``: layers down, columns
    (token positions ``"pos:token"``, or heads) across.

    Colours: red-white-blue centred on 0 with 1 (the clean answer fully
    restored) deep blue; the range widens to cover values past ``[-1, 1]``.
    ``NaN`` cells (not finished) are ``None``: a gap. Up to
    ``LABELLED_CELLS`` cells print their value, where a cell is wide enough
    for it on a plot ``width`` px wide (default ``PLOT_PX``, a notebook's;
    the figure still takes the page's width): a 6 x 40 grid prints none,
    the hover has each. ``cell`` ``(row, col)``
    (indices into ``grid``) is outlined (a shape named ``"cell"``).
    ``customdata`` holds each cell's ``[row, col]``.
    """
    g = as_float(grid)
    if g.dim() != 2 or g.shape != (len(layers), len(columns)):
        raise ValueError(f"grid has shape {list(g.shape)}; expected "
                         f"[{len(layers)} layers, {len(columns)} {column_title}s]")
    z = [[None if math.isnan(v) else v for v in row] for row in g.tolist()]
    finite = [v for row in z for v in row if v is not None]
    reach = max([1.0] + [abs(v) for v in finite])
    ys = [f"layer {x}" for x in layers]
    xs = [plain_text(c) for c in columns]
    # each value in its cell, black or white against the cell's colour
    text = [["" if v is None else f"{v:.2f}" for v in row] for row in z]
    cell_px = ((width or PLOT_PX) - AXES_PX) / max(1, len(columns))
    labelled = g.numel() <= LABELLED_CELLS and labels_fit(text, cell_px)
    heat = go.Heatmap(
        z=z, x=xs, y=ys, zmin=-reach, zmax=reach, zmid=0, colorscale="RdBu",
        customdata=[[[r, c] for c in range(len(columns))] for r in range(len(layers))],
        colorbar={"title": {"text": metric}},
        hovertemplate=f"%{{y}}, {column_title} %{{x}}<br>{metric} %{{z:.3f}}<extra></extra>",
    )
    fig = go.Figure([heat, *(cell_text_traces(heat, text) if labelled else [])])
    shapes = []
    if cell is not None and 0 <= cell[0] < len(layers) and 0 <= cell[1] < len(columns):
        r, c = int(cell[0]), int(cell[1])
        shapes.append({"type": "rect", "xref": "x", "yref": "y", "x0": c - 0.5,
                       "x1": c + 0.5, "y0": r - 0.5, "y1": r + 0.5, "line": OUTLINE,
                       "name": "cell"})
    done = len(finite)
    readable(fig, title or f"{metric}: {done} of {g.numel()} cells",
             height=max(280, 150 + 44 * len(layers)))
    fig.update_layout(
        xaxis={"title": column_title, "tickangle": -60 if len(columns) > 8 else 0,
               "tickfont": {"size": FONT_PX}},
        yaxis={"title": "layer", "autorange": "reversed", "tickfont": {"size": FONT_PX}},
        shapes=shapes, margin={"b": 60},
    )
    return fig


def next_token_bars(
    distributions: Mapping[str, tuple[Sequence[str], Sequence[float]]],
    *,
    top: int = 10,
    marks: Sequence[str] = (),
    title: str | None = None,
) -> go.Figure:
    """Next-token probabilities of several runs, side by side.

    ``distributions`` maps a run's name (``"clean"``, ``"corrupt"``,
    ``"layer 2, pos 5"``) to ``(tokens, probabilities)`` (each run's top
    k). The bars cover the union of those tokens, the ``top`` most likely
    (by their highest probability in any run), most likely first; a token
    outside a run's top k is ``None`` there (no bar). ``marks`` (e.g. the
    clean and corrupt answers) are always shown, written in bold.
    Trace ``i`` is the ``i``-th run.
    """
    if not distributions:
        raise ValueError("no distributions to show")
    best: dict[str, float] = {}
    tables: dict[str, dict[str, float]] = {}
    for name, (tokens, probs) in distributions.items():
        tokens, probs = list(tokens), [float(p) for p in probs]
        if len(tokens) != len(probs):
            raise ValueError(f"{name!r}: {len(tokens)} tokens for {len(probs)} probabilities")
        tables[name] = dict(zip(tokens, probs))
        for tok, p in tables[name].items():
            best[tok] = max(best.get(tok, 0.0), p)
    order = sorted(best, key=lambda t: -best[t])
    keep = [t for t in order if t in marks] + [t for t in order if t not in marks]
    keep = sorted(keep[:max(top, len([t for t in marks if t in best]))],
                  key=lambda t: -best[t])
    labels = [f"<b>{plain_text(t)}</b>" if t in marks else plain_text(t) for t in keep]
    fig = go.Figure([
        go.Bar(x=labels, y=[tables[name].get(t) for t in keep], name=plain_text(name),
               hovertemplate=f"{plain_text(name)}: %{{x}} %{{y:.3f}}<extra></extra>")
        for name in distributions
    ])
    readable(fig, title or "next-token probability", height=320, cells=False)
    fig.update_layout(
        barmode="group", yaxis={"title": "probability", "range": [0, 1.02]},
        xaxis={"tickfont": {"size": FONT_PX}}, margin={"b": 50},
    )
    return fig
