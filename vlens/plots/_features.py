"""What a feature view shows, as frames and figures: a token's top features,
a feature's top-activating contexts over a set of prompts, its activation
histogram, and the tokens its decoder direction promotes and suppresses
through the unembedding.

The reductions take plain tensors (feature activations ``[T, d_sae]`` or one
feature's ``[T]`` per prompt, a decoder row, an unembedding) and return
pandas frames; the builders take those and return plotly figures. Nothing
here knows about an engine or an SAE object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from vlens.plots._common import as_float, token_text

__all__ = [
    "feature_contexts",
    "feature_histogram",
    "feature_logits",
    "promoted_tokens",
    "top_features",
]

PROMOTED, SUPPRESSED = "#2ca02c", "#d62728"


def top_features(row: Any, k: int = 8) -> pd.DataFrame:
    """The ``k`` largest activations of one token's ``[d_sae]`` row that are
    above zero, largest first: columns ``feature``, ``activation``."""
    r = as_float(row)
    if r.dim() != 1:
        raise ValueError(f"top_features takes one token's [d_sae] row, got {list(r.shape)}")
    vals, ids = r.topk(min(int(k), r.numel()))
    keep = vals > 0
    return pd.DataFrame({"feature": ids[keep].tolist(), "activation": vals[keep].tolist()})


def feature_contexts(values: Sequence[Any], tokens: Sequence[Sequence[str]], *, n: int = 8,
                     before: int = 12, after: int = 4) -> pd.DataFrame:
    """Where one feature fires hardest over a set of prompts.

    ``values[p]`` is the feature's ``[T_p]`` activations on prompt ``p``,
    ``tokens[p]`` its ``T_p`` tokens. Each prompt's strongest token (above
    zero) is a candidate; the ``n`` strongest are kept, strongest first, each
    with a window of ``before`` tokens before it and ``after`` after.
    Columns: ``prompt``, ``position`` (of the strongest token),
    ``activation``, ``start`` (the window's first position), ``tokens`` and
    ``values`` (the window's tokens and the feature's activation on each).
    """
    if len(values) != len(tokens):
        raise ValueError(f"{len(values)} activation rows for {len(tokens)} token lists")
    rows = []
    for p, (v, toks) in enumerate(zip(values, tokens)):
        v = as_float(v)
        if v.dim() != 1 or v.numel() != len(toks):
            raise ValueError(f"prompt {p}: {list(v.shape)} activations for {len(toks)} tokens")
        if not v.numel() or float(v.max()) <= 0:
            continue
        pos = int(v.argmax())
        start, stop = max(0, pos - before), min(len(toks), pos + after + 1)
        rows.append({"prompt": p, "position": pos, "activation": float(v[pos]), "start": start,
                     "tokens": [str(t) for t in toks[start:stop]],
                     "values": v[start:stop].tolist()})
    rows.sort(key=lambda r: -r["activation"])
    columns = ["prompt", "position", "activation", "start", "tokens", "values"]
    return pd.DataFrame(rows[:n], columns=columns)


def feature_logits(direction: Any, unembed: Any, *, k: int = 10, norm_weight: Any = None,
                   token_strings: Callable[[list[int]], list[str]] | None = None
                   ) -> pd.DataFrame:
    """The tokens a direction ``[d]`` promotes and suppresses through an
    unembedding ``[vocab, d]``: ``(direction * norm_weight) @ unembed.T``
    (the final norm's gain folded in, its scale left out: a direction has
    none), its ``k`` largest (``kind="promoted"``) and ``k`` smallest
    (``"suppressed"``), each list ordered from the strongest. Columns
    ``kind``, ``token_id``, ``logit``, and ``token`` with ``token_strings``.
    """
    d, u = as_float(direction), as_float(unembed)
    if d.dim() != 1 or u.dim() != 2 or u.shape[1] != d.numel():
        raise ValueError(f"a [d] direction and a [vocab, d] unembedding, got {list(d.shape)} "
                         f"and {list(u.shape)}")
    if norm_weight is not None:
        d = d * as_float(norm_weight)
    logits = u @ d
    k = min(int(k), logits.numel())
    up, down = logits.topk(k), (-logits).topk(k)
    frame = pd.DataFrame({
        "kind": ["promoted"] * k + ["suppressed"] * k,
        "token_id": up.indices.tolist() + down.indices.tolist(),
        "logit": up.values.tolist() + (-down.values).tolist(),
    })
    if token_strings is not None:
        frame["token"] = token_strings(frame["token_id"].tolist())
    return frame


def feature_histogram(values: Any, *, feature: int | None = None, mark: float | None = None,
                      bins: int = 40, title: str | None = None) -> go.Figure:
    """Histogram of one feature's activations ``[N]`` (every token of the
    prompts) where it fires (above zero); the title says on how many of the
    N tokens. ``mark`` draws a line at one value (the clicked token's; a
    shape named ``"token"``)."""
    v = as_float(values).flatten()
    on = v[v > 0]
    name = "feature" if feature is None else f"feature {feature}"
    # the bins and the axis span where it fires (from 0), not plotly's default
    # range, so a feature on 3 tokens shows 3 tokens' values, not a 0-1 axis
    top = max(float(on.max()) if on.numel() else 1.0, mark or 0.0)
    fig = go.Figure(go.Histogram(x=on.tolist(), xbins={"start": 0.0, "end": top,
                                                        "size": top / bins},
                                 marker_color="#ff7f0e",
                                 hovertemplate="activation %{x}<br>%{y} tokens<extra></extra>"))
    if mark is not None and mark > 0:
        fig.add_shape(type="line", x0=mark, x1=mark, y0=0, y1=1, yref="paper", name="token",
                      line={"color": "#1f2328", "width": 2, "dash": "dot"})
    shown = title or (f"{name}: fires on {on.numel()} of {v.numel()} tokens"
                      + (f", max {float(on.max()):.3g}" if on.numel() else ""))
    fig.update_xaxes(range=[0.0, top * 1.05])
    fig.update_layout(title=shown, xaxis_title="activation", yaxis_title="tokens",
                      bargap=0.05, height=300, margin={"l": 50, "r": 20, "t": 50, "b": 40})
    return fig


def promoted_tokens(frame: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Bars of :func:`feature_logits`'s frame: promoted tokens (green) and
    suppressed tokens (red) side by side, strongest on top."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("promoted", "suppressed"),
                        horizontal_spacing=0.2)
    for col, (kind, colour) in enumerate((("promoted", PROMOTED), ("suppressed", SUPPRESSED)),
                                         start=1):
        part = frame[frame["kind"] == kind]
        words = part["token"] if "token" in part else part["token_id"].astype(str)
        labels = _unique([token_text(w) for w in words], part["token_id"].tolist())
        fig.add_trace(go.Bar(x=part["logit"].tolist(), y=labels, orientation="h", name=kind,
                             marker_color=colour, customdata=part["token_id"].tolist(),
                             hovertemplate="%{y} (id %{customdata}): %{x:.3g}<extra></extra>"),
                      row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    fig.update_layout(title=title or "through the unembedding", showlegend=False,
                      height=60 + 22 * max(1, len(frame) // 2),
                      margin={"l": 80, "r": 20, "t": 70, "b": 30})
    return fig


def _unique(labels: list[str], ids: list[int]) -> list[str]:
    """Category labels plotly will not merge: a repeated text gets its id."""
    seen = {x: labels.count(x) for x in labels}
    return [f"{x} #{i}" if seen[x] > 1 else x for x, i in zip(labels, ids)]
