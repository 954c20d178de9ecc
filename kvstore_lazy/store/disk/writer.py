"""The writer thread: records handed over by ``put_records(handoff=True)`` (the disk tier's demotions), written
while the caller goes on.

Owns: the writes under way (segment slot, first and end record, future), sealing and writing a batch of records
(at once, or on the one writer thread, in order), waiting for the writes that hold given records (:meth:`Writer.
settle`) and the sticky error: a handed-over write that failed is a :class:`~.errors.DiskError` at the next call
that waits for it (reads of its records, commit, compaction, rewrite, close) and at every later one, since the
store is not what its index says any more (the disk tier stops the server on it). Does not own: where records go
(the store picks the segment and the offset and indexes them when they are handed over) or their space (reserved
when the segment was made, so a full disk is a DiskError at the handoff, as without).
"""
from __future__ import annotations

import os
from concurrent import futures
from pathlib import Path

import numpy as np

from kvstore_lazy.store.disk.errors import DiskError
from kvstore_lazy.store.disk.layout import RecordLayout
from kvstore_lazy.store.disk.pools import executor


WRITE_AHEAD = 2         # writes handed over and under way at most: a caller handing over a stream of batches (a
                        # demotion's chunks) holds that many of them for writing, not all


def _writer() -> futures.ThreadPoolExecutor:
    """The one thread that writes the records handed over by put_records(handoff=True), in order."""
    return executor("disk-write")


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


class Writer:
    """The appends of one store (in ``path``), written at once or handed to the writer thread."""

    def __init__(self, path: Path, layout: RecordLayout) -> None:
        self.path, self.layout = path, layout
        self.writes: list[tuple] = []                       # (slot, first, end, future): writes under way
        self.error: DiskError | None = None                 # the first of them that failed (settle)

    def write(self, slot: int, file: Path, records: np.ndarray, start: int, locs: np.ndarray, later: bool) -> None:
        """Seal ``records`` for their locations ``locs`` (the check word, after the 8-byte id) and write them at
        record ``start`` of segment ``slot`` (``file``); with ``later`` both on the writer thread (see settle),
        once at most WRITE_AHEAD - 1 other writes are under way."""
        if not later:
            self.seal_and_write(file, records, start, locs)
            return
        future = _writer().submit(self.seal_and_write, file, records, start, locs)
        self.writes.append((slot, start, start + len(records), future))
        self.wait_until(WRITE_AHEAD)

    def seal_and_write(self, file: Path, records: np.ndarray, start: int, locs: np.ndarray) -> None:
        self.layout.seal(records, locs)
        _pwrite_file(file, records, start * self.layout.record_bytes)

    def settle(self, slots: np.ndarray | None = None, offsets: np.ndarray | None = None) -> None:
        """Wait for the writes under way (put_records with handoff) that hold a record at one of the (slot, offset)
        pairs given, or for all of them. Everything that reads or changes the files written calls this first:
        reads wait for their own records only, the rest for all. A failed write is a DiskError, here and at every
        later call (the store is not what its index says any more: the disk tier stops the server on it)."""
        if self.error is not None:
            raise self.error
        waiting = []
        for write in self.writes:
            slot, first, end, future = write
            if future.done() or slots is None or \
                    np.any((slots == slot) & (offsets >= first) & (offsets < end)):
                try:
                    future.result()
                except OSError as exc:
                    self.error = DiskError(exc.errno, f"disk tier {self.path}: write failed: "
                                                      f"{exc.strerror or exc}")
                    raise self.error from exc
            else:
                waiting.append(write)
        self.writes[:] = waiting                # (in place: the store's _writes is this list)

    def wait_until(self, pending: int) -> None:
        """Wait for the oldest writes under way until at most ``pending`` are (a caller handing over records in a
        stream bounds the records held for writing so); a failed one is a DiskError as in :meth:`settle`."""
        if self.error is not None:
            raise self.error
        while len(self.writes) > pending:
            try:
                self.writes[0][3].result()
            except OSError as exc:
                self.error = DiskError(exc.errno, f"disk tier {self.path}: write failed: {exc.strerror or exc}")
                raise self.error from exc
            del self.writes[0]

    def wait(self) -> None:
        """Wait for every write under way; their errors, if any, were the caller's to see (close)."""
        futures.wait([write[3] for write in self.writes])
        self.writes.clear()
