"""The head sites' part of the worker's hooks (q, k, v, z, attn_pattern).

A mixin of :class:`vlens.worker.hooks.WorkerHooks`: the vector matrix a
steering add at ``z`` draws from (one rank's columns under tensor
parallelism), gathering heads across ranks, and ``attn_pattern``, scored
per request from the keys its record keeps (``attention.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from vlens.worker.layout import token_axis
from vlens.worker.attention import AttentionShape, attention_probs
from vlens.protocol.sites import HEAD_SITES

__all__ = ["HeadSiteOps"]


class HeadSiteOps:
    """Methods of WorkerHooks for the head sites (they use its ``sites``,
    ``vectors``, ``tp``, ``reader`` and ``records``)."""

    sites: Any
    vectors: Any
    tp: int
    reader: bool
    records: dict

    def _add_matrix(self, site: str, layer: int, batch) -> torch.Tensor:
        """The vector matrix a steering add at ``site`` draws from: hidden
        wide, or for a head site every head's ``heads * head_dim`` (only the
        columns of this rank's heads under tensor parallelism)."""
        if site not in HEAD_SITES:
            return self.vectors.matrix
        m = self.sites.attention[layer]
        local = int(m.num_heads) * int(m.head_size)
        full = self.vectors.matrix_of(local * self.tp)
        if self.tp == 1:
            return full
        if batch.relative is not None:
            raise ValueError("relative steering at z needs every head's values, which "
                             "tensor-parallel ranks split: use relative=False, or "
                             "tensor_parallel_size=1")
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        return full[:, rank * local:(rank + 1) * local]

    def _gather_heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's heads of ``x`` along ``dim`` (rank order is head
        order). Every rank must call this at the same point of the step."""
        if self.tp == 1:
            return x
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x.contiguous(), dim)

    def _read_pattern(self, step, qk, groups, layer, label) -> None:
        """Keep each reading request's keys of this step, then its query
        rows' attention probabilities over every key so far (one request at
        a time: each has its own key length)."""
        shape = AttentionShape.of(self.sites.attention[layer])
        q, k = qk  # the site's two inputs (compiled mode passes both to its operator)
        axis = token_axis(q, step.layout, site=label)
        if axis != 0:
            raise ValueError(f"expected [T, heads * head_dim] queries, got {list(q.shape)}")
        for g in groups:
            heads = list(g.read.heads) or None
            for span in g.spans:
                rec = self.records.get(span.key)
                if rec is None:  # pragma: no cover - every rank records these requests
                    raise LookupError(f"no record of request {span.key} on this rank")
                rows = slice(span.start, span.stop)
                keys = rec.add_keys(layer, span.first_position,
                                    k[rows].reshape(span.length, shape.kv_heads, -1))
                if self.tp == 1:
                    probs = attention_probs(q[rows], keys, span.first_position, shape, heads)
                else:  # each rank scores its own heads; the reading rank keeps them all
                    probs = attention_probs(q[rows], keys, span.first_position, shape)
                    probs = self._gather_heads(probs, 1)
                    if heads is not None:
                        probs = probs[:, heads]
                if self.reader:
                    rec.keep(g.read.key, "value", layer, probs)
