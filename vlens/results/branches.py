"""What ``Session.branches`` returns: a generation and its branches.

A branch is the run as it went up to a generated position, another token
there (one of the run's top alternatives), and the model's continuation
from it. Every trace reads as a whole generation: ``output_token_ids`` of a
branch are the original's tokens before its branch point, the forced
token, then the continuation, with a logprob for each (the forced token's
is its logprob in the original run). Nothing here touches the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vlens.errors import VlensError
from vlens.plots import branch_rows
from vlens.results.run import Trace
from vlens.tokens import first_divergence, visible

__all__ = ["Alternative", "Branches", "alternatives_of", "branch_label"]


@dataclass(frozen=True)
class Alternative:
    """A token the model could have taken at one generated position:
    ``id``, its text, and its logprob there."""

    id: int
    token: str
    logprob: float

    @property
    def probability(self) -> float:
        return math.exp(self.logprob)


def branch_label(trace: Trace) -> str:
    """``"as it went"``, or ``"@3 ' dog'"`` for a branch at position 3."""
    if trace.branch_point is None:
        return "as it went"
    token = trace.output_tokens[trace.branch_point]
    return f"@{trace.branch_point} {visible(token)!r}"


@dataclass
class Branches:
    """The run as it went (``traces[0]``, ``original``) and its branches
    (``traces[1:]``: for each branch point in ``at``, in order, the
    alternatives by probability), each a :class:`~vlens.results.Trace` with
    ``branch_point`` and ``forced`` set.

    ``alternatives[p]``: the top-k tokens other than the one taken at
    generated position ``p`` of the original run, most likely first (every
    position, not only the branch points)."""

    traces: list[Trace]
    at: list[int]
    alternatives: list[list[Alternative]]
    k: int

    @property
    def original(self) -> Trace:
        return self.traces[0]

    @property
    def branches(self) -> list[Trace]:
        return self.traces[1:]

    def __len__(self) -> int:
        return len(self.traces)

    def __getitem__(self, i: int) -> Trace:
        return self.traces[i]

    def __iter__(self) -> Iterator[Trace]:
        return iter(self.traces)

    @property
    def texts(self) -> list[str]:
        return [t.text for t in self.traces]

    def branches_at(self, position: int) -> list[Trace]:
        """The branches made at generated ``position`` (most likely first)."""
        if position not in self.at:
            raise VlensError(f"no branches at position {position}: they are at {self.at}")
        return [t for t in self.branches if t.branch_point == position]

    def divergence(self, trace: Trace) -> int | None:
        """The first generated position where ``trace`` and the original differ."""
        return first_divergence(self.original.output_token_ids, trace.output_token_ids)

    def to_frame(self):
        """One row per trace: ``branch`` (0: as it went), ``branch_point``,
        ``forced`` (id) and ``token``, ``probability`` (of the forced token
        in the original run), ``divergence`` (first generated position that
        differs from the original), ``n_generated``, ``logprob`` (the sum
        over the generated tokens), ``cached_tokens``, ``text``."""
        import pandas as pd

        rows = []
        for i, t in enumerate(self.traces):
            n0 = len(t.prompt_token_ids)
            gen = [x for x in t.logprobs[n0:] if x is not None]
            bp = t.branch_point
            forced_lp = None if bp is None or not t.logprobs else t.logprobs[n0 + bp]
            rows.append({
                "branch": i, "branch_point": bp, "forced": t.forced,
                "token": None if bp is None else t.output_tokens[bp],
                "probability": None if forced_lp is None else math.exp(forced_lp),
                "divergence": self.divergence(t), "n_generated": len(t.output_token_ids),
                "logprob": float(sum(gen)), "cached_tokens": t.cached_tokens, "text": t.text,
            })
        return pd.DataFrame(rows)

    def figure(self, *, title: str | None = None):
        """The runs as rows of tokens (each branch from its branch point on),
        coloured by probability: :func:`vlens.plots.branch_rows`."""
        labels, starts = [], []
        for t in self.traces:
            labels.append(branch_label(t))
            starts.append(t.branch_point)
        lps = [t.logprobs[len(t.prompt_token_ids):] if t.logprobs else [None] * len(
            t.output_token_ids) for t in self.traces]
        return branch_rows(labels, [t.output_tokens for t in self.traces], lps, starts,
                           title=title)

    def __repr__(self) -> str:
        lines = [f"Branches(at={self.at}, k={self.k}: the run as it went and "
                 f"{len(self.branches)} branches)"]
        for t in self.traces:
            lines.append(f"  {branch_label(t):>18}: {t.text[:70]!r}")
        return "\n".join(lines)


def alternatives_of(top: Sequence[dict[int, float]], taken: Sequence[int], k: int,
                    names: Any) -> list[list[Alternative]]:
    """Per generated position, the ``k`` most likely tokens other than the
    one taken, from vLLM's top logprobs (``top[p]``: id -> logprob);
    ``names(ids)`` gives their texts."""
    out = []
    for entry, tok in zip(top, taken):
        ids = sorted((i for i in entry if i != tok), key=lambda i: (-entry[i], i))[:k]
        out.append([Alternative(i, s, entry[i]) for i, s in zip(ids, names(ids))])
    return out
