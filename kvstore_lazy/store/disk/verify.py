"""Verification: every committed record checked, and the one way a damaged record is reported.

Owns: :func:`verify` (every record the index refers to, read and checked, walking the index's ``items()`` a chunk
at a time, and the index checked against the segments and the live bits: what :meth:`SegmentStore.open` with
``verify`` runs), and :func:`refuse`, the SegmentError that names
the segment and its first damaged record. Does not own: the check word (:mod:`.layout`) or the reads
(:mod:`.reads`, which checks every batch it reads).

A damaged, truncated or missing segment is a :class:`~.errors.SegmentError` naming the file (and the record),
never wrong values.
"""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import numpy as np

from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.files import INDEX_FILE
from kvstore_lazy.store.disk.state import StoreState

VERIFY_BATCH = 1 << 14          # records read and checked at a time (~5 MB at D=32: a restore's transient)
LIVE_BATCH = 1 << 18            # locations tested against the live bits at a time (~6 MB of sort temporaries):
                                # a test takes a step a segment it touches, and a batch of hashed ids touches all


def verify(store: StoreState) -> None:
    """Check every committed record of every segment (SegmentError naming the first damaged one), and the index
    against the store: every location in a segment it lists, within its fill, marked live (a store with live
    bits), as many rows as live records."""
    rows = 0
    fill = np.full(max(store._fill, default=-1) + 1, -1, np.int64)      # segment slot -> records written
    for slot, written in store._fill.items():
        fill[slot] = written
    held: list[np.ndarray] = []
    for ids, locs in store._index.items(VERIFY_BATCH):
        slots = (locs >> np.uint32(store._shift)).astype(np.int64)
        offsets = (locs & np.uint32(store.segment_rows - 1)).astype(np.int64)
        if len(slots) and (int(slots.max()) >= len(fill) or (offsets >= fill[slots]).any()):
            raise SegmentError(f"{store.path / INDEX_FILE}: refers to segments it does not list, or past their fill")
        if store._bits is not None:
            held.append(locs)
            if sum(map(len, held)) >= LIVE_BATCH:
                _check_live(store, held)
                held = []
        rows += len(ids)
        store._read_ordered(ids, locs)      # (checked in file order; not reordered: nothing keeps them)
    _check_live(store, held)
    if rows != len(store) or rows != int(store._live.sum()):
        raise SegmentError(f"{store.path / INDEX_FILE}: {rows} rows indexed, {len(store)} counted, "
                           f"{int(store._live.sum())} live records")


def _check_live(store: StoreState, held: list[np.ndarray]) -> None:
    if held and store._bits is not None and not store._bits.test(np.concatenate(held)).all():
        raise SegmentError(f"{store.path / INDEX_FILE}: the index and the live records it lists disagree")


def refuse(file: Path, bad_offsets: np.ndarray) -> NoReturn:
    raise SegmentError(f"segment {file} is damaged: record {int(bad_offsets[0])} (and "
                       f"{len(bad_offsets) - 1} more of those read) fails its check")
