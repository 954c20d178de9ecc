"""An array given piece by piece: what a snapshot of a table writes without ever holding a copy of it.

Owns: :class:`Pieces`, one array of a table's rows (sorted by id) described by its shape and dtype and gathered
a chunk of rows at a time when read (``RowTable.export_pieces`` makes them; ``persist.snapshots.savez`` writes
them). Does not own: the table or the order of its rows (``store.rows``), the file format (``persist``).
"""
from __future__ import annotations

import functools
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


class Cursor:
    """Consecutive rows of an array, or of anything given in pieces (``pieces()``: :class:`Pieces`, a snapshot's
    members read from its file), ``k`` at a time whatever the pieces' sizes; :meth:`close` runs the pieces to their
    end (where a file's member is checked)."""

    def __init__(self, array) -> None:
        self._pieces = iter(array.pieces()) if hasattr(array, "pieces") else None
        self._array, self._at = array, 0
        self._buffer: np.ndarray | None = None

    def take(self, k: int) -> np.ndarray:
        if self._pieces is None:
            self._at += k
            return self._array[self._at - k:self._at]
        parts = []
        while k:
            if self._buffer is None or not len(self._buffer):
                self._buffer = next(self._pieces)
            part, self._buffer = self._buffer[:k], self._buffer[k:]
            parts.append(part)
            k -= len(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        if self._pieces is not None:
            for _ in self._pieces:
                raise ValueError("rows given in pieces beyond the rows they were said to hold")


def fill(table, ids: np.ndarray, arrays: list, num_states: int, columns: list[str], dtype, chunk: int) -> None:
    """Rows `ids` (sorted, none in ``table``: a new ``RowTable``) into ``table``, ``chunk`` at a time, from `arrays`
    (weights, `num_states` states, then the `columns` named; arrays or in pieces), so slot ``i`` is row ``i``."""
    cursors = [Cursor(a) for a in arrays]
    for lo in range(0, len(ids), chunk):
        k = min(len(ids) - lo, chunk)
        parts = [c.take(k) for c in cursors]
        slots = table.ensure(ids[lo:lo + k], functools.partial(_given, parts[0].astype(dtype, copy=False)))
        if num_states:
            table.set_states(slots, parts[1:1 + num_states])
        for name, values in zip(columns, parts[1 + num_states:]):
            if name in table._columns:
                table._columns[name].array[lo:lo + k] = values
    for cursor in cursors:
        cursor.close()


def _given(rows: np.ndarray, new: np.ndarray) -> np.ndarray:
    return rows
