"""Directions in activation space, from the model's own activations: the
difference of means between two sets of prompts (``Session.direction``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlens import checks
from vlens.errors import VlensError
from vlens.edits import ROLE_SPANS
from vlens.prompts import is_conversation

__all__ = ["difference_of_means"]


def difference_of_means(session: Any, positive: Sequence[Any], negative: Sequence[Any], *,
                        layer: int, site: str, span: Any, progress: Any) -> torch.Tensor:
    """``Session.direction``: ``mean(positive) - mean(negative)`` of ``site``
    at ``layer`` over one traced batch of both sets, each prompt's rows of
    ``span`` averaged first."""
    facts = session.facts
    if not (span == "last" or isinstance(span, (slice, int, list, tuple, range))
            or span in ("all", "prompt") or span in ROLE_SPANS) or isinstance(span, bool):
        raise VlensError(f"direction span must be 'last', 'prompt', 'all', a role, a slice or "
                         f"positions, got {span!r:.60}")
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
        rows = t.activations(site, layer=layer)  # [prompt tokens, hidden]
        rows = rows.reshape(rows.shape[0], -1)  # head sites: heads * head_dim, flat
        means.append(_span_mean(rows, span, t, bos))
    stacked = torch.stack(means)
    k = len(positive)
    return stacked[:k].mean(0) - stacked[k:].mean(0)


def _span_mean(rows: torch.Tensor, span: Any, t: Any, bos: Any) -> torch.Tensor:
    """The mean of one prompt's rows over ``span`` ("last": its last row;
    "prompt": every row but a BOS, the same for every prompt)."""
    n = rows.shape[0]
    if span == "last":
        return rows[-1]
    if span == "prompt":
        skip = 1 if bos is not None and t.token_ids[0] == bos and n > 1 else 0
        return rows[skip:].mean(0)
    if span == "all":
        return rows.mean(0)
    if isinstance(span, str):  # a role of a conversation
        picked = [k for k, role in enumerate(t.roles[:n]) if role == span]
    elif isinstance(span, slice):
        picked = list(range(n))[span]
    else:
        picked = [span] if isinstance(span, int) else list(span)
        bad = [k for k in picked if not -n <= k < n]
        if bad:
            raise VlensError(f"direction span position {bad[0]} is outside prompt "
                             f"{t.index} ({n} tokens)")
    if not picked:
        raise VlensError(f"direction span {span!r:.40} selects no token of prompt {t.index}")
    return rows[picked].mean(0)
