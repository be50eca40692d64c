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
           "thumbnail_at", "thumbnail_outline"]

#: the colours of attention: white at 0, dark blue at 1 (one scale for every head)
ATTENTION_COLOURS = "Blues"
OUTLINE = {"color": "#d62728", "width": 3}


def _causal_array(pattern: torch.Tensor) -> numpy.ndarray:
    """``pattern`` ``[.., T, T]`` as a float32 array, NaN above the diagonal
    (a gap; null on the page). Plotly checks a nested list value by value
    (twice more when a figure is copied and shown), which took half a second
    for one head of a 200-token prompt; an array it takes whole."""
    a = pattern.detach().to(torch.float32).cpu().numpy().copy()
    n = a.shape[-1]
    rows, cols = numpy.triu_indices(min(a.shape[-2], n), k=1, m=n)
    a[..., rows, cols] = numpy.nan
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
    colour scale (0 to 1), pooled to at most ``cells`` x ``cells``. The grid
    is **one** heatmap: the thumbnails are tiles of one array, ``tile``
    cells square, ``step`` cells apart (an empty gap between them), so the
    page draws one trace, not one per head (270 heatmaps for a 30-layer
    model held the page for seconds). The trace's ``meta`` says where each
    tile is (``layers``, ``heads``, ``tile``, ``step``): :func:`thumbnail_at`
    turns a clicked cell into its ``(layer, head)``. ``selected``
    ``(layer, head)`` is outlined (a shape named ``"selected"``).
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
    layers = [int(x) for x in layers]
    small = _causal_array(pool_pattern(p, cells))  # [L, H, tile, tile]
    tile = small.shape[-1]
    step = tile + _gap(tile)
    tiles = numpy.full((n_layers, n_heads, step, step), numpy.nan, dtype=numpy.float32)
    tiles[:, :, :tile, :tile] = small
    # tile (r, c) at rows r*step.., columns c*step..; no gap after the last
    z = tiles.transpose(0, 2, 1, 3).reshape(n_layers * step, n_heads * step)
    z = z[:n_layers * step - (step - tile), :n_heads * step - (step - tile)]
    centre = (tile - 1) / 2
    plain = {"showgrid": False, "zeroline": False, "ticks": "", "constrain": "domain"}
    fig = go.Figure(go.Heatmap(
        z=z, zmin=0, zmax=1, colorscale=ATTENTION_COLOURS, showscale=False,
        meta={"layers": layers, "heads": heads, "tile": tile, "step": step},
        name="attention of every head", hovertemplate="%{z:.2f}<extra></extra>"))
    fig.update_layout(
        title={"text": title or "attention of every head (click one)"},
        shapes=thumbnail_outline(layers, heads, selected, tile=tile),
        xaxis={**plain, "side": "top", "tickvals": [c * step + centre for c in range(n_heads)],
               "ticktext": [f"head {h}" for h in heads], "range": [-0.5, z.shape[1] - 0.5]},
        yaxis={**plain, "autorange": "reversed", "scaleanchor": "x",
               "tickvals": [r * step + centre for r in range(n_layers)],
               "ticktext": [f"layer {x}" for x in layers]},
        height=90 + thumb_px * n_layers, width=110 + thumb_px * n_heads,
        plot_bgcolor="white",  # the causal gaps and the gaps between tiles read as empty
        margin={"t": 90, "b": 10, "l": 70, "r": 10},
    )
    return fig


def _gap(tile: int) -> int:
    """The empty cells between two thumbnails of ``tile`` cells."""
    return max(1, tile // 8)


def thumbnail_at(meta: dict, row: int, col: int) -> tuple[int, int] | None:
    """The ``(layer, head)`` of the thumbnail holding cell ``(row, col)`` of
    an :func:`attention_heads` grid (``meta`` is its trace's), or None for a
    cell of the gaps between thumbnails."""
    step, tile = int(meta["step"]), int(meta["tile"])
    r, i = divmod(int(row), step)
    c, j = divmod(int(col), step)
    if i >= tile or j >= tile or not (0 <= r < len(meta["layers"]) and 0 <= c < len(meta["heads"])):
        return None
    return int(meta["layers"][r]), int(meta["heads"][c])


def thumbnail_outline(layers: Sequence[int], heads: Sequence[int],
                      selected: tuple[int, int] | None, *, tile: int) -> list[dict]:
    """The shapes of :func:`attention_heads`: an outline (named
    ``"selected"``) around the thumbnail of ``selected`` ``(layer, head)``,
    none when it is not on the grid. ``tile`` is the grid's (its trace's
    ``meta["tile"]``). A view moves the outline with these alone, without
    building the grid again."""
    if selected is None:
        return []
    layer, head = int(selected[0]), int(selected[1])
    rows, cols = [int(x) for x in layers], [int(h) for h in heads]
    if layer not in rows or head not in cols:
        return []
    step, pad = tile + _gap(tile), _gap(tile) / 2
    x0, y0 = cols.index(head) * step - 0.5 - pad, rows.index(layer) * step - 0.5 - pad
    return [{"type": "rect", "xref": "x", "yref": "y", "x0": x0, "x1": x0 + tile + 2 * pad,
             "y0": y0, "y1": y0 + tile + 2 * pad, "line": OUTLINE, "name": "selected"}]


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
