"""Tensors as plain data, for crossing vLLM's RPC in any mode.

Out of process, tensors cannot be RPC arguments, and returning raw bytes was
the fastest way back measured (docs/scale-out.md). In process the
same dicts cross as they are.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["encode_tensor", "decode_tensor"]


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """``{"data": bytes, "shape": [...], "dtype": "float32"}``."""
    t = t.detach().to("cpu").contiguous()
    return {
        "data": t.numpy().tobytes(),
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def decode_tensor(payload: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`; the result owns its memory."""
    dtype = getattr(torch, payload["dtype"])
    data = bytearray(payload["data"])
    if not data:
        return torch.empty(payload["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(payload["shape"])
