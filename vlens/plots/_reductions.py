"""Reductions: what a run holds -> the arrays a figure builder takes.

Pure like the builders: tensors and results in, tensors and lists out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlens.plots._common import as_float

__all__ = ["QUANTITIES", "activation_values", "pca_2d", "token_set_metric"]

#: what :func:`activation_values` can compute per token
QUANTITIES = ("norm", "projection", "cosine", "neuron")


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
    acts = as_float(acts)
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
        d = as_float(direction).reshape(-1)
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


def pca_2d(points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal-component projection of ``[n, hidden]`` points.

    Returns ``(coords [n, 2], explained [2])`` where ``explained`` is each
    component's share of the total variance. Signs are fixed (the largest
    loading of each component is positive) so plots do not flip between
    runs. Fewer than two usable components give zeros in that column.
    """
    x = as_float(points)
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


def token_set_metric(sweep: Any, token_ids: Sequence[int]) -> list[float]:
    """How much the model says any of ``token_ids``, one number per row of
    ``sweep.to_frame()`` (a :class:`~vlens.results.Sweep`: prompt by
    prompt, each prompt's scales in order): the mean over generated
    positions of P(next token in the set), from the output distribution the
    sweep read at the last layer (``trace.vocab_logprobs()``)."""
    ids = sorted({int(i) for i in token_ids})
    values = []
    for i in range(len(sweep.prompts)):
        for run in sweep.runs:
            t = run[i]
            start = len(t.prompt_token_ids) - 1  # the row that chose the first new token
            probs = t.vocab_logprobs()[-1, start:].exp()  # [generated, vocab]
            values.append(float(probs[:, ids].sum(-1).mean()))
    return values
