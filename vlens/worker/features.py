"""The sparse autoencoders one worker holds, for feature reads.

An SAE's encoder arrives once (``vlens_put_saes``: ``{id: payload}``, the
id a hash of its weights) and stays on the model's device until dropped,
like steering vectors; a feature read names it by id and encodes the rows
its read group already gathered (one matmul for every request reading it
in the step). Pure torch: no vLLM import (the worker passes
``worker/gemm.py``'s ``packed_matmul`` in, which packs each encoder for the
engine's own CPU kernel).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vlens.protocol.features import FeatureSpec, encode, output_scale, top_features
from vlens.protocol.tensors import decode_tensor

__all__ = ["FeatureStore"]

_WEIGHTS = ("W_enc", "b_enc", "b_dec", "threshold")


class FeatureStore:
    """``{id: (FeatureSpec, weights)}`` on one device."""

    def __init__(self, device: torch.device | str = "cpu",
                 pack: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.device = device
        self._saes: dict[str, tuple[FeatureSpec, dict[str, torch.Tensor]]] = {}
        #: ``pack(W_enc)``: an encoder's ``(x, b_enc) -> b_enc + x @ W_enc`` on
        #: a faster kernel, or None (then ``torch.addmm``)
        self._pack = pack
        self._matmul: dict[str, Any] = {}  # the SAEs ``pack`` packed, by id

    def __contains__(self, sid: str) -> bool:
        return sid in self._saes

    def __len__(self) -> int:
        return len(self._saes)

    def put(self, payloads: dict[str, dict[str, Any]]) -> int:
        """Store SAEs (``{id: {"spec": {...}, "W_enc": encoded, ...}}``);
        ones already held are kept. Returns how many are held."""
        for sid, payload in payloads.items():
            if sid in self._saes:
                continue
            spec = FeatureSpec.from_wire(payload["spec"])
            weights = {name: decode_tensor(payload[name]).to(self.device, torch.float32)
                       for name in _WEIGHTS if name in payload}
            w = weights["W_enc"]
            if w.dim() != 2 or weights["b_enc"].shape != (w.shape[1],) or (
                    weights["b_dec"].shape != (w.shape[0],)):
                raise ValueError(f"SAE {sid}: W_enc {list(w.shape)}, b_enc "
                                 f"{list(weights['b_enc'].shape)} and b_dec "
                                 f"{list(weights['b_dec'].shape)} do not fit together")
            self._saes[sid] = (spec, weights)
            matmul = self._pack(w) if self._pack is not None else None
            if matmul is not None:
                self._matmul[sid] = matmul
        return len(self._saes)

    def drop(self, ids: list[str]) -> int:
        for sid in ids:
            self._saes.pop(sid, None)
            self._matmul.pop(sid, None)
        return len(self._saes)

    def reduce(self, rows: torch.Tensor, sid: str, k: int) -> dict[str, torch.Tensor]:
        """Feature activations of ``rows`` ``[n, ...]`` (flattened to
        ``[n, d_in]``): ``{"value": [n, d_sae]}``, or with ``k > 0`` each
        row's k largest, ``{"ids": [n, k] int32, "values": [n, k]}``."""
        acts = self.activations(rows, sid)
        if k > 0:
            ids, values = top_features(acts, k)
            return {"ids": ids, "values": values}
        return {"value": acts}

    def activations(self, rows: torch.Tensor, sid: str) -> torch.Tensor:
        """``[n, d_sae]`` float32 feature activations of ``rows`` ``[n, ...]``."""
        held = self._saes.get(sid)
        if held is None:
            raise ValueError(f"SAE {sid} has not reached this worker")
        spec, weights = held
        x = rows.reshape(rows.shape[0], -1)
        if x.shape[1] != weights["W_enc"].shape[0]:
            raise ValueError(f"SAE {sid} encodes width {weights['W_enc'].shape[0]}, "
                             f"the site's rows are {x.shape[1]} wide")
        return encode(x.to(weights["W_enc"].device), weights, spec, self._matmul.get(sid))

    def output_scale(self, rows: torch.Tensor, sid: str) -> torch.Tensor:
        """``[n, 1]`` float32: how a clamp's write is scaled per row (the SAE's
        normalisation undone, ``protocol.features.output_scale``)."""
        spec, weights = self._saes[sid]
        return output_scale(rows.to(weights["W_enc"].device), spec)

    @property
    def nbytes(self) -> int:
        """Bytes held, a packed encoder's copy counted as its ``W_enc``'s size."""
        packed = sum(self._saes[sid][1]["W_enc"].nbytes for sid in self._matmul)
        return packed + sum(t.numel() * t.element_size() for _, w in self._saes.values()
                            for t in w.values())
