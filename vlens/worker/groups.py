"""Grouping a batch's requests by plan, once per batch, for the planner.

:class:`BatchGroups` says which requests of a batch (by batch index) share
reads, adds and sets; a worker keeps it while the batch keeps the same
requests in the same order (decode steps usually do), so planning a step
costs array arithmetic per group, not Python work per request.
``StepRequests`` is the step's ``req_id -> (plan, span)`` map, made only when
something looks at it. Pure (numpy only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vlens.protocol.plan import Plan

if TYPE_CHECKING:
    from vlens.worker.layout import StepLayout

__all__ = ["BatchGroups", "StepRequests"]


@dataclass(frozen=True)
class BatchGroups:
    """Which requests of a batch (by batch index) share reads, adds and sets,
    and which have edits: what :func:`plan_step` groups, worked out once per
    batch (a worker reuses it while the batch keeps the same requests in the
    same order, as decode steps usually do)."""

    planned: np.ndarray  # batch indices with a plan
    reads: tuple[tuple[Plan, np.ndarray], ...]  # (a plan, batch indices sharing its reads)
    adds: tuple[tuple[Plan, np.ndarray], ...]
    sets: tuple[tuple[Plan, np.ndarray], ...]
    edits: tuple[int, ...]  # batch indices whose plans have edits
    #: [n] each request's prompt length (0: no plan), where some read keeps
    #: one prompt position only (``Read.position``; negative ones count from
    #: each request's own prompt end); None where none does
    prompt_len: np.ndarray | None = None

    @classmethod
    def of(cls, plans: Sequence[Plan | None]) -> BatchGroups:
        # plans parsed in the worker share equal reads/adds tuples (parse_plan)
        by: tuple[dict, dict, dict] = ({}, {}, {})
        planned, edits = [], []
        positional = any(r.position is not None for p in plans if p is not None
                         for r in p.reads)
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            planned.append(i)
            for groups, part in zip(by, (plan.reads, plan.adds, plan.sets)):
                if part:
                    group = groups.get(id(part))
                    if group is None:
                        group = groups[id(part)] = (plan, [])
                    group[1].append(i)
            if plan.edits:
                edits.append(i)
        arrays = [tuple((p, np.array(idx, dtype=np.int64)) for p, idx in g.values()) for g in by]
        lens = (np.array([0 if p is None else p.prompt_len for p in plans], dtype=np.int64)
                if positional else None)
        return cls(np.array(planned, dtype=np.int64), *arrays, tuple(edits), lens)



class StepRequests(dict):
    """req_id -> (plan, span) of the step's planned requests, built only
    when first looked at (the hooks rarely need it)."""

    def __init__(self, plans: Sequence, layout: StepLayout, planned: np.ndarray) -> None:
        super().__init__()
        self._todo: tuple | None = (plans, layout, planned)

    def _fill(self) -> None:
        if self._todo is not None:
            plans, layout, planned = self._todo
            self._todo = None
            spans = layout.spans
            super().update((spans[i].key, (plans[i], spans[i])) for i in planned.tolist())

    def __getitem__(self, key):
        self._fill()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._fill()
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._fill()
        return super().__contains__(key)

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def items(self):
        self._fill()
        return super().items()

    def keys(self):
        self._fill()
        return super().keys()

    def values(self):
        self._fill()
        return super().values()

    def __eq__(self, other) -> bool:
        self._fill()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]
