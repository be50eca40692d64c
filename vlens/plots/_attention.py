"""Attention figures: every head of every layer as a thumbnail, one head's
token x token pattern, and one token's row and column of it.

Patterns are attention probabilities ``[.., queries, keys]``: row ``i``
is where query token ``i`` looks (it sums to 1 over keys ``0..i``), column
``j`` is who looks at key ``j``. Cells above the diagonal are never
attended (causal) and are drawn empty, not as zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import plotly.graph_objects as go
import torch

from vlens.plots._cells import FONT_PX, readable
from vlens.plots._common import as_float, prompt_boundary, token_labels

__all__ = ["attention_heads", "attention_heatmap", "attention_of_token", "pool_pattern",
           "thumbnail_outline"]

#: the colours of attention: white at 0, dark blue at 1 (one scale for every head)
ATTENTION_COLOURS = "Blues"
OUTLINE = {"color": "#d62728", "width": 3}


def _causal_array(pattern: torch.Tensor) -> numpy.ndarray:
    """``pattern`` ``[T, T]`` as a float32 array, NaN above the diagonal (a
    gap; null on the page). Plotly checks a nested list value by value
    (twice more when a figure is copied and shown), which took seconds for
    the 270 thumbnails of a 30-layer model and half a second for one head
    of a 200-token prompt; an array it takes whole."""
    a = pattern.detach().to(torch.float32).cpu().numpy().copy()
    n = a.shape[-1]
    a[numpy.triu_indices(min(a.shape[0], n), k=1, m=n)] = numpy.nan
    return a


def pool_pattern(pattern: torch.Tensor, cells: int) -> torch.Tensor:
    """``pattern`` ``[.., T, T]`` shrunk to at most ``[.., cells, cells]`` by
    averaging blocks (a thumbnail of a 2,000-token prompt is still small).
    Patterns with ``T <= cells`` come back unchanged."""
    t = pattern.shape[-1]
    if t <= cells:
        return pattern
    lead = pattern.shape[:-2]
    flat = pattern.reshape(-1, 1, t, t)
    pooled = torch.nn.functional.adaptive_avg_pool2d(flat, cells)
    return pooled.reshape(*lead, cells, cells)


def attention_heads(
    patterns: torch.Tensor,
    layers: Sequence[int],
    *,
    heads: Sequence[int] | None = None,
    selected: tuple[int, int] | None = None,
    title: str | None = None,
    cells: int = 48,
    thumb_px: int = 90,
) -> go.Figure:
    """A grid of thumbnails: one row per layer, one column per head.

    ``patterns`` ``[n_layers, n_heads, T, T]`` (``layers`` names its rows,
    ``heads`` its head columns: default ``0..n_heads-1``, or the heads a
    trace read with ``heads=``). Each thumbnail is one head's pattern on one
    colour scale (0 to 1), pooled to at most ``cells`` x ``cells``. Trace
    ``n`` is layer row ``n // n_heads``, head column ``n % n_heads``; each
    trace's ``meta`` is ``[layer, head]`` (what a click on it picks).
    ``selected`` ``(layer, head)`` is outlined (a shape named ``"selected"``).
    """
    p = as_float(patterns)
    if p.dim() != 4 or p.shape[-1] != p.shape[-2]:
        raise ValueError(f"patterns has shape {list(p.shape)}; expected "
                         "[layers, heads, tokens, tokens]")
    n_layers, n_heads = p.shape[0], p.shape[1]
    if len(layers) != n_layers:
        raise ValueError(f"{len(layers)} layer names for {n_layers} layers of patterns")
    heads = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    if len(heads) != n_heads:
        raise ValueError(f"{len(heads)} head names for {n_heads} heads of patterns")
    small = pool_pattern(p, cells)
    layout, axes = _grid_layout([f"layer {x}" for x in layers], [f"head {h}" for h in heads])
    traces = [
        go.Heatmap(
            z=_causal_array(small[r, c]), zmin=0, zmax=1, colorscale=ATTENTION_COLOURS,
            showscale=False, meta=[int(layer), h], name=f"layer {layer} head {h}",
            hovertemplate=f"layer {layer} head {h}<extra></extra>",
            xaxis=axes[r * n_heads + c][0], yaxis=axes[r * n_heads + c][1],
        )
        for r, layer in enumerate(layers) for c, h in enumerate(heads)
    ]
    fig = go.Figure(traces, layout)
    shapes = thumbnail_outline(layers, heads, selected)
    fig.update_layout(
        title={"text": title or "attention of every head (click one)"},
        shapes=shapes,
        height=60 + thumb_px * n_layers, width=80 + thumb_px * n_heads,
        plot_bgcolor="white",  # the causal gaps read as empty, not as a colour
        margin={"t": 60, "b": 10, "l": 10, "r": 40},
    )
    return fig


def _grid_layout(row_titles: list[str], col_titles: list[str], h_space: float = 0.02,
                 v_space: float = 0.03) -> tuple[dict, list[tuple[str, str]]]:
    """The layout of a rows x columns grid of small plots, as
    ``make_subplots`` lays it out (subplot n, counted row by row from the
    top left, on axes ``x{n}``/``y{n}``; titles above the columns and right
    of the rows), without ticks or grid, y reversed -- and each subplot's
    (x, y) axis names. Written as one dict: ``make_subplots`` and
    ``update_xaxes`` build and update the axes one by one, which took about
    a second for a 30-layer model's 270 thumbnails."""
    n_rows, n_cols = len(row_titles), len(col_titles)
    width = (1 - h_space * n_cols) / n_cols  # the row titles take one spacing on the right
    height = (1 - v_space * (n_rows - 1)) / n_rows
    plain = {"showticklabels": False, "showgrid": False, "zeroline": False}
    layout: dict = {"annotations": []}
    axes = []
    for r in range(n_rows):
        top = 1 - r * (height + v_space)
        for c in range(n_cols):
            n = r * n_cols + c + 1
            x, y = ("x", "y") if n == 1 else (f"x{n}", f"y{n}")
            left = c * (width + h_space)
            layout[f"xaxis{'' if n == 1 else n}"] = {
                "anchor": y, "domain": [_unit(left), _unit(left + width)], **plain}
            layout[f"yaxis{'' if n == 1 else n}"] = {
                "anchor": x, "domain": [_unit(top - height), _unit(top)], "autorange": "reversed",
                **plain}
            axes.append((x, y))
    title = {"font": {"size": 16}, "showarrow": False, "xref": "paper", "yref": "paper"}
    for c, text in enumerate(col_titles):
        layout["annotations"].append({**title, "text": text, "x": c * (width + h_space) + width / 2,
                                      "xanchor": "center", "y": 1.0, "yanchor": "bottom"})
    for r, text in enumerate(row_titles):
        layout["annotations"].append({**title, "text": text, "textangle": 90, "x": 1 - h_space,
                                      "xanchor": "left", "y": 1 - r * (height + v_space) - height / 2,
                                      "yanchor": "middle"})
    return layout, axes


def _unit(v: float) -> float:
    """``v`` within [0, 1] (float error at the edges of a grid)."""
    return min(1.0, max(0.0, v))


def thumbnail_outline(layers: Sequence[int], heads: Sequence[int],
                      selected: tuple[int, int] | None) -> list[dict]:
    """The shapes of :func:`attention_heads`: an outline (named
    ``"selected"``) around the thumbnail of ``selected`` ``(layer, head)``,
    none when it is not on the grid. A view moves the outline with these
    alone, without building the grid again."""
    if selected is None:
        return []
    layer, head = int(selected[0]), int(selected[1])
    rows, cols = [int(x) for x in layers], [int(h) for h in heads]
    if layer not in rows or head not in cols:
        return []
    picked = rows.index(layer) * len(cols) + cols.index(head) + 1  # its subplot number
    axis = "" if picked == 1 else str(picked)
    return [{"type": "rect", "xref": f"x{axis} domain", "yref": f"y{axis} domain",
             "x0": -0.02, "x1": 1.02, "y0": -0.02, "y1": 1.02, "line": OUTLINE,
             "name": "selected"}]


def attention_heatmap(
    pattern: torch.Tensor,
    tokens: Sequence[str],
    *,
    token: int | None = None,
    n_prompt: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """One head's pattern ``[T, T]``: queries down (rows), keys across.

    Labels are ``"position:token"``. ``token`` outlines that query's row
    (where it attends, shape ``"query"``) and that key's column (what
    attends to it, shape ``"key"``); ``n_prompt`` draws where generation
    starts. Cells above the diagonal are NaN (drawn empty).
    """
    p = as_float(pattern)
    n = len(tokens)
    if p.shape != (n, n):
        raise ValueError(f"pattern has shape {list(p.shape)}; expected [{n}, {n}] "
                         f"for {n} tokens")
    labels = token_labels(tokens)
    fig = go.Figure(go.Heatmap(
        z=_causal_array(p), x=labels, y=labels, zmin=0, zmax=1, colorscale=ATTENTION_COLOURS,
        colorbar={"title": {"text": "attention"}},
        hovertemplate="query %{y}<br>key %{x}<br>attention %{z:.3f}<extra></extra>",
    ))
    shapes = prompt_boundary(n_prompt, n)
    if token is not None and 0 <= token < n:
        shapes += [
            {"type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
             "y0": token - 0.5, "y1": token + 0.5, "line": OUTLINE, "name": "query"},
            {"type": "rect", "xref": "x", "yref": "paper", "x0": token - 0.5,
             "x1": token + 0.5, "y0": 0, "y1": 1,
             "line": {**OUTLINE, "dash": "dot"}, "name": "key"},
        ]
    # square cells in the page's width; the height grows with the tokens
    # (plotly thins the tick labels when they would not fit)
    side = max(360, min(1100, 80 + 18 * n))
    readable(fig, title or "attention: queries down, keys across", height=side + 100)
    fig.update_layout(
        xaxis={"title": "key (attended to)", "tickangle": -60, "tickfont": {"size": FONT_PX},
               "constrain": "domain"},
        yaxis={"title": "query (attending)", "autorange": "reversed",
               "tickfont": {"size": FONT_PX}, "scaleanchor": "x", "constrain": "domain"},
        shapes=shapes, margin={"b": 60},
    )
    return fig


def attention_of_token(
    pattern: torch.Tensor,
    tokens: Sequence[str],
    token: int,
    *,
    title: str | None = None,
) -> go.Figure:
    """Where token ``token`` attends, and what attends to it, as bars over
    the tokens: trace 0 ``"attends to"`` is row ``token`` of ``pattern``
    ``[T, T]`` (keys ``0..token``), trace 1 ``"attended by"`` is column
    ``token`` (queries ``token..T-1``); cells a causal model cannot have
    are ``None``."""
    p = as_float(pattern)
    n = len(tokens)
    if p.shape != (n, n):
        raise ValueError(f"pattern has shape {list(p.shape)}; expected [{n}, {n}]")
    if not 0 <= token < n:
        raise ValueError(f"token {token} is not a position of this prompt (0..{n - 1})")
    row = [float(v) if j <= token else None for j, v in enumerate(p[token].tolist())]
    col = [float(v) if i >= token else None for i, v in enumerate(p[:, token].tolist())]
    labels = token_labels(tokens)
    word = labels[token]
    fig = go.Figure([
        go.Bar(x=labels, y=row, name="attends to",
               hovertemplate=f"{word} → %{{x}}: %{{y:.3f}}<extra></extra>"),
        go.Bar(x=labels, y=col, name="attended by",
               hovertemplate=f"%{{x}} → {word}: %{{y:.3f}}<extra></extra>"),
    ])
    readable(fig, title or f"token {word}: where it attends, what attends to it",
             height=340, cells=False)
    fig.update_layout(
        barmode="group", yaxis={"title": "attention", "range": [0, 1.02]},
        xaxis={"tickangle": -60, "tickfont": {"size": FONT_PX}}, margin={"b": 60},
    )
    return fig
