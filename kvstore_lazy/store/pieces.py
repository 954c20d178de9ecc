"""An array given piece by piece: what a snapshot of a table writes without ever holding a copy of it.

Owns: :class:`Pieces`, one array of a table's rows (sorted by id) described by its shape and dtype and gathered
a chunk of rows at a time when read (``RowTable.export_pieces`` makes them; ``persist.snapshots.savez`` writes
them). Does not own: the table or the order of its rows (``store.rows``), the file format (``persist``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np


class Pieces:
    """One array of a table's rows sorted by id, given piece by piece along its first axis
    (:meth:`RowTable.export_pieces`): ``shape``, ``dtype``, ``len`` and :meth:`pieces` (the array in order,
    ``chunk`` rows a piece, gathered from the table when asked for: use them before the table changes). A snapshot
    writes it without ever holding the whole array; ``np.asarray`` gathers it whole (tests, in-memory copies)."""

    def __init__(self, take: Callable[[np.ndarray], np.ndarray], order: np.ndarray, row_shape: tuple,
                 dtype, chunk: int) -> None:
        self._take, self._order, self._chunk = take, order, chunk
        self.shape = (len(order),) + tuple(row_shape)
        self.dtype = np.dtype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def pieces(self):
        for lo in range(0, len(self._order), self._chunk):
            yield self._take(self._order[lo:lo + self._chunk])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._take(self._order)
        return whole if dtype is None else whole.astype(dtype, copy=False)
