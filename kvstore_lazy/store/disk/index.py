"""The disk index: row id -> the location of its record, in memory.

Owns: the two index kinds and the few operations the store needs over either (make, place, list, size). Does
not own: the locations' meaning (:mod:`.layout`) or the live-record counts by segment (the store keeps those).

The index holds one ``uint32`` per row: the location ``slot << shift | offset`` (a segment slot, reused after
compaction, and the record number in it). For a store given its row range (``rows``, a key's rows on one server:
the disk tier's choice when it fits a share of the memory budget) it is a :class:`DenseIndex`: 4 bytes a
*possible* row, a probe one array read. Otherwise it is a :class:`~kvstore_lazy.store.rows.RowTable`: 8 bytes of
id + 4 of location + 4 / load of int32 hash buckets a row stored; the table is rebuilt at twice the size past
``INDEX_LOAD`` = 0.8 (denser than a memory table's 0.5: a linear-probing miss then costs about 12 probes, nothing
beside a disk read), so the load is 0.4 .. 0.8 and the buckets 5 to 10 bytes: 17 to 22 bytes a row, exact in
:func:`index_nbytes`. 50 million rows on disk: 0.85 to 1.1 GB of hash index, or 0.2 GB of dense index for a key
of 50 million possible rows.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.store.rows import RowTable

INDEX_LOAD = 0.8                # the index's hash table is rebuilt larger past this load (see the module docstring)
INDEX_RESERVE = 0.95            # index_nbytes counts the next table from this share of the rehash load on


class DenseIndex:
    """The index of a store whose row ids all lie in [first, first + count) (a key's rows on one server): one
    ``uint32`` location per *possible* row at ``id - first`` (the row's index slot), :data:`EMPTY` where the row is
    not stored. 4 bytes a possible row, all of them from the start, against the hash index's 17 to 22 a stored row;
    a probe is one array read, an insert or a removal one write (no hashing, no probe sequence, no rows moved). The
    same interface as the hash index (a :class:`~kvstore_lazy.store.rows.RowTable` of one uint32 column) where the
    store uses it."""

    EMPTY = 0xFFFFFFFF

    def __init__(self, first: int, count: int) -> None:
        if first < 0 or count < 0 or first + count > 1 << 63:
            raise ValueError(f"row range [{first}, {first} + {count}) out of bounds")
        self.first, self.count = int(first), int(count)
        self._locs = np.full((self.count, 1), self.EMPTY, np.uint32)
        self._stored = 0
        self.row_nbytes = 0             # what a row stored adds: nothing (every possible row has its entry)

    def __len__(self) -> int:
        return self._stored

    def _slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(slots, mask of the ids in range, or None when all are)."""
        slots = ids.view(np.int64) - self.first if ids.dtype == np.uint64 else ids.astype(np.int64) - self.first
        if not len(slots) or (slots.min() >= 0 and slots.max() < self.count):
            return slots, None
        inside = (slots >= 0) & (slots < self.count)       # (ids past 2^63 are negative as int64)
        return slots, inside

    def lookup(self, row_ids: np.ndarray) -> np.ndarray:
        """Index slot of each id, -1 where it is not stored (or out of range)."""
        slots, inside = self._slots(row_ids)
        if inside is None:
            return np.where(self._locs[slots, 0] != self.EMPTY, slots, -1)
        out = np.full(len(slots), -1, np.int64)
        at = slots[inside]
        out[inside] = np.where(self._locs[at, 0] != self.EMPTY, at, -1)
        return out

    def place(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, stored already) for ids (unique, all in range: else ValueError, nothing changed); the slots of
        those not stored count as stored from now on (the caller sets their locations)."""
        slots = self.check(row_ids)
        old = self._locs[slots, 0] != self.EMPTY
        self._stored += int(len(slots) - old.sum())
        return slots, old

    def check(self, row_ids: np.ndarray) -> np.ndarray:
        """The slots of ids that must all be in range (else ValueError)."""
        slots, inside = self._slots(row_ids)
        if inside is not None:
            bad = row_ids[~inside][0]
            raise ValueError(f"row {int(bad)} is outside this store's rows [{self.first}, {self.first + self.count})")
        return slots

    def remove_slots(self, slots: np.ndarray) -> None:
        self._locs[slots, 0] = self.EMPTY
        self._stored -= len(slots)

    def arrays(self) -> list[np.ndarray]:
        return [self._locs]

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, their locations) of the rows stored."""
        slots = np.flatnonzero(self._locs[:, 0] != self.EMPTY)
        return slots.astype(np.uint64) + np.uint64(self.first), self._locs[slots, 0]

    def row_ids(self) -> np.ndarray:
        return self.items()[0]

    def nbytes(self) -> int:
        return self._locs.nbytes


def new_index(rows: tuple[int, int] | None, capacity: int = 0) -> RowTable | DenseIndex:
    """A dense index over ``rows`` = (first, count), or (None) a hash index with room for ``capacity`` rows."""
    if rows is not None:
        return DenseIndex(*rows)
    if capacity:
        return RowTable(1, np.uint32, initial_capacity=capacity, max_load=INDEX_LOAD, lean_rehash=True)
    return RowTable(1, np.uint32, max_load=INDEX_LOAD, lean_rehash=True)


def place(index: RowTable | DenseIndex, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index slots for ``ids`` (unique), made where missing (their locations for the caller to set), and a mask
    of those that were there already (one probe)."""
    if isinstance(index, DenseIndex):
        return index.place(ids)
    before = len(index)      # the rows it had are those at older slots
    slots = index.ensure(ids, lambda new: np.zeros((len(new), 1), np.uint32))
    return slots, slots < before


def items(index: RowTable | DenseIndex) -> tuple[np.ndarray, np.ndarray]:
    """(ids, locations) of every row stored (views of the hash index's own arrays, by slot: never copied)."""
    if isinstance(index, DenseIndex):
        return index.items()
    n = len(index)
    return index.row_ids_view(), index.arrays()[0][:n, 0]


def index_nbytes(index: RowTable | DenseIndex) -> int:
    """Memory the index takes (exact: ids, locations, hash buckets), plus, once it is within ``INDEX_RESERVE`` of
    its next rehash, the buckets that rehash adds: a memory budget counting this makes room for the larger table
    before it is built (the old one goes first: lean_rehash), so the rehash of a large index never takes the
    process past its accounted bytes."""
    if isinstance(index, DenseIndex):
        return index.nbytes()
    n, buckets = len(index), index.buckets
    extra = buckets * index._index._table.itemsize if n >= INDEX_RESERVE * INDEX_LOAD * buckets else 0
    return index.nbytes() + extra
