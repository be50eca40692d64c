"""A sparse autoencoder's encoder, as plain math both processes share.

The client's ``SAE.encode`` and the worker's feature reads call the same
:func:`encode`, so a feature read in the engine is the client's encode of
the same activations. The formulas are SAELens's (the library most SAEs
are saved with): the activation normalisation it records, ``b_dec``
subtracted from the input when ``apply_b_dec_to_input``, then
``pre = x @ W_enc + b_enc`` and

* ``standard``: ``relu(pre)``;
* ``jumprelu``: ``relu(pre) * (pre > threshold)`` (Gemma Scope too);
* ``topk``: the ``k`` largest of ``pre`` kept (then relu), the rest zero.

Weights travel to the workers once as a payload of encoded tensors plus
these settings (``FeatureSpec``); torch only, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["ARCHITECTURES", "NORMALISATIONS", "FeatureSpec", "encode", "output_scale",
           "top_features"]

ARCHITECTURES = ("standard", "jumprelu", "topk")
#: SAELens's ``normalize_activations`` values vlens applies per token
NORMALISATIONS = ("none", "constant_norm_rescale", "layer_norm", "scale")


@dataclass(frozen=True)
class FeatureSpec:
    """How an SAE encodes: ``architecture`` (one of ARCHITECTURES), ``k``
    (topk's k), ``norm`` (one of NORMALISATIONS; ``"scale"``: times
    ``scale``), ``b_dec_in`` (SAELens's ``apply_b_dec_to_input``)."""

    architecture: str = "standard"
    k: int = 0
    norm: str = "none"
    scale: float = 1.0
    b_dec_in: bool = True

    def to_wire(self) -> dict:
        return {"architecture": self.architecture, "k": self.k, "norm": self.norm,
                "scale": self.scale, "b_dec_in": self.b_dec_in}

    @classmethod
    def from_wire(cls, raw: dict) -> FeatureSpec:
        spec = cls(str(raw["architecture"]), int(raw.get("k", 0)), str(raw.get("norm", "none")),
                   float(raw.get("scale", 1.0)), bool(raw.get("b_dec_in", True)))
        if spec.architecture not in ARCHITECTURES or spec.norm not in NORMALISATIONS:
            raise ValueError(f"unknown SAE settings {raw!r:.200}")
        return spec


def normalise(x: torch.Tensor, spec: FeatureSpec) -> torch.Tensor:
    """``x`` ``[n, d_in]`` float32, normalised as the SAE was trained."""
    if spec.norm == "constant_norm_rescale":
        return x * (x.shape[-1] ** 0.5 / x.norm(dim=-1, keepdim=True))
    if spec.norm == "layer_norm":
        x = x - x.mean(dim=-1, keepdim=True)
        return x / (x.std(dim=-1, keepdim=True) + 1e-5)
    if spec.norm == "scale":
        return x * spec.scale
    return x


def output_scale(x: torch.Tensor, spec: FeatureSpec) -> torch.Tensor:
    """``[n, 1]``: what SAELens's decode multiplies its output by to undo the
    input's normalisation (``|x| / sqrt(d_in)`` for ``constant_norm_rescale``,
    the row's standard deviation for ``layer_norm``, 1 otherwise: ``scale``
    is SAELens's ``expected_average_only_in``, undone on the input only). A
    clamp writes ``(v - f(x)) * W_dec[i]`` times this, as SAELens's
    ``decode(edited) - decode(encode(x))`` does."""
    x = x.reshape(x.shape[0], -1).float()
    if spec.norm == "constant_norm_rescale":
        return x.norm(dim=-1, keepdim=True) / x.shape[-1] ** 0.5
    if spec.norm == "layer_norm":
        return (x - x.mean(dim=-1, keepdim=True)).std(dim=-1, keepdim=True)
    return torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)


def encode(x: torch.Tensor, weights: dict[str, torch.Tensor], spec: FeatureSpec,
           matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
           ) -> torch.Tensor:
    """Feature activations ``[n, d_sae]`` float32 of ``x`` ``[n, d_in]``.
    ``weights``: ``W_enc`` ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``,
    ``b_dec`` ``[d_in]``, ``threshold`` ``[d_sae]`` (jumprelu), float32 on
    ``x``'s device. ``matmul(x, b_enc)``, if given, is ``b_enc + x @ W_enc``
    on another kernel (the worker's packed one, ``worker/gemm.py``)."""
    x = normalise(x.reshape(x.shape[0], -1).float(), spec)
    if spec.b_dec_in:
        x = x - weights["b_dec"]
    if matmul is not None:
        pre = matmul(x, weights["b_enc"])
    else:
        pre = torch.addmm(weights["b_enc"], x, weights["W_enc"])
    if spec.architecture == "jumprelu":
        return torch.relu(pre) * (pre > weights["threshold"])
    if spec.architecture == "topk":
        top = torch.topk(pre, k=min(spec.k, pre.shape[-1]), dim=-1)
        return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
    return torch.relu(pre)


def top_features(acts: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest activations: ids (int32) and values
    (float32), each ``[n, k]``, largest first."""
    top = torch.topk(acts, k=min(k, acts.shape[-1]), dim=-1)
    return top.indices.to(torch.int32), top.values
