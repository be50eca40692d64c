"""What a worker keeps per request between steps, and hands back.

:class:`RequestBook` is one part of :class:`vlens.worker.hooks.WorkerHooks`
(composed, not mixed in): each request's parsed plan (or why it was
refused), the records of traced requests, the journal of steps whose
records are built when collected, the ``edit=`` functions, and the last
batch's grouping. The RPCs in ``extension.py`` reach it for collect and
drop: packing the records of finished tags (journaled steps replayed
first) and forgetting tags. :class:`Counters` are the step figures
``s.status()`` shows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from vlens.protocol.plan import PLAN_KEY, Plan, parse_plan
from vlens.worker.groups import BatchGroups
from vlens.worker.journal import Journal
from vlens.worker.records import RequestRecord

__all__ = ["Counters", "RequestBook"]


class RequestBook:
    """The per-request state of one worker (``runner``: vLLM's model
    runner, whose ``requests`` and ``input_batch`` say which requests are
    live; ``vectors``: the worker's VectorStore, whose device says whether
    the steps' non-blocking copies must be waited for)."""

    def __init__(self, runner: Any, vectors: Any) -> None:
        self.runner = runner
        self.vectors = vectors
        self.plans: dict[str, Plan | None] = {}  # req_id -> parsed plan (cache)
        self.bad_plans: dict[str, str] = {}  # req_id -> why its plan was refused
        self.records: dict[str, RequestRecord] = {}
        self.journal = Journal()  # steps whose records are built when collected
        self.edit_fns: dict[str, Any] = {}
        # the last batch's request ids, plans, and batch indices of requests
        # keeping records in the forward / journaled (reused while unchanged)
        self.batch: tuple[list[str], list, list[int], list[int], Any] | None = None
        # tags already collected or dropped (the newest few thousand): a
        # request vLLM schedules once more after its stop (async scheduling
        # runs a step ahead) must not start a new record nobody collects
        self.closed_tags: OrderedDict[str, None] = OrderedDict()

    def plan_for(self, req_id: str) -> Plan | None:
        try:
            return self.plans[req_id]
        except KeyError:
            pass
        plan = None
        state = self.runner.requests.get(req_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
        if extra and PLAN_KEY in extra:
            raw = extra[PLAN_KEY]
            try:
                plan = parse_plan(raw)
            except Exception as exc:  # the request learns why; the step goes on
                tag = raw.get("tag") if isinstance(raw, dict) else None
                plan = Plan(tag=str(tag))
                self.bad_plans[req_id] = f"its plan was refused: {exc}"
            if plan.tag in self.closed_tags:
                plan = None
                self.bad_plans.pop(req_id, None)
        if len(self.plans) > 8192:  # forget requests that left long ago
            live = set(self.runner.input_batch.req_ids)
            self.plans = {k: v for k, v in self.plans.items() if k in live}
        self.plans[req_id] = plan
        return plan

    def batch_plans(self, req_ids: list[str],
                    reader: bool) -> tuple[list, list[int], list[int], BatchGroups]:
        """Plans of the batch's requests, and which of them keep records in
        the forward (those reading attn_pattern: every rank) and which are
        journaled (the others, on the reading rank). Worked out again only
        when the batch changes (a decode step usually runs the same one)."""
        last = self.batch
        if last is not None and last[0] == req_ids:
            return last[1:]
        plans = [self.plan_for(r) for r in req_ids]
        eager, lazy = [], []
        for i, p in enumerate(plans):
            if p is None:
                continue
            if any(r.site == "attn_pattern" for r in p.reads):
                eager.append(i)
            elif reader:
                lazy.append(i)
        self.batch = (req_ids, plans, eager, lazy, BatchGroups.of(plans))
        if lazy:
            self.journal.note(req_ids, plans, lazy)
        return self.batch[1:]

    def record(self, req_id: str, plan: Plan) -> RequestRecord:
        rec = self.records.get(req_id)
        if rec is None:
            rec = self.records[req_id] = RequestRecord(plan, req_id)
            if req_id in self.bad_plans:
                rec.error(self.bad_plans.pop(req_id))
        return rec

    def rec(self, req_id: str) -> RequestRecord | None:
        """The record of a traced request (made now if it has none yet)."""
        rec = self.records.get(req_id)
        if rec is None:
            plan = self.plans.get(req_id)
            if plan is not None:
                rec = self.record(req_id, plan)
        return rec

    def _forget_plans(self, wanted: set[str]) -> None:
        """Drop cached plans of these tags, and no-plan entries of requests
        that have left the runner."""
        live = self.runner.requests
        self.batch = None  # its cached plans may be among those dropped
        self.plans = {
            r: p for r, p in self.plans.items()
            if (p is not None and p.tag not in wanted) or (p is None and r in live)
        }
        self.bad_plans = {r: m for r, m in self.bad_plans.items() if r in self.plans}

    def collect(self, tags: list[str], tensors: bool = False) -> dict[str, list[dict[str, Any]]]:
        wanted = set(tags)
        if self.vectors.matrix.device.type == "cuda":
            torch.cuda.synchronize()  # the steps' reads were copied non-blocking
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in tags}
        journaled = self.journal.of_tags(wanted)
        self.journal.replay(set(journaled), self.record)
        self.journal.forget(journaled)
        for req_id in [r for r, rec in self.records.items() if rec.plan.tag in wanted]:
            rec = self.records.pop(req_id)
            out[rec.plan.tag].append(rec.pack(tensors))
        self._forget_plans(wanted)
        self._close(tags)
        return out

    def _close(self, tags: list[str]) -> None:
        for tag in tags:
            self.closed_tags[tag] = None
            self.closed_tags.move_to_end(tag)
        while len(self.closed_tags) > 8192:
            self.closed_tags.popitem(last=False)

    def drop(self, tags: list[str] | None) -> int:
        if tags is None:
            n = len(set(self.records) | set(self.journal.pending))
            self.records.clear()
            self.journal.clear()
            self.batch = None
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
        self._close(tags)
        return len(gone)

    def counts(self) -> dict[str, int]:
        """What ``s.status()`` shows of the book."""
        return {
            "records": len(set(self.records) | set(self.journal.pending)),
            "plans": sum(p is not None for p in self.plans.values()),
            "edit_fns": len(self.edit_fns),
        }


@dataclass
class Counters:
    """What ``s.status()`` shows of the worker's steps and their cost."""

    hook_errors: int = 0
    #: writes that turned non-finite (their rows were restored)
    nonfinite_writes: int = 0
    steps_seen: int = 0
    steps_planned: int = 0
    layout_ns: int = 0
    hook_ns: int = 0
    #: of hook_ns, the reads' own arithmetic (making a summed site's
    #: value, then the norm, the logit lens...): work that grows with the
    #: rows read, where the rest should not
    reduce_ns: int = 0
    #: the same figures over decode steps alone (one new row per request:
    #: the steady state of a wide batch; a prefill step reads every
    #: prompt token)
    decode: dict[str, int] = field(default_factory=lambda: {
        "steps": 0, "layout_ns": 0, "hook_ns": 0, "reduce_ns": 0})

    def as_dict(self) -> dict[str, int]:
        return {
            "hook_errors": self.hook_errors,
            "nonfinite_writes": self.nonfinite_writes,
            "steps_seen": self.steps_seen,
            "steps_planned": self.steps_planned,
            "layout_ns": self.layout_ns,
            "hook_ns": self.hook_ns,
            "reduce_ns": self.reduce_ns,
            **{f"decode_{k}": v for k, v in self.decode.items()},
        }
