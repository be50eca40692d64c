"""The steering vectors one worker holds, as rows of one matrix.

Every request's steering edits at a site in a step are applied with one
``index_select`` from this matrix, so the vectors live side by side on the
model's device. Vectors arrive and leave one by one (the client keeps a
bounded cache of them, see ``Engine.hold_vectors``): a new vector takes a
free row, a dropped one frees its row, and the matrix grows by doubling, so
adding a vector never re-copies the others except on the rare growth.
Pure torch: no vLLM import.
"""

from __future__ import annotations

import torch

__all__ = ["VectorStore"]


class VectorStore:
    """``{id: row}`` over a ``[capacity, hidden]`` float32 matrix."""

    def __init__(self, hidden: int, device: torch.device | str = "cpu", capacity: int = 16) -> None:
        self.hidden = int(hidden)
        self.matrix = torch.zeros(max(1, capacity), self.hidden, device=device)
        self.rows: dict[str, int] = {}
        self._free: list[int] = list(range(self.matrix.shape[0] - 1, -1, -1))

    def __contains__(self, vid: str) -> bool:
        return vid in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, vid: str) -> int | None:
        return self.rows.get(vid)

    def put(self, vid: str, vector: torch.Tensor) -> int:
        """Store ``vector`` ``[hidden]`` under ``vid`` (kept if already
        there); returns its row."""
        if vid in self.rows:
            return self.rows[vid]
        if vector.dim() != 1 or vector.shape[0] != self.hidden:
            raise ValueError(
                f"vector {vid} has shape {list(vector.shape)}; expected [{self.hidden}]"
            )
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.matrix[row].copy_(vector.to(self.matrix.device, torch.float32))
        self.rows[vid] = row
        return row

    def drop(self, vid: str) -> bool:
        row = self.rows.pop(vid, None)
        if row is None:
            return False
        self._free.append(row)
        return True

    def _grow(self) -> None:
        old = self.matrix
        n = old.shape[0]
        self.matrix = torch.zeros(2 * n, self.hidden, device=old.device)
        self.matrix[:n].copy_(old)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    @property
    def nbytes(self) -> int:
        return self.matrix.numel() * self.matrix.element_size()
