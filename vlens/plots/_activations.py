"""Figures over layers and tokens: heatmap, token strip, layer profile,
PCA of token activations (the logit-lens figures are in ``_lens``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go
import torch

from vlens.plots._cells import FONT_PX, cell_text_traces, readable
from vlens.plots._common import (
    SPAN_LINE,
    as_float,
    plain_text,
    prompt_boundary,
    span_shape,
    token_labels,
    token_text,
)
from vlens.plots._reductions import pca_2d

__all__ = ["activation_heatmap", "activation_pca", "colour_values", "layer_profile", "token_strip"]


def colour_values(
    values: torch.Tensor, *, per_layer: bool = True, log: bool | None = None
) -> tuple[torch.Tensor, bool, bool]:
    """What a heatmap colours, from ``values`` ``[n_layers, n_tokens]``.

    ``log`` (default: when every value is positive, as norms are) takes
    ``log10`` (signed values: ``sign(v) * log10(1 + |v|)``), so one huge
    token does not flatten the rest. ``per_layer`` then gives each layer
    (row) its own range: ``0`` at the row's minimum, ``1`` at its maximum
    (signed values: ``v / max |v|`` of the row, ``-1 … 1``), so every layer
    shows its own contrast however different the layers' magnitudes.
    Returns ``(z, signed, log)``.
    """
    v = as_float(values)
    signed = bool((v < 0).any())
    if log is None:
        log = bool(v.numel()) and bool((v > 0).all())
    if log:
        v = torch.sign(v) * torch.log10(1 + v.abs()) if signed else torch.log10(v.clamp_min(1e-12))
    if per_layer and v.dim() == 2 and v.numel():
        if signed:
            v = v / v.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        else:
            lo, hi = v.amin(dim=1, keepdim=True), v.amax(dim=1, keepdim=True)
            v = (v - lo) / (hi - lo).clamp_min(1e-12)
    return v, signed, bool(log)


def activation_heatmap(
    values: torch.Tensor,
    tokens: Sequence[str],
    layers: Sequence[int],
    *,
    quantity: str = "norm",
    title: str | None = None,
    layer: int | None = None,
    span: tuple[int, int] | None = None,
    n_prompt: int | None = None,
    per_layer: bool = True,
    log: bool | None = None,
) -> go.Figure:
    """Layer x token heatmap of ``values`` ``[n_layers, n_tokens]``.

    Rows are ``layers`` (top to bottom), columns the tokens. Colour: by
    default each layer on its own scale, log for positive values (see
    :func:`colour_values`; ``per_layer=False, log=False`` colours the raw
    values on one shared scale). The hover always gives the raw value
    (``customdata``). Optional marks: ``layer`` outlines that row, ``span``
    ``(start, stop)`` outlines those token columns, ``n_prompt`` draws a
    dotted line where generation starts.
    """
    values = as_float(values)
    if values.shape != (len(layers), len(tokens)):
        raise ValueError(
            f"values has shape {list(values.shape)}; expected "
            f"[{len(layers)} layers, {len(tokens)} tokens]"
        )
    z, signed, log = colour_values(values, per_layer=per_layer, log=log)
    how = ", ".join(x for x in ("per layer" if per_layer else "", "log" if log else "") if x)
    bar: dict = {"title": {"text": quantity + (f"<br>({how})" if how else "")}}
    if per_layer:
        bar.update(tickvals=[-1, 0, 1] if signed else [0, 1],
                   ticktext=["-max", "0", "+max"] if signed else ["layer min", "layer max"])
    elif log and not signed:
        lo, hi = (math.floor(float(z.min())), math.ceil(float(z.max()))) if z.numel() else (0, 1)
        bar.update(tickvals=list(range(lo, hi + 1)),
                   ticktext=[f"{10.0 ** e:g}" for e in range(lo, hi + 1)])
    ys = [f"layer {x}" for x in layers]
    fig = go.Figure(
        go.Heatmap(
            z=z.tolist(),
            customdata=values.tolist(),
            x=token_labels(tokens),
            y=ys,
            colorscale="RdBu" if signed else "Viridis",
            zmid=0 if signed else None,
            colorbar=bar,
            hovertemplate="%{y}, token %{x}<br>" + quantity
            + " %{customdata:.3f}<extra></extra>",
        )
    )
    shapes = span_shape(span, len(tokens)) + prompt_boundary(n_prompt, len(tokens))
    row = next((r for r, x in enumerate(layers) if x == layer), None)  # the figure's row
    if layer is not None and row is not None:
        shapes.append(
            {
                "type": "rect",
                "xref": "paper",
                "yref": "y",
                "x0": 0,
                "x1": 1,
                "y0": row - 0.5,
                "y1": row + 0.5,
                "line": {"color": "white", "width": 2},
                "name": "layer",
            }
        )
    readable(fig, title or f"{quantity} by layer and token",
             height=max(300, 170 + 28 * len(layers)))
    fig.update_layout(
        xaxis={"title": "token", "tickfont": {"size": FONT_PX}},
        yaxis={"title": "layer", "autorange": "reversed", "tickfont": {"size": FONT_PX}},
        shapes=shapes,
        margin={"b": 40},
    )
    return fig


def token_strip(
    values: Sequence[float] | torch.Tensor,
    tokens: Sequence[str],
    *,
    n_prompt: int | None = None,
    quantity: str = "value",
    title: str | None = None,
    width: int = 16,
    span: tuple[int, int] | None = None,
) -> go.Figure:
    """The tokens as coloured cells, ``width`` per line, coloured by ``values``
    ``[n_tokens]`` (one layer's quantity). Generated tokens (index >=
    ``n_prompt``) are shown in italics; the hover says which part each is.

    The heatmap's ``z`` and ``text`` are ``[lines, width]`` (padded with
    ``None`` / ``""``); ``customdata`` holds each cell's token index.
    """
    vals = as_float(values).reshape(-1)
    n = len(tokens)
    if vals.shape[0] != n:
        raise ValueError(f"{vals.shape[0]} values for {n} tokens")
    if n == 0:
        raise ValueError("no tokens to show")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    lines = max(1, math.ceil(n / width))
    z: list[list[float | None]] = [[None] * width for _ in range(lines)]
    text = [[""] * width for _ in range(lines)]
    index: list[list[int | None]] = [[None] * width for _ in range(lines)]
    part = [[""] * width for _ in range(lines)]
    for i, tok in enumerate(tokens):
        r, c = divmod(i, width)
        generated = n_prompt is not None and i >= n_prompt
        z[r][c] = float(vals[i])
        text[r][c] = f"<i>{token_text(tok)}</i>" if generated else token_text(tok)
        index[r][c] = i
        part[r][c] = "generated" if generated else "prompt"
    customdata = [[[index[r][c], part[r][c]] for c in range(width)] for r in range(lines)]
    signed = float(vals.min()) < 0
    # signed values: diverging around 0; unsigned (norms): sequential
    reach = float(vals.abs().max()) or 1.0
    lo, hi = (-reach, reach) if signed else (float(vals.min()), float(vals.max()))
    heat = go.Heatmap(
        z=z,
        text=text,
        customdata=customdata,
        colorscale="RdBu" if signed else "Blues",
        zmid=0 if signed else None,
        zmin=lo,
        zmax=hi if hi > lo else lo + 1.0,
        colorbar={"title": {"text": quantity}},
        xgap=2,
        ygap=2,
        hovertemplate="token %{customdata[0]} (%{customdata[1]})<br>"
        + quantity
        + " %{z:.3f}<extra></extra>",
    )
    fig = go.Figure([heat, *cell_text_traces(heat, text)])
    shapes = []
    if span is not None and span[1] > span[0]:
        for i in range(max(0, span[0]), min(n, span[1])):
            r, c = divmod(i, width)
            shapes.append(
                {
                    "type": "rect",
                    "x0": c - 0.5,
                    "x1": c + 0.5,
                    "y0": r - 0.5,
                    "y1": r + 0.5,
                    "line": SPAN_LINE,
                    "name": "span",
                }
            )
    readable(fig, title or f"{quantity} per token", height=130 + 44 * lines)
    fig.update_layout(
        xaxis={"visible": False},
        yaxis={"visible": False, "autorange": "reversed"},
        shapes=shapes,
        margin={"b": 10},
    )
    return fig


def layer_profile(
    values: torch.Tensor, layers: Sequence[int], *, name: str, quantity: str = "mean norm"
) -> go.Figure:
    """One line: a per-layer quantity ``[n_layers]``."""
    values = as_float(values)
    fig = go.Figure(
        go.Scatter(x=list(layers), y=values.tolist(), mode="lines+markers", name=name)
    )
    fig.update_layout(
        title=f"{quantity} by layer", xaxis_title="layer", yaxis_title=quantity,
        # layers are whole numbers: one tick per layer, never 0.5
        xaxis={"tickmode": "array", "tickvals": list(layers)},
    )
    return fig


def activation_pca(
    points: torch.Tensor,
    groups: Sequence[str],
    *,
    hover: Sequence[str] | None = None,
    layer: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """2-D PCA of token activations ``[n, hidden]``, one colour per group.

    ``groups`` ``[n]`` names each point's prompt (one trace per group, in
    first-seen order); ``hover`` ``[n]`` labels each point (its token).
    Axis titles give each component's share of the variance.
    """
    points = as_float(points)
    if points.dim() != 2 or len(groups) != points.shape[0]:
        raise ValueError(
            f"points must be [n, hidden] with one group per point; got "
            f"{list(points.shape)} and {len(groups)} groups"
        )
    if hover is not None and len(hover) != points.shape[0]:
        raise ValueError(f"{len(hover)} hover labels for {points.shape[0]} points")
    coords, explained = pca_2d(points)
    fig = go.Figure()
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        fig.add_trace(
            go.Scatter(
                x=coords[idx, 0].tolist(),
                y=coords[idx, 1].tolist(),
                mode="markers",
                name=str(g),
                text=[plain_text(hover[i]) for i in idx] if hover is not None else None,
                hovertemplate="%{text}<extra>%{fullData.name}</extra>"
                if hover is not None
                else None,
            )
        )
    where = "" if layer is None else f" at layer {layer}"
    fig.update_layout(
        title={"text": title or f"token activations{where}, first two principal components"},
        xaxis_title=f"PC1 ({explained[0]:.0%} of variance)",
        yaxis_title=f"PC2 ({explained[1]:.0%} of variance)",
        legend_title_text="prompt",
    )
    return fig
