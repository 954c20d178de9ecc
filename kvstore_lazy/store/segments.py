"""A log-structured store of fixed-size row records on disk: the disk tier of a row table.

Layout of a store directory::

    store.json              the record layout (payload dtype, bytes per record, records per segment) and, for a
                            dense index, the row range; written once
    index.npz               the committed index: row ids, their record locations, the segments they live in
    seg-000001.dat ...      segment files, each exactly ``segment_rows`` records (reserved with posix_fallocate)

A *record* is ``id`` (uint64), ``check`` (uint32) and the payload (a numpy structured dtype chosen by the caller:
the weights, every optimizer state and the per-row policy columns of one row, together). Records are only ever
appended to the *active* segment (``os.pwrite``, one call per batch); a full segment is *sealed* and never written
again. A row written again gets a new record; the old one becomes garbage. Sealed segments are *compacted* (their
live records appended anew, the file gone): by :meth:`SegmentStore.compact_store` (the tier's, at round ends) the
emptiest first while the whole store's garbage passes ``compact_ratio`` or the emptiest is half garbage, a few a
call; by :meth:`SegmentStore.compact` every one whose own garbage passes the ratio.

The index (row id -> location) holds one ``uint32`` per row: the location ``slot << shift | offset`` (a segment
slot, reused after compaction, and the record number in it). For a store given its row range (``rows``, a key's
rows on one server: the disk tier's choice when it fits a share of the memory budget) it is a :class:`DenseIndex`:
4 bytes a *possible* row, a probe one array read. Otherwise it is a :class:`~kvstore_lazy.store.rows.RowTable`:
8 bytes of id + 4 of location + 4 / load of int32 hash buckets a row stored; the table is rebuilt at twice the size
past ``INDEX_LOAD`` = 0.8 (denser than a memory table's 0.5: a linear-probing miss then costs about 12 probes,
nothing beside a disk read), so the load is 0.4 .. 0.8 and the buckets 5 to 10 bytes: 17 to 22 bytes a row, exact
in :meth:`SegmentStore.index_nbytes`. 50 million rows on disk: 0.85 to 1.1 GB of hash index, or 0.2 GB of dense
index for a key of 50 million possible rows.

Durability. The index file is the commit point: :meth:`SegmentStore.commit` fsyncs the segments written since the
last commit, then writes ``index.npz`` atomically (temp file, fsync, rename, fsync of the directory). A store opened
again holds exactly what the last commit held; records appended after it are unreferenced garbage. A segment a
compaction emptied is deleted at once, unless this directory's committed index refers to it (then at the next
commit). A commit into another directory (:meth:`commit` with ``into``, for a server snapshot) hard-links the
segment files instead of copying them (a snapshot holding a segment keeps its own link when the store deletes
it): appends only ever write past the committed fill, and :meth:`rewrite` (records updated where they are: the
disk tier's rows a push updated without bringing them into memory) writes in place only into a segment no other
directory links (``st_nlink`` 1); one a snapshot shares gets the records appended anew (copy-on-write). A
record written in place is sealed again for its location, so a torn write is a failed check, never wrong values
(and the live directory is never what a restart recovers from: the snapshot is).

Damage. Every record carries a check (a position-weighted sum of its 32-bit words, its location and id mixed in),
verified on every read and, at :meth:`open` with ``verify``, for every committed record: a damaged, truncated or
missing segment is a :class:`SegmentError` naming the file (and the record), never wrong values.

Disk full / write errors. Space for a segment is reserved when it is created (``posix_fallocate``), so a full disk
shows up there, never as a half-written record, as a :class:`DiskError` naming the directory; a failing
``pwrite``/``fsync`` is one too. The store's contents are unchanged by the failed call (nothing of the batch is
indexed; records it wrote before the failure are unreferenced garbage). Records handed over to the writer thread
(:meth:`SegmentStore.put_records` with ``handoff``: the disk tier's demotions) are indexed when handed over and
written while the caller goes on; a write that then fails is a DiskError at the next call that waits for it (reads
of its records, commit, compaction, rewrite, close), and the disk tier stops the server on it.

Reads are batched: the records of a batch are read in file order (sorted by segment and offset, adjacent records
one read) by C calls (:func:`kernels.pread_records`) on a pool's threads while the caller goes on
(:meth:`SegmentStore.begin_take`): in ``READ_PARTS`` parts through an io_uring each where the kernel has one (a
ring of 256 reads a system call, kept per thread; page-cache hits complete inline, the rest in parallel in the
kernel), else a loop of ``pread`` split over up to ``READ_THREADS`` threads (ctypes releases the GIL), so an SSD
sees several requests at once. The records come back in file order (:meth:`SegmentStore.take_records`,
:meth:`SegmentStore.get_records`: no reorder copy; :meth:`SegmentStore.get` reorders). Reads, not a memory map:
page-cache pages of a mapped file count in the server's RSS, a failed read would be a SIGBUS, and on this kernel
(6.18, ext4 with large folios) a fault maps a whole folio: measured 1.0 us a record through a mapping dropped every
16k records (RSS +1.1 GB before that), against 1.3 through the ring. No per-row Python loop anywhere: the loops
are over segments.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

from kvstore_lazy.store import kernels
from kvstore_lazy.store.rows import RowTable, as_row_ids

FORMAT = "kvstore-lazy-segments/1"
DEFAULT_SEGMENT_ROWS = 1 << 16
DEFAULT_COMPACT_RATIO = 0.25     # (KVSTORE_LAZY_DISK_COMPACT; see the README's disk tier costs)
MAX_SLOTS_BITS = 32
_SALT = np.uint64(0x9E3779B97F4A7C15)
INDEX_LOAD = 0.8                # the index's hash table is rebuilt larger past this load (see the module docstring)
INDEX_RESERVE = 0.95            # index_nbytes counts the next table from this share of the rehash load on
READ_THREADS = 4                # a batch's reads go out in this many parts at once with pread (an SSD serves them in
                                # parallel) ...
READ_PARTS = 2                  # ... or through this many io_urings (page-cache copies: the kernel's CPU, two cores)
READ_SPLIT = 1024               # ... of at least this many records each
READ_AHEAD = 256                # a read of at least this many records goes to the pool's threads (see _start_pread)
READ_RING = True                # through an io_uring where the kernel has one (kernels.pread_records), else pread
WRITE_RING = False              # rewrite through the ring too (buffered writes: the kernel punts them to workers)
REWRITE_IN_PLACE = True         # rewrite writes in place (False: appends, as for a segment a snapshot links)
CHEAP_GARBAGE = 0.5             # compact_store compacts a segment this much garbage whatever the store's ratio
COMPACT_LIMIT = 8               # segments compact_store rewrites at most per call (a round end's bound)
_EXECUTORS: dict[str, futures.ThreadPoolExecutor] = {}
_RING: list = []


def _uring() -> bool:
    """kernels.uring_available(), asked once per process (it sets up and tears down a ring)."""
    if not _RING:
        _RING.append(kernels.uring_available())
    return _RING[0]


def executor(name: str, threads: int = 1) -> futures.ThreadPoolExecutor:
    """The process's thread pool ``name`` (thread names ``kvstore-lazy-<name>``), made on first use and kept."""
    if name not in _EXECUTORS:
        _EXECUTORS[name] = futures.ThreadPoolExecutor(threads, thread_name_prefix=f"kvstore-lazy-{name}")
    return _EXECUTORS[name]


def _pool() -> futures.ThreadPoolExecutor:
    """The threads that read a batch's records in parts (_start_pread)."""
    return executor("disk", READ_THREADS)


def _writer() -> futures.ThreadPoolExecutor:
    """The one thread that writes the records handed over by put_records(handoff=True), in order."""
    return executor("disk-write")


class SegmentError(ValueError):
    """A store that can't be used as it is on disk: damaged, truncated or missing segments, a foreign layout."""


class DiskError(OSError):
    """Writing to the store's directory failed (full disk, I/O error); names the directory."""


def fsync_path(path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dtype_json(dtype: np.dtype) -> list:
    return [[name, dtype.fields[name][0].base.str, list(dtype.fields[name][0].shape)] for name in dtype.names]


def _dtype_from_json(fields: list) -> np.dtype:
    return np.dtype([(str(name), np.dtype(str(base)), tuple(int(d) for d in shape)) for name, base, shape in fields])


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


class SegmentStore:
    """Row id -> one payload record (``payload_dtype``), on disk. Not thread-safe."""

    def __init__(self, path, payload_dtype: np.dtype, segment_rows: int = DEFAULT_SEGMENT_ROWS,
                 compact_ratio: float = DEFAULT_COMPACT_RATIO, rows: tuple[int, int] | None = None,
                 _create: bool = True) -> None:
        """With ``rows`` = (first, count), every row id stored is in [first, first + count): the index is a
        :class:`DenseIndex` (4 bytes a possible row), else a hash index (17-22 bytes a stored row)."""
        self.path = Path(path)
        self.payload_dtype = np.dtype(payload_dtype)
        if self.payload_dtype.names is None:
            raise ValueError("the payload dtype must be a structured dtype (named fields)")
        if segment_rows < 1 or segment_rows & (segment_rows - 1):
            raise ValueError(f"segment_rows must be a power of two, got {segment_rows}")
        if not 0.0 < compact_ratio <= 1.0:
            raise ValueError(f"compact_ratio must be in (0, 1], got {compact_ratio}")
        self.segment_rows = int(segment_rows)
        self.compact_ratio = float(compact_ratio)
        self._shift = self.segment_rows.bit_length() - 1
        self.max_slots = (1 << (MAX_SLOTS_BITS - self._shift)) - 1    # (the last location is DenseIndex.EMPTY)
        pad = -self.payload_dtype.itemsize % 4
        fields = [("id", "<u8"), ("check", "<u4"), ("payload", self.payload_dtype)]
        if pad:
            fields.append(("pad", f"V{pad}"))
        self.record_dtype = np.dtype(fields)
        self.record_bytes = self.record_dtype.itemsize
        self._words = self.record_bytes // 4
        self._mult = (np.arange(self._words, dtype=np.uint64) * np.uint64(2) + np.uint64(0x2545F491)) \
            & np.uint64(0xFFFFFFFF)
        self._mult[2] = 0                                   # the check word itself (after the 8-byte id)
        self.rows = None if rows is None else (int(rows[0]), int(rows[1]))
        self._index: RowTable | DenseIndex = self._new_index()
        self._names: dict[int, str] = {}                    # segment slot -> file name
        self._fill: dict[int, int] = {}                     # segment slot -> records written
        self._live = np.zeros(0, np.int64)                  # segment slot -> live records
        self._fds: dict[int, int] = {}                      # segment slot -> read-only file descriptor
        self._fd_at = np.zeros(0, np.int32)                 # the same by slot, -1 where none is open (_fds_of)
        self._writes: list[tuple] = []                      # (slot, first, end, future): writes under way
        self._write_error: DiskError | None = None          # the first of them that failed (_settle)
        self._wfds: dict[int, int] = {}                     # segment slot -> one for writes in place (rewrite)
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
            self._write_layout()
            self.commit()

    # -- opening

    @classmethod
    def open(cls, path, verify: bool = True, compact_ratio: float = DEFAULT_COMPACT_RATIO) -> "SegmentStore":
        """The store in ``path`` as of its last commit. With ``verify`` every committed record is checked (a damaged
        segment is a SegmentError naming it)."""
        path = Path(path)
        try:
            layout = json.loads((path / "store.json").read_text())
            if layout.get("format") != FORMAT:
                raise SegmentError(f"{path / 'store.json'}: not a {FORMAT} store (format {layout.get('format')!r})")
            rows = layout.get("rows")
            store = cls(path, _dtype_from_json(layout["payload"]), int(layout["segment_rows"]), compact_ratio,
                        rows=None if rows is None else (int(rows[0]), int(rows[1])), _create=False)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, SegmentError):
                raise
            raise SegmentError(f"{path / 'store.json'}: cannot read the store's layout: {exc}") from None
        if store.record_bytes != int(layout["record_bytes"]):
            raise SegmentError(f"{path / 'store.json'}: {layout['record_bytes']} bytes a record, "
                               f"this layout has {store.record_bytes}")
        store._load_index(verify)
        return store

    def _write_layout(self) -> None:
        layout = {"format": FORMAT, "payload": _dtype_json(self.payload_dtype), "segment_rows": self.segment_rows,
                  "record_bytes": self.record_bytes}
        if self.rows is not None:
            layout["rows"] = list(self.rows)
        self._atomic(self.path / "store.json", json.dumps(layout).encode())

    def _load_index(self, verify: bool) -> None:
        where = self.path / "index.npz"
        try:
            with np.load(where, allow_pickle=False) as z:
                ids, locs = z["ids"].astype(np.uint64), z["locs"].astype(np.uint32)
                meta = json.loads(bytes(z["meta"]).decode())
        except (OSError, ValueError, KeyError) as exc:
            raise SegmentError(f"{where}: cannot read the index: {exc}") from None
        self._next_number = int(meta["next_number"])
        segments = {int(slot): (str(name), int(fill)) for slot, name, fill in meta["segments"]}
        self._active = None if meta["active"] is None else int(meta["active"])
        self._live = np.zeros(max(segments, default=-1) + 1, np.int64)
        for slot, (name, fill) in segments.items():
            file = self.path / name
            size = file.stat().st_size if file.exists() else -1
            if size != self.segment_rows * self.record_bytes:
                what = "is missing" if size < 0 else f"has {size} bytes, not {self.segment_rows * self.record_bytes}"
                raise SegmentError(f"segment {file} {what}: the store is damaged")
            self._names[slot], self._fill[slot] = name, fill
        self._committed = set(self._names.values())
        for file in self.path.glob("seg-*.dat"):     # made after the last commit: garbage
            if file.name not in self._names.values():
                file.unlink()
        if len(ids):
            slots = (locs >> np.uint32(self._shift)).astype(np.int64)
            if not np.isin(slots, list(segments)).all():
                raise SegmentError(f"{where}: refers to segments it does not list")
            self._live += np.bincount(slots, minlength=len(self._live))
            if len(np.unique(ids)) != len(ids):
                raise SegmentError(f"{where}: the index lists a row twice")
            try:
                self._index = self._new_index(len(ids))
                index, _ = self._index_place(ids)
            except ValueError as exc:
                raise SegmentError(f"{where}: {exc}") from None
            self._index.arrays()[0][index, 0] = locs
        if verify:
            self.verify()

    # -- the API

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, row_ids) -> np.ndarray:
        return self._index.lookup(as_row_ids(row_ids)) >= 0

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

    def put_records(self, records: np.ndarray, handoff: bool = False) -> None:
        """Write records made by :meth:`new_records` (present ids are replaced). With ``handoff`` the caller hands
        ``records`` over (it never touches them again): they are indexed at once and written by the writer thread
        while the caller goes on (their segment space is reserved first, so a full disk is a DiskError here, as
        without; a failed write is a DiskError at the next call that waits for it, see :meth:`_settle`)."""
        if records.dtype != self.record_dtype or records.ndim != 1:
            raise ValueError(f"records of dtype {records.dtype} shape {records.shape}, want {self.record_dtype} (n,)")
        if len(records):
            self._append(np.ascontiguousarray(records), later=handoff)

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

    def begin_take(self, row_ids) -> "Take":
        """:meth:`take_records` in two halves: the index probe now (``Take.present``) and the records' read started
        on the pool's threads; ``Take.records()`` waits for it. Between the two the caller may do other work (the
        disk tier places the rows in its table and drops them from the index: the read does not look at either).
        Take.records() must be called before anything else reads or changes this store's files."""
        ids = as_row_ids(row_ids)
        index = self._index.lookup(ids)
        present = index >= 0
        index = index[present]
        finish = self._start_read(ids[present], self._locations(index)) if len(index) else None
        return Take(self, present, index, finish)

    def get_records(self, row_ids) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`get` as whole records in file order: ``(order, records)``, ``records[j]`` (checked) the record of
        ``row_ids[order[j]]`` (all present: else KeyError)."""
        ids = as_row_ids(row_ids)
        index = self._index.lookup(ids)
        if (index < 0).any():
            raise KeyError(f"{int((index < 0).sum())} of {len(ids)} rows are not in the store {self.path}")
        return self._read_ordered(ids, self._locations(index))

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
        self._settle()
        index = self._index.lookup(records["id"])
        if (index < 0).any():
            raise KeyError(f"{int((index < 0).sum())} of {len(records)} rows are not in the store {self.path}")
        locs = self._locations(index)
        slots = (locs >> np.uint32(self._shift)).astype(np.int64)
        alone = np.zeros(int(slots.max()) + 1, bool)
        for slot in np.unique(slots):
            alone[slot] = self._writable(int(slot))
        here = alone[slots]
        if not here.all():
            self._append(pick(records, ~here))     # shared with a snapshot: copy-on-write
        if here.any():
            order = np.flatnonzero(here)
            order = order[np.argsort(locs[order], kind="stable")]   # file order: adjacent records one write
            part, at, where = pick(records, order), locs[order], slots[order]
            kernels.record_seal(part.view(np.uint32).reshape(len(part), self._words), self._mult, at, 2)
            offsets = (at & np.uint32(self.segment_rows - 1)).astype(np.int64) * self.record_bytes
            fd_of = np.full(len(alone), -1, np.int32)
            for slot in np.unique(where):
                fd_of[slot] = self._wfd(int(slot))
                self._dirty.add(self._names[int(slot)])
            err, row = kernels.pwrite_records(fd_of[where], offsets, self.record_bytes, part, WRITE_RING and _uring())
            if err:
                raise DiskError(err, f"disk tier {self.path}: writing {self._names[int(where[row])]} in place "
                                     f"failed: {os.strerror(err)}")
            self.version += 1
            self.counters["records_rewritten"] += len(part)
        return int(here.sum())

    def _writable(self, slot: int) -> bool:
        """Whether a segment may be written in place: only this directory links it (no snapshot holds it)."""
        try:
            return REWRITE_IN_PLACE and os.fstat(self._wfd(slot)).st_nlink == 1
        except OSError as exc:
            raise DiskError(exc.errno, f"disk tier {self.path}: {self._names[slot]}: {exc.strerror or exc}") from exc

    def delete(self, row_ids) -> int:
        """Drop the present ``row_ids`` (unique) from the index; returns how many there were."""
        index = self._index.lookup(as_row_ids(row_ids))
        index = index[index >= 0]
        if len(index):
            self._drop(index)
        return len(index)

    def take(self, row_ids) -> np.ndarray:
        """:meth:`get` then :meth:`delete`: rows leaving the disk (promotion)."""
        out = self.get(row_ids)
        self.delete(row_ids)
        return out

    def row_ids(self) -> np.ndarray:
        """Ids of the rows stored, ascending (a copy: 8 bytes a row)."""
        return np.sort(self._index.row_ids())

    def items(self, chunk: int = 1 << 16):
        """``(ids, payloads)`` of every row, ascending by id, ``chunk`` rows at a time (reads only those)."""
        ids = self.row_ids()
        for lo in range(0, len(ids), chunk):
            part = ids[lo:lo + chunk]
            yield part, self.get(part)

    def compact(self, ratio: float | None = None) -> int:
        """Rewrite the live records of sealed segments whose garbage share passes ``ratio`` (default the store's),
        then retire them; returns how many segments were compacted."""
        ratio = self.compact_ratio if ratio is None else ratio
        self._settle()
        done = 0
        for slot in self._sealed():
            if 1.0 - self._live[slot] / self.segment_rows >= ratio:
                self._compact_segment(slot)
                done += 1
        return self._compacted(done)

    def compact_store(self, ratio: float | None = None, limit: int = COMPACT_LIMIT) -> int:
        """Amortized compaction (what the disk tier runs at round ends): compact the sealed segment with the fewest
        live records (ties: the lowest slot) while the garbage of the whole store (records written that are not
        live, active segment included) passes ``ratio`` (default the store's) of its records written, or while
        that segment is at least ``CHEAP_GARBAGE`` garbage (it rewrites at most one record per record it frees); at
        most ``limit`` segments a call; returns how many. The emptiest segment frees the most per record rewritten,
        so under skewed promotions (hot rows leave the recent segments) this rewrites far fewer records per record
        freed than :meth:`compact`'s per-segment threshold; the disk stays within ``1 / (1 - ratio)`` of the live
        records, plus the active segment (and what ``limit`` defers to the next call)."""
        ratio = self.compact_ratio if ratio is None else ratio
        self._settle()
        done = 0
        while done < limit:
            sealed = self._sealed()
            if not sealed:
                break
            slot = sealed[int(np.argmin(self._live[sealed]))]      # argmin: the first (lowest slot) of ties
            written = sum(self._fill.values())
            garbage = 1.0 - self._live[slot] / self.segment_rows
            if garbage <= 0.0 or (written - len(self) <= ratio * written and garbage < max(ratio, CHEAP_GARBAGE)):
                break
            self._compact_segment(slot)
            done += 1
        return self._compacted(done)

    def _sealed(self) -> list[int]:
        return [slot for slot in sorted(self._names)
                if slot != self._active and self._fill[slot] == self.segment_rows]

    def _compacted(self, done: int) -> int:
        if done:
            self.counters["compactions"] += 1
            self.counters["segments_compacted"] += done
        return done

    def _compact_segment(self, slot: int) -> None:
        """Append the live records of a sealed segment anew, then retire it. Its records are read in one call; only
        the live ones are checked (every one the index places there must be there, id and contents: else a
        SegmentError), garbage is never looked at twice. A segment with no live record is retired unread."""
        if self._live[slot]:
            records = self._read_segment(slot)
            index = self._index.lookup(records["id"])
            here = np.arange(len(records), dtype=np.uint32) | np.uint32(slot << self._shift)
            found = np.flatnonzero(index >= 0)
            offsets = found[self._locations(index[found]) == here[found]]
            if len(offsets) != self._live[slot]:
                raise SegmentError(f"segment {self.path / self._names[slot]} is damaged: {len(offsets)} of its "
                                   f"{int(self._live[slot])} live records carry the id the index has for them")
            live = pick(records, offsets)
            del records
            self._verify_records(slot, live, offsets)
            self._append(live)
        assert self._live[slot] == 0, "a compacted segment kept live records"
        self._retire(slot)

    def commit(self, into=None) -> None:
        """Make what is stored now durable: fsync the segments written since the last commit, then write the index
        atomically. With ``into`` (another directory on the same file system, which must not exist), the committed
        store goes there instead, its segments hard-linked (this store's own commit is unchanged)."""
        self._settle()
        try:
            live = set(self._names.values())
            for name in sorted(self._dirty & live):
                fd = os.open(self.path / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._dirty.clear()
            ids, locs = self._index_items()
            meta = {"next_number": self._next_number, "active": self._active,
                    "segments": [[slot, self._names[slot], self._fill[slot]] for slot in sorted(self._names)]}
            target = self.path if into is None else Path(into)
            if into is not None:
                target.mkdir(parents=True)
                for name in [self._names[s] for s in sorted(self._names)] + ["store.json"]:
                    link_or_copy(self.path / name, target / name)
            self._atomic(target / "index.npz", lambda f: np.savez(
                f, ids=ids, locs=locs, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8)))
            if into is None:
                self._committed = set(self._names.values())
                for name in self._retired:
                    (self.path / name).unlink(missing_ok=True)
                self._retired = []
        except OSError as exc:
            raise DiskError(exc.errno, f"disk tier {self.path}: commit failed: {exc.strerror or exc}") from exc

    def verify(self) -> None:
        """Check every committed record of every segment (SegmentError naming the first damaged one)."""
        ids, locs = self._index_items()
        if not len(ids):
            return
        slots = (locs >> np.uint32(self._shift)).astype(np.int64)
        for slot in np.unique(slots):
            mine = np.flatnonzero(slots == slot)
            for lo in range(0, len(mine), 1 << 16):
                part = mine[lo:lo + (1 << 16)]
                self._read(ids[part], locs[part])

    def close(self) -> None:
        futures.wait([write[3] for write in self._writes])      # (their errors, if any, were the caller's to see)
        self._writes = []
        for fd in list(self._fds.values()) + list(self._wfds.values()):
            os.close(fd)
        self._fd_at = np.zeros(0, np.int32)
        self._fds.clear()
        self._wfds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    # -- sizes and stats

    def index_nbytes(self) -> int:
        """Memory the index takes (exact: ids, locations, hash buckets), plus, once it is within
        ``INDEX_RESERVE`` of its next rehash, the buckets that rehash adds: a memory budget counting this makes
        room for the larger table before it is built (the old one goes first: lean_rehash), so the rehash of a
        large index never takes the process past its accounted bytes."""
        if isinstance(self._index, DenseIndex):
            return self._index.nbytes()
        n, buckets = len(self._index), self._index.buckets
        extra = buckets * self._index._index._table.itemsize if n >= INDEX_RESERVE * INDEX_LOAD * buckets else 0
        return self._index.nbytes() + extra

    def index_row_nbytes(self) -> int:
        """Index bytes one row adds (the buckets aside)."""
        return self._index.row_nbytes

    def disk_bytes(self) -> int:
        """Bytes of the segment files (fixed size each)."""
        return len(self._names) * self.segment_rows * self.record_bytes

    def stats(self) -> dict:
        return {"rows": len(self), "segments": len(self._names), "disk_bytes": self.disk_bytes(),
                "index_bytes": self.index_nbytes(), "garbage_records": int(sum(self._fill.values()) - len(self)),
                **self.counters}

    # -- internals

    def _locations(self, index: np.ndarray) -> np.ndarray:
        return self._index.arrays()[0][index, 0]

    def _new_index(self, capacity: int = 0) -> RowTable | DenseIndex:
        if self.rows is not None:
            return DenseIndex(*self.rows)
        if capacity:
            return RowTable(1, np.uint32, initial_capacity=capacity, max_load=INDEX_LOAD, lean_rehash=True)
        return RowTable(1, np.uint32, max_load=INDEX_LOAD, lean_rehash=True)

    def _index_place(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Index slots for ``ids`` (unique), made where missing (their locations for the caller to set), and a mask
        of those that were there already (one probe)."""
        if isinstance(self._index, DenseIndex):
            return self._index.place(ids)
        before = len(self._index)      # the rows it had are those at older slots
        index = self._index.ensure(ids, lambda new: np.zeros((len(new), 1), np.uint32))
        return index, index < before

    def _index_items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, locations) of every row stored (views of the hash index's own arrays, by slot: never copied)."""
        if isinstance(self._index, DenseIndex):
            return self._index.items()
        n = len(self._index)
        return self._index.row_ids_view(), self._index.arrays()[0][:n, 0]

    def _fd(self, slot: int) -> int:
        fd = self._fds.get(slot)
        if fd is None:
            file = self.path / self._names[slot]
            try:
                try:    # no access-time update a read (with relatime, one after every write to the file)
                    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
                except PermissionError:                 # O_NOATIME: only the file's owner may ask
                    fd = os.open(file, os.O_RDONLY)
            except OSError as exc:
                raise SegmentError(f"segment {file} cannot be read: {exc}") from None
            self._fds[slot] = fd
        return fd

    def _wfd(self, slot: int) -> int:
        fd = self._wfds.get(slot)
        if fd is None:
            fd = self._wfds[slot] = os.open(self.path / self._names[slot], os.O_WRONLY)
        return fd

    def _checks(self, records: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """The check of each record at its location (compiled: kernels.record_checks; :meth:`_checks_numpy` is
        the same function in numpy)."""
        records = np.ascontiguousarray(records)
        return kernels.record_checks(records.view(np.uint32).reshape(len(records), self._words), self._mult, locs)

    def _checks_numpy(self, records: np.ndarray, locs: np.ndarray) -> np.ndarray:
        words = np.ascontiguousarray(records).view(np.uint32).reshape(len(records), self._words).astype(np.uint64)
        total = (words * self._mult).sum(axis=1, dtype=np.uint64)
        total ^= (locs.astype(np.uint64) + np.uint64(1)) * _SALT
        total ^= total >> np.uint64(29)
        total *= np.uint64(0xBF58476D1CE4E5B9)
        total ^= total >> np.uint64(32)
        return (total & np.uint64(0xFFFFFFFF)).astype(np.uint32)

    def _verify_records(self, slot: int, records: np.ndarray, offsets: np.ndarray) -> None:
        locs = offsets.astype(np.uint32) | np.uint32(slot << self._shift)
        bad = self._checks(records, locs) != records["check"]
        if bad.any():
            self._refuse(slot, offsets[bad])

    def _refuse(self, slot: int, bad_offsets: np.ndarray) -> None:
        raise SegmentError(f"segment {self.path / self._names[slot]} is damaged: record {int(bad_offsets[0])} (and "
                           f"{len(bad_offsets) - 1} more of those read) fails its check")

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
        """:meth:`_read_ordered` started (:meth:`_start_pread`, each part checked on its thread); the function
        returned waits for it and refuses a damaged record."""
        order = np.argsort(locs, kind="stable")              # by segment slot, then offset
        at = locs[order]
        slots = (at >> np.uint32(self._shift)).astype(np.int64)
        offsets = (at & np.uint32(self.segment_rows - 1)).astype(np.int64)
        wait = self._start_pread(slots, offsets, at, ids[order])

        def finish() -> tuple[np.ndarray, np.ndarray]:
            got, bad = wait()
            if len(bad):
                slot = int(slots[bad].min())
                self._refuse(slot, offsets[bad][slots[bad] == slot])
            self.counters["records_read"] += len(ids)
            return order, got

        return finish

    def _read_segment(self, slot: int) -> np.ndarray:
        """All records written to a segment, in one read (straight into the array returned)."""
        out = np.empty(self._fill[slot], self.record_dtype)
        file = self.path / self._names[slot]
        data, got = out.view(np.uint8), 0
        try:
            while got < len(data):
                n = os.preadv(self._fd(slot), [data[got:].data], got)
                if n <= 0:
                    break
                got += n
        except OSError as exc:
            raise DiskError(exc.errno, f"disk tier {self.path}: reading {file.name} failed: {exc}") from exc
        if got != out.nbytes:
            raise SegmentError(f"segment {file} is damaged: it ends before record {got // self.record_bytes}")
        return out

    def _start_pread(self, slots: np.ndarray, offsets: np.ndarray, locs: np.ndarray, ids: np.ndarray) -> Callable:
        """The records of ``ids`` at (slot, offset) pairs ``locs`` in file order (sorted by slot, then offset:
        adjacent records are one read), straight into the array the function returned gives, with the positions
        of those whose check or id is wrong. A batch of at least ``READ_AHEAD`` records is read and checked on the
        pool's threads (the C loops release the GIL), in ``READ_PARTS`` parts through their io_urings (one each,
        kept), or up to ``READ_THREADS`` parts with pread; a smaller one at once. A failed read: SegmentError or
        DiskError naming the segment. A read waits first for the writes still under way that hold any of its
        records (:meth:`_settle`)."""
        got = np.empty(len(slots), self.record_dtype)
        if not len(slots):
            return lambda: (got, np.zeros(0, np.int64))
        self._settle(slots, offsets)
        fds, where = self._fds_of(slots), offsets * self.record_bytes
        ring = READ_RING and _uring()
        parts = max(1, min(READ_PARTS if ring else READ_THREADS, len(slots) // READ_SPLIT))

        def read(i: int) -> tuple[int, int, np.ndarray]:
            lo, hi = len(slots) * i // parts, len(slots) * (i + 1) // parts
            err, row = kernels.pread_records(fds[lo:hi], where[lo:hi], self.record_bytes, got[lo:hi], ring)
            if err:
                return err, row + lo, np.zeros(0, np.int64)
            part = got[lo:hi]
            bad = (self._checks(part, locs[lo:hi]) != part["check"]) | (part["id"] != ids[lo:hi])
            return 0, -1, np.flatnonzero(bad) + lo

        if len(slots) >= READ_AHEAD:
            futures = [_pool().submit(read, i) for i in range(parts)]
            results = None
        else:
            results = [read(0)]

        def wait() -> tuple[np.ndarray, np.ndarray]:
            bad = []
            for err, row, wrong in results if results is not None else [f.result() for f in futures]:
                if err:
                    slot = int(slots[row])
                    file = self.path / self._names[slot]
                    if err < 0:
                        raise SegmentError(f"segment {file} is damaged: it ends before record {int(offsets[row])}")
                    raise DiskError(err, f"disk tier {self.path}: reading {file.name} failed: {os.strerror(err)}")
                bad.append(wrong)
            return got, np.concatenate(bad)

        return wait

    def _fds_of(self, slots: np.ndarray) -> np.ndarray:
        """The read-only file descriptor of each segment slot in ``slots`` (int32), opening those not open yet."""
        top = int(slots.max()) + 1
        if len(self._fd_at) < top:
            self._fd_at = np.concatenate([self._fd_at, np.full(top - len(self._fd_at), -1, np.int32)])
        fds = self._fd_at[slots]
        if (fds < 0).any():
            for slot in np.unique(slots[fds < 0]):
                self._fd_at[slot] = self._fd(int(slot))
            fds = self._fd_at[slots]
        return fds

    def _new_segment(self) -> int:
        free = np.flatnonzero(np.isin(np.arange(len(self._live) + 1), list(self._names), invert=True))
        slot = int(free[0])
        if slot >= self.max_slots:
            raise DiskError(0, f"disk tier {self.path}: {self.max_slots} segments in use, no room for more")
        name = f"seg-{self._next_number:06d}.dat"
        file = self.path / name
        fd = -1
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.segment_rows * self.record_bytes)
            finally:
                os.close(fd)
        except OSError as exc:
            if fd >= 0:
                file.unlink(missing_ok=True)
            raise DiskError(exc.errno, f"disk tier {self.path}: cannot create a segment of "
                                       f"{self.segment_rows * self.record_bytes} bytes: "
                                       f"{exc.strerror or exc}") from exc
        self._next_number += 1
        if slot >= len(self._live):
            self._live = np.concatenate([self._live, np.zeros(slot + 1 - len(self._live), np.int64)])
        self._names[slot], self._fill[slot], self._live[slot] = name, 0, 0
        return slot

    def _append(self, records: np.ndarray, later: bool = False) -> None:
        """Write ``records`` (ids unique, checks unset) at the end of the log and point the index at them. Nothing
        is indexed unless every record was written, or with ``later`` (the records handed over: put_records), its
        segment space reserved and its write handed to the writer thread."""
        ids = records["id"]
        if isinstance(self._index, DenseIndex):
            self._index.check(ids)          # before anything is written
        locs = np.empty(len(records), np.uint32)
        placed = 0
        created: list[int] = []
        try:
            while placed < len(records):
                if self._active is None or self._fill[self._active] == self.segment_rows:
                    self._active = self._new_segment()
                    created.append(self._active)
                slot = self._active
                start = self._fill[slot]
                n = min(self.segment_rows - start, len(records) - placed)
                part = records[placed:placed + n]
                offsets = np.arange(start, start + n, dtype=np.uint32)
                locs[placed:placed + n] = offsets | np.uint32(slot << self._shift)
                self._pwrite(slot, part, start, locs[placed:placed + n], later)
                self._fill[slot] = start + n
                self._dirty.add(self._names[slot])
                placed += n
        except OSError as exc:
            # the records written stay unreferenced garbage (their segments' fill moved on); nothing is indexed
            if not isinstance(exc, DiskError):
                raise DiskError(exc.errno, f"disk tier {self.path}: write failed: {exc.strerror or exc}") from exc
            raise
        index, old = self._index_place(ids)
        if old.any():
            self._live -= np.bincount((self._locations(index[old]) >> np.uint32(self._shift)).astype(np.int64),
                                      minlength=len(self._live))
        self._index.arrays()[0][index, 0] = locs
        self.version += 1
        self._live += np.bincount((locs >> np.uint32(self._shift)).astype(np.int64), minlength=len(self._live))
        self.counters["records_written"] += len(records)

    def _pwrite(self, slot: int, records: np.ndarray, start: int, locs: np.ndarray, later: bool = False) -> None:
        """Seal ``records`` for their locations ``locs`` (the check word, after the 8-byte id) and write them at
        record ``start`` of segment ``slot``; with ``later`` both on the writer thread (see _settle)."""
        file = self.path / self._names[slot]
        if not later:
            self._seal_and_write(file, records, start, locs)
            return
        future = _writer().submit(self._seal_and_write, file, records, start, locs)
        self._writes.append((slot, start, start + len(records), future))

    def _seal_and_write(self, file: Path, records: np.ndarray, start: int, locs: np.ndarray) -> None:
        kernels.record_seal(records.view(np.uint32).reshape(len(records), self._words), self._mult, locs, 2)
        _pwrite_file(file, records, start * self.record_bytes)

    def _settle(self, slots: np.ndarray | None = None, offsets: np.ndarray | None = None) -> None:
        """Wait for the writes under way (put_records with handoff) that hold a record at one of the (slot, offset)
        pairs given, or for all of them. Everything that reads or changes the files written calls this first:
        reads wait for their own records only, the rest for all. A failed write is a DiskError, here and at every
        later call (the store is not what its index says any more: the disk tier stops the server on it)."""
        if self._write_error is not None:
            raise self._write_error
        waiting = []
        for write in self._writes:
            slot, first, end, future = write
            if future.done() or slots is None or \
                    np.any((slots == slot) & (offsets >= first) & (offsets < end)):
                try:
                    future.result()
                except OSError as exc:
                    self._write_error = DiskError(exc.errno, f"disk tier {self.path}: write failed: "
                                                             f"{exc.strerror or exc}")
                    raise self._write_error from exc
            else:
                waiting.append(write)
        self._writes = waiting

    def _drop(self, index: np.ndarray) -> None:
        locs = self._locations(index)
        self._live -= np.bincount((locs >> np.uint32(self._shift)).astype(np.int64), minlength=len(self._live))
        self._index.remove_slots(index)
        self.version += 1

    def _retire(self, slot: int) -> None:
        self._settle()
        if slot < len(self._fd_at):
            self._fd_at[slot] = -1
        for fds in (self._fds, self._wfds):
            fd = fds.pop(slot, None)
            if fd is not None:
                os.close(fd)
        name = self._names.pop(slot)
        if name in self._committed:
            self._retired.append(name)       # this directory's committed index refers to it: until the next commit
        else:
            (self.path / name).unlink(missing_ok=True)     # (a snapshot holding it has a link of its own)
        del self._fill[slot]
        if self._active == slot:
            self._active = None

    def _atomic(self, target: Path, data) -> None:
        """Write ``target`` atomically: ``data`` (bytes, or a function writing to the open file)."""
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data) if isinstance(data, bytes) else data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_path(target.parent)


def _pwrite_file(file: Path, records: np.ndarray, offset: int) -> None:
    """``records``' bytes at ``offset`` of ``file`` (opened for this write alone)."""
    data = records.view(np.uint8).data
    fd = os.open(file, os.O_WRONLY)
    try:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
    finally:
        os.close(fd)


class Take:
    """The records of a batch of rows being read (:meth:`SegmentStore.begin_take`): ``present``, a mask of the ids
    stored, at once; :meth:`records` waits for the read and checks it (once); :meth:`drop` deletes the rows read
    from the index, before or after the read (which does not look at the index)."""

    def __init__(self, store: SegmentStore, present: np.ndarray, index: np.ndarray,
                 finish: Callable[[], tuple[np.ndarray, np.ndarray]] | None) -> None:
        self.store, self.present, self._index, self._finish = store, present, index, finish
        self._order: np.ndarray | None = None

    def records(self) -> tuple[np.ndarray, np.ndarray]:
        """``(order, records)``: ``records[j]`` (checked, in file order) the record of the row
        ``row_ids[present][order[j]]``."""
        if self._finish is None:
            self._order = np.zeros(0, np.int64)
            return self._order, np.zeros(0, self.store.record_dtype)
        self._order, records = self._finish()
        self._finish = None
        return self._order, records

    def drop(self, which: np.ndarray | None = None) -> None:
        """Delete the rows read (with ``which``, a mask over the records, after :meth:`records`: those only)."""
        gone = self._index if which is None else self._index[self._order[which]]
        if len(gone):
            self.store._drop(gone)


def pick(records: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``records[index]`` (an index array or a mask) for structured records, as bytes: numpy copies a structured
    dtype with subarray fields field by field, several times slower than one opaque copy of each record."""
    raw = np.dtype((np.void, records.dtype.itemsize))
    return records.view(raw)[index].view(records.dtype)


def put_at(out: np.ndarray, index: np.ndarray, records: np.ndarray) -> None:
    """``out[index] = records`` for structured records, as bytes (see :func:`pick`)."""
    raw = np.dtype((np.void, out.dtype.itemsize))
    out.view(raw)[index] = records.view(raw)


def join(parts: list) -> np.ndarray:
    """np.concatenate of structured records of one dtype, as bytes (see :func:`pick`)."""
    dtype = parts[0].dtype
    raw = np.dtype((np.void, dtype.itemsize))
    return np.concatenate([p.view(raw) for p in parts]).view(dtype)


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link (segments are never rewritten below a committed fill), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(source, target)
