"""Verification: every committed record checked, and the one way a damaged record is reported.

Owns: :func:`verify` (every record the index refers to, read and checked: what :meth:`SegmentStore.open` with
``verify`` runs), the check of records read whole (compaction), and :func:`refuse`, the SegmentError that names
the segment and its first damaged record. Does not own: the check word (:mod:`.layout`) or the reads
(:mod:`.reads`, which checks every batch it reads).

A damaged, truncated or missing segment is a :class:`~.errors.SegmentError` naming the file (and the record),
never wrong values.
"""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import numpy as np

from kvstore_lazy.store.disk import index as disk_index
from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.state import StoreState

VERIFY_BATCH = 1 << 16          # records of one segment read and checked at a time


def verify(store: StoreState) -> None:
    """Check every committed record of every segment (SegmentError naming the first damaged one)."""
    ids, locs = disk_index.items(store._index)
    if not len(ids):
        return
    slots = (locs >> np.uint32(store._shift)).astype(np.int64)
    for slot in np.unique(slots):
        mine = np.flatnonzero(slots == slot)
        for lo in range(0, len(mine), VERIFY_BATCH):
            part = mine[lo:lo + VERIFY_BATCH]
            store._read(ids[part], locs[part])


def verify_records(store: StoreState, slot: int, records: np.ndarray, offsets: np.ndarray) -> None:
    """Refuse records read from segment ``slot`` at ``offsets`` if any fails its check."""
    locs = offsets.astype(np.uint32) | np.uint32(slot << store._shift)
    bad = store.layout.checks(records, locs) != records["check"]
    if bad.any():
        refuse(store.path / store._names[slot], offsets[bad])


def refuse(file: Path, bad_offsets: np.ndarray) -> NoReturn:
    raise SegmentError(f"segment {file} is damaged: record {int(bad_offsets[0])} (and "
                       f"{len(bad_offsets) - 1} more of those read) fails its check")
