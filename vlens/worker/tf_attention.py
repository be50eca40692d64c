"""The head sites on vLLM's Transformers backend: the attention function.

vLLM's Transformers backend sets each Hugging Face model's
``config._attn_implementation`` to ``"vllm"`` and registers its own
attention function under that name in transformers' registry
(``ALL_ATTENTION_FUNCTIONS``, an ``AttentionInterface``). Every Hugging
Face attention module looks the function up by that name on every call and
hands it ``(module, query, key, value, attention_mask, **kwargs)``, with q
and k after rotary and the Hugging Face layout ``[1, heads, T, head_dim]``
(the batch axis is 1, the tokens are on dim 2); the function returns
``([T, heads * head_dim], None)``, which the module reshapes and feeds to
its output projection.

:func:`route_heads` replaces that registry entry, once per process, by a
wrapper around it. For a module that carries a
:class:`~vlens.protocol.head_tap.HeadTap` (one vlens resolved the sites of) the
wrapper flattens q, k, v to ``[T, heads * head_dim]`` (what vLLM's function
would do first), calls the tap with them -- the tap's hooks are the head
sites -- and the tap calls vLLM's function on views of the same tensors.
Any other module goes straight to vLLM's function. Nothing of vLLM's
attention layer is patched.
"""

from __future__ import annotations

from typing import Any

import torch

from vlens.protocol.head_tap import TAP

__all__ = ["route_heads", "tapped"]

#: the registry name vLLM's Transformers backend dispatches through
VLLM_NAME = "vllm"


def _flat(x: torch.Tensor, tokens: Any) -> torch.Tensor:
    """``[1, heads, T, d]`` -> ``[T, heads * d]`` (a view where the memory allows)."""
    return x.transpose(1, 2).reshape(tokens, -1)


def _unflat(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[T, heads * d]`` -> ``[1, heads, T, d]`` shaped as ``like``: a view."""
    return x.reshape(like.shape[0], like.shape[2], like.shape[1], like.shape[3]).transpose(1, 2)


def tapped(inner):
    """``inner`` (vLLM's attention function) with the head tap in front."""

    def vlens_attention_forward(module, query, key, value, attention_mask, **kwargs):
        tap = getattr(module, TAP, None)
        if tap is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        tokens = query.shape[-2]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = inner(module, _unflat(q, query), _unflat(k, key), _unflat(v, value),
                        attention_mask, **kwargs)[0]
            return out.reshape(tokens, -1)

        z = tap(_flat(query, tokens), _flat(key, tokens), _flat(value, tokens), attend)
        return z, None

    vlens_attention_forward.vlens_inner = inner
    return vlens_attention_forward


def route_heads(sites: Any) -> dict[str, str]:
    """Make the attention function vLLM registered call the head taps
    (once per process). Returns the head sites that cannot be served, with
    the reason (empty when all is well)."""
    heads = [s for s in ("q", "k", "v", "z", "attn_pattern") if s in sites.specs]
    if not heads:
        return {}
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as exc:  # pragma: no cover - the backend needs transformers
        return dict.fromkeys(heads, f"transformers' attention registry is missing: {exc}")
    try:
        inner = ALL_ATTENTION_FUNCTIONS[VLLM_NAME]
    except KeyError:
        inner = None
    configs = {getattr(getattr(layer, "config", None), "_attn_implementation", None)
               for layer in _hf_attention_modules(sites)}
    if inner is None or configs != {VLLM_NAME}:
        return dict.fromkeys(heads, (
            "vLLM's Transformers backend no longer dispatches attention through "
            f"transformers' registry entry {VLLM_NAME!r} (found implementations "
            f"{sorted(map(str, configs))}), where vlens reads the head sites on this route. "
            "Read the residual sites, or open a model vLLM runs natively"))
    if getattr(inner, "vlens_inner", None) is None:  # not wrapped yet
        ALL_ATTENTION_FUNCTIONS.register(VLLM_NAME, tapped(inner))
    return {}


def _hf_attention_modules(sites: Any) -> list[Any]:
    """The Hugging Face attention modules that hold the head taps."""
    out = []
    for layer in sites.layers:
        for m in layer.modules():
            if isinstance(getattr(m, TAP, None), torch.nn.Module):
                out.append(m)
    return out
