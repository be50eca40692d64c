"""Steering figures: a metric against scale, baseline vs steered."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from vlens.plots._cells import readable
from vlens.plots._common import nan_list, plain_text
from vlens.plots._token_rows import (
    GAP_PX,
    PER_LINE,
    ROW_PX,
    TokenRow,
    add_token_rows,
    cell_lines,
    named_scale,
)
from vlens.tokens import first_divergence, visible

__all__ = ["baseline_vs_steered", "dose_response"]

#: the token cells' colours: the probability of each token, white 0 to dark blue 1
TOKEN_COLOURS = "Blues"


def dose_response(
    frame: Any,
    metric: str = "kl_mean",
    *,
    x: str = "scale",
    by: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """A steering metric against scale: one line (per ``by`` group).

    ``frame`` is tidy (a pandas DataFrame such as ``sweep.to_frame()``) with
    numeric columns ``x`` and ``metric``; rows are sorted by ``x``. Typical
    metrics: ``mean_logprob`` (of the tokens the model chose),
    ``kl_from_baseline``, or a token-set probability column you add.
    Hover shows the ``text`` column when there is one.
    """
    for col in (x, metric) + ((by,) if by else ()):
        if col not in frame.columns:
            raise ValueError(
                f"frame has no column {col!r}; it has {', '.join(map(str, frame.columns))}"
            )
    groups = [(None, frame)] if by is None else list(frame.groupby(by, sort=True))
    fig = go.Figure()
    for key, part in groups:
        part = part.sort_values(x)
        hover = part["text"].astype(str).str.slice(0, 80).tolist() if "text" in part else None
        fig.add_trace(
            go.Scatter(
                x=part[x].tolist(),
                y=[None if math.isnan(v) else v for v in part[metric].astype(float).tolist()],
                mode="lines+markers",
                name=metric if key is None else f"{by} {key}",
                text=hover,
                hovertemplate=f"{x} %{{x}}<br>{metric} %{{y:.3f}}"
                + ("<br>%{text}" if hover else "")
                + "<extra></extra>",
            )
        )
    readable(fig, title or f"{metric} against {x}", cells=False)
    fig.update_layout(
        xaxis_title=x,
        yaxis_title=metric,
        showlegend=by is not None,
    )
    return fig


def baseline_vs_steered(
    tokens_base: Sequence[str | None],
    tokens_steered: Sequence[str | None],
    logprob_base: Sequence[float | None],
    logprob_steered: Sequence[float | None],
    *,
    positions: Sequence[int] | None = None,
    divergence: int | None = None,
    n_prompt: int | None = None,
    title: str | None = None,
    label: str = "steered",
    per_line: int = PER_LINE,
) -> go.Figure:
    """Two panels over the same positions.

    Top: per-token logprob delta (``label`` - baseline), one bar per
    position (``None`` entries, e.g. the first token's, are gaps). Bottom:
    the two token sequences as rows of cells (``"baseline"`` and ``label``:
    ``"steered"``, ``"ablated"``, ``"clamped"``), each token in its own
    cell with its whitespace visible, coloured by the token's probability
    (``exp(logprob)``, white 0 to dark blue 1) with black or white text,
    whichever reads better; a long run wraps every ``per_line`` tokens
    (see :mod:`vlens.plots._token_rows`). The first divergence is outlined
    (computed from the tokens when ``divergence`` is not given) and named
    in the title. All inputs are ``[n]`` for the same positions; shorter
    sequences are padded with blanks (``None`` tokens are blanks too).
    ``positions`` ``[n]`` labels them (default ``0 … n-1``); ``divergence``
    and ``n_prompt`` are in the same units. The height follows the number
    of lines; the width is the page's.
    """
    from plotly.subplots import make_subplots

    n = max(len(tokens_base), len(tokens_steered))

    def pad(seq, fill):
        return list(seq) + [fill] * (n - len(seq))

    tb, ts = pad(tokens_base, None), pad(tokens_steered, None)
    lb, ls = nan_list(pad(logprob_base, None)), nan_list(pad(logprob_steered, None))
    xs = list(range(n)) if positions is None else [int(p) for p in positions]
    if len(xs) != n:
        raise ValueError(f"{len(xs)} positions for {n} tokens")
    if divergence is None:
        i = first_divergence(list(tokens_base), list(tokens_steered))
        divergence = None if i is None else xs[i]
    delta = [s - b for b, s in zip(lb, ls)]
    # gaps as None, not NaN: a FigureWidget sends its data as strict JSON
    delta, lb, ls = ([None if math.isnan(v) else v for v in seq] for seq in (delta, lb, ls))
    words = [[_word(t) for t in seq] for seq in (tb, ts)]
    bars_px, spacing_px = 190, 70
    # lines the token rows take: the same breaks add_token_rows makes
    n_lines = len(cell_lines(list(zip(tb, ts)), per_line)[1])
    rows_px = n_lines * (2 * ROW_PX + GAP_PX) + 10
    total = bars_px + spacing_px + rows_px
    fig = make_subplots(rows=2, cols=1, vertical_spacing=spacing_px / total,
                        row_heights=[bars_px / total, rows_px / total])
    fig.add_trace(
        go.Bar(
            x=xs,
            y=delta,
            name="logprob delta",
            marker_color=["#2ca02c" if d is not None and d >= 0 else "#d62728" for d in delta],
            customdata=[[a, b] for a, b in zip(*words)],
            hovertemplate="position %{x}: %{customdata[0]} → %{customdata[1]}"
            "<br>Δ logprob %{y:.3f}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    probs = [[None if v is None else math.exp(v) for v in seq] for seq in (lb, ls)]
    hover = [[("" if v is None else f"logprob {v:.3f}, p {math.exp(v):.3f}") for v in seq]
             for seq in (lb, ls)]
    add_token_rows(
        fig, [TokenRow("baseline", tb, probs[0], hover[0]),
              TokenRow(label, ts, probs[1], hover[1])],
        xs, colorscale=named_scale(TOKEN_COLOURS), zmin=0.0, zmax=1.0, value_name="p",
        axes=("x2", "y2"), subplot={"row": 2, "col": 1}, mark=divergence,
        n_prompt=n_prompt, per_line=per_line)
    if n_prompt is not None and xs and xs[0] < n_prompt <= xs[-1]:
        fig.add_shape(type="line", xref="x", yref="y domain", x0=n_prompt - 0.5,
                      x1=n_prompt - 0.5, y0=0, y1=1, line={"color": "grey", "dash": "dot"},
                      name="prompt|generated")
    where = "no divergence" if divergence is None else f"first divergence at position {divergence}"
    readable(fig, title or f"baseline vs {label}: {where}", height=total + 90, top=70)
    fig.update_layout(showlegend=False, margin={"b": 20, "l": 90, "r": 20})
    fig.update_yaxes(title_text="Δ logprob", gridcolor="#dddddd", zerolinecolor="#999999",
                     row=1, col=1)
    fig.update_xaxes(title_text="position", row=1, col=1)
    return fig


def _word(token: str | None) -> str:
    """A token as the hover writes it (a blank: nothing)."""
    return "" if token is None else plain_text(visible(token))
