"""The vectors one worker holds, as rows of one matrix per width.

Every request's steering edits (and sets: ablation means, patched cells) at
a site in a step are applied with one ``index_select`` from a matrix, so
the vectors live side by side on the model's device. Most vectors are
``[hidden]`` wide; a site of another width (``z`` is ``heads * head_dim``
wide) gets its own matrix, so one index per (site, layer) still suffices.
Vectors arrive and leave one by one (the client keeps a bounded cache of
them, see ``Engine.hold_vectors``): a new vector takes a free row of its
width's matrix, a dropped one frees its row, and a matrix grows by
doubling, so adding a vector never re-copies the others except on the rare
growth. Pure torch: no vLLM import.
"""

from __future__ import annotations

import torch

__all__ = ["VectorStore"]


class VectorStore:
    """``{id: row}`` over one ``[capacity, width]`` float32 matrix per width;
    ``matrix`` is the ``[capacity, hidden]`` one."""

    def __init__(self, hidden: int, device: torch.device | str = "cpu", capacity: int = 16) -> None:
        self.hidden = int(hidden)
        self.device = device
        self._capacity = max(1, capacity)
        self._mats: dict[int, torch.Tensor] = {}
        self._free: dict[int, list[int]] = {}
        self.rows: dict[str, int] = {}
        self.widths: dict[str, int] = {}
        #: changes whenever a vector arrives or leaves (a step plan kept
        #: between steps is valid only while it stays the same)
        self.version = 0
        self._new_matrix(self.hidden)

    def __contains__(self, vid: str) -> bool:
        return vid in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def matrix(self) -> torch.Tensor:
        return self._mats[self.hidden]

    def matrix_of(self, width: int) -> torch.Tensor:
        """The matrix of ``[width]`` vectors (a ValueError if none was stored)."""
        mat = self._mats.get(int(width))
        if mat is None:
            raise ValueError(f"no vector of width {width} reached this worker")
        return mat

    def get(self, vid: str) -> int | None:
        return self.rows.get(vid)

    def put(self, vid: str, vector: torch.Tensor) -> int:
        """Store ``vector`` ``[width]`` under ``vid`` (kept if already
        there); returns its row in the matrix of its width."""
        if vid in self.rows:
            return self.rows[vid]
        if vector.dim() != 1 or vector.shape[0] == 0:
            raise ValueError(
                f"vector {vid} has shape {list(vector.shape)}; expected [width] "
                f"(steering: [{self.hidden}])"
            )
        width = int(vector.shape[0])
        if width not in self._mats:
            self._new_matrix(width)
        if not self._free[width]:
            self._grow(width)
        row = self._free[width].pop()
        self.version += 1
        self._mats[width][row].copy_(vector.to(self.device, torch.float32))
        self.rows[vid] = row
        self.widths[vid] = width
        return row

    def drop(self, vid: str) -> bool:
        row = self.rows.pop(vid, None)
        if row is None:
            return False
        self._free[self.widths.pop(vid)].append(row)
        self.version += 1
        return True

    def _new_matrix(self, width: int) -> None:
        n = self._capacity
        self._mats[width] = torch.zeros(n, width, device=self.device)
        self._free[width] = list(range(n - 1, -1, -1))

    def _grow(self, width: int) -> None:
        old = self._mats[width]
        n = old.shape[0]
        self._mats[width] = torch.zeros(2 * n, width, device=old.device)
        self._mats[width][:n].copy_(old)
        self._free[width].extend(range(2 * n - 1, n - 1, -1))

    @property
    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self._mats.values())
