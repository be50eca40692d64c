"""The steps a worker ran, kept as arrays until the run's records are packed.

Building one :class:`~vlens.worker.records.RequestRecord` step per request inside
the forward costs Python work per request per step. Instead, each planned
step leaves one :class:`~vlens.worker.records.StepLog`: the runner's arrays of the
step (request ids in batch order, row offsets, tokens already computed,
token ids and positions) and the reads its hooks kept for whole groups of
requests. When the client collects a tag, :meth:`Journal.replay` walks the
logs in step order and gives each wanted request its steps, exactly as the
forward would have (restarts and gaps included, see records.py). Requests
whose plans read ``attn_pattern`` keep their records in the forward (their
keys must be at hand every step), so they are not journaled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vlens.protocol.plan import Plan
from vlens.worker.records import RequestRecord
from vlens.worker.steplog import StepLog

__all__ = ["Journal", "StepArrays", "kept", "rows_of"]


class StepArrays:
    """The runner's arrays of one step (copies: the runner reuses its buffers)."""

    __slots__ = ("req_ids", "qsl", "first", "ids", "pos", "lazy")

    def __init__(self, req_ids: list[str], qsl: np.ndarray, first: np.ndarray,
                 ids: torch.Tensor | np.ndarray | None, pos: torch.Tensor | np.ndarray | None,
                 lazy: list[int]) -> None:
        self.req_ids = req_ids  # batch order (the list is never changed after)
        self.qsl = qsl  # [n + 1] int64 row offsets
        self.first = first  # [n] tokens computed before this step
        self.ids = ids  # [rows] token ids, or None
        self.pos = pos  # [rows] positions, or None
        self.lazy = lazy  # batch indices of journaled requests


class Journal:
    """Step logs not yet packed, and the journaled requests of each tag."""

    def __init__(self) -> None:
        self.logs: list[tuple[StepLog, StepArrays]] = []
        self.pending: dict[str, Plan] = {}  # journaled req_id -> its plan

    def add(self, log: StepLog, arrays: StepArrays) -> None:
        self.logs.append((log, arrays))

    def note(self, req_ids: list[str], plans: list[Plan | None], lazy: list[int]) -> None:
        """These requests of a new batch are journaled."""
        for i in lazy:
            self.pending.setdefault(req_ids[i], plans[i])

    def of_tags(self, wanted: set[str]) -> list[str]:
        """Journaled requests whose tags are in ``wanted``."""
        return [r for r, p in self.pending.items() if p.tag in wanted]

    def replay(self, req_ids: set[str], record: Callable[[str, Plan], RequestRecord]) -> None:
        """Give each of ``req_ids`` (journaled requests) its steps, in order."""
        if not req_ids:
            return
        for log, a in self.logs:
            hit = [i for i in a.lazy if a.req_ids[i] in req_ids]
            if not hit:
                continue
            q = a.qsl.tolist()
            first = a.first.tolist()
            ids = a.ids.tolist() if a.ids is not None else None
            pos = a.pos.tolist() if a.pos is not None else None
            for i in hit:
                lo, hi = q[i], q[i + 1]
                if hi == lo:  # no rows of it in this step
                    continue
                r = a.req_ids[i]
                record(r, self.pending[r]).begin_step(
                    first[i], hi - lo,
                    ids[lo:hi] if ids is not None else None,
                    pos[lo:hi] if pos is not None else None,
                    log,
                )

    def forget(self, req_ids: Any) -> None:
        """Drop these requests, then every log that no pending request needs."""
        for r in req_ids:
            self.pending.pop(r, None)
        live = self.pending
        self.logs = [(log, a) for log, a in self.logs
                     if any(a.req_ids[i] in live for i in a.lazy)]

    def clear(self) -> None:
        self.logs.clear()
        self.pending.clear()


def rows_of(t: torch.Tensor | None, rows: int, flat: bool) -> Any:
    """The step's first ``rows`` entries of a runner input (``flat``: token
    ids, any shape; else positions ``[T]`` or ``[k, T]``, the first row):
    numpy views on the CPU (cheaper than torch views), tensors elsewhere."""
    if t is None:
        return None
    if t.device.type == "cpu":
        t = t.numpy()
    if flat:
        return t.reshape(-1)[:rows]
    return t.reshape(-1, t.shape[-1])[0, :rows]


def kept(t: Any) -> Any:
    """A copy of a runner buffer's rows that outlives the step (the runner
    refills its buffers): numpy's copy on the CPU, where a torch clone costs
    a dispatch; a clone (staying on the device) elsewhere."""
    if t is None:
        return None
    return t.copy() if isinstance(t, np.ndarray) else t.clone()
