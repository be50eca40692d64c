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
from vlens.results.run import prompt_span, span_mean

__all__ = ["difference_of_means"]


def difference_of_means(session: Any, positive: Sequence[Any], negative: Sequence[Any], *,
                        layer: int, site: str, span: Any, progress: Any) -> torch.Tensor:
    """``Session.direction``: ``mean(positive) - mean(negative)`` of ``site``
    at ``layer`` over one traced batch of both sets, each prompt's rows of
    ``span`` averaged first."""
    facts = session.facts
    prompt_span(span)  # checked before anything runs
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
    means = []
    for t in run:
        rows = t.activations(site, layer=layer)  # [prompt tokens, hidden]
        rows = rows.reshape(rows.shape[0], -1)  # head sites: heads * head_dim, flat
        means.append(span_mean(rows, span, t.roles, f"prompt {t.index}"))
    stacked = torch.stack(means)
    k = len(positive)
    return stacked[:k].mean(0) - stacked[k:].mean(0)

