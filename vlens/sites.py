"""Named places in a decoder stack where vlens reads (and later writes).

A site name is what a user types (``resid_post``); resolving it means
knowing, for the architecture and backend vLLM chose, which module to hook,
whether it is a pre- or post-forward hook, and how to turn the raw hook
arguments into the canonical value:

* native vLLM decoder layers (Llama, Mistral, Qwen2 …) are called as
  ``layer(positions, hidden [T, H], residual [T, H] | None)`` and return
  ``(hidden, residual)`` -- the residual stream is their **sum**;
* vLLM's Transformers backend runs the Hugging Face layer on
  ``hidden [1, T, H]`` and returns the full residual stream directly.

Canonical values equal Hugging Face's ``hidden_states``: ``resid_pre`` of
layer i is ``hidden_states[i]``, ``resid_post`` of layer i is
``hidden_states[i + 1]`` (before the final norm). No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SITES",
    "WRITABLE",
    "SiteSpec",
    "ModelSites",
    "resolve_sites",
    "describe_sites",
    "lens_logits",
]

#: site name -> what it is, in words (shown in errors and widgets)
SITES: dict[str, str] = {
    "resid_pre": "residual stream entering the layer (HF hidden_states[layer])",
    "resid_post": "residual stream leaving the layer (HF hidden_states[layer + 1])",
    "attn_out": "the attention block's output (after o_proj), before it joins the residual",
    "mlp_out": "the MLP block's output (after down_proj), before it joins the residual",
    "positions": "the token positions the layer is given (read-only; an engine buffer "
    "that is rewritten every step, used to show what clone reads protect)",
}


def describe_sites() -> str:
    return "; ".join(f"{k}: {v}" for k, v in SITES.items())


Extractor = Callable[[tuple, dict, Any], torch.Tensor]


@dataclass(frozen=True)
class SiteSpec:
    """How to read one site: hook ``module_of(layer)`` before (``pre``) or
    after its forward, and pull the value out with ``extract(args, kwargs,
    output)``. ``replicated``: every tensor-parallel rank holds the whole
    value (true for the residual stream after the all-reduce).

    ``target(args, kwargs, output)`` is the tensor to add to, in place, so
    that the canonical value changes by the same amount (for a native
    ``resid_post`` that is the residual half of ``(hidden, residual)``);
    ``None`` for read-only sites."""

    name: str
    module_of: Callable[[nn.Module], nn.Module]
    pre: bool
    extract: Extractor
    target: Extractor | None = None
    replicated: bool = True


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _native_resid_pre(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    hidden = _arg(args, kwargs, 1, "hidden_states")
    residual = _arg(args, kwargs, 2, "residual")
    return hidden if residual is None else hidden + residual


def _native_resid_post(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    if not (isinstance(output, (tuple, list)) and len(output) == 2):
        raise TypeError(
            "expected the native decoder layer to return (hidden, residual), got "
            f"{type(output).__name__}; start the Session with "
            "model_impl='transformers' for this model"
        )
    return output[0] + output[1]


def _native_resid_pre_target(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    residual = _arg(args, kwargs, 2, "residual")
    return _arg(args, kwargs, 1, "hidden_states") if residual is None else residual


def _native_resid_post_target(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    _native_resid_post(args, kwargs, output)  # checks the output's shape
    return output[1]


def _native_positions(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    return _arg(args, kwargs, 0, "positions")


def _hf_positions(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    return kwargs["position_ids"]


def _hf_resid_pre(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    return _arg(args, kwargs, 0, "hidden_states")


def _output_value(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    return _first(output)


def _self(m: nn.Module) -> nn.Module:
    return m


def _attn(m: nn.Module) -> nn.Module:
    return m.self_attn


def _mlp(m: nn.Module) -> nn.Module:
    return m.mlp


_NATIVE = {
    "resid_pre": SiteSpec("resid_pre", _self, True, _native_resid_pre, _native_resid_pre_target),
    "resid_post": SiteSpec(
        "resid_post", _self, False, _native_resid_post, _native_resid_post_target
    ),
    "attn_out": SiteSpec("attn_out", _attn, False, _output_value, _output_value),
    "mlp_out": SiteSpec("mlp_out", _mlp, False, _output_value, _output_value),
    "positions": SiteSpec("positions", _self, True, _native_positions),
}
_TRANSFORMERS = {
    "resid_pre": SiteSpec("resid_pre", _self, True, _hf_resid_pre, _hf_resid_pre),
    "resid_post": SiteSpec("resid_post", _self, False, _output_value, _output_value),
    "attn_out": SiteSpec("attn_out", _attn, False, _output_value, _output_value),
    "mlp_out": SiteSpec("mlp_out", _mlp, False, _output_value, _output_value),
    "positions": SiteSpec("positions", _self, True, _hf_positions),
}

#: sites that can be written (steered / edited)
WRITABLE = ("resid_pre", "resid_post", "attn_out", "mlp_out")


@dataclass(frozen=True)
class ModelSites:
    """The sites of one loaded model."""

    impl: str  # "native" | "transformers"
    architecture: str
    layers: tuple[nn.Module, ...]
    specs: dict[str, SiteSpec]

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def _find_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList):
            return mod
    raise TypeError(
        f"vlens could not find the decoder layers of {type(model).__name__}: "
        "expected a ModuleList at model.model.layers"
    )


def resolve_sites(model: nn.Module) -> ModelSites:
    """Find the layers of a vLLM model and the way to read each site."""
    layers = tuple(_find_layers(model))
    impl = "transformers" if type(model).__name__.startswith("Transformers") else "native"
    for i, layer in enumerate(layers):
        for part in ("self_attn", "mlp"):
            if not hasattr(layer, part):
                raise TypeError(
                    f"layer {i} ({type(layer).__name__}) has no .{part}: vlens knows "
                    "Llama-family layers (Llama, Mistral, Qwen2) natively and any "
                    "model through model_impl='transformers'"
                )
    return ModelSites(
        impl=impl,
        architecture=type(model).__name__,
        layers=layers,
        specs=dict(_TRANSFORMERS if impl == "transformers" else _NATIVE),
    )


def lens_logits(model: nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """Logit lens with the model's own modules: final norm, then the
    unembedding (``compute_logits``). ``resid`` is ``[n, hidden]``; returns
    ``[n, vocab]`` float32 (None on ranks that do not receive the gathered
    logits). On tensor-parallel engines every rank must call
    this together (the unembedding gathers across ranks)."""
    norm = model.model.norm
    normed = norm(resid)
    if isinstance(normed, tuple):
        normed = normed[0]
    logits = model.compute_logits(normed)
    # ranks other than the driver may get None back from the gather
    return None if logits is None else logits.float()
