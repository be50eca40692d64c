"""The rows vlens wrote in a step, checked for non-finite values when the
step ends: each add, set and edit call registers a flag per written row
(``site_ops.keep_finite`` already put back any row that went non-finite, in
the step); one read back to the host at the step's end finds the requests
whose write it was and gives each an error naming the write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WrittenRows"]


class WrittenRows:
    """This step's writes: ``(ok per written row [m] bool, rows written,
    (site, layer), what wrote, the step's layout)`` each."""

    def __init__(self, book: Any, counters: Any) -> None:
        self.book = book  # the requests' records (errors go there)
        self.counters = counters  # counts the writes that went non-finite
        self.entries: list[tuple[torch.Tensor, Any, tuple[str, int], Any, Any]] = []

    def add(self, entry: tuple[torch.Tensor, Any, tuple[str, int], Any, Any]) -> None:
        self.entries.append(entry)

    def clear(self) -> None:
        self.entries = []

    def check(self, fail: Callable[[list[str], tuple[str, int], BaseException], None]) -> None:
        """The step's writes, checked once when it ends (one read back to
        the host for all of them): a request whose write turned a row
        non-finite gets an error naming it. Its rows were already restored
        in the step (``site_ops.keep_finite``), so nothing non-finite went
        on into later layers or the KV cache."""
        if not self.entries:
            return
        written, self.entries = self.entries, []
        try:
            oks = [w[0] for w in written]
            if bool(torch.cat(oks).all() if len(oks) > 1 else oks[0].all()):
                return
            for ok, rows, (site, layer), what, layout in written:
                bad = (~ok).nonzero().flatten().tolist()
                if not bad:
                    continue
                self.counters.nonfinite_writes += 1
                if isinstance(rows, tuple):
                    idx = [rows[0] + i for i in bad]
                elif rows is None:
                    idx = None
                else:
                    idx = rows[bad].tolist()
                spans = layout.spans if idx is not None else ()
                hit = {sp.key for sp in spans for r in idx if sp.start <= r < sp.stop}
                if isinstance(what, tuple):  # an edit call: its own request
                    what, hit = what[0], {what[1]}
                for r in hit:
                    rec = self.book.rec(r)
                    if rec is not None:
                        rec.error(
                            f"site {site}, layer {layer}: {what} turned this request's values "
                            "non-finite (inf or NaN); vlens put back the values it had before "
                            "the write, so the engine and other requests stay clean, and "
                            "refuses this request's results. Use a smaller scale or vector")
        except Exception as exc:  # pragma: no cover - reported (fail counts it), never raised
            for *_, layout in written[:1]:
                fail([sp.key for sp in layout.spans], ("(finite check)", -1), exc)
