"""Attention probabilities, recomputed from the queries and keys vLLM's
attention layer receives.

vLLM never materialises attention weights: its paged kernels go straight
from queries, cached keys and values to each head's output. vlens recomputes
the probabilities for the requests that ask (site ``attn_pattern``): the
worker keeps each such request's post-rotary keys per layer as its steps
arrive (prefill chunks, then one row per decode step; see
:class:`~vlens.worker.records.RequestRecord`), and each step turns the step's query
rows into probability rows over every key so far, as the layer's kernel
defines them:

* the scale vLLM's attention was built with (``impl.scale``: ``head_dim **
  -0.5``, or Gemma's ``query_pre_attn_scalar ** -0.5``);
* logit softcapping (Gemma2): ``cap * tanh(scores / cap)`` before the mask;
* causal masking, and a sliding window where the layer has one: the query
  at position ``i`` sees keys ``j`` with ``i - window < j <= i``;
* grouped-query attention: query head ``h`` reads key head
  ``h // (heads / kv_heads)``.

Pure torch, no vLLM import. Cost: per request, layer and step,
``heads x rows x keys`` scores, so a whole prompt of T tokens costs
``heads x T x T`` floats per layer (what ``read_budget`` counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlens.protocol.sites import HEAD_SITES

__all__ = ["AttentionShape", "attention_probs", "head_info", "head_refusals"]


@dataclass(frozen=True)
class AttentionShape:
    """How one attention layer scores: its (local) head counts, head size,
    scale, softcap (0: none) and sliding window (None: the whole prefix)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float = 0.0
    window: int | None = None

    @classmethod
    def of(cls, module) -> AttentionShape:
        """From a vLLM ``Attention`` module (``num_heads``, ``num_kv_heads``,
        ``head_size``, ``sliding_window``, ``impl.scale``,
        ``impl.logits_soft_cap``)."""
        impl = module.impl
        cap = getattr(impl, "logits_soft_cap", None) or 0.0
        window = getattr(module, "sliding_window", None)
        return cls(int(module.num_heads), int(module.num_kv_heads), int(module.head_size),
                   float(impl.scale), float(cap), None if window in (None, -1, 0) else int(window))


def attention_probs(q: torch.Tensor, keys: torch.Tensor, first: int, shape: AttentionShape,
                    heads: list[int] | None = None) -> torch.Tensor:
    """Probabilities of one request's query rows in one step.

    ``q`` is ``[n, heads * head_dim]`` (the step's rows, at positions
    ``first .. first + n - 1``), ``keys`` ``[first + n, kv_heads, head_dim]``
    (every key of the request so far). Returns ``[n, len(heads), first + n]``
    float32: row ``i`` sums to 1 over keys ``0 .. first + i`` and is zero
    after them (and before the window, where there is one). ``heads``: the
    query heads wanted (None: all)."""
    n = q.shape[0]
    qh = q.reshape(n, shape.heads, shape.head_dim).float()
    group = shape.heads // shape.kv_heads
    idx = torch.arange(shape.heads, device=q.device) if heads is None else torch.tensor(
        heads, device=q.device, dtype=torch.long)
    qh = qh.index_select(1, idx)  # [n, h, d]
    kh = keys.float().index_select(1, idx // group)  # [k, h, d]
    scores = torch.einsum("nhd,khd->nhk", qh, kh) * shape.scale
    if shape.softcap > 0:
        scores = torch.tanh(scores / shape.softcap) * shape.softcap
    rows = torch.arange(first, first + n, device=q.device)[:, None]
    cols = torch.arange(keys.shape[0], device=q.device)[None, :]
    hidden = cols > rows
    if shape.window is not None:
        hidden = hidden | (cols <= rows - shape.window)
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    return scores.softmax(-1)


def head_info(sites: Any, tp: int) -> dict[str, int]:
    """``n_heads``, ``n_kv_heads``, ``head_dim`` of the whole model (every
    tensor-parallel rank's heads; 0 where vlens found no attention layer).
    ``sites`` is the model's :class:`~vlens.protocol.sites.ModelSites`."""
    if not sites.attention:
        return {"n_heads": 0, "n_kv_heads": 0, "head_dim": 0}
    m = sites.attention[0]
    return {"n_heads": int(m.num_heads) * tp, "n_kv_heads": int(m.num_kv_heads) * tp,
            "head_dim": int(m.head_size)}


def head_refusals(sites: Any, tp: int, total_kv_heads: int) -> dict[str, str]:
    """Head sites an engine cannot serve, with the way out. Compiled mode
    serves them (its read operator takes attn_pattern's q and k as two inputs);
    tensor parallelism too (the worker gathers every rank's heads), except
    where the key/value heads are copied onto ranks instead of split."""
    heads = [s for s in HEAD_SITES if s in sites.specs]
    if not heads or tp == 1 or total_kv_heads % tp == 0:
        return {}
    return dict.fromkeys(heads, (
        f"this model's {total_kv_heads} key/value heads are copied onto each of the {tp} "
        "tensor-parallel ranks rather than split between them, and vlens gathers only split "
        "heads (it never returns one rank's shard): open the model with "
        f"tensor_parallel_size=1 (or one that divides {total_kv_heads}) to read the head "
        "sites (q, k, v, z, attn_pattern)"))
