"""An array given piece by piece: what a snapshot of a table writes without ever holding a copy of it.

Owns: :class:`Pieces`, one array of a table's rows (sorted by id) described by its shape and dtype and gathered
a chunk of rows at a time when read (``RowTable.export_pieces`` makes them; ``store.npz.savez`` writes
them); :func:`id_order`, the slots of a table's rows in id order, found a range of ids at a time (a sort of every id
of a table in memory at once holds 16-20 bytes a row, a fifth of the table's own bytes). Does not own: the table
(``store.rows``), the file format (``persist``).
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np


def ascends_after(ids: np.ndarray, last: int) -> bool:
    """Whether ``ids`` (a piece of a stream of ids) ascend strictly and all lie above ``last``, the last id of the
    pieces before it (-1 before the first: ids are >= 0): a stream read a piece at a time is sorted and unique."""
    return not len(ids) or (int(ids[0]) > last and (len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())))


class Pieces:
    """One array of a table's rows sorted by id, given piece by piece along its first axis
    (:meth:`RowTable.export_pieces`): ``shape``, ``dtype``, ``len`` and :meth:`pieces` (the array in order,
    ``chunk`` rows a piece, gathered from the table when asked for: use them before the table changes). A snapshot
    writes it without ever holding the whole array; ``np.asarray`` gathers it whole (tests, in-memory copies)."""

    def __init__(self, take: Callable[[np.ndarray], np.ndarray], order, row_shape: tuple, dtype, chunk: int,
                 rows: int | None = None) -> None:
        """`order`: the positions to take, in order: an array, or a callable giving them as consecutive parts
        (:func:`id_ranges`; then `rows` is their total)."""
        self._take, self._order, self._chunk = take, order, chunk
        self.shape = (len(order) if rows is None else rows,) + tuple(row_shape)
        self.dtype = np.dtype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def _parts(self):
        return self._order() if callable(self._order) else [self._order]

    def pieces(self):
        for part in self._parts():
            for lo in range(0, len(part), self._chunk):
                yield self._take(part[lo:lo + self._chunk])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        parts = list(self._parts())
        whole = self._take(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return whole if dtype is None else whole.astype(dtype, copy=False)


ORDER_PASS = 1 << 20        # rows an id range of id_order holds, about (its temporaries: ~16 bytes each)
ORDER_PASSES = 16           # at most: a larger table's ranges hold more rows each (1 byte a row of the table)
SCAN = 1 << 20              # ids compared at once while a range's rows are found


def id_ranges(ids: np.ndarray):
    """The positions of `ids` (a table's ids by slot) in ascending id order, as ``np.argsort(ids)`` gives them, in
    consecutive parts: one range of ids at a time, the ranges cut at quantiles of a sample of the ids. What it holds
    is one range's positions and ids, about 1/16 of the table's rows at most (or ORDER_PASS), never a copy of every
    id with a sort's buffers (16-20 bytes a row); each range costs a scan of the ids."""
    n = len(ids)
    index = np.int32 if n < 2 ** 31 else np.int64
    passes = min(ORDER_PASSES, -(-n // ORDER_PASS))
    if passes <= 1:
        if n:
            yield np.argsort(ids, kind="stable").astype(index, copy=False)
        return
    sample = np.sort(ids[::max(1, n // (64 * passes))])
    cuts = np.unique(sample[(np.arange(1, passes) * len(sample)) // passes])
    for lo, hi in zip([None] + list(cuts), list(cuts) + [None]):
        found = []
        for start in range(0, n, SCAN):
            part = ids[start:start + SCAN]
            hit = part < hi if lo is None else (part >= lo if hi is None else (part >= lo) & (part < hi))
            found.append(np.add(np.flatnonzero(hit), start, dtype=index))
        slots = np.concatenate(found)
        del found
        yield slots[np.argsort(ids[slots], kind="stable")]


def id_order(ids: np.ndarray) -> np.ndarray:
    """:func:`id_ranges` as one array (4 bytes a row while the table has fewer than 2^31)."""
    order = np.empty(len(ids), np.int32 if len(ids) < 2 ** 31 else np.int64)
    at = 0
    for part in id_ranges(ids):
        order[at:at + len(part)] = part
        at += len(part)
    return order


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


def fill(table, ids, arrays: list, num_states: int, columns: list[str], dtype, chunk: int) -> None:
    """Rows `ids` (sorted and unique, checked here a chunk at a time: else ValueError; none in ``table``: a new
    ``RowTable``; an array or in pieces) into ``table``, ``chunk`` at a time, from `arrays` (weights, `num_states`
    states, then the `columns` named; arrays or in pieces), so slot ``i`` is row ``i``."""
    id_cursor, cursors = Cursor(ids), [Cursor(a) for a in arrays]
    last = -1
    for lo in range(0, len(ids), chunk):
        k = min(len(ids) - lo, chunk)
        part = np.asarray(id_cursor.take(k)).astype(np.uint64, copy=False)
        if not ascends_after(part, last):
            raise ValueError("row ids to load are not sorted and unique")
        last = int(part[-1])
        parts = [c.take(k) for c in cursors]
        slots = table.ensure(part, functools.partial(_given, parts[0].astype(dtype, copy=False)))
        if num_states:
            table.set_states(slots, parts[1:1 + num_states])
        for name, values in zip(columns, parts[1 + num_states:]):
            if name in table._columns:
                table._columns[name].array[lo:lo + k] = values
    for cursor in [id_cursor, *cursors]:
        cursor.close()


def _given(rows: np.ndarray, new: np.ndarray) -> np.ndarray:
    return rows
