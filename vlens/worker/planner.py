"""The step planner: what every hook does in one forward step.

Once per forward step the worker hands this module the runner's arrays --
the requests in batch order, each one's plan (or None), vLLM's cumulative
row offsets (``query_start_loc``), how many tokens each request had already
computed, the padded row count -- and :func:`plan_step` returns a
:class:`StepPlan`: for every (site, layer) that anyone wants this step, the
read groups, the one batched steering add, and the edit calls. The hooks
then only execute it.

This is the code that decides which rows are whose, so it is pure (torch
only, no vLLM import) and tested with plain data (tests/test_planner.py),
like the batcher it builds on. Rules it keeps:

* the layout covers every request in the step, with or without a plan:
  rows of untraced requests still shift everyone after them;
* a request's rows in this step are positions ``[first, first + n)`` of its
  own sequence (``first`` = tokens already computed), so token spans of
  steering edits are clipped per step, whatever the chunking;
* all requests' steering adds at one (site, layer) become one index: one
  ``index_add_`` however many requests there are; so do all their sets
  (ablations, patched cells): one gather, one masked difference, one
  ``index_add_``;
* requests that read the same (site, layer) the same way form one group:
  one gather and one reduction for all of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vlens.worker.layout import RowSpan, StepLayout
from vlens.protocol.plan import Add, Edit, Plan, Read, Set
from vlens.worker.groups import BatchGroups, _Requests

__all__ = ["AddBatch", "BatchGroups", "EditCall", "ReadGroup", "SetBatch", "StepPlan", "plan_step", "COLLECTIVE",
           "GATHERED"]

#: reductions that every tensor-parallel rank must join (the unembedding
#: gathers across ranks), though only the reading rank keeps the result
COLLECTIVE = ("logit_lens", "logprobs")

#: sites whose values are sharded by head across tensor-parallel ranks: every
#: rank reads them, and the worker gathers the heads before one rank keeps them
GATHERED = ("q", "k", "v", "z", "attn_pattern")

Key = tuple[str, int]  # (site, layer)


class ReadGroup:
    """Requests reading one (site, layer) the same way in one step.

    ``spans`` are the requests' spans in the group's row order; a group the
    planner makes keeps only batch indices and makes them when first asked
    for (after the run, when the reads are cut per request)."""

    __slots__ = ("read", "_spans", "_pick", "index", "rows_t", "bounds")

    def __init__(self, read: Read, spans: Sequence[RowSpan] | None = None,
                 index: np.ndarray | None = None, rows_t: torch.Tensor | None = None,
                 bounds: tuple[int, int] | None = None, *,
                 pick: tuple[StepLayout, list[np.ndarray]] | None = None) -> None:
        self.read = read  # a representative (same key and k for the whole group)
        self._spans = None if spans is None else tuple(spans)
        self._pick = pick  # (layout, batch indices of each plan group)
        #: [sum of span lengths] int64 step rows of the spans, one after
        #: another (built once per step with array arithmetic)
        self.index = index
        #: ``index`` as a tensor on the step's device
        self.rows_t = rows_t
        #: ``(lo, hi)`` when the rows are exactly ``lo, lo + 1, …, hi - 1``
        #: (a decode step of a whole batch): a slice instead of a gather
        self.bounds = bounds

    @property
    def spans(self) -> tuple[RowSpan, ...]:
        if self._spans is None:
            layout, picks = self._pick or (None, [])
            every = layout.spans if layout is not None else ()
            self._spans = tuple(every[i] for idx in picks for i in idx.tolist())
        return self._spans

    def __repr__(self) -> str:
        return f"ReadGroup({self.read!r}, {len(self.spans)} spans)"

    def on(self, layout: StepLayout) -> ReadGroup:
        """The same rows in another step with the same row layout (a decode
        step reusing the last one's plan): spans from ``layout``."""
        if self._pick is None:
            raise ValueError("only a group the planner made can move to another step")
        return ReadGroup(self.read, None, self.index, self.rows_t, self.bounds,
                         pick=(layout, self._pick[1]))

    def index_on(self, device: torch.device) -> torch.Tensor:
        """:meth:`rows` as an int64 tensor on ``device`` (the planner makes
        it once per group of plans: every site they read shares it)."""
        t = self.rows_t
        if t is None or t.device != device:
            t = torch.from_numpy(self.rows()).to(device)
        return t

    def rows(self) -> np.ndarray:
        """The group's step rows, the spans' rows one after another."""
        if self.index is not None:
            return self.index
        return np.concatenate([np.arange(s.start, s.stop) for s in self.spans]
                              ) if self.spans else np.zeros(0, np.int64)

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.spans]

    @property
    def req_ids(self) -> list[str]:
        return [s.key for s in self.spans]


@dataclass(frozen=True)
class AddBatch:
    """Every steering add at one (site, layer) in one step.

    Row ``rows[i]`` of the step gets ``scales[i] * matrix[vectors[i]]``
    (times the row's own norm where ``relative[i]``)."""

    rows: torch.Tensor  # [m] int64 row numbers in the step
    vectors: torch.Tensor  # [m] int64 rows of the worker's vector matrix
    scales: torch.Tensor  # [m] float32
    relative: torch.Tensor | None  # [m] bool, None when no add is relative
    req_ids: tuple[str, ...]  # the requests concerned
    #: ``(lo, hi, vector row, scale)`` when every add is the same fixed
    #: (not relative) vector and scale on rows ``lo, …, hi - 1``, as when
    #: one Steer covers a whole decode batch: one slice add, no index
    uniform: tuple[int, int, int, float] | None = None
    #: the hooks' scratch for this batch (the uniform add's scaled vector),
    #: kept while decode steps reuse the plan
    cache: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class SetBatch:
    """Every set (ablation, patched cell) at one (site, layer) in one step.

    Dims ``[lo[i], hi[i])`` of row ``rows[i]`` become those of
    ``matrix[vectors[i]]`` (zeros where ``vectors[i] < 0``)."""

    rows: torch.Tensor  # [m] int64 row numbers in the step
    vectors: torch.Tensor  # [m] int64 rows of the worker's vector matrix, -1: zeros
    lo: torch.Tensor  # [m] int64 first dim replaced
    hi: torch.Tensor  # [m] int64 dim after the last replaced
    any_vector: bool  # False: every set writes zeros (no matrix needed)
    req_ids: tuple[str, ...]


@dataclass(frozen=True)
class EditCall:
    """One request's ``edit=`` function at one (site, layer) in one step."""

    span: RowSpan
    edit: Edit
    plan: Plan

    @property
    def req_id(self) -> str:
        return self.span.key

    @property
    def positions(self) -> tuple[int, ...]:
        p0 = self.span.first_position
        return tuple(range(p0, p0 + self.span.length))


@dataclass(frozen=True)
class StepPlan:
    layout: StepLayout
    #: requests with a plan and rows in this step: req_id -> (plan, span)
    requests: dict[str, tuple[Plan, RowSpan]]
    reads: dict[Key, tuple[ReadGroup, ...]]
    adds: dict[Key, AddBatch]
    sets: dict[Key, SetBatch]
    edits: dict[Key, tuple[EditCall, ...]]
    #: req_id -> what could not be planned for it (e.g. a missing vector)
    problems: dict[str, list[str]]
    #: what the plan was made from, for :func:`plan_step` to reuse it in the
    #: next decode step: (query_start_loc, first positions, padded rows,
    #: the BatchGroups, vector_version)
    basis: tuple | None = field(default=None, compare=False, repr=False)
    #: the hooks' scratch for this plan (shared by a decode step reusing it:
    #: the same (site, layer) keys)
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    def wants(self, key: Key) -> bool:
        return key in self.reads or key in self.adds or key in self.sets or key in self.edits


def plan_step(
    req_ids: Sequence[str],
    plans: Sequence[Plan | None],
    query_start_loc: Sequence[int],
    num_computed: Sequence[int],
    *,
    num_padded: int | None = None,
    vector_rows: Mapping[str, int] | None = None,
    reader: bool = True,
    device: torch.device | str = "cpu",
    groups: BatchGroups | None = None,
    previous: StepPlan | None = None,
    vector_version: int = 0,
) -> StepPlan | None:
    """Plan one forward step; None when no request in it carries a plan.

    ``vector_rows`` maps steering-vector ids to rows of the worker's matrix
    (an id it lacks becomes a problem of the request, not an exception).
    ``reader`` is False on tensor-parallel ranks that keep nothing: they plan
    only the writes, edits and the reads every rank must join. ``groups``:
    ``BatchGroups.of(plans)``, when the caller keeps it between steps.
    Apart from the layout's spans, the work per step is array arithmetic
    per group of requests, not Python work per request.

    ``previous``: the last step's plan. When this step is the decode step
    after it (same groups, one row per request, every request one position
    further) and no request crossed the edge of a steering or set span,
    its reads, adds and sets are reused with this step's layout: the
    indices are the same tensors, built once for the whole decode run.
    ``vector_version`` changes whenever a vector leaves the worker (a
    reused plan must not point at a freed row)."""
    if groups is None:
        if plans.count(None) == len(plans):
            return None
        groups = BatchGroups.of(plans)
    elif not groups.planned.size:
        return None
    req_ids = list(req_ids)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    first = np.asarray(num_computed, dtype=np.int64)
    layout = StepLayout.from_query_start_loc(
        req_ids, qsl, first_positions=first, num_padded=num_padded,
    )
    basis = (qsl, first, layout.num_padded, groups, vector_version)
    if previous is not None and _same_decode(previous.basis, basis):
        return StepPlan(
            layout, _Requests(plans, layout, groups.planned),
            {key: tuple(g.on(layout) for g in gs) for key, gs in previous.reads.items()},
            previous.adds, previous.sets, previous.edits, previous.problems, basis,
            previous.scratch,
        )
    counts = qsl[1:] - qsl[:-1]

    def live(idx: np.ndarray) -> np.ndarray:  # requests with rows in this step
        return idx if bool((counts[idx] > 0).all()) else idx[counts[idx] > 0]

    planned = live(groups.planned)
    requests = _Requests(plans, layout, planned)
    edits: dict[Key, list[EditCall]] = defaultdict(list)
    for i in groups.edits:
        if counts[i] > 0:
            for edit in plans[i].edits:
                edits[(edit.site, edit.layer)].append(EditCall(layout.spans[i], edit, plans[i]))
    # (site, layer) -> (how read) -> [read, spans, row indices of each plan group]
    read_spans: dict[Key, dict[tuple[str, int], list]] = defaultdict(dict)
    for plan, idx in groups.reads:
        idx = live(idx)
        if not idx.size:
            continue
        rows = None  # built once per plan group, shared by all its sites
        for where, how, read in plan.read_slots:
            if reader or read.reduce in COLLECTIVE or read.site in GATHERED:
                if rows is None:
                    rows = _span_rows(qsl, idx)
                    rows = (rows, torch.from_numpy(rows).to(device))
                group = read_spans[where].get(how)
                if group is None:
                    group = read_spans[where][how] = [read, [], []]
                group[1].append(idx)
                group[2].append(rows)
    reads = {
        key: tuple(_read_group(g[0], layout, g[1], g[2]) for g in groups_.values())
        for key, groups_ in read_spans.items()
    }
    where = (qsl, first, counts, req_ids)
    add_parts: dict[Key, list] = defaultdict(list)
    problems: dict[str, list[str]] = defaultdict(list)
    for plan, idx in groups.adds:
        _clip_adds(plan, live(idx), where, vector_rows or {}, add_parts, problems)
    set_parts: dict[Key, list] = defaultdict(list)
    for plan, idx in groups.sets:
        _clip_sets(plan, live(idx), where, vector_rows or {}, set_parts, problems)
    return StepPlan(
        layout=layout,
        requests=requests,
        reads=reads,
        adds={key: _add_batch(parts, layout, device) for key, parts in add_parts.items()},
        sets={key: _set_batch(parts, layout, device) for key, parts in set_parts.items()},
        edits={key: tuple(calls) for key, calls in edits.items()},
        problems=dict(problems),
        basis=basis,
    )


def _same_decode(last: tuple | None, now: tuple) -> bool:
    """Whether a step planned from ``now`` would plan what ``last`` did:
    the same batch groups and vectors, both decode steps of one row per
    request in the same rows, every request one position further, no edits
    (their calls carry positions), and no request now at the first or
    last position of an add's or set's span (where its rows would change)."""
    if last is None:
        return False
    qsl0, first0, padded0, groups0, version0 = last
    qsl, first, padded, groups, version = now
    n = len(first)
    if groups is not groups0 or version != version0 or padded != padded0 or groups.edits:
        return False
    if len(qsl) != len(qsl0) or int(qsl[-1]) != n or not np.array_equal(qsl, qsl0):
        return False
    if n and not bool((qsl[1:] > qsl[:-1]).all()):  # from 0 to n in n steps: one row each
        return False
    if not np.array_equal(first, first0 + 1):
        return False
    for plan, idx in groups.adds + groups.sets:
        edges = {x for e in plan.adds + plan.sets for x in (e.start, e.stop) if x > 0}
        at = first[idx] if edges else None
        if any(bool((at == edge).any()) for edge in edges):
            return False
    return True


def _read_group(read: Read, layout: StepLayout, picks: list[np.ndarray],
                rows: list[tuple]) -> ReadGroup:
    """One read group from each plan group's batch indices and (rows, rows
    as a tensor)."""
    if len(rows) == 1:
        index, index_t = rows[0]
    else:
        index = np.concatenate([r for r, _ in rows])
        index_t = torch.cat([t for _, t in rows])
    bounds = None
    if index.size and int(index[-1]) - int(index[0]) + 1 == index.size and (
            index.size == 1 or bool((index[1:] > index[:-1]).all())):
        bounds = (int(index[0]), int(index[-1]) + 1)
    return ReadGroup(read, None, index, index_t, bounds, pick=(layout, picks))


def _span_rows(qsl: np.ndarray, batch_idx: np.ndarray) -> np.ndarray:
    """Step rows of the requests at ``batch_idx`` of the batch (cumulative
    offsets ``qsl``), one request after another, by array arithmetic."""
    lo = qsl[batch_idx]
    counts = qsl[batch_idx + 1] - lo
    if bool((counts == 1).all()):  # a decode step: one row each
        return lo
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(lo, counts) + offsets


def _clip_adds(plan: Plan, idx: np.ndarray, where: tuple, vector_rows: Mapping[str, int],
               add_parts: dict, problems: dict) -> None:
    """Each add of ``plan``, clipped to the rows of the requests at batch
    indices ``idx`` whose positions fall in its ``[start, stop)`` (``stop <
    0``: to the end): appends ``(first rows, last rows + 1, vector row,
    scale, relative, request ids)`` to ``add_parts[(site, layer)]``."""
    for add, rows_lo, rows_hi, keys in _clipped(plan.adds, idx, where):
        vec = vector_rows.get(add.vec)
        if vec is None:
            for key in keys:
                problems[key].append(
                    f"site {add.site}, layer {add.layer}: steering vector {add.vec} "
                    "never reached this worker"
                )
            continue
        add_parts[(add.site, add.layer)].append(
            (rows_lo, rows_hi, vec, add.scale, add.relative, keys))


def _clip_sets(plan: Plan, idx: np.ndarray, where: tuple, vector_rows: Mapping[str, int],
               set_parts: dict, problems: dict) -> None:
    """Like :func:`_clip_adds` for the plan's sets: appends ``(first rows,
    last rows + 1, vector row or -1, lo, hi, request ids)``."""
    for st, rows_lo, rows_hi, keys in _clipped(plan.sets, idx, where):
        vec = vector_rows.get(st.vec, None) if st.vec else -1
        if vec is None:
            for key in keys:
                problems[key].append(
                    f"site {st.site}, layer {st.layer}: vector {st.vec} never reached "
                    "this worker"
                )
            continue
        set_parts[(st.site, st.layer)].append((rows_lo, rows_hi, vec, st.lo, st.hi, keys))


def _clipped(entries: Sequence[Add | Set], idx: np.ndarray, where: tuple):
    """For each entry with a ``[start, stop)`` token span, the step rows of
    the requests at batch indices ``idx`` inside it (``where``: the step's
    row offsets, tokens computed before it, row counts and request ids):
    yields ``(entry, first rows [k], last rows + 1 [k], the k request ids)``
    for entries that cover any row."""
    qsl, computed, counts, req_ids = where
    start = qsl[idx]
    first = computed[idx]
    end = first + counts[idx]
    for entry in entries:
        lo = np.maximum(entry.start, first)
        hi = end if entry.stop < 0 else np.minimum(entry.stop, end)
        hit = np.nonzero(lo < hi)[0]
        if hit.size:
            yield (entry, start[hit] + lo[hit] - first[hit], start[hit] + hi[hit] - first[hit],
                   [req_ids[i] for i in idx[hit].tolist()])


def _add_batch(parts: list, layout: StepLayout, device: torch.device | str) -> AddBatch:
    """One index for all of a (site, layer)'s adds, built on the host and
    checked there, so applying it needs no device-to-host read."""
    rows, per_part = _rows_of(parts, layout)
    vec = np.repeat(np.array([p[2] for p in parts], dtype=np.int64), per_part)
    scale = np.repeat(np.array([p[3] for p in parts], dtype=np.float32), per_part)
    rel = np.array([p[4] for p in parts], dtype=bool)
    relative = torch.from_numpy(np.repeat(rel, per_part)).to(device) if rel.any() else None
    uniform = None
    if relative is None and rows.size and int(rows[-1]) - int(rows[0]) + 1 == rows.size and (
            rows.size == 1 or bool((rows[1:] > rows[:-1]).all())) and (
            len({(p[2], p[3]) for p in parts}) == 1):
        uniform = (int(rows[0]), int(rows[-1]) + 1, int(parts[0][2]), float(scale[0]))
    return AddBatch(
        torch.from_numpy(rows).to(device),
        torch.from_numpy(vec).to(device),
        torch.from_numpy(scale).to(device),
        relative,
        tuple(r for p in parts for r in p[5]),
        uniform,
    )


def _rows_of(parts: list, layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """The step rows of ``parts`` (each with arrays of first rows and last
    rows + 1 as its first two items), and how many rows each part has."""
    lo = np.concatenate([p[0] for p in parts])
    hi = np.concatenate([p[1] for p in parts])
    if lo.min() < 0 or hi.max() > layout.num_actual:
        raise ValueError(f"edited rows outside the step's {layout.num_actual} rows")
    counts = hi - lo
    sizes = [len(p[0]) for p in parts]
    # row numbers: each part's first row, repeated, plus 0, 1, … within the part
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.repeat(lo, counts) + offsets
    per_part = np.add.reduceat(counts, np.cumsum([0] + sizes[:-1]))
    return rows, per_part


def _set_batch(parts: list, layout: StepLayout, device: torch.device | str) -> SetBatch:
    """One index for all of a (site, layer)'s sets; ``hi == -1`` becomes a
    bound past any row width."""
    rows, per_part = _rows_of(parts, layout)
    vec = np.array([p[2] for p in parts], dtype=np.int64)
    hi = np.array([p[4] for p in parts], dtype=np.int64)
    hi = np.where(hi < 0, np.iinfo(np.int64).max, hi)
    return SetBatch(
        torch.from_numpy(rows).to(device),
        torch.from_numpy(np.repeat(vec, per_part)).to(device),
        torch.from_numpy(np.repeat(np.array([p[3] for p in parts], dtype=np.int64),
                                   per_part)).to(device),
        torch.from_numpy(np.repeat(hi, per_part)).to(device),
        bool((vec >= 0).any()),
        tuple(r for p in parts for r in p[5]),
    )
