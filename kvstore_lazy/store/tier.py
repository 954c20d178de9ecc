"""The disk tier of one row table: rows moved out of memory whole (weights, every optimizer state, the per-row
columns) into a :class:`~kvstore_lazy.store.segments.SegmentStore`, and moved back on their next touch.

A row is in exactly one tier at a time: :meth:`DiskTier.demote` writes the rows at some slots to disk and then
removes them from the table; :meth:`DiskTier.promote` takes the rows of a batch that are on disk (one batched read)
and inserts them into the table as they were. Both are a handful of whole-array operations per batch; nothing loops
over rows in Python. Threads help, none of them deciding anything: the store's pool reads a promotion's records
while this thread places the rows in the table and drops them from the disk index, and the store's writer thread
writes a demotion's records while this thread packs and indexes the next chunk of them (SegmentStore.begin_take,
put_records with handoff); what moves where is decided here, in request order, as before. The record of a row is
the structured dtype :func:`record_dtype` of the table's layout, so a row that went to disk and back is bit for bit
the row that left.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore_lazy import paths
from kvstore_lazy.store import kernels
from kvstore_lazy.store.arena import release_free_memory
from kvstore_lazy.store.rows import RowTable, as_row_ids
from kvstore_lazy.store.segments import (DEFAULT_COMPACT_RATIO, DEFAULT_SEGMENT_ROWS, MEMTABLE_ENTRIES, DiskError,
                                         SegmentError, SegmentStore, join, link_or_copy, pick, put_at)

STORE_FILE = paths.STORE_FILE
MMAP_THRESHOLD = 4 << 20         # see _fix_mmap_threshold
TRIM_THRESHOLD = 16 << 20
DEMOTE_CHUNK = 1 << 13          # rows packed and written per step of a demotion (one pwrite of ~2 MB at D=32:
                                # large and sequential, and a buffer below glibc's mmap threshold: heap memory used
                                # again, not fresh pages the kernel faults in and zeroes every time). A pass's
                                # records are written while the next chunk is packed (disk.writer.WRITE_AHEAD
                                # chunks of them held for writing at most: see DiskTier.demote)
DENSE_SHARE = 4                 # a dense disk index takes at most a quarter of the memory budget (dense_rows)
MEMTABLE_SHARE = DENSE_SHARE    # a key's disk index memtable takes at most a quarter of the budget, as the hash
                                # index it replaces could without a cost: until then no cold row reads an index
                                # block (memtable_entries) ...
MEMTABLE_MIN = 1 << 10          # ... but at least this many entries ...
MEMTABLE_MAX = 1 << 18          # ... and at most this many: writing it as a run (RunIndex.flush) takes about 45
                                # bytes an entry at once (sorted copies, the run's blocks: 46.6 MiB at 1M entries,
                                # 11.7 at this many), all of it above the budget
CACHE_ROWS = 1 << 15            # records of rows read in place kept for their promotion (~8.9 MB at D=32)
CACHE_BYTES = 16 << 20          # and at most this many bytes of them (wide rows: fewer records)
READ_CHUNK = 1 << 13            # records a read of many rows (a checkpoint's piece) holds at once (read_field): ~2 MB
READ_BYTES = 4 << 20            # and at most this many bytes of them
_FIXED: list = []


def _fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at 4 MiB and its trim threshold at 16 MiB (once per process). Demotions and
    budget passes allocate and free temporaries of tens of MB every round; glibc's default *dynamic* threshold
    rises to the largest freed mapping, after which such temporaries come from the heap and are never returned:
    measured, 73 MiB of RSS above the budget at 2M rows under 128 MiB. Fixed, those are mappings, unmapped when
    freed. Not lower: a request's own temporaries (a few MB of records, weights, ids) then came from fresh
    mappings every time, and their page faults (the kernel zeroing every page) cost more than the work on them:
    at 128 KiB, 32-41 ms of CPU a Zipf step at 4.9M rows, at 4 MiB 22-24 ms (VmHWM +9 MiB). No glibc: nothing."""
    if _FIXED:
        return
    _FIXED.append(True)
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, MMAP_THRESHOLD)        # M_MMAP_THRESHOLD
        libc.mallopt(-1, TRIM_THRESHOLD)        # M_TRIM_THRESHOLD: free heap kept at its top before it is returned
    except (OSError, AttributeError):
        pass




COUNTERS = ("promoted", "demoted", "hits", "misses", "expired_disk", "updated_in_place")


class DiskTierFailure(BaseException):
    """The disk tier cannot go on (a full disk, a failed write or read, a damaged segment, a directory that is not
    ours): the server must stop, not answer. Deliberately not an ``Exception``: the server's catch-all that refuses
    one hostile request and goes on must not swallow it; the runtime logs it as an ERROR and exits (status 4)
    without writing a snapshot, so the last good snapshot stays the one to recover from."""


def _fatal(method):
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (DiskError, SegmentError) as exc:
            raise DiskTierFailure(f"disk tier failed ({KVSTORE_LAZY_DISK_DIR}={self.path.parent.parent}): "
                                  f"{exc}") from exc
    wrapped.__name__, wrapped.__doc__ = method.__name__, method.__doc__
    return wrapped


KVSTORE_LAZY_DISK_DIR = "KVSTORE_LAZY_DISK_DIR"


def dense_rows(first: int, count: int, budget: int) -> tuple[int, int] | None:
    """The row range a key's disk tier indexes densely (segments.DenseIndex: 4 bytes a *possible* row, counted in
    the memory budget from the start; a probe one array read), or None (the RunIndex: about 1.4 bytes a row on
    disk, an index block read a cold row). Dense when its index takes at most ``1 / DENSE_SHARE`` of the budget."""
    return (first, count) if 4 * count * DENSE_SHARE <= budget else None


def memtable_entries(budget: int | None) -> int:
    """The entries a key's RunIndex keeps in RAM before it writes them as a run: a ``1 / MEMTABLE_SHARE`` share of
    the memory budget at ~22 bytes an entry, at least ``MEMTABLE_MIN`` (a run file a few rounds, not a few rows)
    and at most ``MEMTABLE_MAX``."""
    if not budget or budget <= 0:
        return MEMTABLE_ENTRIES
    return int(min(max(budget // MEMTABLE_SHARE // 22, MEMTABLE_MIN), MEMTABLE_MAX))


def record_dtype(row_size: int, dtype, num_states: int, columns: dict) -> np.dtype:
    """The payload of one row on disk: ``w`` (the weights), ``s0``.. (the states), ``c_<name>`` (the columns)."""
    fields: list[tuple] = [("w", np.dtype(dtype), (row_size,))]
    fields += [(f"s{i}", np.dtype(dtype), (row_size,)) for i in range(num_states)]
    fields += [(f"c_{name}", np.dtype(col)) for name, col in columns.items()]
    return np.dtype(fields)


def _is_store(path: Path) -> bool:
    return (path / STORE_FILE).exists() or not any(path.iterdir())


def clear_dir(path: Path) -> None:
    """Remove a disk tier a previous process left in ``path`` (its rows mean nothing without that process's
    snapshot). Anything else there is refused, never deleted. The store is first renamed aside (``.<name>.old``)
    and removed there, so a process killed while removing it leaves no half-removed store at ``path`` (which the
    next start would refuse as "not a disk tier"); a ``.<name>.old`` a killed clear left is ours by its name and
    removed first."""
    old = paths.old_dir(path)
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        if not path.is_dir() or not _is_store(path):
            raise SegmentError(f"{path} is not a disk tier of kvstore_lazy (no {STORE_FILE}): not touching it")
        os.replace(path, old)
        shutil.rmtree(old)


class RecordCache:
    """Whole records of rows on disk that a request read in place (no room under the budget, or not admitted),
    kept for the next touch of the same rows (the push after a pull) so they are not read again: valid for one
    version of the store; a change that only drops or rewrites known rows (:meth:`forget`) keeps the others.
    At most ``limit`` records (past it, it starts over). Parts as they were added, never copied as a whole. With
    each record its location, so a promotion from here drops the row from the disk index without looking it up."""

    def __init__(self, limit: int, dtype: np.dtype) -> None:
        self.limit, self.dtype = limit, dtype
        self.version: int | None = None
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (ids ascending, records,
        #                                                                               alive, locations)
        self.size = 0

    def clear(self) -> None:
        self.version, self.parts, self.size = None, [], 0

    def add(self, version: int, ids: np.ndarray, records: np.ndarray, locs: np.ndarray) -> None:
        if self.version != version:
            self.clear()
        if self.size + len(ids) > self.limit:
            self.clear()
            return
        if not len(ids):
            return
        order = np.argsort(ids, kind="stable")
        self.parts.append((ids[order], pick(records, order), np.ones(len(ids), bool), locs[order]))
        self.size += len(ids)
        self.version = version

    def find(self, version: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A mask of the ``ids`` whose records are kept (for this version of the store), those records in the
        order of ``ids``, and their locations."""
        hit = np.zeros(len(ids), bool)
        if self.version != version or not self.parts:
            self.clear()
            return hit, np.zeros(0, self.dtype), np.zeros(0, np.uint32)
        found = []
        for kept, records, alive, locs in self.parts:
            where = np.minimum(np.searchsorted(kept, ids), len(kept) - 1)
            new = (kept[where] == ids) & alive[where] & ~hit
            if new.any():
                found.append((np.flatnonzero(new), records, where[new], locs))
                hit |= new
        out = np.empty(int(hit.sum()), self.dtype)
        out_locs = np.empty(len(out), np.uint32)
        rank = np.cumsum(hit) - 1
        for at, records, where, locs in found:
            put_at(out, rank[at], pick(records, where))
            out_locs[rank[at]] = locs[where]
        return hit, out, out_locs

    def forget(self, before: int, after: int, gone: np.ndarray) -> None:
        """The store went from version ``before`` to ``after`` changing only the rows ``gone``: the others stay."""
        if self.version != before:
            self.clear()
            return
        for kept, _, alive, _ in self.parts:
            where = np.minimum(np.searchsorted(kept, gone), len(kept) - 1)
            alive[where[kept[where] == gone]] = False
        self.version = after


class DiskTier:
    """Rows of one table on disk; see the module docstring. ``table`` is the in-memory table it pairs with."""

    @_fatal
    def __init__(self, path, table: RowTable, segment_rows: int = DEFAULT_SEGMENT_ROWS,
                 store: SegmentStore | None = None, compact_ratio: float = DEFAULT_COMPACT_RATIO,
                 rows: tuple[int, int] | None = None, memtable_entries: int = MEMTABLE_ENTRIES) -> None:
        """A new, empty tier in ``path`` (or ``store``'s); ``rows`` (first, count): the range of the table's row ids
        when the store should index them densely (:func:`dense_rows`); else the store's RunIndex keeps at most
        ``memtable_entries`` recent changes in RAM (:func:`memtable_entries`)."""
        _fix_mmap_threshold()
        self.path = Path(path)
        self.layout = (table.row_size, table.dtype, table.num_states, dict(table.column_dtypes))
        self.record = record_dtype(*self.layout)
        if store is None:
            clear_dir(self.path)
            store = SegmentStore(self.path, self.record, segment_rows, compact_ratio, rows=rows,
                                 memtable_entries=memtable_entries)
        elif store.payload_dtype != self.record:
            raise SegmentError(f"disk tier {self.path}: its records are {store.payload_dtype}, the table's rows "
                               f"{self.record}")
        self.store = store
        self.counters = dict.fromkeys(COUNTERS, 0)
        size = store.record_dtype.itemsize
        self._cache = RecordCache(min(CACHE_ROWS, max(1024, CACHE_BYTES // size)), store.record_dtype)   # see read
        self._read_chunk = min(READ_CHUNK, max(64, READ_BYTES // size))

    @classmethod
    def open(cls, path, table: RowTable, verify: bool = True, compact_ratio: float = DEFAULT_COMPACT_RATIO,
             memtable_entries: int = MEMTABLE_ENTRIES) -> "DiskTier":
        try:
            store = SegmentStore.open(path, verify=verify, compact_ratio=compact_ratio,
                                      memtable_entries=memtable_entries)
        except SegmentError as exc:
            raise DiskTierFailure(f"disk tier failed ({KVSTORE_LAZY_DISK_DIR}={Path(path).parent.parent}): "
                                  f"{exc}") from exc
        return cls(path, table, store=store)

    @classmethod
    def restore(cls, source, path, table: RowTable, compact_ratio: float = DEFAULT_COMPACT_RATIO,
                memtable_entries: int = MEMTABLE_ENTRIES) -> "DiskTier":
        """The tier of a snapshot (``source``: a store committed there) as this table's tier in ``path``: its files
        hard-linked (copied across file systems), every committed record verified (a damaged segment is a
        DiskTierFailure naming it)."""
        source, path = Path(source), Path(path)
        try:
            clear_dir(path)
            path.mkdir(parents=True)
            for file in sorted(source.iterdir()):
                link_or_copy(file, path / file.name)
        except (OSError, SegmentError) as exc:
            raise DiskTierFailure(f"disk tier failed ({KVSTORE_LAZY_DISK_DIR}={path.parent.parent}): cannot "
                                  f"restore {source}: {exc}") from exc
        return cls.open(path, table, compact_ratio=compact_ratio, memtable_entries=memtable_entries)

    def __len__(self) -> int:
        return len(self.store)

    @_fatal
    def contains(self, row_ids) -> np.ndarray:
        return self.store.contains(row_ids)     # (an index read: a damaged run stops the server)

    # -- moving rows

    @_fatal
    def demote(self, table: RowTable, slots: np.ndarray) -> np.ndarray:
        """Write the rows at ``slots`` to disk and remove them from ``table``; returns their ids. If the write
        fails (DiskError) the table holds the same rows as before.

        DEMOTE_CHUNK rows at a time: packed (by id, as RowTable.export gives rows), handed to the store (indexed
        here, written by its writer thread while the next chunk is packed, at most WRITE_AHEAD chunks' records held
        for writing); the rows leave the table once all of them are on their way. So a pass's transient is a
        few chunks' records (~2 MB each at D=32), not a record per row it demotes (a pass of a fifth of a 256 MiB
        budget held about 50 MiB of them at once)."""
        slots = np.asarray(slots, np.int64)
        written: list[np.ndarray] = []
        fields = self._fields(table, ids=True)
        index = self.store.index_nbytes()
        try:
            for lo in range(0, len(slots), DEMOTE_CHUNK):
                chunk = slots[lo:lo + DEMOTE_CHUNK]
                ids = table.ids_at(chunk)
                order = np.argsort(ids, kind="stable")
                records = np.empty(len(chunk), self.store.record_dtype)
                kernels.gather_fields(records, chunk[order], fields)      # packed in one pass
                self.store.put_records(records, handoff=True, absent=True)   # (a row is in one tier)
                del records
                written.append(ids[order])
        except (DiskError, SegmentError):
            for ids in written:       # a row is in one tier: none went to disk, all of them stay in the table
                self.store.delete(ids)
            raise
        del fields
        table.remove_slots(slots)
        if self.store.index_nbytes() < index:
            release_free_memory()       # (the index's memtable went out as a run: its ~45 B an entry of temporaries)
        self.counters["demoted"] += len(slots)
        return np.concatenate(written) if written else np.zeros(0, np.uint64)

    @_fatal
    def count(self, hits: int, misses: int = 0) -> None:
        """A request touched `hits` rows in memory and `misses` rows on disk (the hit rate: every pull and push,
        the pulls the compiled fast path answers from memory included)."""
        self.counters["hits"] += hits
        self.counters["misses"] += misses

    @_fatal
    def promote(self, table: RowTable, row_ids: np.ndarray, count: bool = True, known_absent: bool = False,
                admit: Callable[[np.ndarray], np.ndarray] | None = None) -> int:
        """Bring the rows of ``row_ids`` (unique) that are on disk and not in ``table`` back into it, with one
        batched read; returns how many. With `count` they are a request's rows: the ones found in memory are hits
        and the ones found on disk misses. With `known_absent` the caller knows none of them is in ``table``. With
        `admit` (the memory tier's admission: a function of a batch of records, their payloads' columns, giving a
        mask) only the rows it admits come in; the records of the others are kept as :meth:`read` keeps them (so a
        pull answers them from there; :meth:`promote_or_keep` hands them to a push instead)."""
        return self._bring(table, row_ids, count, known_absent, admit)[0]

    @_fatal
    def promote_absent(self, table: RowTable, row_ids: np.ndarray,
                       admit: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """:meth:`promote` of a request's rows none of which is in ``table`` (``known_absent``): the slot each of
        them has in ``table`` afterwards (-1: not on disk, or not admitted), so the caller need not look them up
        (promotions only add rows: the slots of the others stay)."""
        slot_of = self._bring(table, row_ids, True, True, admit)[2]
        return slot_of if slot_of is not None else np.full(len(row_ids), -1, np.int64)

    @_fatal
    def promote_or_keep(self, table: RowTable, row_ids: np.ndarray,
                        admit: Callable[[np.ndarray], np.ndarray]) -> tuple[int, np.ndarray]:
        """:meth:`promote` with `admit` for a push: ``(promoted, records)``, the records (whole, of the rows on
        disk not admitted: to be updated where they are, :meth:`write_back`) in no particular order."""
        return self._bring(table, row_ids, True, False, admit, keep=False)[:2]

    def _bring(self, table: RowTable, row_ids: np.ndarray, count: bool, known_absent: bool,
               admit: Callable[[np.ndarray], np.ndarray] | None,
               keep: bool = True) -> tuple[int, np.ndarray, np.ndarray | None]:
        """``(rows promoted, records of the rows on disk not admitted, the slot in the table of each row of the
        cold ones (those absent from it, in their order): -1 where none; None if none was found)``."""
        none = np.zeros(0, self.store.record_dtype)
        ids = as_row_ids(row_ids)
        absent = np.ones(len(ids), bool) if known_absent else table.lookup(ids) < 0
        cold = ids[absent]
        if not len(cold) or not len(self.store):
            if count:
                self.count(int(len(ids) - absent.sum()), 0)
            return 0, none, None
        version = self.store.version
        cached, cached_records, cached_locs = self._cache.find(version, cold)   # read in place since it changed
        take = self.store.begin_take(cold[~cached])                  # one index probe; the read under way
        # where in cold each record's row is: cached_records[j] of cold[at_cached[j]], the stored ones at at_stored
        at_cached, at_stored = np.flatnonzero(cached), np.flatnonzero(~cached)[take.present]
        if count:
            self.count(int(len(ids) - absent.sum()), len(at_cached) + len(at_stored))
        if not len(at_cached) and not len(at_stored):
            return 0, none, None
        come = np.zeros(len(cold), bool)
        slot_of = None
        if admit is None:
            # every row found comes in: while its record is read (on the pool's threads), it gets its slot and
            # leaves the disk index (a read that then fails stops the server: DiskTierFailure)
            come[at_cached] = come[at_stored] = True
            slot_of = self._place(table, cold, come)
            take.drop()
        order, records = take.records()
        at_read = at_stored[order]          # records[j] of cold[at_read[j]]
        in_c = np.ones(len(at_cached), bool) if admit is None else admit(cached_records["payload"])
        in_r = np.ones(len(at_read), bool) if admit is None else admit(records["payload"])
        rest = none
        if not (in_c.all() and in_r.all()):
            rest = join([pick(cached_records, ~in_c), pick(records, ~in_r)])
            rest_locs = np.concatenate([cached_locs[~in_c], take.locs()[~in_r]])
        if slot_of is None:         # (admission: the rows admitted are known now)
            come[at_cached[in_c]] = True
            come[at_read[in_r]] = True
        moved = cold[come]
        if slot_of is None and len(moved):
            slot_of = self._place(table, cold, come)
            take.drop(in_r)
        if len(moved):
            fields = self._fields(table)
            kernels.scatter_fields(cached_records if in_c.all() else pick(cached_records, in_c),
                                   slot_of[at_cached[in_c]], fields)
            kernels.scatter_fields(records if in_r.all() else pick(records, in_r), slot_of[at_read[in_r]], fields)
            del fields
            table.mark_changed(slot_of[come])
            if in_c.any():
                self.store.delete(cold[at_cached[in_c]], cached_locs[in_c])     # (their locations known)
            self._cache.forget(version, self.store.version, moved)
            self.counters["promoted"] += len(moved)
        if keep and len(rest):
            self._cache.add(self.store.version, rest["id"], rest, rest_locs)
        return len(moved), rest, slot_of

    @staticmethod
    def _place(table: RowTable, cold: np.ndarray, come: np.ndarray) -> np.ndarray:
        """Slots in ``table`` for the rows ``cold[come]`` (absent from it), zero until their records are scattered
        there, made in the order of ``cold`` (as RowTable.insert_rows would place them); -1 elsewhere."""
        slot_of = np.full(len(cold), -1, np.int64)
        slot_of[come] = table.insert_absent(cold[come])
        return slot_of

    @_fatal
    def write_back(self, records: np.ndarray) -> None:
        """Records of rows on disk that a push updated where they are (from :meth:`promote_or_keep`, their
        payloads changed): written back in place (SegmentStore.rewrite)."""
        version = self.store.version
        self.store.rewrite(records)
        self._cache.forget(version, self.store.version, records["id"])
        self.counters["updated_in_place"] += len(records)

    @_fatal
    def read(self, row_ids) -> dict:
        """Rows on disk (all present), as :meth:`RowTable.export` gives them, without promoting them. Their records
        are kept until the store next changes (promotions and updates of other rows keep them; at most CACHE_ROWS of
        them: RecordCache): a promotion of the same rows (the push after a pull that found no room) takes them from
        there instead of reading them again."""
        ids = as_row_ids(row_ids)
        order, records, locs = self.store.read_records(ids)
        self._cache.add(self.store.version, ids[order], records, locs)
        out = np.empty(len(records), self.store.record_dtype)
        put_at(out, order, records)
        return self._unpack(ids, out["payload"])

    @_fatal
    def read_weights(self, row_ids, out: np.ndarray, at: np.ndarray) -> None:
        """:meth:`read`'s weights only, straight into rows ``at`` of ``out`` (a C-contiguous (n, row_size) array
        of the table's dtype: a pull's reply), the records kept as :meth:`read` keeps them."""
        self.read_field(row_ids, "w", out, at)

    @_fatal
    def read_field(self, row_ids, field: str, out: np.ndarray, at: np.ndarray) -> None:
        """One part of rows on disk (all present): ``field`` of their payload (``"w"``, ``"s0"``, ...), straight into
        rows ``at`` of ``out`` (C-contiguous, (n, row_size), the table's dtype). A read of at most half the rows
        the cache holds (a training pull's cold rows) keeps their records as :meth:`read` does; a larger one (a
        checkpoint's piece: the fast path asks for its missing rows 32,768 at a time) is read READ_CHUNK records at
        a time and keeps none, so its transient is a chunk's records, not a record per row asked for (twice: read,
        then kept)."""
        ids = as_row_ids(row_ids)
        at = np.asarray(at, np.int64)
        w = self.store.record_dtype.fields["payload"][1] + self.record.fields[field][1]
        cached, cached_records, _ = self._cache.find(self.store.version, ids)
        if cached.any():               # kept by a promotion that did not admit them, or an earlier read
            kernels.scatter_fields(cached_records, at[cached], [(out, w)])
            ids, at = ids[~cached], at[~cached]
            if not len(ids):
                return
        del cached_records
        if 2 * len(ids) > self._cache.limit:   # a checkpoint's piece: none of them kept
            self._cache.clear()
            step = self._read_chunk
            for lo in range(0, len(ids), step):
                order, records = self.store.get_records(ids[lo:lo + step])
                kernels.scatter_fields(records, at[lo:lo + step][order], [(out, w)])
                del records
            return
        order, records, locs = self.store.read_records(ids)
        self._cache.add(self.store.version, ids[order], records, locs)
        kernels.scatter_fields(records, at[order], [(out, w)])

    @_fatal
    def write_field(self, row_ids, field: str, values: np.ndarray) -> None:
        """Set ``field`` of the payload (``"s0"``, ...) of rows on disk (all present) to ``values`` (rows in the order
        of ``row_ids``), where they are: READ_CHUNK records read, changed and written back at a time (a worker
        restoring a checkpoint's optimizer states sets every row's: they must not all come into memory)."""
        ids = as_row_ids(row_ids)
        step = self._read_chunk
        for lo in range(0, len(ids), step):
            order, records = self.store.get_records(ids[lo:lo + step])
            records["payload"][field] = values[lo:lo + step][order]
            version = self.store.version
            self.store.rewrite(records)
            self._cache.forget(version, self.store.version, records["id"])

    def read_pieces(self, row_ids):
        """:meth:`read` of many rows, READ_CHUNK at a time: ``(lo, rows)`` for ``row_ids[lo:lo + READ_CHUNK]``
        (a caller that needs whole rows, not one part: its transient is a chunk's, not all of them at once)."""
        step = self._read_chunk
        for lo in range(0, len(row_ids), step):
            yield lo, self.read(row_ids[lo:lo + step])

    def chunks(self, chunk: int = 1 << 16):
        """Every row on disk, ascending by id, ``chunk`` rows at a time, as :meth:`read` gives them."""
        for ids, payload in self.store.items(chunk):
            yield self._unpack(ids, payload)

    @_fatal
    def drop(self, row_ids) -> int:
        return self.store.delete(row_ids)

    @_fatal
    def expire(self, dead) -> int:
        """Remove the rows on disk for which ``dead(columns)`` (a dict of column arrays of a chunk) is true."""
        dead_ids = []
        for rows in self.chunks():          # (the store is not changed while its index is walked)
            mask = dead(rows["columns"])
            if mask.any():
                dead_ids.append(rows["row_ids"][mask])
        gone = self.store.delete(np.concatenate(dead_ids)) if dead_ids else 0
        self.counters["expired_disk"] += gone
        return gone

    @_fatal
    def commit(self, into=None) -> None:
        """The store's commit (:meth:`SegmentStore.commit`: with ``into``, a snapshot's copy, its files hard-linked);
        it writes the index's memtable as a run, so a full disk here stops the server (DiskTierFailure) too."""
        self.store.commit(into)

    @_fatal
    def compact(self) -> int:
        """Amortized: the store's garbage ratio over all its segments, the emptiest segments first (compact_store)."""
        return self.store.compact_store()

    # -- sizes

    def index_nbytes(self) -> int:
        return self.store.index_nbytes()

    def index_row_nbytes(self) -> int:
        return self.store.index_row_nbytes()

    def stats(self) -> dict:
        c = self.counters
        touched = c["hits"] + c["misses"]
        s = self.store.stats()
        return {"disk_rows": len(self.store), "disk_bytes": self.store.disk_bytes(),
                "disk_index_bytes": self.index_nbytes(), "promoted": c["promoted"], "demoted": c["demoted"],
                "hit_rate": c["hits"] / touched if touched else 1.0, "expired_disk": c["expired_disk"],
                "disk_index_disk_bytes": s["index_disk_bytes"],
                "disk_index_reads_per_lookup": s.get("index_reads_per_lookup", 0.0)}

    # -- records

    def _fields(self, table: RowTable, ids: bool = False) -> list:
        """``(array, byte offset in a record)`` of each part of a row, for kernels.gather_fields/scatter_fields: the
        table's weights, states and columns (whole arrays by slot: use them at once), with ``ids`` its ids too."""
        if (table.row_size, table.dtype, table.num_states, dict(table.column_dtypes)) != self.layout:
            raise ValueError(f"disk tier {self.path}: the table's rows are not this tier's records {self.record}")
        record, payload = self.store.record_dtype, self.record
        at = record.fields["payload"][1]
        arrays = table.arrays()
        fields = [(arrays[0], at + payload.fields["w"][1])]
        fields += [(arrays[1 + i], at + payload.fields[f"s{i}"][1]) for i in range(table.num_states)]
        fields += [(table.column(name), at + payload.fields[f"c_{name}"][1]) for name in self.layout[3]]
        if ids:
            fields.append((table.row_ids_view(), record.fields["id"][1]))
        return fields

    def _pack(self, rows: dict, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(len(rows["row_ids"]), self.record) if out is None else out
        out["w"] = rows["weights"]
        for i, states in enumerate(rows["states"]):
            out[f"s{i}"] = states
        for name, values in rows["columns"].items():
            out[f"c_{name}"] = values
        return out

    def _unpack(self, ids: np.ndarray, payload: np.ndarray) -> dict:
        num_states, columns = self.layout[2], self.layout[3]
        return {"row_ids": ids, "weights": np.ascontiguousarray(payload["w"]),
                "states": [np.ascontiguousarray(payload[f"s{i}"]) for i in range(num_states)],
                "columns": {name: np.ascontiguousarray(payload[f"c_{name}"]) for name in columns}}
