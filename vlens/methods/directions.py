"""Directions in activation space, from the model's own activations: the
difference of means between two sets of prompts (``Session.direction``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlens import checks
from vlens.errors import VlensError
from vlens.prompts import is_conversation

__all__ = ["difference_of_means"]


def difference_of_means(session: Any, facts: checks.ModelFacts, positive: Sequence[Any],
                        negative: Sequence[Any], *, layer: int, site: str, position: str,
                        progress: Any) -> torch.Tensor:
    """``Session.direction``: ``mean(positive) - mean(negative)`` of ``site``
    at ``layer`` over one traced batch of both sets (``facts``: the
    session's model)."""
    if position not in ("last", "mean"):
        raise VlensError(f"position must be 'last' or 'mean', got {position!r}")
    for name, group in (("positive", positive), ("negative", negative)):
        if (isinstance(group, str) or not isinstance(group, (list, tuple)) or not group
                or is_conversation(group)):
            raise VlensError(f"{name} must be a non-empty list of prompts (strings, or "
                             "conversations: one conversation alone is wrapped in a list)")
    layer = checks.check_layers([layer], facts)[0]
    checks.check_sites([site], facts)
    if site == "attn_pattern":
        raise VlensError("a direction needs a site with a value per token; attn_pattern "
                         "has one per token pair: use 'z' or a residual site")
    run = session.trace(list(positive) + list(negative), layers=[layer], sites=[site],
                        max_new_tokens=1, logprobs=False, progress=progress)
    bos = session.tokenizer.bos_token_id
    means = []
    for t in run:
        rows = t.activations(site)[0]  # [prompt tokens, hidden]
        rows = rows.reshape(rows.shape[0], -1)  # head sites: heads * head_dim, flat
        if position == "last":
            means.append(rows[-1])
        else:
            skip = 1 if bos is not None and t.token_ids[0] == bos and len(rows) > 1 else 0
            means.append(rows[skip:].mean(0))
    stacked = torch.stack(means)
    k = len(positive)
    return stacked[:k].mean(0) - stacked[k:].mean(0)
