"""A log-structured store of fixed-size row records on disk: the disk tier of a row table.

Owns: :class:`SegmentStore`, the facade that composes the units of :mod:`kvstore_lazy.store.disk` into one store,
the state they share (the segments by slot: file name, records written, live records and their bits; the
active segment; the index; what the next commit must fsync or delete) and the append at the end of the log; and
the store's knobs (``READ_*``, ``WRITE_RING``, ``REWRITE_IN_PLACE``, the compaction bounds), read here at every
call and passed to the units, so a benchmark script or a test may set them on this module. It re-exports the
names callers import from here (the errors, :class:`DenseIndex`, :class:`RunIndex`, the record copies,
:func:`executor`, :func:`fsync_path`, :func:`link_or_copy`). Does not own: the row table it serves
(:mod:`kvstore_lazy.store.tier`).

Layout of a store directory::

    store.json              the record layout (payload dtype, bytes per record, records per segment) and, for a
                            dense index, the row range; written once
    index.npz               the commit point: the segments and their fill, and the index as committed (a dense
                            index's ids and locations; a RunIndex's manifest and the live bits of each segment)
    seg-000001.dat ...      segment files, each exactly ``segment_rows`` records (reserved with posix_fallocate)
    idx-000001.run ...      the RunIndex's runs (:mod:`.disk.runs`), each written once

A *record* is ``id`` (uint64), ``check`` (uint32) and the payload (a numpy structured dtype chosen by the caller:
the weights, every optimizer state and the per-row policy columns of one row, together): :mod:`.disk.layout`.
Records are only ever appended to the *active* segment (``os.pwrite``, one call per batch); a full segment is
*sealed* and never written again. A row written again gets a new record; the old one becomes garbage. Sealed
segments are *compacted* (their live records appended anew, the file gone): by :meth:`SegmentStore.compact_store`
(the tier's, at round ends) the emptiest first while the whole store's garbage passes ``compact_ratio`` or the
emptiest is half garbage, a few a call; by :meth:`SegmentStore.compact` every one whose own garbage passes the
ratio (:mod:`.disk.compaction`).

The index (row id -> location, :mod:`.disk.index`), id-based: ``lookup(ids) -> locs``, ``set``/``remove`` returning
the previous locations (given by the caller where it knows them: a demotion's rows are absent, a promotion's were
just looked up, a compaction's are live). A :class:`DenseIndex` for a store given its row range (4 bytes a
*possible* row), else a :class:`RunIndex` in the store's directory, an LSM index out of RAM (about 1.4 bytes a row:
its bloom filters and fences, and the live bits, a bit a record slot, by which compaction finds live records
without reading the index; the memtable aside).

Durability (:mod:`.disk.commit`). The index file is the commit point: :meth:`SegmentStore.commit` fsyncs the
segments written since the last commit, writes the RunIndex's memtable as a run, then writes ``index.npz``
atomically. A store opened again holds exactly what the last commit held (index runs written after it are
deleted). A commit into another directory (a server snapshot) hard-links the segment files and the index runs;
:meth:`SegmentStore.rewrite` writes in place only into a segment no other directory links (:mod:`.disk.rewrite`).

Damage (:mod:`.disk.verify`). Every record carries a check, verified on every read and, at :meth:`open` with
``verify``, for every committed record: a damaged, truncated or missing segment or index run is a
:class:`SegmentError` naming the file (and the record or block), never wrong values.

Disk full / write errors. Space for a segment is reserved when it is created (``posix_fallocate``), so a full disk
shows up there, never as a half-written record, as a :class:`DiskError` naming the directory; a failing
``pwrite``/``fsync`` is one too. The store's contents are unchanged by the failed call (nothing of the batch is
indexed; records it wrote before the failure are unreferenced garbage). Records handed over to the writer thread
(:meth:`SegmentStore.put_records` with ``handoff``: the disk tier's demotions) are indexed when handed over and
written while the caller goes on; a write that then fails is a DiskError at the next call that waits for it (reads
of its records, commit, compaction, rewrite, close), and the disk tier stops the server on it (:mod:`.disk.writer`).

Reads are batched, in file order, on a pool's threads while the caller goes on (:meth:`SegmentStore.begin_take`),
through an io_uring where the kernel has one, else with pread; reads, not a memory map (:mod:`.disk.reads`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore_lazy.store.disk import commit as disk_commit
from kvstore_lazy.store.disk import compaction
from kvstore_lazy.store.disk import index as disk_index
from kvstore_lazy.store.disk import rewrite as disk_rewrite
from kvstore_lazy.store.disk import verify as disk_verify
from kvstore_lazy.store.disk.errors import DiskError, SegmentError
from kvstore_lazy.store.disk.files import create_segment, fsync_path, link_or_copy, segment_name
from kvstore_lazy.store.disk.index import EMPTY, DenseIndex, LiveBits, RunIndex
from kvstore_lazy.store.disk.layout import FORMAT, MAX_SLOTS_BITS, RecordLayout, dtype_from_json
from kvstore_lazy.store.disk.pools import executor
from kvstore_lazy.store.disk.reads import Reads, Take, uring
from kvstore_lazy.store.disk.records import join, pick, put_at
from kvstore_lazy.store.disk.writer import Writer
from kvstore_lazy.store.disk.runs import MEMTABLE_ENTRIES
from kvstore_lazy.store.rows import as_row_ids

__all__ = ["SegmentStore", "Take", "SegmentError", "DiskError", "DenseIndex", "DEFAULT_SEGMENT_ROWS",
           "DEFAULT_COMPACT_RATIO", "FORMAT", "MAX_SLOTS_BITS", "MEMTABLE_ENTRIES", "RunIndex", "executor",
           "fsync_path", "link_or_copy", "pick", "put_at", "join"]

DEFAULT_SEGMENT_ROWS = 1 << 16
DEFAULT_COMPACT_RATIO = 0.25     # (KVSTORE_LAZY_DISK_COMPACT; see the README's disk tier costs)
READ_THREADS = 4                # a batch's reads go out in this many parts at once with pread (an SSD serves them in
                                # parallel) ...
READ_PARTS = 2                  # ... or through this many io_urings (page-cache copies: the kernel's CPU, two cores)
READ_SPLIT = 1024               # ... of at least this many records each
READ_AHEAD = 256                # a read of at least this many records goes to the pool's threads (see Reads.start)
READ_RING = True                # through an io_uring where the kernel has one (kernels.pread_records), else pread
WRITE_RING = False              # rewrite through the ring too (buffered writes: the kernel punts them to workers)
REWRITE_IN_PLACE = True         # rewrite writes in place (False: appends, as for a segment a snapshot links)
CHEAP_GARBAGE = 0.5             # compact_store compacts a segment this much garbage whatever the store's ratio
COMPACT_LIMIT = 8               # segments compact_store rewrites at most per call (a round end's bound)


class SegmentStore:
    """Row id -> one payload record (``payload_dtype``), on disk. Not thread-safe."""

    def __init__(self, path, payload_dtype: np.dtype, segment_rows: int = DEFAULT_SEGMENT_ROWS,
                 compact_ratio: float = DEFAULT_COMPACT_RATIO, rows: tuple[int, int] | None = None,
                 memtable_entries: int = MEMTABLE_ENTRIES, _create: bool = True) -> None:
        """With ``rows`` = (first, count), every row id stored is in [first, first + count): the index is a
        :class:`DenseIndex` (4 bytes a possible row), else a :class:`RunIndex` in the store's directory (about 1.4
        bytes a stored row, its memtable of at most ``memtable_entries`` entries aside)."""
        self.path = Path(path)
        self.layout = layout = RecordLayout(payload_dtype, segment_rows)
        if not 0.0 < compact_ratio <= 1.0:
            raise ValueError(f"compact_ratio must be in (0, 1], got {compact_ratio}")
        self.payload_dtype, self.segment_rows, self.compact_ratio = layout.payload_dtype, layout.segment_rows, \
            float(compact_ratio)
        self.record_dtype, self.record_bytes, self.max_slots = layout.record_dtype, layout.record_bytes, \
            layout.max_slots
        self._shift, self._words, self._mult = layout.shift, layout.words, layout.mult
        self._checks, self._checks_numpy = layout.checks, layout.checks_numpy
        self.rows = None if rows is None else (int(rows[0]), int(rows[1]))
        self.memtable_entries = int(memtable_entries)
        # the index: dense over rows, else a RunIndex made below (a new store); an open's only by load_index
        self._index: DenseIndex | RunIndex = DenseIndex(*self.rows) if self.rows and _create else DenseIndex(0, 0)
        self._bits: LiveBits | None = None          # the live bits: made once the RunIndex has runs (_ensure_bits)
        self._last_locs = np.zeros(0, np.uint32)    # the locations of the records get_records gave last
        self._names: dict[int, str] = {}                    # segment slot -> file name
        self._fill: dict[int, int] = {}                     # segment slot -> records written
        self._live = np.zeros(0, np.int64)                  # segment slot -> live records
        self._writer = Writer(self.path, layout)
        self._writes = self._writer.writes                  # the writes under way (the same list)
        self._reads = Reads(self.path, layout, self._names, self._writer.settle)
        self._active: int | None = None
        self._next_number = 1
        self._dirty: set[str] = set()                       # segment files written since the last commit
        self._retired: list[str] = []                       # files to delete at the next commit
        self._committed: set[str] = set()                   # segments this directory's index.npz refers to
        self.counters = {"records_written": 0, "records_read": 0, "records_rewritten": 0, "compactions": 0,
                         "segments_compacted": 0}
        self.version = 0                                    # +1 at every change of what is stored (writes, drops)
        if _create:
            self.path.mkdir(parents=True, exist_ok=True)
            if (self.path / "store.json").exists() or (self.path / "index.npz").exists():
                raise SegmentError(f"{self.path} already holds a segment store (open it instead)")
            disk_commit.write_layout(self)
            if self.rows is None:
                self._index = disk_index.new_index(None, self.path, self.memtable_entries)
            self.commit()

    @classmethod
    def open(cls, path, verify: bool = True, compact_ratio: float = DEFAULT_COMPACT_RATIO,
             memtable_entries: int = MEMTABLE_ENTRIES) -> "SegmentStore":
        """The store in ``path`` as of its last commit. With ``verify`` every committed record is checked (a damaged
        segment or index run is a SegmentError naming it). A store committed with the hash index of earlier
        versions (every id in ``index.npz``) is converted into index runs (committed at its next commit)."""
        path = Path(path)
        try:
            layout = disk_commit.read_layout(path)
            rows = layout.get("rows")
            store = cls(path, dtype_from_json(layout["payload"]), int(layout["segment_rows"]), compact_ratio,
                        rows=None if rows is None else (int(rows[0]), int(rows[1])),
                        memtable_entries=memtable_entries, _create=False)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, SegmentError):
                raise
            raise SegmentError(f"{path / 'store.json'}: cannot read the store's layout: {exc}") from None
        if store.record_bytes != int(layout["record_bytes"]):
            raise SegmentError(f"{path / 'store.json'}: {layout['record_bytes']} bytes a record, "
                               f"this layout has {store.record_bytes}")
        disk_commit.load_index(store, verify)
        return store

    # -- the API

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, row_ids) -> np.ndarray:
        return self._index.lookup(as_row_ids(row_ids)) != EMPTY

    def put(self, row_ids, payload: np.ndarray) -> None:
        """Write the records of ``row_ids`` (unique; present ones are replaced), payload rows in their order."""
        ids = as_row_ids(row_ids)
        payload = np.asarray(payload)
        if payload.dtype != self.payload_dtype or payload.shape != (len(ids),):
            raise ValueError(f"payload of dtype {payload.dtype} shape {payload.shape}, want "
                             f"{self.payload_dtype} ({len(ids)},)")
        if not len(ids):
            return
        records = self.new_records(ids)
        records["payload"] = payload
        self._append(records)

    def new_records(self, row_ids) -> np.ndarray:
        """Records for ``row_ids`` (unique) with their ids set and a zero payload, for the caller to fill in place
        (``records["payload"]``) and hand to :meth:`put_records`: :meth:`put` without a copy of the payload."""
        ids = as_row_ids(row_ids)
        records = np.zeros(len(ids), self.record_dtype)
        records["id"] = ids
        return records

    def put_records(self, records: np.ndarray, handoff: bool = False, absent: bool = False) -> None:
        """Write records made by :meth:`new_records` (present ids are replaced). With ``handoff`` the caller hands
        ``records`` over (it never touches them again): they are indexed at once and written by the writer thread
        while the caller goes on (their segment space is reserved first, so a full disk is a DiskError here, as
        without; a failed write is a DiskError at the next call that waits for it, see :meth:`Writer.settle`).
        With ``absent`` the caller knows none of the ids is stored (a demotion: a row is in one tier): the index
        is not asked for their previous locations."""
        if records.dtype != self.record_dtype or records.ndim != 1:
            raise ValueError(f"records of dtype {records.dtype} shape {records.shape}, want {self.record_dtype} (n,)")
        if len(records):
            self._append(np.ascontiguousarray(records), later=handoff,
                         old=np.full(len(records), EMPTY, np.uint32) if absent else None)

    def get(self, row_ids) -> np.ndarray:
        """The payloads of ``row_ids`` (all present: else KeyError), in their order."""
        order, records = self.get_records(row_ids)
        out = np.empty(len(records), self.record_dtype)
        put_at(out, order, records)
        return out["payload"]

    def take_present(self, row_ids) -> tuple[np.ndarray, np.ndarray, Callable[..., None]]:
        """``(present, payloads, drop)`` for ``row_ids`` (unique) with one index probe: a mask of the ids stored,
        their payloads (in their order), and ``drop()`` to delete them afterwards (call it before anything else
        changes the store). For moving rows out: read, place them elsewhere, then drop."""
        present, order, records, drop = self.take_records(row_ids)
        out = np.empty(len(records), self.record_dtype)
        put_at(out, order, records)
        return present, out["payload"], drop

    def take_records(self, row_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray, Callable[..., None]]:
        """:meth:`take_present` as whole records in file order, without reordering them: ``(present, order, records,
        drop)``, ``records[j]`` (checked) the record of ``row_ids[present][order[j]]``."""
        take = self.begin_take(row_ids)
        order, records = take.records()
        return take.present, order, records, take.drop

    def begin_take(self, row_ids) -> Take:
        """:meth:`take_records` in two halves: the index probe now (``Take.present``) and the records' read started
        on the pool's threads; ``Take.records()`` waits for it. Between the two the caller may do other work (the
        disk tier places the rows in its table and drops them from the index: the read does not look at either).
        Take.records() must be called before anything else reads or changes this store's files."""
        ids = as_row_ids(row_ids)
        locs = self._index.lookup(ids)
        present = locs != EMPTY
        ids, locs = ids[present], locs[present]
        finish = self._start_read(ids, locs) if len(locs) else None
        return Take(self, present, ids, locs, finish)

    def get_records(self, row_ids) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`get` as whole records in file order: ``(order, records)``, ``records[j]`` (checked) the record of
        ``row_ids[order[j]]`` (all present: else KeyError)."""
        ids = as_row_ids(row_ids)
        locs = self._index.lookup(ids)
        if (locs == EMPTY).any():
            raise KeyError(f"{int((locs == EMPTY).sum())} of {len(ids)} rows are not in the store {self.path}")
        order, records = self._read_ordered(ids, locs)
        self._last_locs = locs[order]
        return order, records

    def read_records(self, row_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`get_records` and the records' locations (for :meth:`delete` later without a lookup)."""
        return *self.get_records(row_ids), self._last_locs

    def rewrite(self, records: np.ndarray) -> int:
        """Write back records of rows stored here (``records``: whole records, e.g. from :meth:`get_records`, their
        payload changed; ids unique and present, else KeyError) **in place**: each at the location the index has
        for it, its check sealed again for that location, in one batched write; no index change, no garbage. A
        segment another directory links (a snapshot: more than one link) is never written in place (copy-on-write:
        its records are appended anew, the old ones garbage). Returns how many were written in place."""
        if records.dtype != self.record_dtype or records.ndim != 1:
            raise ValueError(f"records of dtype {records.dtype} shape {records.shape}, want {self.record_dtype} (n,)")
        if not len(records):
            return 0
        return disk_rewrite.rewrite(self, records, REWRITE_IN_PLACE, WRITE_RING and uring())

    def delete(self, row_ids, locs: np.ndarray | None = None) -> int:
        """Drop the present ``row_ids`` (unique) from the index; returns how many there were. ``locs``: their
        locations where the caller knows them (rows it read: :meth:`read_records`; all present), no lookup."""
        ids = as_row_ids(row_ids)
        if locs is not None:
            if len(ids):
                self._drop(ids, np.asarray(locs, np.uint32))
            return len(ids)
        locs = self._index.lookup(ids)
        present = locs != EMPTY
        if present.any():
            self._drop(ids[present], locs[present])
        return int(present.sum())

    def take(self, row_ids) -> np.ndarray:
        """:meth:`get` then :meth:`delete`: rows leaving the disk (promotion)."""
        out = self.get(row_ids)
        self.delete(row_ids)
        return out

    def row_ids(self) -> np.ndarray:
        """Ids of the rows stored, ascending (a copy: 8 bytes a row)."""
        return np.concatenate([np.zeros(0, np.uint64), *self.id_chunks()])

    def id_chunks(self, chunk: int = 1 << 16):
        """Ids of the rows stored, ascending, ``chunk`` at a time (the index's walk; don't change the store)."""
        return (ids for ids, _ in self._index.items(chunk))

    def items(self, chunk: int = 1 << 16):
        """``(ids, payloads)`` of every row, ascending by id, ``chunk`` rows at a time, as the index lists them (no
        lookup, no listing of every id). Don't change the store while iterating (collect changes, then make them)."""
        for ids, locs in self._index.items(chunk):
            yield ids, self._read(ids, locs)["payload"]

    def compact(self, ratio: float | None = None) -> int:
        """Rewrite the live records of sealed segments whose garbage share passes ``ratio`` (default the store's),
        then retire them; returns how many segments were compacted."""
        return compaction.compact(self, self.compact_ratio if ratio is None else ratio)

    def compact_store(self, ratio: float | None = None, limit: int = COMPACT_LIMIT) -> int:
        """Amortized compaction (what the disk tier runs at round ends): compact the sealed segment with the fewest
        live records (ties: the lowest slot) while the garbage of the whole store (records written that are not
        live, active segment included) passes ``ratio`` (default the store's) of its records written, or while
        that segment is at least ``CHEAP_GARBAGE`` garbage (it rewrites at most one record per record it frees); at
        most ``limit`` segments a call; returns how many. The emptiest segment frees the most per record rewritten,
        so under skewed promotions (hot rows leave the recent segments) this rewrites far fewer records per record
        freed than :meth:`compact`'s per-segment threshold; the disk stays within ``1 / (1 - ratio)`` of the live
        records, plus the active segment (and what ``limit`` defers to the next call)."""
        return compaction.compact_store(self, self.compact_ratio if ratio is None else ratio, limit, CHEAP_GARBAGE)

    def commit(self, into=None) -> None:
        """Make what is stored now durable: fsync the segments written since the last commit, then write the index
        atomically. With ``into`` (another directory on the same file system, which must not exist), the committed
        store goes there instead, its segments hard-linked (this store's own commit is unchanged)."""
        disk_commit.commit(self, into)

    def verify(self) -> None:
        """Check every committed record of every segment (SegmentError naming the first damaged one)."""
        disk_verify.verify(self)

    def close(self) -> None:
        self._writer.wait()             # (their errors, if any, were the caller's to see)
        self._reads.close()
        self._index.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()

    # -- sizes and stats

    def index_nbytes(self) -> int:
        """RAM the index takes (exact in its arrays): a dense index's locations, or a RunIndex's fences, bloom
        filters and memtable (:meth:`RunIndex.ram_bytes`) and the live bits of the segments."""
        if isinstance(self._index, DenseIndex):
            return self._index.ram_bytes()
        return disk_index.run_ram_bytes(self._index) + (self._bits.nbytes() if self._bits is not None else 0)

    def index_row_nbytes(self) -> int:
        """Index RAM one more row on disk adds now (the buckets aside): nothing for a dense index; its memtable
        entry for a RunIndex (12 bytes, until the memtable is written as a run: then ~1.4 bytes a row)."""
        return 0 if isinstance(self._index, DenseIndex) else self._index._mem.row_nbytes

    def disk_bytes(self) -> int:
        """Bytes of the segment files (fixed size each)."""
        return len(self._names) * self.segment_rows * self.record_bytes

    def stats(self) -> dict:
        """Sizes, counters; ``index_bytes`` (RAM), ``index_disk_bytes`` (runs), ``index_reads_per_lookup``."""
        out = {"rows": len(self), "segments": len(self._names), "disk_bytes": self.disk_bytes(),
               "index_bytes": self.index_nbytes(), "index_disk_bytes": self._index.disk_bytes(),
               "garbage_records": int(sum(self._fill.values()) - len(self)), **self.counters}
        if isinstance(self._index, RunIndex):
            c = self._index.counters
            out.update(index_runs=len(self._index._runs), index_lookups=c["lookups"],
                       index_blocks_read=c["blocks_read"])
            return {**out, "index_reads_per_lookup": c["blocks_read"] / max(1, c["lookups"])}
        return out

    # -- internals (the units of kvstore_lazy.store.disk work through these)

    def _sealed(self) -> list[int]:
        return compaction.sealed(self)

    def _new_segment(self) -> int:
        free = np.flatnonzero(np.isin(np.arange(len(self._live) + 1), list(self._names), invert=True))
        slot = int(free[0])
        if slot >= self.max_slots:
            raise DiskError(0, f"disk tier {self.path}: {self.max_slots} segments in use, no room for more")
        name = segment_name(self._next_number)
        create_segment(self.path, name, self.layout.segment_bytes)
        self._next_number += 1
        if slot >= len(self._live):
            self._live = np.concatenate([self._live, np.zeros(slot + 1 - len(self._live), np.int64)])
        if self._bits is not None:
            self._bits.grow(len(self._live))
            self._bits.zero(slot)
        self._names[slot], self._fill[slot], self._live[slot] = name, 0, 0
        return slot

    def _append(self, records: np.ndarray, later: bool = False, old: np.ndarray | None = None) -> None:
        """Write ``records`` (ids unique, checks unset) at the end of the log and point the index at them. Nothing
        is indexed unless every record was written, or with ``later`` (the records handed over: put_records), its
        segment space reserved and its write handed to the writer thread. ``old``: the ids' previous locations
        (EMPTY: not stored) when the caller knows them (no index lookup)."""
        ids = records["id"]
        if isinstance(self._index, DenseIndex):
            self._index.check(ids)          # before anything is written
        locs = np.empty(len(records), np.uint32)
        placed = 0
        try:
            while placed < len(records):
                if self._active is None or self._fill[self._active] == self.segment_rows:
                    self._active = self._new_segment()
                slot = self._active
                start = self._fill[slot]
                n = min(self.segment_rows - start, len(records) - placed)
                offsets = np.arange(start, start + n, dtype=np.uint32)
                locs[placed:placed + n] = offsets | np.uint32(slot << self._shift)
                self._writer.write(slot, self.path / self._names[slot], records[placed:placed + n], start,
                                   locs[placed:placed + n], later)
                self._fill[slot] = start + n
                self._dirty.add(self._names[slot])
                placed += n
        except OSError as exc:
            # the records written stay unreferenced garbage (their segments' fill moved on); nothing is indexed
            if not isinstance(exc, DiskError):
                raise DiskError(exc.errno, f"disk tier {self.path}: write failed: {exc.strerror or exc}") from exc
            raise
        old = self._index.set(ids, locs, old)
        self._ensure_bits()
        self.version += 1
        self._unlive(old[old != EMPTY])
        self._live += np.bincount((locs >> np.uint32(self._shift)).astype(np.int64), minlength=len(self._live))
        if self._bits is not None:
            self._bits.set(locs)
        self.counters["records_written"] += len(records)

    def _drop(self, ids: np.ndarray, locs: np.ndarray) -> None:
        """Remove ``ids`` (stored, at ``locs``) from the index."""
        self._index.remove(ids, locs)
        self._ensure_bits()
        self._unlive(locs)
        self.version += 1

    def _ensure_bits(self) -> None:
        """Make the live bits once the RunIndex has written its first run (:func:`~.disk.index.live_bits`)."""
        if self._bits is None and isinstance(self._index, RunIndex) and self._index._runs:
            self._bits = disk_index.live_bits(self._index, self.layout, len(self._live))

    def _unlive(self, locs: np.ndarray) -> None:
        """The records at ``locs`` are garbage from now on (the live counts and bits)."""
        if len(locs):
            self._live -= np.bincount((locs >> np.uint32(self._shift)).astype(np.int64), minlength=len(self._live))
            if self._bits is not None:
                self._bits.clear(locs)

    def _retire(self, slot: int) -> None:
        self._writer.settle()
        self._reads.forget(slot)
        name = self._names.pop(slot)
        if name in self._committed:
            self._retired.append(name)       # this directory's committed index refers to it: until the next commit
        else:
            (self.path / name).unlink(missing_ok=True)     # (a snapshot holding it has a link of its own)
        del self._fill[slot]
        if self._bits is not None:
            self._bits.zero(slot)
        if self._active == slot:
            self._active = None

    def _read(self, ids: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """The records at ``locs`` (of ``ids``), checked (all at once: a damage names the lowest segment that has
        one, and its first damaged record), in their order."""
        order, got = self._read_ordered(ids, locs)
        out = np.empty(len(got), self.record_dtype)
        put_at(out, order, got)
        return out

    def _read_ordered(self, ids: np.ndarray, locs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(order, records)``: the records at ``locs`` (of ``ids``) in file order, ``records[j]`` the one of
        ``ids[order[j]]``, checked as :meth:`_read` says."""
        return self._start_read(ids, locs)()

    def _start_read(self, ids: np.ndarray, locs: np.ndarray) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """:meth:`_read_ordered` started (:meth:`Reads.start`, each part checked on its thread, split as the knobs
        say); the function returned waits for it and refuses a damaged record."""
        order = np.argsort(locs, kind="stable")              # by segment slot, then offset
        at = locs[order]
        slots = (at >> np.uint32(self._shift)).astype(np.int64)
        offsets = (at & np.uint32(self.segment_rows - 1)).astype(np.int64)
        ring = READ_RING and uring()
        parts = max(1, min(READ_PARTS if ring else READ_THREADS, len(slots) // READ_SPLIT))
        pool = executor("disk", READ_THREADS) if len(slots) >= READ_AHEAD else None
        wait = self._reads.start(slots, offsets, at, ids[order], ring, parts, pool)

        def finish() -> tuple[np.ndarray, np.ndarray]:
            got, bad = wait()
            if len(bad):
                slot = int(slots[bad].min())
                disk_verify.refuse(self.path / self._names[slot], offsets[bad][slots[bad] == slot])
            self.counters["records_read"] += len(ids)
            return order, got

        return finish
