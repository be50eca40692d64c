"""Logit-lens figures: tokens down, layers across, so a long text stays
legible (one row per token, however many tokens; the cell text is as large
as in a table).

* :func:`logit_lens_grid` -- each cell the top next token at that layer,
  coloured by its probability; the hover lists the top-k.
* :func:`logit_lens_track` -- one chosen token's probability (or rank) at
  every layer and position: where does the model start to say it?
* :func:`lens_token_values` -- that token's probability and rank from a
  top-k read (unknown where it is not among the k).

Inputs are ``[n_layers, n_tokens]`` (or ``[n_layers, n_tokens, k]``), as
``Trace.logit_lens`` gives them; the figures are transposed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
import torch

from vlens.plots._cells import CHAR_PX, FONT_PX, cell_text_traces, labels_fit, readable
from vlens.plots._common import as_float, plain_text, token_labels, token_text

__all__ = ["lens_row_marks", "lens_token_values", "logit_lens_grid", "logit_lens_track"]

ROW_PX = 24  # one token row: room for 14 px text and no overlap
MARGIN = {"l": 130, "r": 20, "t": 90, "b": 20}


def _fit(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters (an ellipsis marks the cut)."""
    return text if len(text) <= chars else text[: max(1, chars - 1)] + "…"


def _cell_px(n_layers: int, width: int) -> float:
    """One cell's width when the plot is ``width`` px."""
    return (width - MARGIN["l"] - MARGIN["r"] - 90) / max(1, n_layers)  # 90: colour bar


def _cell_chars(n_layers: int, width: int) -> int:
    """How many characters fit in one cell when the plot is ``width`` px."""
    return max(2, int(_cell_px(n_layers, width) / CHAR_PX) - 1)


def lens_row_marks(span: tuple[int, int] | None, n_prompt: int | None, n: int) -> list[dict]:
    """The shapes of a lens figure of ``n`` token rows: the span outline
    (rows ``[start, stop)``) and the prompt|generated line. A view moves the
    outline with these alone, without building the grid again."""
    shapes = []
    if span is not None and span[1] > span[0]:
        shapes.append({
            "type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
            "y0": max(0, span[0]) - 0.5, "y1": min(n, span[1]) - 0.5,
            "line": {"color": "#d62728", "width": 2}, "name": "span",
        })
    if n_prompt is not None and 0 < n_prompt < n:
        shapes.append({
            "type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
            "y0": n_prompt - 0.5, "y1": n_prompt - 0.5,
            "line": {"color": "#ff7f0e", "width": 2, "dash": "dot"},
            "name": "prompt|generated",
        })
    return shapes


def _layout(fig: go.Figure, title: str, labels: list[str], n: int, shapes: list[dict],
            width: int | None) -> None:
    readable(fig, title, height=MARGIN["t"] + MARGIN["b"] + ROW_PX * n, top=MARGIN["t"])
    fig.update_layout(
        title={"y": 0.995, "yanchor": "top"},
        width=width,
        margin={k: v for k, v in MARGIN.items() if k != "t"},
        # every token labelled, in reading order, top to bottom
        yaxis={"title": "input token", "autorange": "reversed", "tickmode": "array",
               "tickvals": labels, "ticktext": labels, "tickfont": {"size": FONT_PX}},
        xaxis={"title": "layer", "side": "top", "tickfont": {"size": FONT_PX}},
        shapes=shapes,
    )


def _top_k(top_tokens: Sequence[Any], top_probs: Any, n_layers: int, n_tokens: int):
    """``(words [L][T][k], probs [L, T, k])`` from 2-D or 3-D inputs."""
    probs = as_float(top_probs)
    if probs.dim() == 2:
        probs = probs.unsqueeze(-1)
        words = [[[w] for w in row] for row in top_tokens]
    else:
        words = [[list(cell) for cell in row] for row in top_tokens]
    if (probs.shape[:2] != (n_layers, n_tokens) or len(words) != n_layers
            or any(len(row) != n_tokens for row in words)):
        raise ValueError(
            f"top_probs has shape {list(probs.shape)} and top_tokens {len(words)} rows; "
            f"expected [{n_layers} layers, {n_tokens} tokens] (or [..., k])"
        )
    return words, probs


def logit_lens_grid(
    top_tokens: Sequence[Sequence[Any]],
    top_probs: Any,
    tokens: Sequence[str],
    layers: Sequence[int],
    *,
    title: str | None = None,
    span: tuple[int, int] | None = None,
    n_prompt: int | None = None,
    width: int | None = None,
) -> go.Figure:
    """Token x layer grid of the top next token, coloured by its probability.

    ``top_tokens`` (strings) and ``top_probs`` are ``[n_layers, n_tokens]``
    or ``[n_layers, n_tokens, k]`` (top-k, best first: the cell shows the
    first, the hover all ``k``). Row ``i`` is what each layer predicts after
    reading token ``i``; ``n_prompt`` draws a line where generation starts,
    ``span`` outlines rows ``[start, stop)``. Text longer than a cell (many
    layers, ``width`` px wide: default 900) is cut, the hover has it whole.
    The heatmap's ``z``, ``text`` and ``customdata`` are ``[n_tokens, n_layers]``.
    """
    words, probs = _top_k(top_tokens, top_probs, len(layers), len(tokens))
    n_l, n_t, k = probs.shape
    chars = _cell_chars(n_l, width or 900)
    cols = [f"layer {x}" for x in layers]
    z = probs[..., 0].T.tolist()
    p = probs.tolist()  # plain floats: indexing a tensor per value is slow
    shown: dict[str, str] = {}  # each distinct word's hover text, made once

    def word(w: Any) -> str:
        got = shown.get(w)
        if got is None:
            got = shown[w] = token_text(str(w))
        return got

    text = [[token_text(_fit(str(words[l][t][0]), chars)) for l in range(n_l)]
            for t in range(n_t)]
    hover = [["<br>".join(f"{word(w)}: {v:.3f}" for w, v in zip(words[l][t], p[l][t]))
              for l in range(n_l)] for t in range(n_t)]
    labels = token_labels(tokens)
    heat = go.Heatmap(
        z=z, x=cols, y=labels, text=text, customdata=hover,
        colorscale="Blues", zmin=0, zmax=1, xgap=1, ygap=1,
        colorbar={"title": {"text": "p(top)"}, "len": min(1.0, 400 / (ROW_PX * n_t + 1))},
        hovertemplate=("after %{y}, %{x}<br>top " + str(k) + " next:<br>%{customdata}"
                       "<extra></extra>"),
    )
    fig = go.Figure([heat, *cell_text_traces(heat, text)])
    _layout(fig, title or f"logit lens: top next token per layer ({n_t} tokens)", labels,
            n_t, lens_row_marks(span, n_prompt, n_t), width)
    return fig


def lens_token_values(ids: torch.Tensor, probs: torch.Tensor,
                      token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's place in a top-k logit-lens read.

    ``ids`` and ``probs`` are ``[layers, tokens, k]`` (``Trace.logit_lens``).
    Returns ``(p, rank, floor)``, each ``[layers, tokens]``: the token's
    probability and 1-based rank where it is among the k, NaN where it is
    not; ``floor`` is the k-th probability there (the token's probability
    is below it).
    """
    ids, probs = torch.as_tensor(ids), as_float(probs)
    hit = ids == int(token_id)  # [L, T, k], at most one True per cell
    found = hit.any(-1)
    nan = torch.full(found.shape, math.nan)
    p = torch.where(found, (probs * hit).sum(-1), nan)
    rank = torch.where(found, hit.float().argmax(-1).float() + 1, nan)
    return p, rank, probs[..., -1]


def logit_lens_track(
    values: Any,
    tokens: Sequence[str],
    layers: Sequence[int],
    *,
    token: str,
    quantity: str = "probability",
    floor: Any = None,
    k: int | None = None,
    title: str | None = None,
    span: tuple[int, int] | None = None,
    n_prompt: int | None = None,
    width: int | None = None,
) -> go.Figure:
    """Token x layer grid of one token's ``probability`` or ``rank``
    (``values`` ``[n_layers, n_tokens]``, NaN where unknown).

    Read it as "after token ``i``, how sure is layer ``l`` that ``token``
    comes next?". Unknown cells (the token was not in a top-``k`` read)
    show ``–``, their hover says the probability is below ``floor``
    (``[n_layers, n_tokens]``, the k-th probability there). The values are
    written in the cells only where they fit (at ``width`` px, default 900,
    four characters fit up to 17 layers); the hover always has them.
    """
    if quantity not in ("probability", "rank"):
        raise ValueError(f"quantity must be 'probability' or 'rank', got {quantity!r}")
    vals = as_float(values)
    n_l, n_t = len(layers), len(tokens)
    if vals.shape != (n_l, n_t):
        raise ValueError(f"values has shape {list(vals.shape)}; expected "
                         f"[{n_l} layers, {n_t} tokens]")
    fl = None if floor is None else as_float(floor)
    known = ~torch.isnan(vals)
    v_rows, known_rows = vals.T.tolist(), known.T.tolist()  # plain values, not tensor indexing
    if quantity == "probability":
        z = vals
        text = [[f"{v:.2f}" if ok else "–" for v, ok in zip(r, kn)]
                for r, kn in zip(v_rows, known_rows)]
        scale = {"colorscale": "Viridis", "zmin": 0, "zmax": 1}
        bar = f"p({plain_text(token)})"
    else:
        z = torch.log10(vals.clamp_min(1))  # rank 1 -> 0: the brightest
        text = [[f"#{int(v)}" if ok else "–" for v, ok in zip(r, kn)]
                for r, kn in zip(v_rows, known_rows)]
        top = max(1.0, float(z[known].max()) if known.any() else 1.0)
        scale = {"colorscale": "Viridis", "reversescale": True, "zmin": 0, "zmax": top,
                 "colorbar_tickvals": [0, 1, 2, 3, 4][: int(top) + 1],
                 "colorbar_ticktext": ["1", "10", "100", "1k", "10k"][: int(top) + 1]}
        bar = f"rank of {plain_text(token)}"
    word = plain_text(token)
    hover = []
    fl_rows = None if fl is None else fl.T.tolist()
    for t in range(n_t):
        row = []
        for li in range(n_l):
            if known_rows[t][li]:
                v = v_rows[t][li]
                row.append(f"p({word}) = {v:.4f}" if quantity == "probability"
                           else f"{word} is #{int(v)}")
            elif fl_rows is not None:
                row.append(f"{word} not in the top {k or ''}: p < {fl_rows[t][li]:.3f}")
            else:
                row.append(f"{word}: unknown")
        hover.append(row)
    labels = token_labels(tokens)
    cb = {key.split("_", 1)[1]: scale.pop(key)
          for key in list(scale) if key.startswith("colorbar_")}
    heat = go.Heatmap(
        z=[[None if math.isnan(x) else x for x in row] for row in z.T.tolist()],
        x=[f"layer {x}" for x in layers], y=labels, text=text, customdata=hover,
        xgap=1, ygap=1,
        colorbar={"title": {"text": bar}, "len": min(1.0, 400 / (ROW_PX * n_t + 1)), **cb},
        hovertemplate="after %{y}, %{x}<br>%{customdata}<extra></extra>",
        **scale,
    )
    fits = labels_fit(text, _cell_px(n_l, width or 900))
    fig = go.Figure([heat, *(cell_text_traces(heat, text) if fits else [])])
    _layout(fig, title or f"logit lens: {quantity} of {word!r} next, per layer", labels,
            n_t, lens_row_marks(span, n_prompt, n_t), width)
    return fig
