"""The sparse autoencoders one worker holds, for feature reads.

An SAE's encoder arrives once (``vlens_put_saes``: ``{id: payload}``, the
id a hash of its weights) and stays on the model's device until dropped,
like steering vectors; a feature read names it by id and encodes the rows
its read group already gathered (one matmul for every request reading it
in the step). Pure torch: no vLLM import (the worker passes
``worker/gemm.py``'s ``packed_matmul`` in, which packs each encoder for the
engine's own CPU kernel).

On a CPU, a step with few rows (a decode step: one per request) is not
encoded in the step. Its gathered rows (a copy) wait, and are encoded with
other steps' rows in one product once ``DEFER_ROWS`` rows wait, or when a
record that needs them is packed, whichever comes first. Between steps the
model's own weights push the encoder out of the CPU's cache, so 32 rows a
step read all of ``W_enc`` from memory each time: on the 2-core test
machine 64 such steps took 372 ms, the same 2,048 rows in products of 256
took 187 ms. Each read's values are its own rows' (the product is cut back
per step), equal to encoding them alone within float32 rounding.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from vlens.protocol.features import FeatureSpec, encode, output_scale, top_features
from vlens.protocol.tensors import decode_tensor
from vlens.worker.steplog import Later

__all__ = ["DEFER_ROWS", "FeatureStore", "LazyPart"]

_WEIGHTS = ("W_enc", "b_enc", "b_dec", "threshold")

#: a CPU read of fewer rows waits for others; this many waiting are encoded
DEFER_ROWS = 256


class _Waiting:
    """Reads of one SAE (and one ``k``) whose rows wait for one product."""

    def __init__(self, encode_rows: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> None:
        self.encode_rows = encode_rows
        self.reads: list[_Deferred] = []
        self.rows = 0

    def add(self, read: _Deferred) -> None:
        self.reads.append(read)
        self.rows += read.rows.shape[0]

    def flush(self) -> None:
        """Encode every waiting read in one product and give each its rows."""
        reads, self.reads, self.rows = self.reads, [], 0
        if not reads:
            return
        sizes = [r.rows.shape[0] for r in reads]
        try:
            parts = self.encode_rows(torch.cat([r.rows for r in reads]))
        except Exception as exc:  # each read raises it when its rows are asked for
            for r in reads:
                r.rows, r.failed = None, exc
            return
        for r in reads:
            r.rows = None
        for name, t in parts.items():
            for r, chunk in zip(reads, t.split(sizes)):
                r.parts[name] = chunk


class _Deferred:
    """One read's gathered rows until encoded, then its parts."""

    def __init__(self, rows: torch.Tensor, waiting: _Waiting) -> None:
        self.rows: torch.Tensor | None = rows
        self.waiting = waiting
        self.parts: dict[str, torch.Tensor] = {}
        self.failed: Exception | None = None

    def part(self, name: str) -> torch.Tensor:
        if not self.parts and self.failed is None:
            self.waiting.flush()  # still waiting: encode it now, with the others
        if self.failed is not None:
            exc = self.failed
            raise RuntimeError("encoding feature reads after their steps failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        return self.parts[name]


class LazyPart(Later):
    """One part of a deferred feature read, standing in a step's log for its
    tensor: the shape and dtype are known in the step, the values when the
    log is cut after the run (:meth:`tensor`)."""

    def __init__(self, read: _Deferred, name: str, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        super().__init__(lambda: read.part(name), shape, dtype)
        self.read, self.name = read, name


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
        self._waiting: dict[tuple[str, int], _Waiting] = {}  # deferred reads, by (id, k)

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
            for key in [key for key in self._waiting if key[0] == sid]:
                self._waiting.pop(key).flush()  # their reads keep their values
            self._saes.pop(sid, None)
            self._matmul.pop(sid, None)
        return len(self._saes)

    def reduce(self, rows: torch.Tensor, sid: str, k: int) -> dict[str, torch.Tensor]:
        """Feature activations of ``rows`` ``[n, ...]`` (flattened to
        ``[n, d_in]``): ``{"value": [n, d_sae]}``, or with ``k > 0`` each
        row's k largest, ``{"ids": [n, k] int32, "values": [n, k]}``.

        On a CPU, fewer than ``DEFER_ROWS`` rows are encoded later, with
        other reads of the SAE: the parts are then :class:`LazyPart`."""
        if rows.device.type == "cpu" and rows.shape[0] < DEFER_ROWS:
            return self._defer(rows, sid, k)
        return self._reduce_now(rows, sid, k)

    def _defer(self, rows: torch.Tensor, sid: str, k: int) -> dict[str, Any]:
        d_sae = self._held(sid, rows)[1]["W_enc"].shape[1]  # the width checked now
        waiting = self._waiting.get((sid, k))
        if waiting is None:
            waiting = self._waiting[(sid, k)] = _Waiting(
                lambda x, sid=sid, k=k: self._reduce_now(x, sid, k))
        n = rows.shape[0]
        read = _Deferred(rows.reshape(n, -1), waiting)
        waiting.add(read)
        if k > 0:
            kk = min(k, d_sae)
            parts = {"ids": LazyPart(read, "ids", (n, kk), torch.int32),
                     "values": LazyPart(read, "values", (n, kk), torch.float32)}
        else:
            parts = {"value": LazyPart(read, "value", (n, d_sae), torch.float32)}
        if waiting.rows >= DEFER_ROWS:
            waiting.flush()
        return parts

    def _reduce_now(self, rows: torch.Tensor, sid: str, k: int) -> dict[str, torch.Tensor]:
        acts = self.activations(rows, sid)
        if k > 0:
            ids, values = top_features(acts, k)
            return {"ids": ids, "values": values}
        return {"value": acts}

    def activations(self, rows: torch.Tensor, sid: str) -> torch.Tensor:
        """``[n, d_sae]`` float32 feature activations of ``rows`` ``[n, ...]``."""
        spec, weights = self._held(sid, rows)
        x = rows.reshape(rows.shape[0], -1)
        return encode(x.to(weights["W_enc"].device), weights, spec, self._matmul.get(sid))

    def _held(self, sid: str, rows: torch.Tensor) -> tuple[FeatureSpec, dict[str, torch.Tensor]]:
        """The SAE ``sid``, checked against the width of ``rows``."""
        held = self._saes.get(sid)
        if held is None:
            raise ValueError(f"SAE {sid} has not reached this worker")
        width = math.prod(rows.shape[1:])
        if width != held[1]["W_enc"].shape[0]:
            raise ValueError(f"SAE {sid} encodes width {held[1]['W_enc'].shape[0]}, "
                             f"the site's rows are {width} wide")
        return held

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
