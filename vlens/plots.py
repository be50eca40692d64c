"""Plot builders: data in, ``plotly.graph_objects.Figure`` out.

Pure functions: no engine, no display, no session. Widgets, notebooks and
the demo report call them; tests assert on the returned figure's data.
Tokens are shown as ``"position:token"`` category labels because plotly
merges identical categories (two ``"the"`` tokens would share a column).

A few small reductions live here too (:func:`activation_values`,
:func:`first_divergence`, :func:`pca_2d`): they turn what a run holds into
the arrays a builder takes, and are pure in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
import torch

__all__ = [
    "QUANTITIES",
    "activation_heatmap",
    "activation_pca",
    "activation_values",
    "baseline_vs_steered",
    "dose_response",
    "first_divergence",
    "layer_profile",
    "logit_lens_grid",
    "pca_2d",
    "plain_text",
    "token_labels",
    "token_strip",
]

#: what :func:`activation_values` can compute per token
QUANTITIES = ("norm", "projection", "cosine", "neuron")

_SPAN_LINE = {"color": "#d62728", "width": 2}


def plain_text(text: str) -> str:
    """``text`` as plotly shows it literally: plotly reads ``<b>``, ``<s>``,
    ``<br>`` … in labels as markup, so a ``<s>`` token would vanish."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def token_labels(tokens: Sequence[str]) -> list[str]:
    """``["0:the", "1:cat", …]``: unique category labels for tokens (plotly
    merges identical categories), markup-escaped (:func:`plain_text`)."""
    return [f"{i}:{plain_text(t)}" for i, t in enumerate(tokens)]


_labels = token_labels  # the demo's name for it


def _as_float(values: Any) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32)


def _nan_list(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


# -- reductions ---------------------------------------------------------------


def activation_values(
    acts: torch.Tensor,
    quantity: str = "norm",
    *,
    direction: torch.Tensor | None = None,
    neuron: int | None = None,
) -> torch.Tensor:
    """One number per token: ``[..., tokens, hidden]`` -> ``[..., tokens]``.

    * ``"norm"`` -- L2 norm of the activation;
    * ``"projection"`` -- dot product with ``direction`` divided by its norm
      (the length of the activation along the direction, same units);
    * ``"cosine"`` -- cosine similarity to ``direction`` (-1 … 1);
    * ``"neuron"`` -- the value of hidden unit ``neuron``.
    """
    acts = _as_float(acts)
    if quantity == "norm":
        return acts.norm(dim=-1)
    if quantity == "neuron":
        if neuron is None or not 0 <= int(neuron) < acts.shape[-1]:
            raise ValueError(
                f"quantity 'neuron' needs neuron= between 0 and {acts.shape[-1] - 1}, "
                f"got {neuron!r}"
            )
        return acts[..., int(neuron)].clone()
    if quantity in ("projection", "cosine"):
        if direction is None:
            raise ValueError(
                f"quantity {quantity!r} needs a direction= (a [hidden] vector), "
                "for example one from session.direction(...)"
            )
        d = _as_float(direction).reshape(-1)
        if d.shape[0] != acts.shape[-1]:
            raise ValueError(
                f"direction has {d.shape[0]} entries but activations have hidden "
                f"size {acts.shape[-1]}"
            )
        unit = d / d.norm().clamp_min(1e-12)
        proj = acts @ unit
        if quantity == "projection":
            return proj
        return proj / acts.norm(dim=-1).clamp_min(1e-12)
    raise ValueError(f"unknown quantity {quantity!r}: pick one of {', '.join(QUANTITIES)}")


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first place two token sequences differ (a length
    difference counts at the shorter length); ``None`` when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


def pca_2d(points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal-component projection of ``[n, hidden]`` points.

    Returns ``(coords [n, 2], explained [2])`` where ``explained`` is each
    component's share of the total variance. Signs are fixed (the largest
    loading of each component is positive) so plots do not flip between
    runs. Fewer than two usable components give zeros in that column.
    """
    x = _as_float(points)
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"points must be [n, hidden] with n >= 1, got {list(x.shape)}")
    centered = x - x.mean(0, keepdim=True)
    _, s, vh = torch.linalg.svd(centered, full_matrices=False)
    comps = torch.zeros(2, x.shape[1])
    k = min(2, vh.shape[0])
    comps[:k] = vh[:k]
    for i in range(k):
        if comps[i, comps[i].abs().argmax()] < 0:
            comps[i] = -comps[i]
    var = s.pow(2)
    total = var.sum()
    explained = torch.zeros(2)
    if total > 0:
        explained[:k] = var[:k] / total
    return centered @ comps.T, explained


# -- figures ------------------------------------------------------------------


def _span_shape(span: tuple[int, int] | None, n: int, *, yref: str = "paper") -> list[dict]:
    if span is None or span[1] <= span[0]:
        return []
    start, stop = max(0, span[0]), min(n, span[1])
    return [
        {
            "type": "rect",
            "xref": "x",
            "yref": yref,
            "x0": start - 0.5,
            "x1": stop - 0.5,
            "y0": 0,
            "y1": 1,
            "line": _SPAN_LINE,
            "name": "span",
        }
    ]


def _prompt_boundary(n_prompt: int | None, n: int) -> list[dict]:
    if n_prompt is None or not 0 < n_prompt < n:
        return []
    return [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": n_prompt - 0.5,
            "x1": n_prompt - 0.5,
            "y0": 0,
            "y1": 1,
            "line": {"color": "white", "width": 2, "dash": "dot"},
            "name": "prompt|generated",
        }
    ]


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
) -> go.Figure:
    """Layer x token heatmap of ``values`` ``[n_layers, n_tokens]``.

    Rows are ``layers`` (top to bottom), columns the tokens. Optional marks:
    ``layer`` outlines that row, ``span`` ``(start, stop)`` outlines those
    token columns, ``n_prompt`` draws a dotted line where generation starts.
    """
    values = _as_float(values)
    if values.shape != (len(layers), len(tokens)):
        raise ValueError(
            f"values has shape {list(values.shape)}; expected "
            f"[{len(layers)} layers, {len(tokens)} tokens]"
        )
    ys = [f"layer {x}" for x in layers]
    fig = go.Figure(
        go.Heatmap(
            z=values.tolist(),
            x=token_labels(tokens),
            y=ys,
            colorscale="Viridis",
            colorbar={"title": {"text": quantity}},
            hovertemplate="%{y}, token %{x}<br>" + quantity + " %{z:.3f}<extra></extra>",
        )
    )
    shapes = _span_shape(span, len(tokens)) + _prompt_boundary(n_prompt, len(tokens))
    if layer is not None and layer in list(layers):
        row = list(layers).index(layer)
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
    fig.update_layout(
        title={"text": title or f"{quantity} by layer and token"},
        xaxis_title="token",
        yaxis_title="layer",
        yaxis={"autorange": "reversed"},
        shapes=shapes,
        margin={"t": 50, "b": 40},
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
    vals = _as_float(values).reshape(-1)
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
        text[r][c] = f"<i>{plain_text(tok)}</i>" if generated else plain_text(tok)
        index[r][c] = i
        part[r][c] = "generated" if generated else "prompt"
    customdata = [[[index[r][c], part[r][c]] for c in range(width)] for r in range(lines)]
    signed = float(vals.min()) < 0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            texttemplate="%{text}",
            customdata=customdata,
            # signed values: diverging around 0; unsigned (norms): sequential
            colorscale="RdBu" if signed else "Blues",
            zmid=0 if signed else None,
            textfont={"size": 12},
            colorbar={"title": {"text": quantity}},
            xgap=2,
            ygap=2,
            hovertemplate="token %{customdata[0]} (%{customdata[1]})<br>"
            + quantity
            + " %{z:.3f}<extra></extra>",
        )
    )
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
                    "line": _SPAN_LINE,
                    "name": "span",
                }
            )
    fig.update_layout(
        title={"text": title or f"{quantity} per token"},
        xaxis={"visible": False},
        yaxis={"visible": False, "autorange": "reversed"},
        height=120 + 40 * lines,
        shapes=shapes,
        margin={"t": 50, "b": 10},
    )
    return fig


def layer_profile(
    values: torch.Tensor, layers: Sequence[int], *, name: str, quantity: str = "mean norm"
) -> go.Figure:
    """One line: a per-layer quantity ``[n_layers]``."""
    values = _as_float(values)
    fig = go.Figure(
        go.Scatter(x=list(layers), y=values.tolist(), mode="lines+markers", name=name)
    )
    fig.update_layout(title=f"{quantity} by layer", xaxis_title="layer", yaxis_title=quantity)
    return fig


def logit_lens_grid(
    top_tokens: Sequence[Sequence[str]],
    top_probs: torch.Tensor,
    tokens: Sequence[str],
    layers: Sequence[int],
    *,
    title: str | None = None,
    span: tuple[int, int] | None = None,
) -> go.Figure:
    """Layer x position grid: colour = probability of the top next token,
    text = that token. ``top_tokens`` and ``top_probs`` are
    ``[n_layers, n_tokens]``; column ``i`` is what layer ``l`` predicts
    after reading token ``i``."""
    top_probs = _as_float(top_probs)
    if top_probs.shape != (len(layers), len(tokens)) or len(top_tokens) != len(layers):
        raise ValueError(
            f"top_probs has shape {list(top_probs.shape)} and top_tokens "
            f"{len(top_tokens)} rows; expected [{len(layers)} layers, {len(tokens)} tokens]"
        )
    fig = go.Figure(
        go.Heatmap(
            z=top_probs.tolist(),
            x=token_labels(tokens),
            y=[f"layer {layer}" for layer in layers],
            text=[[plain_text(t) for t in row] for row in top_tokens],
            texttemplate="%{text}",
            textfont={"size": 10},
            colorscale="Blues",
            zmin=0,
            zmax=1,
            colorbar={"title": {"text": "p(top)"}},
            hovertemplate="%{y}, after %{x}<br>next: %{text} (p %{z:.2f})<extra></extra>",
        )
    )
    fig.update_layout(
        title={"text": title or "logit lens: top next token per layer"},
        xaxis_title="input token",
        yaxis_title="layer",
        yaxis={"autorange": "reversed"},
        shapes=_span_shape(span, len(tokens)),
    )
    return fig


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
                y=part[metric].astype(float).tolist(),
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
    lb, ls = _nan_list(pad(logprob_base, None)), _nan_list(pad(logprob_steered, None))
    xs = list(range(n)) if positions is None else [int(p) for p in positions]
    if len(xs) != n:
        raise ValueError(f"{len(xs)} positions for {n} tokens")
    if divergence is None:
        i = first_divergence(list(tokens_base), list(tokens_steered))
        divergence = None if i is None else xs[i]
    delta = [s - b for b, s in zip(lb, ls)]
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4]
    )
    fig.add_trace(
        go.Bar(
            x=xs,
            y=delta,
            name="logprob delta",
            marker_color=["#2ca02c" if d >= 0 else "#d62728" for d in delta],
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
                "line": _SPAN_LINE,
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
    points = _as_float(points)
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
