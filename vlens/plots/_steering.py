"""Steering figures: a metric against scale, baseline vs steered."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from vlens.plots._common import SPAN_LINE, nan_list, plain_text
from vlens.plots._reductions import first_divergence

__all__ = ["baseline_vs_steered", "dose_response"]


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
    fig.update_layout(
        title={"text": title or f"{metric} against {x}"},
        xaxis_title=x,
        yaxis_title=metric,
        showlegend=by is not None,
    )
    return fig


def baseline_vs_steered(
    tokens_base: Sequence[str],
    tokens_steered: Sequence[str],
    logprob_base: Sequence[float | None],
    logprob_steered: Sequence[float | None],
    *,
    positions: Sequence[int] | None = None,
    divergence: int | None = None,
    n_prompt: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """Two panels sharing the token axis.

    Top: per-token logprob delta (steered - baseline), one bar per position
    (``None`` entries, e.g. the first token's, are gaps). Bottom: the two
    token sequences as rows (``baseline`` and ``steered``), coloured by each
    token's logprob, with the first divergence outlined (computed from the
    tokens when ``divergence`` is not given). All inputs are ``[n]`` for the
    same positions; shorter sequences are padded with blanks. ``positions``
    ``[n]`` labels the x axis (default ``0 … n-1``); ``divergence`` and
    ``n_prompt`` are in the same units.
    """
    from plotly.subplots import make_subplots

    n = max(len(tokens_base), len(tokens_steered))

    def pad(seq, fill):
        return list(seq) + [fill] * (n - len(seq))

    tb, ts = pad(tokens_base, ""), pad(tokens_steered, "")
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
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4]
    )
    fig.add_trace(
        go.Bar(
            x=xs,
            y=delta,
            name="logprob delta",
            marker_color=["#2ca02c" if d is not None and d >= 0 else "#d62728" for d in delta],
            customdata=[[plain_text(b), plain_text(s)] for b, s in zip(tb, ts)],
            hovertemplate="position %{x}: %{customdata[0]} → %{customdata[1]}"
            "<br>Δ logprob %{y:.3f}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            x=xs,
            y=["baseline", "steered"],
            z=[lb, ls],
            text=[[plain_text(t) for t in tb], [plain_text(t) for t in ts]],
            texttemplate="%{text}",
            textfont={"size": 12},
            colorscale="Greys",
            reversescale=True,
            showscale=False,
            name="tokens",
            hovertemplate="%{y} position %{x}: %{text}<br>logprob %{z:.3f}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    shapes = _divergence_shapes(divergence, n_prompt, xs)
    where = "no divergence" if divergence is None else f"first divergence at position {divergence}"
    fig.update_layout(
        title={"text": title or f"baseline vs steered ({where})"},
        showlegend=False,
        shapes=shapes,
        height=420,
    )
    fig.update_yaxes(title_text="Δ logprob", row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_xaxes(title_text="position", row=2, col=1)
    return fig


def _divergence_shapes(divergence: int | None, n_prompt: int | None,
                       xs: list[int]) -> list[dict]:
    """The first divergence outlined on the token rows, and the
    prompt|generated boundary on both panels (positions in ``xs`` units)."""
    shapes = []
    if divergence is not None:
        shapes.append(
            {
                "type": "rect",
                "xref": "x2",
                "yref": "y2",
                "x0": divergence - 0.5,
                "x1": divergence + 0.5,
                "y0": -0.5,
                "y1": 1.5,
                "line": SPAN_LINE,
                "name": "first divergence",
            }
        )
    if n_prompt is not None and xs[0] < n_prompt <= xs[-1]:
        for ref in ("", "2"):
            shapes.append(
                {
                    "type": "line",
                    "xref": f"x{ref}",
                    "yref": f"y{ref} domain",
                    "x0": n_prompt - 0.5,
                    "x1": n_prompt - 0.5,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": "grey", "dash": "dot"},
                    "name": "prompt|generated",
                }
            )
    return shapes
