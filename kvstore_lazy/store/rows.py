"""Row storage for ``row_sparse`` keys: the rows a worker has touched, and nothing else.

This module owns two things:

* :class:`RowIndex` maps 64-bit row ids (``uint64``, every value allowed, 0 and ``2**64 - 1`` included) to dense
  slots ``0 .. len - 1``. It is an open-addressing hash table with linear probing. The table holds only slots
  (``int32`` while fewer than ``2**31`` rows are possible, else ``int64``; ``-1`` marks an empty bucket); the id of
  slot ``s`` lives in a dense ``keys[s]`` array, which is also :meth:`RowIndex.row_ids`. Probing runs in a compiled
  loop (:mod:`kvstore_lazy.store.kernels`), one pass over a batch.
* :class:`RowTable` puts row arenas beside a :class:`RowIndex`: one array for the weights, one per optimizer state
  and one per named *column* (per-row metadata such as a policy's counters), all with the same capacity, row ``s``
  of each belonging to slot ``s``. Optionally it tracks which rows changed and which were removed since the last
  :meth:`RowTable.clear_changes` (what an incremental snapshot writes).

Removal keeps slots dense (swap-with-last): the removed slots below the new length are refilled with the live rows
above it, whose bucket and ``keys`` entry follow them; the removed buckets are emptied by backward-shift deletion,
so probe runs stay unbroken without tombstones. Everything is one C pass over the index plus one per arena. The
vacated tail is zeroed and its whole pages handed back to the kernel (``madvise(MADV_DONTNEED)``), so resident
memory falls with the rows and the next rows reuse those slots: a table whose row count is bounded has bounded
memory. Slot order therefore depends on history; everything that leaves the table (:meth:`RowTable.items`,
:meth:`RowTable.export`) is sorted by row id.

Memory. For ``n`` rows the index costs ``8 * n`` bytes of ``keys`` plus ``itemsize(table) * buckets``: the table has
a power-of-two bucket count and is rebuilt at twice the size once the load passes ``MAX_LOAD`` (so 4 bytes / load, 8
to 16 bytes a row with int32 slots); about 16 to 24 bytes a row in all. The table never shrinks; a table restored
with ``buckets`` gets the bucket count it had, so :meth:`RowTable.nbytes` (``n`` times the bytes of a row in every
arena, plus ``keys`` and the table: exact, not rounded to pages, a pure function of the history) is the same for a
restored table as for the one it was saved from.

Arenas (and ``keys``) are :class:`~kvstore_lazy.store.arena.Arena` objects: anonymous memory mappings that grow
in place with ``mremap``. Growing copies nothing, never holds old and new at once, and writes nothing: the kernel
hands out zeroed pages the first time a row is written, so resident memory follows the rows stored, not the
capacity (which doubles, as address space only). If growing in place is refused (a view of the array escaped, or
no ``mremap`` on this platform), an arena falls back to a new mapping and copies its used rows: the peak is then
the old plus the new used part of that one arena. A rehash builds the new table (from ``keys``) before dropping
the old one: peak 1.5 x the new table, and a failure leaves the index as it was.

Rows are gathered and scattered through a view of each arena as one opaque ``void`` item per row (``take`` and
``put``), which moves a row as one block: several times faster than numpy's 2-D fancy indexing.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from kvstore_lazy.store import kernels
from kvstore_lazy.store.arena import KEEP_SHARE, Arena
from kvstore_lazy.store.pieces import Pieces, fill, id_order, id_ranges

__all__ = ["Arena", "KEEP_SHARE", "RowIndex", "RowTable", "as_row_ids"]

#: Check :meth:`RowIndex.insert`'s preconditions (unique, absent ids). Costs a sort and a lookup per insert.
DEBUG = False
#: The hash table is rebuilt larger once more than this fraction of its buckets is used.
MAX_LOAD = 0.5
#: Capacity factor for arenas and the slot -> id array (address space only: untouched pages cost no memory).
ARENA_GROWTH = 2

_MIN_BUCKETS = 8
_MAX_INT32_SLOTS = 2**31  # tables that may hold this many rows use int64 slots


def as_row_ids(row_ids) -> np.ndarray:
    """Row ids as a 1-D ``uint64`` array (no copy when they already are one; other integers cast like numpy)."""
    return np.asarray(row_ids, dtype=np.uint64).reshape(-1)


def _grown_capacity(capacity: int, needed: int) -> int:
    return max(needed, int(capacity * ARENA_GROWTH) + 1)


REMOVED_SHARE = 64    # a table tracking changes keeps the ids it removed up to 1/64 of its bytes ...
REMOVED_MIN = 1 << 20  # ... or 1 MiB of them (RowTable.changes_complete)


EXPORT_CHUNK = 1 << 16  # rows a streamed export (RowTable.export_pieces) or a load copies at once,
EXPORT_BYTES = 8 << 20  # and at most this many bytes of an array (8 MiB: 65,536 rows of D=32 float32)


def _chunk(row_bytes: int) -> int:
    return min(EXPORT_CHUNK, max(1024, EXPORT_BYTES // max(1, row_bytes)))


def _shift(table: np.ndarray) -> int:
    """The home bucket of an id is the top bits of ``((id >> 31) ^ id) * MULT`` (see kernels): this many fewer than 64.
    A bucket in a smaller table is a prefix of the one in a larger table."""
    return 65 - len(table).bit_length()


class RowIndex:
    """uint64 row id -> int64 slot; slots are handed out ``len, len+1, ...`` in insertion order and stay dense
    ``0 .. len - 1`` through removals (the last rows move into the removed slots).

    Not thread-safe: callers serialise access (a concurrent reader only makes growth fall back to copying).
    """

    def __init__(self, capacity: int = 1024, buckets: int | None = None, max_load: float | None = None,
                 lean_rehash: bool = False):
        self._n = 0
        self.lean_rehash = lean_rehash    # drop the old table before building the new one (see _grow_table)
        self.max_load = MAX_LOAD if max_load is None else float(max_load)   # (an index of many rows that are
        if not 0.0 < self.max_load < 1.0:                                    # rarely looked up: up to 0.8)
            raise ValueError(f"max_load must be in (0, 1), got {max_load}")
        self._keys = Arena((), np.uint64, capacity)  # row id by slot
        self._table = self._new_table(capacity if buckets is None else int(buckets * self.max_load))
        if buckets is not None and len(self._table) != buckets:
            raise ValueError(f"buckets must be a power of two >= {2 * _MIN_BUCKETS}, got {buckets}")

    def __len__(self) -> int:
        return self._n

    def lookup(self, row_ids) -> np.ndarray:
        """Slots of ``row_ids`` (``int64``), ``-1`` where absent. Duplicates in the batch are fine."""
        ids = as_row_ids(row_ids)
        if not self._n or not len(ids):
            return np.full(len(ids), -1, np.int64)
        out = np.empty(len(ids), np.int64)   # the kernel writes every entry, -1 where absent
        kernels.index_lookup(self._table, self._keys.array, ids, _shift(self._table), out)
        return out

    def ensure_placed(self, ids: np.ndarray, weights: np.ndarray, place: Callable) -> np.ndarray | None:
        """Slots of ``ids`` (``uint64``, unique), the absent ones added as :meth:`insert` adds them and their rows of
        ``weights`` (an arena beside this index) given their initial values by ``place`` in one compiled call (see
        :meth:`RowTable.ensure`); None, changing nothing, if they need a larger table or arena."""
        slots = np.empty(len(ids), np.int64)
        made = place(ids, self._table, self._keys.array, _shift(self._table), self._n,
                     int(self.max_load * len(self._table)), weights, slots)
        if made is None:
            return None
        self._n += made
        return slots

    def insert(self, row_ids) -> np.ndarray:
        """Add ``row_ids`` (unique and absent: the caller guarantees it) as slots ``len, len+1, ...`` in order.

        With ``DEBUG`` set, a duplicate or present id raises ``AssertionError`` and nothing changes.
        """
        ids = as_row_ids(row_ids)
        start, m = self._n, len(ids)
        if DEBUG:
            assert len(np.unique(ids)) == m, "duplicate row ids in one insert"
            assert not (self.lookup(ids) >= 0).any(), "row id already present"
        slots = np.arange(start, start + m, dtype=np.int64)
        if not m:
            return slots
        if start + m > len(self._keys):
            self._keys.grow(_grown_capacity(len(self._keys), start + m), start)
        self._keys.array[start:start + m] = ids
        if start + m > self.max_load * len(self._table):
            self._grow_table(start, m)
        else:
            kernels.index_place(self._table, ids, start, _shift(self._table))
        self._n = start + m
        return slots

    def remove(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """Remove the rows at ``slots`` (unique, in use: else ValueError/IndexError and nothing changes). The live
        rows at ``movers`` (the last slots) take the removed slots ``holes``; returns ``(holes, movers)`` so that
        arenas beside the index can move their rows the same way."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        n, k = self._n, len(slots)
        if k and (slots.min() < 0 or slots.max() >= n):
            raise IndexError(f"slot out of range [0, {n})")
        slots = np.unique(slots)
        if len(slots) != k:
            raise ValueError("duplicate slots in one remove")
        rest = n - k
        holes = slots[slots < rest]
        tail = np.arange(rest, n, dtype=np.int64)
        movers = tail[~np.isin(tail, slots[slots >= rest], assume_unique=True)]
        if k:
            kernels.index_remove(self._table, self._keys.array, slots, holes, movers, _shift(self._table))
            self._keys.clear(rest, n)
            self._n = rest
        return holes, movers

    def row_ids(self) -> np.ndarray:
        """``uint64`` ids ordered by slot (a copy)."""
        return self._keys.array[:self._n].copy()

    def ids_at(self, slots: np.ndarray) -> np.ndarray:
        """The ids of slots in use (checked by the caller)."""
        return self._keys.array[slots]

    @property
    def buckets(self) -> int:
        return len(self._table)

    def nbytes(self) -> int:
        """Bytes in use: the stored ids (8 a row) plus the hash table."""
        return 8 * self._n + self._table.nbytes

    # -- internals

    def _new_table(self, rows: int) -> np.ndarray:
        """An empty table with room for ``rows`` at ``max_load``: a power-of-two count of buckets, all ``-1``."""
        buckets = 1 << (max(_MIN_BUCKETS, int(np.ceil(rows / self.max_load))) - 1).bit_length()
        return np.full(buckets, -1, np.int32 if buckets * self.max_load < _MAX_INT32_SLOTS else np.int64)

    def _grow_table(self, start: int, m: int) -> None:
        """A larger table for ``start + m`` rows. By default built before the old one goes (peak 1.5x the new
        table, and a failure leaves the index as it was); with ``lean_rehash`` (a large index whose memory is
        budgeted: a disk tier's) the old one goes first (peak: the new table), and if building the new one fails
        the old size is rebuilt from the ids before the error goes on."""
        if not self.lean_rehash:
            self._table = self._rebuilt(start + m)
            return
        del self._table
        try:
            self._table = self._rebuilt(start + m)
        except MemoryError:
            self._table = self._rebuilt(start)
            raise

    def _rebuilt(self, n: int) -> np.ndarray:
        """A new table holding slots ``0 .. n-1``."""
        table = self._new_table(n)
        kernels.index_place(table, self._keys.array[:n], 0, _shift(table))
        return table


class RowTable:
    """Rows of one ``row_sparse`` key: weights plus ``num_states`` optimizer states per row, created on first touch,
    plus named per-row ``columns`` (``{name: dtype}``, scalars, zero for a new row) that move with their rows.

    Arena rows at and past ``len(self)`` are always zero: arenas start zero, growth adds zero pages, slots past
    ``len`` can't be written and removal zeroes what it vacates. So a new row's states and columns need no write.

    With ``track_changes`` the table remembers which rows were created or written through it since the last
    :meth:`clear_changes` (updates made in place through :meth:`arrays` are marked by the caller with
    :meth:`mark_changed`) and the ids removed since then: :meth:`changes`. Not thread-safe.
    """

    def __init__(self, row_size: int, dtype, num_states: int = 0, initial_capacity: int = 1024,
                 columns: dict | None = None, track_changes: bool = False, buckets: int | None = None,
                 max_load: float | None = None, lean_rehash: bool = False):
        self.row_size = int(row_size)
        self.dtype = np.dtype(dtype)
        self._index = RowIndex(initial_capacity, buckets, max_load, lean_rehash)
        capacity = max(int(initial_capacity), 1)
        # _arenas[0] holds the weights, _arenas[1:] the states; all share one capacity (their first dimension)
        self._arenas = [self._arena(capacity) for _ in range(1 + int(num_states))]
        self._columns = {name: Arena((), dtype, capacity) for name, dtype in (columns or {}).items()}
        self._changed = Arena((), np.uint8, capacity) if track_changes else None
        self._removed: list[np.ndarray] = []
        self._removed_n = 0                 # ids in _removed
        self._removed_lost = False          # too many were removed to keep them (changes_complete)
        self.moves = 0        # removals so far: slots a caller kept are those of the same rows while it is unchanged

    @property
    def num_states(self) -> int:
        return len(self._arenas) - 1

    @property
    def buckets(self) -> int:
        return self._index.buckets

    @property
    def tracks_changes(self) -> bool:
        return self._changed is not None

    @property
    def changes_complete(self) -> bool:
        """:meth:`changes` can say what changed since :meth:`clear_changes`: the table tracks changes and the ids
        removed since then were kept. Not kept once they pass ``max(REMOVED_MIN, nbytes() / REMOVED_SHARE)`` bytes
        (8 a row: a table under a budget with a disk tier demotes its rows many times over between two snapshots,
        and those ids were memory no budget counted: 152 MB after 19M demotions); what changed is then the whole
        table (an incremental snapshot of it writes it whole)."""
        return self._changed is not None and not self._removed_lost

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, row_ids) -> np.ndarray:
        return self._index.lookup(row_ids)

    def probe_arrays(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """(buckets, slot -> row id, home-bucket shift, weights) as they are now, for a compiled reader that probes
        and gathers in one call (protocol/_fast.c gather_rows); stale after the next change of the table."""
        index = self._index
        return index._table, index._keys.array, _shift(index._table), self._arenas[0].array

    def ensure(self, row_ids, make_rows: Callable[[np.ndarray], np.ndarray],
               place: Callable | None = None) -> np.ndarray:
        """Slots of ``row_ids`` (unique), creating the absent rows: weights ``make_rows(missing_ids)``, zero states.

        ``make_rows`` gets the missing ids in their ``row_ids`` order and must return a ``(m, row_size)`` array;
        it runs before anything changes, so if it raises the table is untouched; so does running out of memory
        while growing the arenas. ``place``: a compiled routine that does the same for a float32 table in one pass
        when the new rows fit (``protocol/_fast.c`` ``ensure_rows`` with a key's row size and initial values bound:
        ``place(ids, buckets, slot_ids, shift, len, row_limit, weights, slots_out) -> rows made or None``; a key
        hands it over, as :meth:`probe_arrays` hands the table to a compiled reader); else the general path.
        """
        ids = as_row_ids(row_ids)
        if place is not None and self.dtype == np.float32 and ids.flags.c_contiguous:
            lo = len(self)
            slots = self._index.ensure_placed(ids, self._arenas[0].array, place)
            if slots is not None:
                if self._changed is not None and len(self) > lo:
                    self._changed.array[lo:len(self)] = 1
                return slots
        slots = self._index.lookup(ids)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            new_ids = ids[missing]
            rows = np.asarray(make_rows(new_ids), dtype=self.dtype)
            if rows.shape != (len(new_ids), self.row_size):
                raise ValueError(f"make_rows returned shape {rows.shape}, want {(len(new_ids), self.row_size)}")
            lo = len(self)
            self._reserve(lo + len(new_ids))
            slots[missing] = self._index.insert(new_ids)
            self._arenas[0].array[lo:len(self)] = rows  # their states are zero already (see the class docstring)
            if self._changed is not None:
                self._changed.array[lo:len(self)] = 1
        return slots

    def insert_absent(self, row_ids) -> np.ndarray:
        """Add ``row_ids`` (unique and absent: the caller knows it, e.g. it looked them up just now) with every
        value zero (freed slots are cleared), for the caller to fill in place; returns their slots (``len ..``).
        :meth:`ensure` without its lookup and its copy of the new values."""
        ids = as_row_ids(row_ids)
        lo = len(self)
        self._reserve(lo + len(ids))
        slots = self._index.insert(ids)
        if self._changed is not None:
            self._changed.array[lo:len(self)] = 1
        return slots

    def insert_rows(self, rows: dict) -> np.ndarray:
        """Add rows given whole (``{"row_ids", "weights", "states", "columns"}`` as :meth:`export` gives them; ids
        unique and absent), e.g. rows coming back from a disk tier; returns their slots (new: ``len .. len + n``)."""
        weights = np.asarray(rows["weights"], self.dtype)
        slots = self.ensure(rows["row_ids"], lambda new: weights)
        if self.num_states:
            self.set_states(slots, rows["states"])
        for name, values in rows["columns"].items():
            self._columns[name].array[slots] = values
        return slots

    def remove_slots(self, slots) -> np.ndarray:
        """Remove the rows at ``slots`` (unique, in use: else ValueError/IndexError and nothing changes); returns
        their ids. The last rows move into the freed slots (see the module docstring), so slots of other rows change:
        look them up again."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        if len(slots) == 0:
            return np.zeros(0, np.uint64)
        n = len(self)
        ids = self._index.ids_at(self._slots(slots)).copy()
        self.moves += 1
        holes, movers = self._index.remove(slots)
        for arena in self._all_arenas():
            kernels.move_rows(arena.array, holes, movers)   # row by row in place: no temporary copy
            arena.clear(len(self), n)
        if self._changed is not None and not self._removed_lost:
            self._removed.append(ids)
            self._removed_n += len(ids)
            if 8 * self._removed_n > max(REMOVED_MIN, self.nbytes() // REMOVED_SHARE):
                self._removed, self._removed_n, self._removed_lost = [], 0, True
        return ids

    def weights(self, slots) -> np.ndarray:
        """Copy of the weight rows at ``slots``, shape ``(k, row_size)``."""
        return self._arenas[0].take(self._slots(slots))

    def set_weights(self, slots, values) -> None:
        slots = self._slots(slots)
        self._arenas[0].put(slots, values)
        self.mark_changed(slots)

    def arrays(self) -> list[np.ndarray]:
        """The whole weight and state tables (``capacity`` rows each), to update rows in place by slot. Use them at
        once and drop them: a view still held when the table grows makes it copy instead of growing in place."""
        return [arena.array for arena in self._arenas]

    @property
    def column_dtypes(self) -> dict:
        """``{name: dtype}`` of the per-row columns."""
        return {name: arena.dtype for name, arena in self._columns.items()}

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` of every slot (``capacity`` values; those of slots in use are ``[:len(self)]``), to read
        and write in place; the same caveat as :meth:`arrays`."""
        return self._columns[name].array

    def mark_changed(self, slots) -> None:
        """Note rows written in place (through :meth:`arrays` or :meth:`column`) for :meth:`changes`."""
        if self._changed is not None:
            self._changed.array[slots] = 1

    def states(self, slots) -> list[np.ndarray]:
        """Copies of each state's rows at ``slots``."""
        slots = self._slots(slots)
        return [states.take(slots) for states in self._arenas[1:]]

    def set_states(self, slots, values: list[np.ndarray]) -> None:
        if len(values) != self.num_states:
            raise ValueError(f"{len(values)} state arrays for {self.num_states} states")
        slots = self._slots(slots)
        for states, value in zip(self._arenas[1:], values):
            states.put(slots, value)
        self.mark_changed(slots)

    def set_num_states(self, n: int) -> None:
        """Drop all states and start ``n`` fresh zero states for every row (a new optimizer)."""
        capacity = len(self._arenas[0])
        del self._arenas[1:]  # free the old states before allocating the new ones
        self._arenas += [self._arena(capacity) for _ in range(int(n))]
        if self._changed is not None:
            self._changed.array[:len(self)] = 1

    def row_ids(self) -> np.ndarray:
        """Ids by slot (a copy)."""
        return self._index.row_ids()

    def release_unused(self) -> None:
        """Give back the memory of the rows kept zeroed past the ones in use (Arena.release): before a phase that
        adds no rows (a checkpoint's reads), whose own buffers would otherwise come on top of it."""
        for arena in self._all_arenas() + [self._index._keys]:
            arena.release(len(self))

    def row_ids_view(self) -> np.ndarray:
        """Ids by slot, a view (no copy): use it at once and drop it (as :meth:`arrays`)."""
        return self._index._keys.array[:len(self)]

    def ids_at(self, slots) -> np.ndarray:
        """Ids of the rows at `slots` (in use: else IndexError)."""
        return self._index.ids_at(self._slots(slots))

    def items(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """``(ids ascending, their weights, [their states]...)``, all copies: for snapshots and checkpoints."""
        order = id_order(self.row_ids_view())
        return self._index.ids_at(order), self._arenas[0].take(order), [s.take(order) for s in self._arenas[1:]]

    def export(self, slots: np.ndarray | None = None) -> dict:
        """Rows (all, or those at ``slots``) sorted by id, copies: ``{"row_ids", "weights", "states": [...],
        "columns": {name: values}}``; :meth:`load` builds the same table from it."""
        if slots is None:
            order = id_order(self.row_ids_view())
        else:
            order = np.asarray(slots, np.int64)[np.argsort(self._index.ids_at(slots), kind="stable")]
        return {"row_ids": self._index.ids_at(order), "weights": self._arenas[0].take(order),
                "states": [states.take(order) for states in self._arenas[1:]],
                "columns": {name: arena.take(order) for name, arena in self._columns.items()}}

    def export_pieces(self, slots: np.ndarray | None = None, chunk: int | None = None) -> dict:
        """:meth:`export` as :class:`Pieces` gathered ``chunk`` rows at a time when read (a snapshot streams them
        into its file): the transient is a chunk, and the order of `slots` (8 bytes a row) or, of the whole table,
        one range of its ids at a time (store.pieces.id_ranges, found again for each array). Read them before the
        table changes."""
        rows = len(self) if slots is None else len(slots)
        if slots is None:
            order = functools.partial(id_ranges, self.row_ids_view())
        else:
            order = np.asarray(slots, np.int64)[np.argsort(self._index.ids_at(slots), kind="stable")]
        keys = self._index._keys
        arena = lambda a: Pieces(a.take, order, a.row_shape, a.dtype, chunk or _chunk(a.row_bytes), rows)  # noqa: E731
        return {"row_ids": Pieces(lambda at: keys.array[at], order, (), np.uint64, chunk or _chunk(8), rows),
                "weights": arena(self._arenas[0]), "states": [arena(a) for a in self._arenas[1:]],
                "columns": {name: arena(a) for name, a in self._columns.items()}}

    @classmethod
    def load(cls, rows: dict, dtype=None, columns: dict | None = None, track_changes: bool = False,
             buckets: int | None = None, lean_rehash: bool = False) -> "RowTable":
        """A table holding exactly ``rows`` (as :meth:`export` gives them; columns not given start zero) with
        ``columns`` (``{name: dtype}``, default those of ``rows``), ``buckets`` buckets if given. Any of the arrays,
        the ids included, may come in pieces (anything with ``len`` and ``pieces()``); the ids must be sorted and
        unique (checked a piece at a time: ValueError)."""
        weights = rows["weights"]
        if not hasattr(weights, "pieces"):
            weights = np.asarray(weights)
        dtype = weights.dtype if dtype is None else np.dtype(dtype)
        given = rows.get("columns", {})
        columns = {name: values.dtype for name, values in given.items()} if columns is None else columns
        ids = rows["row_ids"]           # an array, or in pieces (a snapshot's, folded by id): never whole here
        ids = ids if hasattr(ids, "pieces") else as_row_ids(ids)
        n = len(ids)
        table = cls(weights.shape[1], dtype, num_states=len(rows["states"]), columns=columns,
                    initial_capacity=max(n, 1) if buckets is None else max(n, buckets // 2),
                    track_changes=track_changes, buckets=buckets, lean_rehash=lean_rehash)
        # EXPORT_CHUNK rows at a time: arrays in pieces (a snapshot's, from its file) are never whole beside the table
        fill(table, ids, [weights, *rows["states"], *given.values()], len(rows["states"]), list(given), dtype,
             _chunk(table.row_nbytes))
        return table

    def changes(self, pieces: bool = False) -> dict:
        """What changed since :meth:`clear_changes`: :meth:`export` of the rows created or written (with `pieces`:
        :meth:`export_pieces`), plus ``"removed"``: ids removed since then and not present now (sorted)."""
        if not self.changes_complete:
            raise ValueError("this table does not track changes" if self._changed is None else
                             "this table removed too many rows since its changes were cleared to list them")
        changed = np.flatnonzero(self._changed.array[:len(self)])
        out = self.export_pieces(changed) if pieces else self.export(changed)
        removed = np.unique(np.concatenate(self._removed)) if self._removed else np.zeros(0, np.uint64)
        out["removed"] = removed[self.lookup(removed) < 0] if len(removed) else removed
        return out

    def clear_changes(self) -> None:
        if self._changed is not None:
            self._changed.array[:len(self)] = 0
            self._removed, self._removed_n, self._removed_lost = [], 0, False

    @property
    def row_nbytes(self) -> int:
        """Bytes one row costs in :meth:`nbytes`: its row in every arena plus its id (the buckets aside)."""
        return sum(a.row_bytes for a in self._all_arenas()) + 8

    def nbytes(self) -> int:
        """Bytes in use, exact: ``len`` times the bytes of a row in every arena (weights, states, columns, change
        flags) and its id, plus the hash table."""
        return len(self) * self.row_nbytes + self._index.buckets * self._index._table.itemsize

    # -- internals

    def _arena(self, capacity: int) -> Arena:
        return Arena((self.row_size,), self.dtype, capacity)

    def _all_arenas(self) -> list[Arena]:
        extra = [self._changed] if self._changed is not None else []
        return self._arenas + list(self._columns.values()) + extra

    def _reserve(self, n: int) -> None:
        capacity = len(self._arenas[0])
        if n > capacity:
            capacity = _grown_capacity(capacity, n)
            for arena in self._all_arenas():
                arena.grow(capacity, len(self))

    def _slots(self, slots) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) and (slots.min() < 0 or slots.max() >= len(self)):
            raise IndexError(f"slot out of range [0, {len(self)})")
        return slots

