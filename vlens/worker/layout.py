"""Which rows of vLLM's flattened batch belong to which request.

vLLM runs many requests in one forward step and lays their tokens back to
back: a decoder layer sees ``[T, H]`` (native models) or ``[1, T, H]``
(vLLM's Transformers backend, which keeps Hugging Face's leading batch dim),
where the T rows are request A's prompt chunk, request B's single decode row,
and so on, possibly followed by padding rows up to a captured graph size.

This module turns that into per-request row spans and reads / writes those
rows, and nothing else. It is pure torch and never imports vLLM, so every
rule here is tested with plain tensors.

The rule that matters (docs/concepts.md, "The token axis"): never decide "is this
tensor batched?" by ``shape[0] == T`` alone. On a ``[1, T, H]`` tensor that
test says "not batched" and the whole step -- every request's rows -- passes
through. ``token_axis`` finds the axis or raises :class:`TokenAxisError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from vlens.errors import TokenAxisError

__all__ = [
    "RowSpan",
    "StepLayout",
    "TokenAxisError",
    "narrow",
    "add_rows",
    "token_axis",
    "widen",
]


class RowSpan(NamedTuple):
    """Rows ``[start, stop)`` of one step that belong to request ``key``.

    ``first_position`` is the position in the request's own sequence of the
    first of those rows (0 for the first prefill chunk, the number of tokens
    already computed for a later chunk or a decode row). A named tuple:
    a step makes one per request, so it must be cheap to build.
    """

    key: Hashable
    start: int
    stop: int
    first_position: int = 0

    @property
    def length(self) -> int:
        return self.stop - self.start


class _Arrays(NamedTuple):
    """A layout's spans still as arrays: keys, row edges, first positions."""

    keys: Sequence[Hashable]
    edges: np.ndarray
    first: Sequence[int] | np.ndarray


class StepLayout:
    """The row layout of one forward step.

    ``spans`` follow the engine's batch order and cover every request in the
    step, including requests that carry no vlens plan: their rows still
    shift everyone after them. ``num_actual`` is the number of real rows;
    ``num_padded`` (>= ``num_actual``) is the row count the model actually
    ran, which is larger when the engine pads a step (CUDA graphs).

    A layout made by :meth:`from_query_start_loc` keeps the runner's arrays
    and makes its spans only when they are first asked for: a step whose
    hooks only need row indices never builds one object per request.
    """

    __slots__ = ("_spans", "_arrays", "num_actual", "num_padded")

    def __init__(self, spans: tuple[RowSpan, ...] | _Arrays, num_actual: int,
                 num_padded: int) -> None:
        self.num_actual = num_actual
        self.num_padded = num_padded
        if isinstance(spans, _Arrays):  # checked by the maker; spans made when asked for
            self._spans: tuple[RowSpan, ...] | None = None
            self._arrays: _Arrays | None = spans
            return
        at = 0
        for s in spans:
            if s.start != at or s.stop < s.start:
                raise ValueError(
                    f"spans must be contiguous and in order: {s} starts at "
                    f"{s.start}, expected {at}"
                )
            at = s.stop
        if at != num_actual:
            raise ValueError(f"spans cover {at} rows but num_actual is {num_actual}")
        if num_padded < num_actual:
            raise ValueError(
                f"num_padded ({num_padded}) < num_actual ({num_actual})"
            )
        self._spans = tuple(spans)
        self._arrays = None

    @property
    def spans(self) -> tuple[RowSpan, ...]:
        if self._spans is None:
            keys, edges, first = self._arrays
            edges = edges.tolist() if isinstance(edges, np.ndarray) else edges
            first = first.tolist() if isinstance(first, np.ndarray) else first
            self._spans = tuple(map(RowSpan, keys, edges[:-1], edges[1:], first))
            self._arrays = None
        return self._spans

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepLayout):
            return NotImplemented
        return (self.spans, self.num_actual, self.num_padded) == (
            other.spans, other.num_actual, other.num_padded)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"StepLayout(spans={self.spans!r}, num_actual={self.num_actual}, "
                f"num_padded={self.num_padded})")

    @classmethod
    def from_counts(
        cls,
        keys: Sequence[Hashable],
        counts: Sequence[int],
        *,
        first_positions: Sequence[int] | None = None,
        num_padded: int | None = None,
    ) -> StepLayout:
        """Layout from each request's row count, in batch order."""
        if len(keys) != len(counts):
            raise ValueError(f"{len(keys)} keys but {len(counts)} counts")
        if first_positions is None:
            first_positions = [0] * len(keys)
        spans, at = [], 0
        for key, n, p in zip(keys, counts, first_positions):
            spans.append(RowSpan(key, at, at + int(n), int(p)))
            at += int(n)
        return cls(tuple(spans), at, at if num_padded is None else int(num_padded))

    @classmethod
    def from_query_start_loc(
        cls,
        keys: Sequence[Hashable],
        query_start_loc: Sequence[int],
        *,
        first_positions: Sequence[int] | None = None,
        num_padded: int | None = None,
    ) -> StepLayout:
        """Layout from vLLM's cumulative row offsets ``[0, n0, n0+n1, …]``."""
        if len(query_start_loc) != len(keys) + 1:
            raise ValueError(
                f"query_start_loc has {len(query_start_loc)} entries for "
                f"{len(keys)} requests; expected {len(keys) + 1}"
            )
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        if len(keys) and (qsl[0] != 0 or bool((qsl[1:] < qsl[:-1]).any())):
            counts = [int(b) - int(a) for a, b in zip(qsl.tolist(), qsl[1:].tolist())]
            return cls.from_counts(  # raises, naming the bad span
                keys, counts, first_positions=first_positions, num_padded=num_padded
            )
        # built with array arithmetic and checked above: no per-span check
        first = [0] * len(keys) if first_positions is None else first_positions
        if len(first) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(first)} first positions")
        n = int(qsl[-1]) if len(qsl) else 0
        padded = n if num_padded is None else int(num_padded)
        if padded < n:
            raise ValueError(f"num_padded ({padded}) < num_actual ({n})")
        # the spans (and lists) are made from the arrays only if something asks for them
        return cls(_Arrays(keys, qsl, first if isinstance(first, np.ndarray) else list(first)),
                   n, padded)

    def span(self, key: Hashable) -> RowSpan:
        for s in self.spans:
            if s.key == key:
                return s
        raise KeyError(f"request {key!r} is not in this step")

    def keys(self) -> list[Hashable]:
        return [s.key for s in self.spans]


def token_axis(tensor: torch.Tensor, layout: StepLayout, *, site: str = "?") -> int:
    """The axis of ``tensor`` that runs over the step's tokens.

    * ``[T, …]`` -> 0 (vLLM's native models);
    * ``[1, T, …]`` -> 1 (the Transformers backend's leading batch dim);
    * T may be the real or the padded row count.

    A tensor with 3 or more dims whose leading dim is 1 and whose second dim
    is T is read as ``[1, T, …]``, even when T is 1 too (both readings then
    select the same elements) or the hidden size happens to equal T. Any
    other shape raises :class:`TokenAxisError` naming the site: vlens never
    passes a tensor through whole because it could not place the rows.
    """
    sizes = {layout.num_actual, layout.num_padded}
    shape = tuple(tensor.shape)
    if len(shape) >= 2 and shape[0] == 1 and shape[1] in sizes:
        if len(shape) >= 3 or shape[0] not in sizes:
            return 1
    if len(shape) >= 1 and shape[0] in sizes:
        return 0
    raise TokenAxisError(
        f"site {site}: cannot find the token axis of a tensor of shape "
        f"{list(shape)} in a step of {layout.num_actual} tokens"
        + (f" ({layout.num_padded} with padding)" if layout.num_padded != layout.num_actual else "")
        + ". vlens expects [tokens, ...] or [1, tokens, ...]; this site's value "
        "has another layout, so vlens cannot tell which rows belong to which "
        "request. Read a residual-stream site (resid_pre, resid_post, attn_out, "
        "mlp_out) instead, or report the model and site."
    )


def _resolved_axis(tensor: torch.Tensor, layout: StepLayout, axis: int | None, site: str) -> int:
    """``axis`` if it is the token axis of ``tensor`` (found when None)."""
    if axis is None:
        return token_axis(tensor, layout, site=site)
    if tensor.dim() <= axis or tensor.shape[axis] not in (layout.num_actual, layout.num_padded):
        raise TokenAxisError(
            f"site {site}: axis {axis} of shape {list(tensor.shape)} is not the "
            f"token axis of a step of {layout.num_actual} tokens"
        )
    return axis


def _checked_axis(
    tensor: torch.Tensor, layout: StepLayout, span: RowSpan, axis: int | None, site: str
) -> int:
    axis = _resolved_axis(tensor, layout, axis, site)
    if not 0 <= span.start <= span.stop <= layout.num_actual:
        raise TokenAxisError(
            f"site {site}: rows [{span.start}, {span.stop}) of request "
            f"{span.key!r} fall outside the step's {layout.num_actual} real rows"
        )
    return axis


def narrow(
    tensor: torch.Tensor,
    layout: StepLayout,
    span: RowSpan,
    *,
    axis: int | None = None,
    clone: bool = False,
    site: str = "?",
) -> torch.Tensor:
    """One request's rows of ``tensor``, on its token axis.

    The result keeps the tensor's layout (``[n, H]`` or ``[1, n, H]``). It is
    a view of engine memory unless ``clone`` is true, in which case it is a
    copy that later kernels cannot overwrite.
    """
    axis = _checked_axis(tensor, layout, span, axis, site)
    rows = tensor.narrow(axis, span.start, span.length)
    return rows.clone() if clone else rows


def widen(
    tensor: torch.Tensor,
    layout: StepLayout,
    span: RowSpan,
    rows: torch.Tensor,
    *,
    axis: int | None = None,
    site: str = "?",
) -> torch.Tensor:
    """Write one request's rows back into the step's ``tensor``, in place.

    ``rows`` must have the shape :func:`narrow` returns for the same span.
    Other requests' rows and padding rows are left untouched. Returns
    ``tensor``. The write never depends on ``rows`` aliasing ``tensor``.
    """
    axis = _checked_axis(tensor, layout, span, axis, site)
    target = tensor.narrow(axis, span.start, span.length)
    if tuple(rows.shape) != tuple(target.shape):
        raise TokenAxisError(
            f"site {site}: cannot write rows of shape {list(rows.shape)} for "
            f"request {span.key!r}; its rows here have shape {list(target.shape)}"
        )
    if rows.data_ptr() != target.data_ptr() or rows.stride() != target.stride():
        target.copy_(rows)
    return tensor


def add_rows(
    tensor: torch.Tensor,
    layout: StepLayout,
    rows: torch.Tensor,
    delta: torch.Tensor,
    *,
    axis: int | None = None,
    site: str = "?",
    check: bool = True,
) -> torch.Tensor:
    """Add ``delta[i]`` to row ``rows[i]`` of the step's ``tensor``, in place,
    in one batched operation whatever the number of requests.

    ``rows`` is an int64 index of real rows (duplicates accumulate);
    ``delta`` is ``[len(rows), *row_shape]``. This is how many requests'
    steering edits land at one site in one step. Returns ``tensor``.
    ``check=False`` skips the range check of ``rows``, which reads them back
    to the host (a device sync on a GPU): for callers that built ``rows``
    from the layout themselves (the step planner does).
    """
    axis = _resolved_axis(tensor, layout, axis, site)
    if check and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= layout.num_actual):
        raise TokenAxisError(
            f"site {site}: row index outside the step's {layout.num_actual} real rows"
        )
    if axis == 1:
        if tensor.shape[0] != 1:
            raise TokenAxisError(f"site {site}: expected [1, T, ...], got {list(tensor.shape)}")
        tensor[0].index_add_(0, rows, delta.to(tensor.dtype))
    else:
        tensor.index_add_(0, rows, delta.to(tensor.dtype))
    return tensor


