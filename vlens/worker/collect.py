"""The client-facing part of the worker's hooks: collect, drop, status.

A mixin of :class:`vlens.worker.hooks.WorkerHooks` (the RPCs in
``worker.py`` call these): packing the records of finished tags (journaled
steps replayed first), forgetting tags, and the counters ``s.status()``
shows.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ClientSide"]


class ClientSide:
    """Methods of WorkerHooks the client calls through the worker's RPCs."""

    records: dict
    plans: dict
    journal: Any

    def _forget_plans(self, wanted: set[str]) -> None:
        """Drop cached plans of these tags, and no-plan entries of requests
        that have left the runner."""
        live = self.runner.requests
        self._batch = None  # its cached plans may be among those dropped
        self.plans = {
            r: p for r, p in self.plans.items()
            if (p is not None and p.tag not in wanted) or (p is None and r in live)
        }
        self.bad_plans = {r: m for r, m in self.bad_plans.items() if r in self.plans}

    def collect(self, tags: list[str]) -> dict[str, list[dict[str, Any]]]:
        wanted = set(tags)
        if self.vectors.matrix.device.type == "cuda":
            torch.cuda.synchronize()  # the steps' reads were copied non-blocking
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in tags}
        journaled = self.journal.of_tags(wanted)
        self.journal.replay(set(journaled), self._record)
        self.journal.forget(journaled)
        for req_id in [r for r, rec in self.records.items() if rec.plan.tag in wanted]:
            rec = self.records.pop(req_id)
            out[rec.plan.tag].append(rec.pack())
        self._forget_plans(wanted)
        return out

    def drop(self, tags: list[str] | None) -> int:
        if tags is None:
            n = len(set(self.records) | set(self.journal.pending))
            self.records.clear()
            self.journal.clear()
            self._batch = None
            self.plans.clear()
            self.bad_plans.clear()
            self.edit_fns.clear()
            return n
        wanted = set(tags)
        gone = [r for r, rec in self.records.items() if rec.plan.tag in wanted]
        for r in gone:
            del self.records[r]
        journaled = self.journal.of_tags(wanted)
        self.journal.forget(journaled)
        gone = list(set(gone) | set(journaled))
        self._forget_plans(wanted)
        return len(gone)

    def status(self) -> dict[str, Any]:
        return {
            "hooks": len(self.handles),
            "records": len(set(self.records) | set(self.journal.pending)),
            "plans": sum(p is not None for p in self.plans.values()),
            "vectors": len(self.vectors),
            "vector_bytes": self.vectors.nbytes,
            "edit_fns": len(self.edit_fns),
            "hook_errors": self.hook_errors,
            "nonfinite_writes": self.nonfinite_writes,
            "steps_seen": self.steps_seen,
            "steps_planned": self.steps_planned,
            "layout_ns": self.layout_ns,
            "hook_ns": self.hook_ns,
            "reduce_ns": self.reduce_ns,
            **{f"decode_{k}": v for k, v in self.decode_counts.items()},
        }
