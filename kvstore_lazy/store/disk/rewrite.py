"""Rewrites in place: records of rows stored, their payload changed, written back where they are.

Owns: :func:`rewrite` (the disk tier's rows a push updated without bringing them into memory) and the rule of
which segment may be written in place: only one no other directory links (``st_nlink`` 1). One a snapshot shares
gets its records appended anew instead (copy-on-write: the old ones garbage). A record written in place is
sealed again for its location, so a torn write is a failed check, never wrong values. Does not own: the append
(the store's) or the descriptors (:class:`~.reads.Reads` keeps the write-only ones with the read-only ones).
"""
from __future__ import annotations

import os

import numpy as np

from kvstore_lazy.store import kernels
from kvstore_lazy.store.disk.errors import DiskError
from kvstore_lazy.store.disk.index import EMPTY
from kvstore_lazy.store.disk.records import pick
from kvstore_lazy.store.disk.state import StoreState


def rewrite(store: StoreState, records: np.ndarray, in_place: bool, ring: bool) -> int:
    """:meth:`SegmentStore.rewrite`: ``in_place`` False appends them all (as for a segment a snapshot links);
    ``ring``: the writes through an io_uring. Returns how many were written in place."""
    store._writer.settle()
    locs = store._index.lookup(records["id"])
    if (locs == EMPTY).any():
        raise KeyError(f"{int((locs == EMPTY).sum())} of {len(records)} rows are not in the store {store.path}")
    slots = (locs >> np.uint32(store._shift)).astype(np.int64)
    alone = np.zeros(int(slots.max()) + 1, bool)
    for slot in np.unique(slots):
        alone[slot] = in_place and _alone(store, int(slot))
    here = alone[slots]
    if not here.all():
        store._append(pick(records, ~here), old=locs[~here])     # shared with a snapshot: copy-on-write
    if here.any():
        order = np.flatnonzero(here)
        order = order[np.argsort(locs[order], kind="stable")]   # file order: adjacent records one write
        part, at, where = pick(records, order), locs[order], slots[order]
        store.layout.seal(part, at)
        offsets = (at & np.uint32(store.segment_rows - 1)).astype(np.int64) * store.record_bytes
        fd_of = np.full(len(alone), -1, np.int32)
        for slot in np.unique(where):
            fd_of[slot] = store._reads.wfd(int(slot))
            store._dirty.add(store._names[int(slot)])
        err, row = kernels.pwrite_records(fd_of[where], offsets, store.record_bytes, part, ring)
        if err:
            raise DiskError(err, f"disk tier {store.path}: writing {store._names[int(where[row])]} in place "
                                 f"failed: {os.strerror(err)}")
        store.version += 1
        store.counters["records_rewritten"] += len(part)
    return int(here.sum())


def _alone(store: StoreState, slot: int) -> bool:
    """Whether a segment may be written in place: only this directory links it (no snapshot holds it)."""
    try:
        return os.fstat(store._reads.wfd(slot)).st_nlink == 1
    except OSError as exc:
        raise DiskError(exc.errno, f"disk tier {store.path}: {store._names[slot]}: {exc.strerror or exc}") from exc

