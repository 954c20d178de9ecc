"""The disk index: row id -> the location of its record, and the live records of each segment.

Owns: the index kinds a store uses, behind one id-based interface (``lookup(ids) -> locs``, ``set(ids, locs,
old)``, ``remove(ids, old)``, ``items(chunk)``, ``ram_bytes()``), :func:`new_index` choosing between them, and
:class:`LiveBits` (a bit a record slot of the live records of each segment: compaction's view of what is live
without the index). Does not own: the locations' meaning (:mod:`.layout`), the runs' files (:mod:`.runs`,
:mod:`.runfile`), or the live-record counts by segment (the store keeps those, from the previous locations
``set`` and ``remove`` return).

A location is one ``uint32``: ``slot << shift | offset`` (a segment slot, reused after compaction, and the record
number in it); :data:`EMPTY` (0xFFFFFFFF) is "absent" in what ``lookup``, ``set`` and ``remove`` return. Two kinds:

* :class:`DenseIndex`, for a store given its row range (``rows``, a key's rows on one server: the disk tier's
  choice when it fits a share of the memory budget): one location per *possible* row in RAM, 4 bytes each, a probe
  one array read. Compaction finds a segment's live records by looking its records up (an array read each).
* :class:`~.runs.RunIndex` for any other id space (hashed ids over 2^40 included): an LSM index, a bounded memtable
  over sorted runs ``idx-*.run`` in the store's directory, with fences and a bloom filter per run in RAM (1.27 bytes
  an entry at 10 bits; ``ram_bytes()``). A lookup of a cold row is about one block read. Compaction cannot afford
  a lookup per record, so the store keeps :class:`LiveBits` beside it: a bit a record slot of every segment, 1/8
  byte a record written (about 0.17 bytes a live row at ``compact_ratio`` 0.25). So a row on disk costs about 1.4
  bytes of RAM (the memtable aside: at most ``memtable_entries`` entries of 17 to 22 bytes, emptied at every flush).

The hash index of earlier versions (a RowTable, 17 to 22 bytes a row) is gone: a store committed with it is
converted into runs when it is opened (:func:`~.commit.load_index`).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvstore_lazy.store.disk import runcalls
from kvstore_lazy.store.disk.layout import RecordLayout
from kvstore_lazy.store.disk.runs import EMPTY, RunIndex

__all__ = ["DenseIndex", "RunIndex", "LiveBits", "EMPTY", "new_index", "run_ram_bytes"]

CHUNK = 1 << 16                 # entries items() gives at a time
MEMTABLE_LOAD = 0.8             # a RunIndex's memtable's hash table load (runs.RunIndex._new_memtable) ...
INDEX_RESERVE = 0.95            # ... run_ram_bytes counts its next table from this share of that load on
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


class DenseIndex:
    """The index of a store whose row ids all lie in [first, first + count) (a key's rows on one server): one
    ``uint32`` location per *possible* row at ``id - first``, :data:`EMPTY` where the row is not stored. 4 bytes a
    possible row, all of them from the start; a probe is one array read, a change one write. The same id-based
    interface as :class:`~.runs.RunIndex` where the store uses it."""

    EMPTY = EMPTY

    def __init__(self, first: int, count: int) -> None:
        if first < 0 or count < 0 or first + count > 1 << 63:
            raise ValueError(f"row range [{first}, {first} + {count}) out of bounds")
        self.first, self.count = int(first), int(count)
        self._locs = np.full(self.count, EMPTY, np.uint32)
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
        """The location of each id, :data:`EMPTY` where it is not stored (or out of range)."""
        slots, inside = self._slots(row_ids)
        if inside is None:
            return self._locs[slots]
        out = np.full(len(slots), EMPTY, np.uint32)
        out[inside] = self._locs[slots[inside]]
        return out

    def check(self, row_ids: np.ndarray) -> np.ndarray:
        """The slots of ids that must all be in range (else ValueError)."""
        slots, inside = self._slots(row_ids)
        if inside is not None:
            bad = row_ids[~inside][0]
            raise ValueError(f"row {int(bad)} is outside this store's rows [{self.first}, {self.first + self.count})")
        return slots

    def set(self, row_ids: np.ndarray, locs: np.ndarray, old: np.ndarray | None = None) -> np.ndarray:
        """Point ``row_ids`` (unique, all in range: else ValueError, nothing changed) at ``locs``; returns their
        previous locations (``old`` if the caller gives them: trusted, as RunIndex.set trusts them)."""
        slots = self.check(row_ids)
        old = self._locs[slots] if old is None else np.asarray(old, np.uint32)
        self._locs[slots] = locs
        self._stored += int((old == EMPTY).sum())
        return old

    def remove(self, row_ids: np.ndarray, old: np.ndarray | None = None) -> np.ndarray:
        """Drop ``row_ids`` (unique); returns their previous locations (:data:`EMPTY` where absent)."""
        slots, inside = self._slots(row_ids)
        if old is None:
            old = self.lookup(row_ids)
        present = np.asarray(old) != EMPTY
        self._locs[slots[present]] = EMPTY
        self._stored -= int(present.sum())
        return old

    def items(self, chunk: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids ascending, their locations) of the rows stored, at most ``chunk`` at a time."""
        for lo in range(0, self.count, chunk):
            part = self._locs[lo:lo + chunk]
            at = np.flatnonzero(part != EMPTY)
            if len(at):
                yield at.astype(np.uint64) + np.uint64(self.first + lo), part[at]

    def ram_bytes(self) -> int:
        return self._locs.nbytes

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def new_index(rows: tuple[int, int] | None, directory, memtable_entries: int) -> DenseIndex | RunIndex:
    """A dense index over ``rows`` = (first, count), or (None) an empty RunIndex in ``directory``."""
    if rows is not None:
        return DenseIndex(*rows)
    return RunIndex(directory, memtable_entries)


def run_ram_bytes(index: RunIndex) -> int:
    """RAM a RunIndex holds (:meth:`RunIndex.ram_bytes`: its runs' fences and filters, its memtable's hash table),
    plus, once the memtable is within ``INDEX_RESERVE`` of its next rehash, the buckets that rehash adds: a budget
    counting this makes room for the larger table before it is built (as for any row table of the server)."""
    mem = index._mem
    n, buckets = len(mem), mem.buckets
    extra = buckets * mem._index._table.itemsize if n >= INDEX_RESERVE * MEMTABLE_LOAD * buckets else 0
    return index.ram_bytes() + extra


def live_bits(index: RunIndex, layout: RecordLayout, slots: int) -> LiveBits:
    """The live bits of the entries of ``index`` (a store's ``layout``: records a segment, shift; ``slots`` segment
    slots): made when the index writes its first run (before it, every entry is in the memtable, in RAM, and
    compaction looks records up as with a dense index), from its entries then: at most a memtable's."""
    bits = LiveBits(layout.segment_rows, layout.shift)
    bits.grow(slots)
    for _, locs in index.items():
        bits.set(locs)
    return bits


class LiveBits:
    """A bit a record slot of every segment slot: set while the record at that location is a row's (live).
    ``segment_rows`` records a segment, locations ``slot << shift | offset``. A segment's bits grow with its
    records written (doubling, at most ``segment_rows`` bits): 1/8 byte a record written, up to twice that in
    the active segment. A batch is set, cleared or tested by one compiled loop over its locations
    (``runcalls.live_bits_*``), through the address and length of each segment's bytes (16 bytes a slot, kept
    beside them); growing a segment's bytes is the only step in Python, a few times in its life."""

    def __init__(self, segment_rows: int, shift: int) -> None:
        self.segment_rows, self.shift = segment_rows, shift
        self.width = (segment_rows + 7) // 8
        self.bits: list[np.ndarray] = []                # segment slot -> its bits (little-endian bit order)
        self._addrs = np.zeros(0, np.uint64)            # slot -> the address of bits[slot]'s bytes, and how many
        self._lens = np.zeros(0, np.int64)

    def grow(self, slots: int) -> None:
        if slots <= len(self.bits):
            return
        first = len(self.bits)
        self._addrs = np.concatenate([self._addrs, np.zeros(slots - first, np.uint64)])
        self._lens = np.concatenate([self._lens, np.zeros(slots - first, np.int64)])
        for slot in range(first, slots):
            self.bits.append(np.zeros(0, np.uint8))
            self._keep(slot, self.bits[slot])

    def zero(self, slot: int) -> None:
        self._keep(slot, np.zeros(0, np.uint8))

    def load(self, slot: int, bits: np.ndarray) -> None:
        """A segment's bits as committed (``row``: its ``width`` bytes), trailing zero bytes not kept."""
        used = np.flatnonzero(bits)
        self._keep(slot, bits[:int(used[-1]) + 1].copy() if len(used) else np.zeros(0, np.uint8))

    def row(self, slot: int) -> np.ndarray:
        """A segment's bits as ``width`` bytes (what a commit writes)."""
        out = np.zeros(self.width, np.uint8)
        mine = self.bits[slot]
        out[:len(mine)] = mine
        return out

    def _keep(self, slot: int, mine: np.ndarray) -> None:
        """``mine`` (C-contiguous uint8) as slot's bits, its address and length where the compiled loops find them."""
        self.bits[slot] = mine
        self._addrs[slot] = mine.ctypes.data
        self._lens[slot] = len(mine)

    def set(self, locs: np.ndarray) -> None:
        """Set the bits of ``locs`` (of slots known: :meth:`grow`), growing a segment's bytes where a location is past
        them (doubling, at least 16 bytes, at most ``width``)."""
        locs = np.ascontiguousarray(locs, np.uint32)
        while len(locs):
            stop = runcalls.live_bits_apply(self._addrs, self._lens, locs, self.shift, True)
            if stop < 0:
                return
            loc = int(locs[stop])
            slot, top = loc >> self.shift, ((loc & (self.segment_rows - 1)) >> 3) + 1
            if slot >= len(self.bits):
                raise IndexError(f"location {loc:#x}: segment slot {slot} of {len(self.bits)} known")
            mine = self.bits[slot]
            size = min(self.width, max(top, 2 * len(mine), 16))
            self._keep(slot, np.concatenate([mine, np.zeros(size - len(mine), np.uint8)]))
            locs = locs[stop:]

    def clear(self, locs: np.ndarray) -> None:
        """Clear the bits of ``locs`` (past a segment's bytes: clear already)."""
        runcalls.live_bits_apply(self._addrs, self._lens, locs, self.shift, False)

    def test(self, locs: np.ndarray) -> np.ndarray:
        """Whether each of ``locs`` is live (False past the segments known)."""
        return runcalls.live_bits_test(self._addrs, self._lens, locs, self.shift)

    def offsets(self, slot: int) -> np.ndarray:
        """The live record numbers of segment ``slot``, ascending."""
        return np.flatnonzero(np.unpackbits(self.bits[slot], bitorder="little"))

    def counts(self) -> np.ndarray:
        """Live records by segment slot."""
        return np.array([int(_POPCOUNT[mine].sum()) for mine in self.bits], np.int64)

    def nbytes(self) -> int:
        return int(self._lens.sum()) + self._addrs.nbytes + self._lens.nbytes
