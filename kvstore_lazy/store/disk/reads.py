"""The read path: the segments' read file descriptors, batch reads on the read pool's threads, whole segments.

Owns: the fd cache (one read-only descriptor per segment slot, in one int32 array by slot, -1 where none is open:
the C reads take a batch's descriptors as one array; and the write-only ones of in-place rewrites), the io_uring
probe, the batch read (:meth:`Reads.start`) and its check of every record read, the read of a whole segment
(compaction), and :class:`Take`, a batch being read. Does not own: how a batch is split (the store's knobs,
``segments.READ_*``, passed in per call so a script or a test may set them there), the index, or the writes
(a read first waits for the writes under way that hold its records: the ``settle`` it is given).

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

import os
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Protocol

import numpy as np

from kvstore_lazy.store import kernels
from kvstore_lazy.store.disk.errors import DiskError, SegmentError
from kvstore_lazy.store.disk.layout import RecordLayout

_RING: list = []


def uring() -> bool:
    """kernels.uring_available(), asked once per process (it sets up and tears down a ring)."""
    if not _RING:
        _RING.append(kernels.uring_available())
    return _RING[0]


class Reads:
    """The reads of one store's segments (in ``path``; ``names``: segment slot -> file name, the store's own dict)."""

    def __init__(self, path: Path, layout: RecordLayout, names: dict[int, str],
                 settle: Callable[[np.ndarray, np.ndarray], None]) -> None:
        self.path, self.layout, self._names, self._settle = path, layout, names, settle
        self._fd_at = np.zeros(0, np.int32)                 # segment slot -> read-only descriptor, -1 where none
        self._wfds: dict[int, int] = {}                     # segment slot -> one for writes in place (rewrite)

    # -- the fd cache

    def fd(self, slot: int) -> int:
        """The read-only file descriptor of segment ``slot``, opened on first use."""
        if slot < len(self._fd_at) and self._fd_at[slot] >= 0:
            return int(self._fd_at[slot])
        self._grow(slot + 1)
        fd = self._fd_at[slot] = self._open(slot)
        return fd

    def fds_of(self, slots: np.ndarray) -> np.ndarray:
        """The read-only file descriptor of each segment slot in ``slots`` (int32), opening those not open yet."""
        self._grow(int(slots.max()) + 1)
        fds = self._fd_at[slots]
        if (fds < 0).any():
            for slot in np.unique(slots[fds < 0]):
                self._fd_at[slot] = self._open(int(slot))
            fds = self._fd_at[slots]
        return fds

    def wfd(self, slot: int) -> int:
        """A write-only file descriptor of segment ``slot`` (rewrite), opened on first use."""
        fd = self._wfds.get(slot)
        if fd is None:
            fd = self._wfds[slot] = os.open(self.path / self._names[slot], os.O_WRONLY)
        return fd

    def forget(self, slot: int) -> None:
        """Close the descriptors of a segment being retired."""
        fds = [self._wfds.pop(slot, -1)]
        if slot < len(self._fd_at):
            fds.append(int(self._fd_at[slot]))
            self._fd_at[slot] = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        for fd in [int(fd) for fd in self._fd_at[self._fd_at >= 0]] + list(self._wfds.values()):
            os.close(fd)
        self._fd_at = np.zeros(0, np.int32)
        self._wfds.clear()

    def _grow(self, top: int) -> None:
        if len(self._fd_at) < top:
            self._fd_at = np.concatenate([self._fd_at, np.full(top - len(self._fd_at), -1, np.int32)])

    def _open(self, slot: int) -> int:
        file = self.path / self._names[slot]
        try:
            try:    # no access-time update a read (with relatime, one after every write to the file)
                return os.open(file, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
            except PermissionError:                 # O_NOATIME: only the file's owner may ask
                return os.open(file, os.O_RDONLY)
        except OSError as exc:
            raise SegmentError(f"segment {file} cannot be read: {exc}") from None

    # -- reads

    def start(self, slots: np.ndarray, offsets: np.ndarray, locs: np.ndarray, ids: np.ndarray, ring: bool,
              parts: int, pool: futures.ThreadPoolExecutor | None) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """The records of ``ids`` at (slot, offset) pairs ``locs`` in file order (sorted by slot, then offset:
        adjacent records are one read), straight into the array the function returned gives, with the positions
        of those whose check or id is wrong. With a ``pool`` (a batch of at least ``READ_AHEAD`` records) they are
        read and checked on the pool's threads (the C loops release the GIL), in ``parts`` parts through their
        io_urings (with ``ring``: one each, kept) or with pread; without, at once. A failed read: SegmentError or
        DiskError naming the segment. A read waits first for the writes still under way that hold any of its
        records (``settle``)."""
        got = np.empty(len(slots), self.layout.record_dtype)
        if not len(slots):
            return lambda: (got, np.zeros(0, np.int64))
        self._settle(slots, offsets)
        record_bytes, checks = self.layout.record_bytes, self.layout.checks
        fds, where = self.fds_of(slots), offsets * record_bytes

        def read(i: int) -> tuple[int, int, np.ndarray]:
            lo, hi = len(slots) * i // parts, len(slots) * (i + 1) // parts
            err, row = kernels.pread_records(fds[lo:hi], where[lo:hi], record_bytes, got[lo:hi], ring)
            if err:
                return err, row + lo, np.zeros(0, np.int64)
            part = got[lo:hi]
            bad = (checks(part, locs[lo:hi]) != part["check"]) | (part["id"] != ids[lo:hi])
            return 0, -1, np.flatnonzero(bad) + lo

        if pool is not None:
            running = [pool.submit(read, i) for i in range(parts)]
            results = None
        else:
            results = [read(0)]

        def wait() -> tuple[np.ndarray, np.ndarray]:
            bad = []
            for err, row, wrong in results if results is not None else [f.result() for f in running]:
                if err:
                    slot = int(slots[row])
                    file = self.path / self._names[slot]
                    if err < 0:
                        raise SegmentError(f"segment {file} is damaged: it ends before record {int(offsets[row])}")
                    raise DiskError(err, f"disk tier {self.path}: reading {file.name} failed: {os.strerror(err)}")
                bad.append(wrong)
            return got, np.concatenate(bad)

        return wait

    def segment(self, slot: int, count: int, first: int = 0) -> np.ndarray:
        """``count`` records of a segment (all written) from record ``first`` on, in one read (straight into the
        array returned)."""
        out = np.empty(count, self.layout.record_dtype)
        file = self.path / self._names[slot]
        data, got, at = out.view(np.uint8), 0, first * self.layout.record_bytes
        try:
            while got < len(data):
                n = os.preadv(self.fd(slot), [data[got:].data], at + got)
                if n <= 0:
                    break
                got += n
        except OSError as exc:
            raise DiskError(exc.errno, f"disk tier {self.path}: reading {file.name} failed: {exc}") from exc
        if got != out.nbytes:
            raise SegmentError(f"segment {file} is damaged: it ends before record "
                               f"{first + got // self.layout.record_bytes}")
        return out


class _Taken(Protocol):
    """What a Take needs of its store (the SegmentStore; a Protocol so that this unit does not import it)."""

    record_dtype: np.dtype

    def _drop(self, ids: np.ndarray, locs: np.ndarray) -> None: ...


class Take:
    """The records of a batch of rows being read (:meth:`SegmentStore.begin_take`): ``present``, a mask of the ids
    stored, at once; :meth:`records` waits for the read and checks it (once); :meth:`drop` deletes the rows read
    from the index, before or after the read (which does not look at the index), their locations known (no
    second lookup)."""

    def __init__(self, store: _Taken, present: np.ndarray, ids: np.ndarray, locs: np.ndarray,
                 finish: Callable[[], tuple[np.ndarray, np.ndarray]] | None) -> None:
        self.store, self.present, self._ids, self._locs, self._finish = store, present, ids, locs, finish
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

    def locs(self) -> np.ndarray:
        """The locations of the records :meth:`records` gave, in their order (after it)."""
        assert self._order is not None
        return self._locs[self._order]

    def drop(self, which: np.ndarray | None = None) -> None:
        """Delete the rows read (with ``which``, a mask over the records, after :meth:`records`: those only)."""
        if which is None:
            ids, locs = self._ids, self._locs
        else:
            at = self._order[which]
            ids, locs = self._ids[at], self._locs[at]
        if len(ids):
            self.store._drop(ids, locs)
