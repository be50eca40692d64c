"""Where the head sites sit on vLLM's Transformers backend.

On vLLM's native models the head sites (q, k, v, z, attn_pattern) are the
inputs and output of vLLM's attention layer, called as ``attn(q, k, v)``.
The Transformers backend runs Hugging Face's attention module instead, which
hands its post-rotary q, k, v to an *attention function* looked up by name in
transformers' registry (``ALL_ATTENTION_FUNCTIONS["vllm"]``, registered by
vLLM); that function calls the vLLM layer's ``forward`` directly, past any
hook on it. vlens therefore puts a :class:`HeadTap` on each Hugging Face
attention module (child ``vlens_heads``, beside vLLM's ``attn``) and wraps
the registered function (``vlens/worker/tf_attention.py``) so that it calls
the tap with the native layout:

    tap(query [T, heads * head_dim], key [T, kv_heads * head_dim],
        value [T, kv_heads * head_dim], attend) -> z [T, heads * head_dim]

``attend(q, k, v)`` runs vLLM's own function on those tensors. The hooks
vlens installs on the tap (before and after its forward) are the same as
on a native attention layer, in eager and in compiled mode.

Pure torch: no vLLM and no transformers import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["TAP", "HeadTap", "attach_taps"]

#: the tap's name as a child of the Hugging Face attention module
TAP = "vlens_heads"


class HeadTap(nn.Module):
    """The head sites of one layer on the Transformers backend: its
    arguments are q, k, v and its output is z, flat as vLLM's attention
    layer takes and gives them (tokens on dim 0). No parameters."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        return attend(query, key, value)


def attach_taps(layers: Sequence[nn.Module], attention: Sequence[nn.Module]
                ) -> tuple[HeadTap, ...]:
    """Give the module holding each layer's vLLM attention module (the
    Hugging Face attention module) a :class:`HeadTap` child, once; returns
    the taps in layer order."""
    taps = []
    for layer, attn in zip(layers, attention):
        holder = next((m for m in layer.modules()
                       if any(c is attn for c in m.children())), None)
        if holder is None:  # pragma: no cover - found inside this layer by construction
            raise LookupError(f"no module of {type(layer).__name__} holds its attention layer")
        tap = getattr(holder, TAP, None)
        if not isinstance(tap, HeadTap):
            tap = HeadTap()
            holder.add_module(TAP, tap)
        taps.append(tap)
    return tuple(taps)
