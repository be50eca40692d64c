"""Direct logit attribution's figure: where the answer's logit difference
comes from, layer by layer (attention beside MLP) and head by head.

Data in, figure out: per-layer values and a layer x head grid (the
``Attribution`` result holds them; this module imports no results).
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from vlens.plots._cells import FONT_PX, PLOT_PX, cell_text_traces, labels_fit, readable
from vlens.plots._common import as_float

__all__ = ["attribution_figure"]

ATTN, MLP = "#1f77b4", "#ff7f0e"
#: up to this many head cells the grid writes each value in its cell (when it fits)
LABELLED_CELLS = 200
#: the head grid's share of the plot's width (the bars take the rest), at PLOT_PX
HEAD_GRID_PX = 0.43 * (PLOT_PX - 200)


def attribution_figure(attn: object, mlp: object, heads: object | None = None, *,
                       title: str = "direct logit attribution",
                       metric: str = "logit difference") -> go.Figure:
    """Left: bars of each layer's attention (``attn`` ``[layers]``) and MLP
    (``mlp`` ``[layers]``) contributions side by side. Right, where
    ``heads`` ``[layers, heads]`` is given: a layer x head heatmap,
    red-white-blue centred on 0 (blue: toward the answer). Hovers name the
    layer (and head) and the value in units of ``metric``."""
    a, m = as_float(attn).flatten(), as_float(mlp).flatten()
    if a.shape != m.shape:
        raise ValueError(f"attn has {a.numel()} layers and mlp {m.numel()}: give one value "
                         "per layer to each")
    h = None if heads is None else as_float(heads)
    if h is not None and (h.dim() != 2 or h.shape[0] != a.numel()):
        raise ValueError(f"heads must be [layers, heads] with {a.numel()} layers, got "
                         f"{list(h.shape)}")
    layers = [f"layer {i}" for i in range(a.numel())]
    cols = 1 if h is None else 2
    fig = make_subplots(rows=1, cols=cols, horizontal_spacing=0.14,
                        subplot_titles=("by layer", "by head")[:cols])
    for name, values, colour in (("attn", a, ATTN), ("mlp", m, MLP)):
        fig.add_trace(go.Bar(x=layers, y=values.tolist(), name=name, marker_color=colour,
                             hovertemplate=f"%{{x}} {name}: %{{y:.4g}}<extra></extra>"),
                      row=1, col=1)
    fig.update_yaxes(title_text=metric, row=1, col=1)
    if h is not None:
        _head_grid(fig, h, layers, metric)
    readable(fig, title, height=max(360, 150 + 30 * a.numel()), cells=False)
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": -0.15})
    return fig


def _head_grid(fig: go.Figure, h, layers: Sequence[str], metric: str) -> None:
    reach = max(1e-9, float(h.abs().max())) if h.numel() else 1.0
    heat = go.Heatmap(
        z=h.tolist(), x=[str(i) for i in range(h.shape[1])], y=list(layers),
        zmin=-reach, zmax=reach, zmid=0, colorscale="RdBu", name="heads",
        colorbar={"title": {"text": metric}, "x": 1.02},
        customdata=[[[r, c] for c in range(h.shape[1])] for r in range(h.shape[0])],
        hovertemplate="%{y}, head %{x}: %{z:.4g}<extra></extra>", xaxis="x2", yaxis="y2",
    )
    fig.add_trace(heat, row=1, col=2)
    text = [[f"{v:.2f}" for v in row] for row in h.tolist()]
    # only where each value fits its cell: 12 heads share about 300 px
    if h.numel() <= LABELLED_CELLS and labels_fit(text, HEAD_GRID_PX / max(1, h.shape[1])):
        for t in cell_text_traces(heat, text):
            fig.add_trace(t, row=1, col=2)
    fig.update_xaxes(title_text="head", tickfont={"size": FONT_PX}, row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=2)
