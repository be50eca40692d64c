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
like the row layout (``layout.py``) it builds on. Rules it keeps:

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

from vlens.protocol.plan import Edit, Plan, Read
from vlens.worker.groups import BatchGroups, StepRequests
from vlens.worker.layout import RowSpan, StepLayout
from vlens.worker.writes import AddBatch, SetBatch, add_batch, clip_adds, clip_sets, set_batch

__all__ = ["AddBatch", "BatchGroups", "EditCall", "ReadGroup", "SetBatch", "StepPlan", "plan_step",
           "COLLECTIVE", "GATHERED"]

#: reductions that every tensor-parallel rank must join (the unembedding
#: gathers across ranks), though only the reading rank keeps the result
COLLECTIVE = ("logit_lens", "vocab_logprobs")

#: sites whose values are sharded by head across tensor-parallel ranks: every
#: rank reads them, and the worker gathers the heads before one rank keeps them
GATHERED = ("q", "k", "v", "z", "attn_pattern")

Key = tuple[str, int]  # (site, layer)


class _Picks:
    """The requests a read group takes rows of: the step's layout and the
    batch indices of each plan group (or ``(batch indices, the position
    each keeps)`` for a read of one position). The step's groups that pick
    the same requests (every site and layer one call reads) share one, so
    their spans are made once, and are one list the step log can tell by
    identity."""

    __slots__ = ("layout", "picks", "_spans")

    def __init__(self, layout: StepLayout | None, picks: Sequence) -> None:
        self.layout = layout
        self.picks = picks
        self._spans: tuple[RowSpan, ...] | None = None

    @property
    def spans(self) -> tuple[RowSpan, ...]:
        if self._spans is None:
            every = self.layout.spans if self.layout is not None else ()
            spans: list[RowSpan] = []
            for pick in self.picks:
                if isinstance(pick, tuple):  # (batch indices, the one position each keeps)
                    for i, p in zip(*(a.tolist() for a in pick)):
                        sp = every[i]
                        row = sp.start + p - sp.first_position
                        spans.append(RowSpan(sp.key, row, row + 1, p))
                else:
                    spans.extend(every[i] for i in pick.tolist())
            self._spans = tuple(spans)
        return self._spans


class ReadGroup:
    """Requests reading one (site, layer) the same way in one step.

    ``spans`` are the requests' spans in the group's row order; a group the
    planner makes keeps only batch indices and makes them when first asked
    for (after the run, when the reads are cut per request)."""

    __slots__ = ("read", "_spans", "_pick", "index", "rows_t", "bounds")

    def __init__(self, read: Read, spans: Sequence[RowSpan] | None = None,
                 index: np.ndarray | None = None, rows_t: torch.Tensor | None = None,
                 bounds: tuple[int, int] | None = None, *,
                 pick: _Picks | tuple[StepLayout, list[np.ndarray]] | None = None) -> None:
        self.read = read  # a representative (same key and k for the whole group)
        self._spans = None if spans is None else tuple(spans)
        # the requests whose rows it reads: (layout, batch indices of each
        # plan group), shared by the step's groups that pick the same ones
        self._pick = pick if pick is None or isinstance(pick, _Picks) else _Picks(*pick)
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
            self._spans = () if self._pick is None else self._pick.spans
        return self._spans

    def __repr__(self) -> str:
        return f"ReadGroup({self.read!r}, {len(self.spans)} spans)"

    def on(self, layout: StepLayout, shared: dict | None = None) -> ReadGroup:
        """The same rows in another step with the same row layout (a decode
        step reusing the last one's plan): spans from ``layout``, one list
        for the groups that picked the same requests (``shared``: a dict
        for one step's groups)."""
        if self._pick is None:
            raise ValueError("only a group the planner made can move to another step")
        old = self._pick
        pick = None if shared is None else shared.get(id(old))
        if pick is None:
            pick = _Picks(layout, old.picks)
            if shared is not None:
                shared[id(old)] = pick
        return ReadGroup(self.read, None, self.index, self.rows_t, self.bounds, pick=pick)

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
        moved: dict[int, _Picks] = {}
        return StepPlan(
            layout, StepRequests(plans, layout, groups.planned),
            {key: tuple(g.on(layout, moved) for g in gs) for key, gs in previous.reads.items()},
            previous.adds, previous.sets, previous.edits, previous.problems, basis,
            previous.scratch,
        )
    counts = qsl[1:] - qsl[:-1]

    def live(idx: np.ndarray) -> np.ndarray:  # requests with rows in this step
        return idx if bool((counts[idx] > 0).all()) else idx[counts[idx] > 0]

    planned = live(groups.planned)
    requests = StepRequests(plans, layout, planned)
    edits: dict[Key, list[EditCall]] = defaultdict(list)
    for i in groups.edits:
        if counts[i] > 0:
            for edit in plans[i].edits:
                edits[(edit.site, edit.layer)].append(EditCall(layout.spans[i], edit, plans[i]))
    reads = _plan_reads(groups, live, qsl, first, layout, reader, device)
    where = (qsl, first, counts, req_ids)
    add_parts: dict[Key, list] = defaultdict(list)
    problems: dict[str, list[str]] = defaultdict(list)
    for plan, idx in groups.adds:
        clip_adds(plan, live(idx), where, vector_rows or {}, add_parts, problems)
    set_parts: dict[Key, list] = defaultdict(list)
    for plan, idx in groups.sets:
        clip_sets(plan, live(idx), where, vector_rows or {}, set_parts, problems)
    return StepPlan(
        layout=layout,
        requests=requests,
        reads=reads,
        adds={key: add_batch(parts, layout, device) for key, parts in add_parts.items()},
        sets={key: set_batch(parts, layout, device) for key, parts in set_parts.items()},
        edits={key: tuple(calls) for key, calls in edits.items()},
        problems=dict(problems),
        basis=basis,
    )


def _plan_reads(groups: BatchGroups, live, qsl: np.ndarray, first: np.ndarray,
                layout: StepLayout, reader: bool, device: torch.device | str
                ) -> dict[Key, tuple[ReadGroup, ...]]:
    """The step's read groups per (site, layer): requests that read it the
    same way share one group (``live``: the requests of a plan group with
    rows in this step). A read of one position (``Read.position``) takes
    only the row at it, from the requests whose rows in this step hold it
    (a prefill chunk may not; a decode step never does). Ranks other than
    the reader plan only the reads every rank must join."""
    # (site, layer) -> (how read) -> [read, spans, row indices of each plan group]
    read_spans: dict[Key, dict[tuple[str, int], list]] = defaultdict(dict)
    for plan, idx in groups.reads:
        idx = live(idx)
        if not idx.size:
            continue
        # built once per plan group (and position), shared by all its sites:
        # (rows, rows as a tensor, the pick the group's spans are made from)
        rows = None
        at_rows: dict[int, tuple | None] = {}
        for where, how, read in plan.read_slots:
            if reader or read.reduce in COLLECTIVE or read.site in GATHERED:
                if read.position is None:
                    if rows is None:
                        r = _span_rows(qsl, idx)
                        rows = (r, torch.from_numpy(r).to(device), idx)
                    entry = rows
                else:
                    if read.position not in at_rows:
                        at_rows[read.position] = _position_rows(
                            qsl, first, groups.prompt_len, idx, read.position, device)
                    entry = at_rows[read.position]
                    if entry is None:  # no request of the group holds it in this step
                        continue
                group = read_spans[where].get(how)
                if group is None:
                    group = read_spans[where][how] = [read, [], []]
                group[1].append(entry[2])
                group[2].append(entry[:2])
    shared: dict[tuple[int, ...], _Picks] = {}  # the same picks (by identity): one spans list
    return {
        key: tuple(_read_group(g[0], layout, g[1], g[2], shared) for g in groups_.values())
        for key, groups_ in read_spans.items()
    }


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
    if groups.prompt_len is not None:  # a one-position read: its row is in one step only
        for plan, idx in groups.reads:
            for r in plan.reads:
                if r.position is not None:
                    at = _positions(r.position, groups.prompt_len, idx)
                    if bool(((at == first[idx]) | (at == first0[idx])).any()):
                        return False
    for plan, idx in groups.adds + groups.sets:
        edges = {x for e in plan.adds + plan.sets for x in (e.start, e.stop) if x > 0}
        at = first[idx] if edges else None
        if any(bool((at == edge).any()) for edge in edges):
            return False
    return True


def _read_group(read: Read, layout: StepLayout, picks: list[np.ndarray],
                rows: list[tuple], shared: dict[tuple[int, ...], _Picks]) -> ReadGroup:
    """One read group from each plan group's batch indices and (rows, rows
    as a tensor); ``shared``: the step's picks so far, by the identity of
    what they pick (made once per plan group and position, and alive for
    the whole planning)."""
    if len(rows) == 1:
        index, index_t = rows[0]
    else:
        index = np.concatenate([r for r, _ in rows])
        index_t = torch.cat([t for _, t in rows])
    bounds = None
    if index.size and int(index[-1]) - int(index[0]) + 1 == index.size and (
            index.size == 1 or bool((index[1:] > index[:-1]).all())):
        bounds = (int(index[0]), int(index[-1]) + 1)
    same = tuple(map(id, picks))
    pick = shared.get(same)
    if pick is None:
        pick = shared[same] = _Picks(layout, picks)
    return ReadGroup(read, None, index, index_t, bounds, pick=pick)


def _positions(position: int, prompt_len: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
    """The sequence position a one-position read keeps, for each request at
    batch indices ``idx`` (negative: from each one's prompt end)."""
    if position >= 0 or prompt_len is None:
        return np.full(idx.size, position, dtype=np.int64)
    return prompt_len[idx] + position


def _position_rows(qsl: np.ndarray, first: np.ndarray, prompt_len: np.ndarray | None,
                   idx: np.ndarray, position: int, device: torch.device | str) -> tuple | None:
    """Step rows of ``position`` of the requests at ``idx`` whose rows in
    this step hold it, as a tensor too, and the pick ``(batch indices,
    positions)`` their spans are made from; None where none does."""
    at = _positions(position, prompt_len, idx)
    f = first[idx]
    inside = (at >= f) & (at < f + (qsl[idx + 1] - qsl[idx]))
    if not bool(inside.any()):
        return None
    sel, at = idx[inside], at[inside]
    rows = qsl[sel] + (at - first[sel])
    return rows, torch.from_numpy(rows).to(device), (sel, at)


def _span_rows(qsl: np.ndarray, batch_idx: np.ndarray) -> np.ndarray:
    """Step rows of the requests at ``batch_idx`` of the batch (cumulative
    offsets ``qsl``), one request after another, by array arithmetic."""
    lo = qsl[batch_idx]
    counts = qsl[batch_idx + 1] - lo
    if bool((counts == 1).all()):  # a decode step: one row each
        return lo
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(lo, counts) + offsets
