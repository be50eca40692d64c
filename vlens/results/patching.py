"""What ``Session.patch`` returns: the patching grid and what each cell
saw (the call is built in :mod:`vlens.methods.patching`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vlens.plots import patching_heatmap
from vlens.tokens import visible

__all__ = ["Dist", "Patching"]

Dist = tuple[list[str], list[float]]  # (tokens, log-probabilities), most likely first


@dataclass
class Patching:
    """The result of ``Session.patch``: ``grid`` ``[layers, positions]``
    float32 (``[layers, heads]`` with ``heads=``) of the normalised
    metric, NaN where a cell has not finished (``stream_patch``).

    ``tokens``: the clean prompt's token strings at ``positions``;
    ``answer``: ``(clean_id, corrupt_id)``; ``clean_diff`` /
    ``corrupt_diff``: the unpatched runs' logit differences; ``diffs``: each
    cell's; ``cell_logprobs[i][j]``: cell (i, j)'s next-token
    ``(tokens, logprobs)``, most likely first (None until it finished), and
    ``clean_logprobs`` / ``corrupt_logprobs`` the same for the unpatched
    runs.

    ``rows_computed`` / ``rows_cached``: the prompt rows the engine
    computed and read from its prefix cache, summed over the call's
    requests (both stages; vLLM's ``num_cached_tokens``). On an in-process
    engine each cell reads the corrupt run's cached blocks before its
    first patched position; ``rows_cached`` is 0 for the cells where they
    are salted apart (``vlens serve``, an engine core in another process)."""

    site: str
    layers: list[int]
    positions: list[int]
    heads: list[int] | None
    tokens: list[str]
    answer: tuple[int, int]
    answer_text: tuple[str, str]
    grid: torch.Tensor
    diffs: torch.Tensor
    clean_diff: float = math.nan
    corrupt_diff: float = math.nan
    cell_logprobs: list[list[Dist | None]] = field(default_factory=list)
    clean_logprobs: Dist | None = None
    corrupt_logprobs: Dist | None = None
    rows_computed: int = 0
    rows_cached: int = 0

    @property
    def done(self) -> int:
        """How many cells have finished."""
        return int((~self.grid.isnan()).sum())

    @property
    def columns(self) -> list[str]:
        """Column labels: ``"pos:token"`` or ``"head h"``."""
        if self.heads is not None:
            return [f"head {h}" for h in self.heads]
        return [f"{p}:{visible(t)}" for p, t in zip(self.positions, self.tokens)]

    def to_frame(self):
        """Tidy: one row per cell with ``layer``, ``position`` (None for a
        head cell, which patches every position in ``positions``), ``head``
        (None for a position cell), ``value`` and ``logit_diff``."""
        import pandas as pd

        rows = []
        for i, layer in enumerate(self.layers):
            for j in range(self.grid.shape[1]):
                rows.append({
                    "layer": layer,
                    "position": None if self.heads is not None else self.positions[j],
                    "head": self.heads[j] if self.heads is not None else None,
                    "token": None if self.heads is not None else self.tokens[j],
                    "value": float(self.grid[i, j]),
                    "logit_diff": float(self.diffs[i, j]),
                })
        return pd.DataFrame(rows)

    def figure(self, cell: tuple[int, int] | None = None):
        """A plotly heatmap of the grid (layers down, positions or heads
        across; unfinished cells empty)."""
        return patching_heatmap(
            self.grid, self.layers, self.columns, cell=cell,
            column_title="head" if self.heads is not None else "position",
            title=f"patching {self.site}: {self.done} of {self.grid.numel()} cells "
                  f"({self.answer_text[0]!r} vs {self.answer_text[1]!r})",
        )

    def __repr__(self) -> str:
        shape = "x".join(str(x) for x in self.grid.shape)
        return (f"Patching({self.site}, grid {shape}, {self.done} done, answer "
                f"{self.answer_text!r}, clean_diff {self.clean_diff:.3f}, corrupt_diff "
                f"{self.corrupt_diff:.3f})")
