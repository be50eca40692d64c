"""One engine step's reads, kept once for every request in the step.

The hooks keep each read group's gathered (and reduced) rows as one tensor
per (read key, part, layer) in the step's :class:`StepLog`; nothing is cut
per request inside the forward. After the run, when the records are packed
(``records.py``), the log says where each request's rows are: once per list
of spans (a :class:`_Layout`: the groups of one call's reads share one), not
once per entry and request, and a read of many layers is stacked once for
its whole group and sliced per request. Pure torch: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Later", "ReadKey", "StepLog", "host_copies"]

ReadKey = tuple[str, str, int]  # (read key, part, layer)


class Later:
    """Rows standing in a step's log for a tensor made when the log is cut,
    after the run (a feature read encoded with other steps' rows, a DLA
    read reduced outside the compiled step): the shape and dtype now, the
    values from :meth:`tensor`, made once by ``make()``."""

    device = torch.device("cpu")

    def __init__(self, make: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._make, self._value = make, None
        self.shape, self.dtype = torch.Size(shape), dtype

    def dim(self) -> int:
        return len(self.shape)

    def tensor(self) -> torch.Tensor:
        if self._value is None:  # a failed make() raises again when asked again
            self._value, self._make = self._make(), None
        return self._value


class _Layout:
    """The entries of one step's log whose groups share one list of spans
    (the sites a call reads, every layer): where each request's rows are in
    them, and what they hold, worked out once per list, not per entry."""

    __slots__ = ("spans", "rows", "where", "entries", "parts", "row_bytes")

    def __init__(self, spans: Any) -> None:
        self.spans = spans  # kept: the log looks lists up by id()
        #: req_id -> (its first row in the group's rows, how many, the
        #: sequence position of the first; None: the span does not say)
        self.where: dict[Any, tuple[int, int, int | None]] = {}
        o = 0
        for sp in spans:
            n = sp.stop - sp.start
            self.where[sp.key] = (o, n, getattr(sp, "first_position", None))
            o += n
        self.rows = o
        self.entries: list[tuple[ReadKey, torch.Tensor]] = []
        self.parts: dict[str, set[str]] = {}  # read key -> its parts among the entries
        self.row_bytes = 0  # one row of every entry


class StepLog:
    """The reads of one engine step, kept once for every request in it.

    A hook that reads a group of requests keeps the group's gathered (and
    reduced) rows as one tensor, ``[sum of the requests' rows, ...]``, with
    the group (its spans say whose rows are where). Nothing is cut per
    request inside the forward: :meth:`of` slices one request's rows out
    when the records are packed, after the run."""

    def __init__(self) -> None:
        # (read key, part, layer) -> [(rows of one whole group, the group)]:
        # one entry per group that read it this step. Calls running at once
        # may read one key differently (a logit lens of k=3 beside one of
        # k=5, the same site at other heads): each group keeps its own rows.
        self.entries: dict[ReadKey, list[tuple[torch.Tensor, Any]]] = {}
        self._cut: list[_Layout] | None = None
        # (read key, part, layers) -> (rows of every layer stacked, their
        # layout), or False where they cannot be stacked at once
        self._stacks: dict[tuple, Any] = {}

    def put(self, key: ReadKey, rows: torch.Tensor, group: Any) -> None:
        """``group``: whose rows are where (a ``ReadGroup``: its ``spans``,
        asked for only when the log is cut)."""
        self.entries.setdefault(key, []).append((rows, group))
        self._cut = None
        self._stacks.clear()

    def _layouts(self) -> list[_Layout]:
        """The step's entries by the spans of their groups, made once, when
        the first record is packed (after the run). A read whose rows do not
        match its group's spans is left out: it fails its own requests
        (their records miss it), never the step's others."""
        if self._cut is None:
            by: dict[int, _Layout] = {}
            for key, held in self.entries.items():
                for j, (rows, group) in enumerate(held):
                    if isinstance(rows, Later):  # made after its step
                        rows = rows.tensor()
                        held[j] = (rows, group)
                    spans = group.spans
                    lay = by.get(id(spans))
                    if lay is None:
                        lay = by[id(spans)] = _Layout(spans)
                    if rows.dim() == 0 or rows.shape[0] != lay.rows:
                        continue
                    lay.entries.append((key, rows))
                    lay.parts.setdefault(key[0], set()).add(key[1])
                    lay.row_bytes += rows[:1].numel() * rows.element_size()
            self._cut = list(by.values())
        return self._cut

    def _holding(self, req_id: Any) -> Iterator[tuple[_Layout, int, int, int | None]]:
        """Each layout with rows of ``req_id``: (it, where its rows start in
        the group's, how many, the sequence position of the first)."""
        for lay in self._layouts():
            at = lay.where.get(req_id)
            if at is not None and lay.entries:
                yield (lay, *at)

    def of(self, req_id: Any) -> tuple[int, dict[ReadKey, torch.Tensor], int]:
        """Request ``req_id``'s most rows of a key this step, its rows of
        each key it read, and their bytes."""
        m, nbytes, rows = 0, 0, {}
        for lay, o, n, _ in self._holding(req_id):
            m, nbytes = max(m, n), nbytes + n * lay.row_bytes
            rows.update((key, t[o : o + n]) for key, t in lay.entries)
        return m, rows, nbytes

    def summary(self, req_id: Any) -> tuple[int, dict[str, set[str]], int, int]:
        """What :meth:`of` and :meth:`starts` say of ``req_id`` without
        cutting a row: its most rows of a key, each read key's parts, the
        bytes, and one past the last position any of its rows holds."""
        m, parts, nbytes, reach = 0, {}, 0, 0
        for lay, _, n, p0 in self._holding(req_id):
            m, nbytes = max(m, n), nbytes + n * lay.row_bytes
            if p0 is not None:
                reach = max(reach, p0 + n)
            for key, got in lay.parts.items():
                parts.setdefault(key, set()).update(got)
        return m, parts, nbytes, reach

    def starts(self, req_id: Any) -> tuple[dict[ReadKey, int], int]:
        """The sequence position of the first row of each key request
        ``req_id`` read this step (a read of one position: that one), and
        one past the last position any of them holds."""
        first, reach = {}, 0
        for lay, _, n, p0 in self._holding(req_id):
            if p0 is not None:
                first.update((key, p0) for key, _ in lay.entries)
                reach = max(reach, p0 + n)
        return first, reach

    def stacked(self, req_id: Any, key: str, part: str, layers: tuple[int, ...]
                ) -> tuple[torch.Tensor, int | None] | None:
        """Request ``req_id``'s rows of ``(key, part)`` at every layer of
        ``layers`` this step, ``[len(layers), rows, ...]``, and the sequence
        position of the first row (None: the span does not say): one stack
        for the whole group and a slice per request. None where the log
        cannot give them so (a layer not read here, a key read by more than
        one group this step, layers read by groups of other spans): the
        caller then takes them from :meth:`of`, layer by layer."""
        ck = (key, part, layers)
        got = self._stacks.get(ck)
        if got is None:
            got = self._stacks[ck] = self._stack(key, part, layers)
        if got is False:
            return None
        stack, lay = got
        at = lay.where.get(req_id)
        if at is None:
            return None
        o, m, p0 = at
        return stack[:, o : o + m], p0

    def _stack(self, key: str, part: str, layers: tuple[int, ...]) -> Any:
        layouts = self._layouts()  # (stand-ins made tensors first)
        held = [self.entries.get((key, part, layer)) for layer in layers]
        if not held or any(h is None or len(h) != 1 for h in held):
            return False
        spans = held[0][0][1].spans
        rows = [h[0][0] for h in held]
        if any(h[0][1].spans is not spans for h in held):
            return False
        lay = next((x for x in layouts if x.spans is spans), None)
        first = rows[0]
        if lay is None or first.dim() == 0 or first.shape[0] != lay.rows or any(
                r.shape != first.shape or r.dtype != first.dtype for r in rows):
            return False
        return torch.stack(rows), lay

    def to_host(self) -> None:
        """Move this step's tensors to the host: one device-to-host copy
        per dtype, into pinned memory, not blocking the device."""
        items = [(k, j, t) for k, held in self.entries.items()
                 for j, (t, _) in enumerate(held) if t.device.type != "cpu"]
        for (key, j, _), host in zip(items, host_copies([t for _, _, t in items])):
            held = self.entries[key]
            held[j] = (host, held[j][1])
        self._cut = None
        self._stacks.clear()


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of device ``tensors``, in order: one non-blocking copy
    per dtype into pinned memory."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        host = torch.empty(flat.shape, dtype=dtype, device="cpu", pin_memory=True)
        host.copy_(flat, non_blocking=True)
        at = 0
        for i in idx:
            t = tensors[i]
            out[i] = host[at : at + t.numel()].view(t.shape)
            at += t.numel()
    return out
