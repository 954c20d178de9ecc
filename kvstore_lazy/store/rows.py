"""Row storage for ``row_sparse`` keys: the rows a worker has touched, and nothing else.

This module owns two things:

* :class:`RowIndex` maps 64-bit row ids (``uint64``, every value allowed, 0 and ``2**64 - 1`` included) to dense
  slots ``0, 1, 2, ...`` in insertion order. It is an open-addressing hash table with linear probing. The table
  holds only slots (``int32`` while fewer than ``2**31`` rows are possible, else ``int64``; ``-1`` marks an empty
  bucket); the id of slot ``s`` lives in a dense ``keys[s]`` array, which is also :meth:`RowIndex.row_ids`.
  Everything is vectorised: a batch walks the probe sequence one round at a time, and only the rows still unresolved
  take part in the next round, so the number of Python-level iterations is the longest probe run in the batch, not
  the batch size. Two new ids claiming the same empty bucket in one round are settled by writing all claims and
  reading the bucket back: exactly one write survives, the losers probe on.
* :class:`RowTable` puts row arenas beside a :class:`RowIndex`: one 2-D array for the weights and one per optimizer
  state, all with the same capacity, row ``s`` of each belonging to slot ``s``. Rows are never removed.

Memory. For ``n`` rows the index costs ``8 * keys_capacity + itemsize(table) * buckets`` bytes: the table has a
power-of-two bucket count and is rebuilt at twice the size once the load passes ``MAX_LOAD`` (so 4 bytes / load, 8 to
16 bytes a row with int32 slots), ``keys`` grows like the arenas; about 17 to 26 bytes a row in all. Arenas and
``keys`` grow by ``ARENA_GROWTH`` (x1.125, at most 12.5 % unused capacity; still amortised O(1) per row).

Growth peaks. Arrays grow with ``ndarray.resize``, i.e. ``realloc``: for large arrays glibc moves the pages with
``mremap``, so growing an arena copies nothing and never holds old and new at once (numpy zero-fills the new part,
which costs the page faults any new row needs anyway; at 10M rows one step faults ~1.25M rows x 384 B at once, a
pause of about a second on a slow VM). If something else references an array (a view escaped, another thread
holds it), ``resize`` refuses and we fall back to allocate-and-copy, one array at a time: the peak is then the old
total plus one new arena (``1.125 x`` that arena). A rehash builds the new table (from ``keys``, in chunks of
``2**20`` to bound temporaries) before dropping the old one: peak 1.5 x the new table, and a failure leaves the
index as it was.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

#: Check :meth:`RowIndex.insert`'s preconditions (unique, absent ids). Costs a sort and a lookup per insert.
DEBUG = False
#: The hash table is rebuilt larger once more than this fraction of its buckets is used.
MAX_LOAD = 0.5
#: Capacity factor for arenas and the slot -> id array.
ARENA_GROWTH = 1.125

_MIN_BUCKETS = 8
_MAX_INT32_SLOTS = 2**31  # tables that may hold this many rows use int64 slots
_REHASH_CHUNK = 1 << 20
_FOLD = np.uint64(31)
_MULT = np.uint64(0xBF58476D1CE4E5B9)  # odd 64-bit multiplier (splitmix64); the top bits of the product pick the bucket


def as_row_ids(row_ids) -> np.ndarray:
    """Row ids as a 1-D ``uint64`` array (no copy when they already are one; other integers cast like numpy)."""
    return np.asarray(row_ids, dtype=np.uint64).reshape(-1)


def _grown_capacity(capacity: int, needed: int) -> int:
    return max(needed, int(capacity * ARENA_GROWTH) + 1)


def _resize_rows(holder, key, rows: int) -> None:
    """Give ``holder[key]`` (an array nothing else should reference) ``rows`` rows, keeping the leading ones.

    In place via ``realloc`` when numpy allows it (no copy, no old+new peak); otherwise a copy, zero-filled like
    ``ndarray.resize`` would.
    """
    try:
        holder[key].resize((rows,) + holder[key].shape[1:])
    except ValueError:  # referenced elsewhere (or not resizable): copy
        old = holder[key]
        new = np.zeros((rows,) + old.shape[1:], old.dtype)
        keep = min(rows, len(old))
        new[:keep] = old[:keep]
        holder[key] = new


def _home(ids: np.ndarray, buckets: int) -> np.ndarray:
    """Home bucket of each id in a table of ``buckets`` (a power of two): fold the high half in, multiply, keep the
    top bits. A bucket in a smaller table is a prefix of the one in a larger table."""
    h = ids >> _FOLD
    h ^= ids
    h *= _MULT
    h >>= np.uint64(65 - buckets.bit_length())
    return h.astype(np.intp)


def _place(table: np.ndarray, ids: np.ndarray, slots: np.ndarray) -> None:
    """Write each slot into the first empty bucket of its id's probe run (ids known absent from ``table``)."""
    mask = len(table) - 1
    pos = _home(ids, len(table))
    slots = slots.astype(table.dtype)
    while len(pos):
        free = table[pos] < 0
        table[pos[free]] = slots[free]  # rivals for one bucket: exactly one write survives
        left = table[pos] != slots  # all but the survivors (a slot is never in the table twice)
        pos, slots = pos[left], slots[left]
        pos += 1
        pos &= mask


class RowIndex:
    """uint64 row id -> int64 slot; slots are handed out ``0, 1, 2, ...`` in insertion order.

    Not thread-safe: callers serialise access (a concurrent reader only makes growth fall back to copying).
    """

    def __init__(self, capacity: int = 1024):
        self._n = 0
        self._keys = np.zeros(max(int(capacity), 1), np.uint64)  # row id by slot; len() is the capacity
        self._table = self._new_table(capacity)

    def __len__(self) -> int:
        return self._n

    def lookup(self, row_ids) -> np.ndarray:
        """Slots of ``row_ids`` (``int64``), ``-1`` where absent. Duplicates in the batch are fine."""
        ids = as_row_ids(row_ids)
        out = np.full(len(ids), -1, np.int64)
        if not self._n or not len(ids):
            return out
        table, keys, mask = self._table, self._keys, len(self._table) - 1
        pos = _home(ids, len(table))
        todo = np.arange(len(ids))
        while len(todo):  # one probe per round for the ids still unresolved; runs always end at an empty bucket
            slot = table[pos]
            used = slot >= 0
            hit = used & (keys[slot] == ids)  # keys[-1] read for empty buckets is masked off by `used`
            out[todo[hit]] = slot[hit]
            more = used & ~hit
            todo, ids, pos = todo[more], ids[more], pos[more]
            pos += 1
            pos &= mask
        return out

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
            _resize_rows(vars(self), "_keys", _grown_capacity(len(self._keys), start + m))
        self._keys[start:start + m] = ids
        if start + m > MAX_LOAD * len(self._table):
            self._table = self._rebuilt(start + m)
        else:
            _place(self._table, ids, slots)
        self._n = start + m
        return slots

    def row_ids(self) -> np.ndarray:
        """``uint64`` ids ordered by slot (a copy)."""
        return self._keys[:self._n].copy()

    def nbytes(self) -> int:
        return self._keys.nbytes + self._table.nbytes

    # -- internals

    @staticmethod
    def _new_table(rows: int) -> np.ndarray:
        """An empty table with room for ``rows`` at ``MAX_LOAD``: a power-of-two count of buckets, all ``-1``."""
        buckets = 1 << (max(_MIN_BUCKETS, int(np.ceil(rows / MAX_LOAD))) - 1).bit_length()
        return np.full(buckets, -1, np.int32 if buckets * MAX_LOAD < _MAX_INT32_SLOTS else np.int64)

    def _rebuilt(self, n: int) -> np.ndarray:
        """A new table holding slots ``0 .. n-1``, filled chunk by chunk to bound the temporaries."""
        table = self._new_table(n)
        for lo in range(0, n, _REHASH_CHUNK):
            hi = min(lo + _REHASH_CHUNK, n)
            _place(table, self._keys[lo:hi], np.arange(lo, hi))
        return table


class RowTable:
    """Rows of one ``row_sparse`` key: weights plus ``num_states`` optimizer states per row, created on first touch.

    Arena rows at and past ``len(self)`` are always zero: arenas start as ``np.zeros``, growth zero-fills, slots
    past ``len`` can't be written and rows are never removed. So a new row's states need no write. Not thread-safe.
    """

    def __init__(self, row_size: int, dtype, num_states: int = 0, initial_capacity: int = 1024):
        self.row_size = int(row_size)
        self.dtype = np.dtype(dtype)
        self._index = RowIndex(initial_capacity)
        capacity = max(int(initial_capacity), 1)
        # _arenas[0] holds the weights, _arenas[1:] the states; all share one capacity (their first dimension)
        self._arenas = [self._arena(capacity) for _ in range(1 + int(num_states))]

    @property
    def num_states(self) -> int:
        return len(self._arenas) - 1

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, row_ids) -> np.ndarray:
        return self._index.lookup(row_ids)

    def ensure(self, row_ids, make_rows: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Slots of ``row_ids`` (unique), creating the absent rows: weights ``make_rows(missing_ids)``, zero states.

        ``make_rows`` gets the missing ids in their ``row_ids`` order and must return a ``(m, row_size)`` array;
        it runs before anything changes, so if it raises the table is untouched; so does running out of memory
        while growing the arenas.
        """
        ids = as_row_ids(row_ids)
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
            self._arenas[0][lo:len(self)] = rows  # their states are zero already (see the class docstring)
        return slots

    def weights(self, slots) -> np.ndarray:
        """Copy of the weight rows at ``slots``, shape ``(k, row_size)``."""
        return self._arenas[0][self._slots(slots)]

    def set_weights(self, slots, values) -> None:
        self._arenas[0][self._slots(slots)] = values

    def states(self, slots) -> list[np.ndarray]:
        """Copies of each state's rows at ``slots``."""
        slots = self._slots(slots)
        return [states[slots] for states in self._arenas[1:]]

    def set_states(self, slots, values: list[np.ndarray]) -> None:
        if len(values) != self.num_states:
            raise ValueError(f"{len(values)} state arrays for {self.num_states} states")
        slots = self._slots(slots)
        for states, value in zip(self._arenas[1:], values):
            states[slots] = value

    def set_num_states(self, n: int) -> None:
        """Drop all states and start ``n`` fresh zero states for every row (a new optimizer)."""
        capacity = len(self._arenas[0])
        del self._arenas[1:]  # free the old states before allocating the new ones
        self._arenas += [self._arena(capacity) for _ in range(int(n))]

    def row_ids(self) -> np.ndarray:
        """Ids by slot (a copy)."""
        return self._index.row_ids()

    def items(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """``(ids ascending, their weights, [their states]...)``, all copies: for snapshots and checkpoints."""
        ids = self._index.row_ids()
        order = np.argsort(ids, kind="stable")
        return ids[order], self._arenas[0][order], [states[order] for states in self._arenas[1:]]

    def nbytes(self) -> int:
        """Bytes held: arena capacity of weights and states plus the index."""
        return sum(a.nbytes for a in self._arenas) + self._index.nbytes()

    # -- internals

    def _arena(self, capacity: int) -> np.ndarray:
        return np.zeros((capacity, self.row_size), self.dtype)

    def _reserve(self, n: int) -> None:
        capacity = len(self._arenas[0])
        if n > capacity:
            capacity = _grown_capacity(capacity, n)
            for i in range(len(self._arenas)):
                _resize_rows(self._arenas, i, capacity)

    def _slots(self, slots) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) and (slots.min() < 0 or slots.max() >= len(self)):
            raise IndexError(f"slot out of range [0, {len(self)})")
        return slots


def _benchmark(n: int = 10_000_000, batch: int = 8192, row_size: int = 32, num_states: int = 2) -> None:
    """Build a RowIndex and a RowTable of ``n`` random 40-bit ids in batches; print rates and bytes per row.

    Rates are given per wall-clock second and per CPU second of this process (the latter is steadier on a shared
    machine).
    """
    import time
    import tracemalloc

    rng = np.random.default_rng(0)
    extra = 300 * batch
    ids = np.unique(rng.integers(0, 2**40, int((n + extra) * 1.01), dtype=np.uint64))
    ids = rng.permutation(ids)[:n + extra]
    base, fresh = ids[:n], ids[n:]

    def timed(what, count, run):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{what:<48} {count / wall / 1e6:6.2f} M/s wall  {count / cpu / 1e6:6.2f} M/s cpu")

    def batches(a):
        return [a[lo:lo + batch] for lo in range(0, len(a), batch)]

    index = RowIndex()
    timed(f"RowIndex insert 0 -> {n:,} (incl. rehashes)", n, lambda: [index.insert(b) for b in batches(base)])
    present = [base[rng.integers(0, n, batch)] for _ in range(200)]
    timed(f"RowIndex lookup, present, at {len(index):,}", 200 * batch, lambda: [index.lookup(p) for p in present])
    absent = batches(fresh[:200 * batch])
    timed(f"RowIndex lookup, absent, at {len(index):,}", 200 * batch, lambda: [index.lookup(p) for p in absent])
    timed(f"RowIndex insert at {len(index):,} (no rehash)", 200 * batch, lambda: [index.insert(b) for b in absent])
    print(f"RowIndex bytes/row at {len(index):,}: {index.nbytes() / len(index):.1f}")
    del index, present

    def make_rows(new_ids):
        return np.full((len(new_ids), row_size), 0.01, np.float32)

    tracemalloc.start()
    table = RowTable(row_size, np.float32, num_states)
    timed(f"RowTable ensure (all new) 0 -> {n:,}", n, lambda: [table.ensure(b, make_rows) for b in batches(base)])
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    raw = row_size * table.dtype.itemsize * (1 + num_states)
    print(f"RowTable {len(table):,} rows: nbytes/row {table.nbytes() / n:.1f}, tracemalloc/row {current / n:.1f} "
          f"(peak {peak / n:.1f}), raw/row {raw}, ratio {current / n / raw:.3f}")
    mixed = [np.concatenate([base[rng.integers(0, n, batch // 2)], b[:batch // 2]])
             for b in batches(fresh[200 * batch:])]

    def update():
        for m in mixed:
            slots = table.ensure(m, make_rows)
            table.set_weights(slots, table.weights(slots))

    timed("RowTable ensure (half new) + weights + set_weights", len(mixed) * batch, update)


if __name__ == "__main__":
    _benchmark()
