"""Plot builders: data in, ``plotly.graph_objects.Figure`` out.

Pure functions: no engine, no display. Widgets and the demo report call
them; tests assert on the returned figure's data.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
import torch

__all__ = ["activation_heatmap", "layer_profile", "logit_lens_grid"]


def _labels(tokens: Sequence[str]) -> list[str]:
    # Plotly merges identical category labels; prefix the position.
    return [f"{i}:{t}" for i, t in enumerate(tokens)]


def activation_heatmap(
    values: torch.Tensor,
    tokens: Sequence[str],
    layers: Sequence[int],
    *,
    quantity: str = "norm",
    title: str | None = None,
) -> go.Figure:
    """Layer x token heatmap of ``values`` ``[n_layers, n_tokens]``."""
    values = torch.as_tensor(values, dtype=torch.float32)
    if values.shape != (len(layers), len(tokens)):
        raise ValueError(
            f"values has shape {list(values.shape)}; expected "
            f"[{len(layers)} layers, {len(tokens)} tokens]"
        )
    fig = go.Figure(
        go.Heatmap(
            z=values.tolist(),
            x=_labels(tokens),
            y=[f"layer {layer}" for layer in layers],
            colorscale="Viridis",
            colorbar={"title": quantity},
            hovertemplate="%{y}, token %{x}<br>" + quantity + " %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title or f"{quantity} by layer and token",
        xaxis_title="token",
        yaxis_title="layer",
        yaxis={"autorange": "reversed"},
    )
    return fig


def layer_profile(values: torch.Tensor, layers: Sequence[int], *, name: str, quantity: str = "mean norm") -> go.Figure:
    """One line: a per-layer quantity ``[n_layers]``."""
    values = torch.as_tensor(values, dtype=torch.float32)
    fig = go.Figure(go.Scatter(x=list(layers), y=values.tolist(), mode="lines+markers", name=name))
    fig.update_layout(title=f"{quantity} by layer", xaxis_title="layer", yaxis_title=quantity)
    return fig


def logit_lens_grid(
    top_tokens: Sequence[Sequence[str]],
    top_probs: torch.Tensor,
    tokens: Sequence[str],
    layers: Sequence[int],
) -> go.Figure:
    """Layer x position grid: colour = probability of the top next token,
    text = that token. ``top_probs`` is ``[n_layers, n_tokens]``."""
    top_probs = torch.as_tensor(top_probs, dtype=torch.float32)
    fig = go.Figure(
        go.Heatmap(
            z=top_probs.tolist(),
            x=_labels(tokens),
            y=[f"layer {layer}" for layer in layers],
            text=[list(row) for row in top_tokens],
            texttemplate="%{text}",
            colorscale="Blues",
            zmin=0,
            zmax=1,
            colorbar={"title": "p(top)"},
        )
    )
    fig.update_layout(
        title="logit lens: top next token per layer",
        xaxis_title="input token",
        yaxis_title="layer",
        yaxis={"autorange": "reversed"},
    )
    return fig
