"""The writes of one step, planned: every request's steering adds and sets
(ablations, patched cells) at one (site, layer) as one batch.

:func:`vlens.worker.planner.plan_step` clips each request's adds and sets
to the rows it runs in the step (``clip_adds``, ``clip_sets``: array
arithmetic per group of requests) and makes one :class:`AddBatch` /
:class:`SetBatch` per (site, layer) (``add_batch``, ``set_batch``): one
index built and checked on the host, so applying it (``site_ops``) needs
no device-to-host read. Pure: numpy and torch, tested with plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vlens.protocol.plan import Add, Plan, Set
from vlens.worker.layout import StepLayout

__all__ = ["AddBatch", "SetBatch", "add_batch", "clip_adds", "clip_sets", "set_batch"]


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
    #: clamps among the adds: per SAE id, ``(its entries of the batch [c]
    #: int64, their features [c] int64)``; each such row gets
    #: ``(scale - f(row)) * vector`` instead of ``scale * vector``
    clamps: tuple[tuple[str, torch.Tensor, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class SetBatch:
    """Every set (ablation, patched cell) at one (site, layer) in one step.

    Dims ``[lo[i], hi[i])`` of row ``rows[i]`` become those of
    ``matrix[vectors[i]]`` (zeros where ``vectors[i] < 0``); where
    ``project[i]``, row ``rows[i]`` loses its component along that vector
    instead (a directional ablation)."""

    rows: torch.Tensor  # [m] int64 row numbers in the step
    vectors: torch.Tensor  # [m] int64 rows of the worker's vector matrix, -1: zeros
    lo: torch.Tensor  # [m] int64 first dim replaced
    hi: torch.Tensor  # [m] int64 dim after the last replaced
    any_vector: bool  # False: every set writes zeros (no matrix needed)
    req_ids: tuple[str, ...]
    project: torch.Tensor | None = None  # [m] bool, None when no set projects


def clip_adds(plan: Plan, idx: np.ndarray, where: tuple, vector_rows: Mapping[str, int],
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
            (rows_lo, rows_hi, vec, add.scale, add.relative, keys,
             (add.sae, add.feature) if add.sae else None))


def clip_sets(plan: Plan, idx: np.ndarray, where: tuple, vector_rows: Mapping[str, int],
               set_parts: dict, problems: dict) -> None:
    """Like :func:`clip_adds` for the plan's sets: appends ``(first rows,
    last rows + 1, vector row or -1, lo, hi, request ids, project)``."""
    for st, rows_lo, rows_hi, keys in _clipped(plan.sets, idx, where):
        vec = vector_rows.get(st.vec, None) if st.vec else -1
        if vec is None:
            for key in keys:
                problems[key].append(
                    f"site {st.site}, layer {st.layer}: vector {st.vec} never reached "
                    "this worker"
                )
            continue
        set_parts[(st.site, st.layer)].append((rows_lo, rows_hi, vec, st.lo, st.hi, keys,
                                               st.project))


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


def add_batch(parts: list, layout: StepLayout, device: torch.device | str) -> AddBatch:
    """One index for all of a (site, layer)'s adds, built on the host and
    checked there, so applying it needs no device-to-host read."""
    rows, per_part = _rows_of(parts, layout)
    vec = np.repeat(np.array([p[2] for p in parts], dtype=np.int64), per_part)
    scale = np.repeat(np.array([p[3] for p in parts], dtype=np.float32), per_part)
    rel = np.array([p[4] for p in parts], dtype=bool)
    relative = torch.from_numpy(np.repeat(rel, per_part)).to(device) if rel.any() else None
    clamps = _clamps_of(parts, per_part, device)
    uniform = None
    if relative is None and not clamps and rows.size and int(rows[-1]) - int(rows[0]) + 1 == rows.size and (
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
        clamps=clamps,
    )


def _clamps_of(parts: list, per_part: np.ndarray, device: torch.device | str) -> tuple:
    """The batch entries of the clamps among ``parts``, grouped by SAE."""
    if all(len(p) < 7 or p[6] is None for p in parts):
        return ()
    ends = np.cumsum(per_part)
    by: dict[str, tuple[list, list]] = {}
    for p, end, n in zip(parts, ends.tolist(), per_part.tolist()):
        if len(p) > 6 and p[6] is not None:
            sel, feats = by.setdefault(p[6][0], ([], []))
            sel.append(np.arange(end - n, end))
            feats.append(np.full(n, p[6][1], dtype=np.int64))
    return tuple((sid, torch.from_numpy(np.concatenate(sel)).to(device),
                  torch.from_numpy(np.concatenate(feats)).to(device))
                 for sid, (sel, feats) in by.items())


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


def set_batch(parts: list, layout: StepLayout, device: torch.device | str) -> SetBatch:
    """One index for all of a (site, layer)'s sets; ``hi == -1`` becomes a
    bound past any row width."""
    rows, per_part = _rows_of(parts, layout)
    vec = np.array([p[2] for p in parts], dtype=np.int64)
    hi = np.array([p[4] for p in parts], dtype=np.int64)
    hi = np.where(hi < 0, np.iinfo(np.int64).max, hi)
    proj = np.array([p[6] for p in parts], dtype=bool)
    return SetBatch(
        torch.from_numpy(rows).to(device),
        torch.from_numpy(np.repeat(vec, per_part)).to(device),
        torch.from_numpy(np.repeat(np.array([p[3] for p in parts], dtype=np.int64),
                                   per_part)).to(device),
        torch.from_numpy(np.repeat(hi, per_part)).to(device),
        bool((vec >= 0).any()),
        tuple(r for p in parts for r in p[5]),
        torch.from_numpy(np.repeat(proj, per_part)).to(device) if proj.any() else None,
    )
