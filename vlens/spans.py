"""One grammar for token spans, the same in every call that takes ``span=``.

``Steer``, ``Ablate``, ``Clamp``, ``s.patch``, ``s.attribution_patch``,
``s.direction``, ``Diff.direction``, the widgets and the OpenAI body's
``vlens`` object all read a span here (docs/concepts.md has the table):

* a name: ``"all"`` (every row the request runs: the prompt, then the
  generated tokens fed back), ``"prompt"`` (the prompt's rows), ``"generated"``
  (the rows fed back), ``"last"`` (the prompt's last row), or a role
  (``"user"``, ``"assistant"`` ...: the content rows of that role's messages,
  conversations only; ``"assistant"`` also covers the reply being written);
* a range: ``(start, stop)`` or ``slice(start, stop)`` or ``range(start,
  stop)``, ``stop`` exclusive, ``None`` for "to the end";
* explicit positions: a list ``[3, 5]``, or one int ``3``.

Positions count from 0, the first token of the prompt, BOS included: no name
leaves the BOS out (to leave it out, start at 1: ``slice(1, None)``). A
negative position counts back from the prompt's end (``-1``: its last
token), in a range too.

On the wire (JSON has no tuples) a range is a two-number array
``[start, stop]``, explicit positions ``{"positions": [3, 5]}``.

Where the meaning of a spelling changed (before 0.5 ``s.patch``,
``s.direction``, ``Diff.direction`` and ``s.attribution_patch`` read
``(3, 5)`` as the positions 3 and 5), :func:`parse` with ``was_positions``
refuses a tuple with an error that names both new spellings, rather than
silently selecting other rows.

Plain values: nothing here touches the engine or imports the rest of vlens
but its error type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlens.errors import VlensError

__all__ = ["NAMES", "ROLES", "Positions", "from_wire", "parse", "rows", "runs", "to_wire"]

#: the named spans that are not roles
NAMES = ("all", "prompt", "generated", "last")
#: role spans: the content tokens of every message of that role
ROLES = ("system", "user", "assistant", "developer", "tool")

_FORMS = ("a name ('all', 'prompt', 'generated', 'last' or a role), (start, stop) or "
          "slice(start, stop) for a range, a list of positions or one int")


class Positions(tuple):
    """Explicit token positions (a span given as a list or an int), in the
    order given, each once; shown as the list it came from."""

    def __repr__(self) -> str:
        return repr(list(self))


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _range(start: Any, stop: Any, what: str, shown: str) -> tuple[int, int | None]:
    start = 0 if start is None else start
    if not _int(start) or not (stop is None or _int(stop)):
        raise VlensError(f"{what} span {shown} must have whole-number bounds (stop may be "
                         f"None: to the end)")
    if stop is not None and (start >= 0) == (stop >= 0) and stop <= start:
        raise VlensError(f"{what} span {shown} is empty: give (start, stop) with start < stop "
                         f"(stop exclusive)")
    return int(start), None if stop is None else int(stop)


def parse(span: Any, what: str = "", *, was_positions: bool = False) -> Any:
    """A span checked and in its one form: a name (str), a range ``(start,
    stop)`` (``stop`` None: to the end) or :class:`Positions`. ``what``
    names the call in errors; ``was_positions``: the call read a tuple as
    positions before 0.5, so a tuple is refused, naming both new forms."""
    label = f"{what} span" if what else "span"
    if isinstance(span, Positions):
        return span
    if isinstance(span, str):
        if span not in NAMES + ROLES:
            raise VlensError(f"{label} {span!r:.40} is unknown: use {_FORMS}")
        return span
    if isinstance(span, bool):
        raise VlensError(f"{label} must be {_FORMS}, got {span!r}")
    if _int(span):
        return Positions((int(span),))
    if isinstance(span, tuple):
        if len(span) != 2:
            raise VlensError(f"{label} {span!r:.60} has {len(span)} values: a tuple is a range "
                             f"(start, stop); for positions pass a list {list(span)!r:.60}")
        if was_positions and all(_int(x) for x in span):
            a, b = span
            raise VlensError(
                f"{label} {span!r:.40} meant the positions {a} and {b} here before vlens 0.5, "
                f"and a (start, stop) tuple is a range in every call now: write [{a}, {b}] for "
                f"those positions or slice({a}, {b}) for the range {a} <= i < {b}")
        return _range(span[0], span[1], label, repr(span))
    if isinstance(span, slice):
        if span.step not in (None, 1):
            raise VlensError(f"{label} {span!r} has a step: a span is a contiguous range "
                             "(or list the positions)")
        return _range(span.start, span.stop, label, repr(span))
    if isinstance(span, range):
        if span.step != 1:
            raise VlensError(f"{label} {span!r} has a step: list the positions instead")
        return _range(span.start, span.stop, label, repr(span))
    if isinstance(span, list):
        if not span or not all(_int(p) for p in span):
            raise VlensError(f"{label} list must hold token positions (ints), at least one, "
                             f"got {span!r:.60}")
        if len(set(span)) != len(span):
            raise VlensError(f"{label} {span!r:.60} names a position twice")
        return Positions(int(p) for p in span)
    raise VlensError(f"{label} must be {_FORMS}, got {span!r:.60}")


def from_wire(value: Any, what: str = "") -> Any:
    """A span as JSON sends it (``[start, stop]``: a range; ``{"positions":
    [...]}``) -> :func:`parse`'s form."""
    if isinstance(value, list):
        if len(value) != 2:
            raise VlensError(f"{what or 'span'}: an array is a range [start, stop]; for "
                             "positions send {\"positions\": [...]}")
        value = tuple(value)
    elif isinstance(value, dict):
        if set(value) != {"positions"} or not isinstance(value["positions"], list):
            raise VlensError(f"{what or 'span'}: an object span is {{\"positions\": [p, ...]}}")
        value = value["positions"]
    elif isinstance(value, float):
        raise VlensError(f"{what or 'span'}: a position is a whole number, got {value!r}")
    return parse(value, what)


def to_wire(span: Any) -> Any:
    """:func:`parse`'s form as JSON (see :func:`from_wire`)."""
    if isinstance(span, Positions):
        return {"positions": list(span)}
    if isinstance(span, tuple):
        return list(span)
    return span


def _at(p: int, n_prompt: int) -> int:
    return p + n_prompt if p < 0 else p


def rows(span: Any, n_prompt: int, n_total: int | None = None,
         roles: Sequence[Any] | None = None, what: str = "") -> list[int]:
    """The rows a parsed span selects in a request of ``n_prompt`` prompt
    rows and ``n_total`` rows in all (default: the prompt only), in order.
    ``roles``: each prompt row's role (conversations), for role names.
    A position outside the rows, or a span that selects none, is an error."""
    total = n_prompt if n_total is None else n_total
    label = f"{what} span" if what else "span"
    if span == "all":
        out = list(range(total))
    elif span == "prompt":
        out = list(range(n_prompt))
    elif span == "generated":
        out = list(range(n_prompt, total))
    elif span == "last":
        out = [n_prompt - 1]
    elif isinstance(span, str):
        if roles is None or not any(roles):
            raise VlensError(f"{label} {span!r} names a role: it needs a conversation prompt")
        out = [k for k, r in enumerate(list(roles)[:n_prompt]) if r == span]
        if span == "assistant":
            out += list(range(n_prompt, total))
    elif isinstance(span, Positions):
        out = [_at(p, n_prompt) for p in span]
        bad = [p for p, q in zip(span, out) if not 0 <= q < total]
        if bad:
            where = "the prompt" if total == n_prompt else "the rows"
            raise VlensError(f"{label}: position {bad[0]} is outside {where} (0 to "
                             f"{total - 1}; negative counts back from the prompt's "
                             f"{n_prompt} tokens)")
    else:
        start, stop = span
        a = _at(start, n_prompt)
        b = total if stop is None else _at(stop, n_prompt)
        if not 0 <= a < b <= total:
            raise VlensError(f"{label} {tuple(span)!r} is outside the rows: there are {total} "
                             f"(0 to {total - 1}; negative counts back from the prompt's "
                             f"{n_prompt} tokens)")
        out = list(range(a, b))
    if not out:
        raise VlensError(f"{label} {span!r:.40} selects no row ({n_prompt} prompt rows, "
                         f"{total} in all)")
    return out


def runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Positions as runs of consecutive rows ``(start, stop)``, in order."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out
