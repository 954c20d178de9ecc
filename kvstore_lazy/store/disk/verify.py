"""Verification: every committed record checked, and the one way a damaged record is reported.

Owns: :func:`verify` (what :meth:`SegmentStore.open` with ``verify`` runs: every record the index refers to read
and checked, and the index checked against the segments and the live bits), and :func:`refuse`, the SegmentError
that names the segment and its first damaged record. Does not own: the check word (:mod:`.layout`) or the reads
(:mod:`.reads`, which checks every batch it reads).

Two walks. A store with live bits (a RunIndex) is checked in file order: the index's ``items()`` a chunk at a time
(every location in a segment it lists, within its fill, marked live; as many rows as live records), then every
segment's live records read in pieces of adjacent records, in order, each record's check word checked at its
location; that the index maps each id to the record holding it is checked by a sum over both walks of a 64-bit
hash of each (id, location) pair (a missing, extra or moved pair changes it, but for 2^-64). A restore of 300M
hashed rows reads its 25 GB of segments once, in order, instead of a record at a time in the index's (id) order,
which is random in the files: out of the page cache, a disk read a record. A store without live bits (a dense
index: at most a quarter of the budget's worth of rows) reads the records in the index's order, a chunk at a
time, as a lookup does (an id that is not its record's is a damaged record).

A damaged, truncated or missing segment is a :class:`~.errors.SegmentError` naming the file (and the record),
never wrong values.
"""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import numpy as np

from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.files import INDEX_FILE
from kvstore_lazy.store.disk.layout import CHECK_WORD
from kvstore_lazy.store.disk.runfile import mix64
from kvstore_lazy.store.disk.state import StoreState

VERIFY_BATCH = 1 << 14          # records read and checked at a time (~5 MB at D=32: a restore's transient)
_MASK = (1 << 64) - 1
_SALT = np.uint64(0x9E3779B97F4A7C15)


def verify(store: StoreState) -> None:
    """Check every committed record of every segment (SegmentError naming the first damaged one), and the index
    against the store: every location in a segment it lists, within its fill, marked live (a store with live
    bits), as many rows as live records, each id's record the one at its location."""
    where = store.path / INDEX_FILE
    fill = np.full(max(store._fill, default=-1) + 1, -1, np.int64)      # segment slot -> records written
    for slot, written in store._fill.items():
        fill[slot] = written
    rows, pairs = 0, 0
    for ids, locs in store._index.items(VERIFY_BATCH):
        slots = (locs >> np.uint32(store._shift)).astype(np.int64)
        offsets = (locs & np.uint32(store.segment_rows - 1)).astype(np.int64)
        if len(slots) and (int(slots.max()) >= len(fill) or (offsets >= fill[slots]).any()):
            raise SegmentError(f"{where}: refers to segments it does not list, or past their fill")
        rows += len(ids)
        if store._bits is None:
            store._read_ordered(ids, locs)  # (checked in file order; not reordered: nothing keeps them)
            continue
        if not store._bits.test(locs).all():
            raise SegmentError(f"{where}: the index and the live records it lists disagree")
        pairs = (pairs + _pair_sum(ids, locs)) & _MASK
    if rows != len(store) or rows != int(store._live.sum()):
        raise SegmentError(f"{where}: {rows} rows indexed, {len(store)} counted, {int(store._live.sum())} live records")
    if store._bits is not None and _live_records_sum(store) != pairs:
        raise SegmentError(f"{where}: the index and the live records it lists disagree (an id's location does not "
                           "hold its record)")


def _pair_sum(ids: np.ndarray, locs: np.ndarray) -> int:
    """The sum (mod 2^64) of a 64-bit mix (the bloom filters' splitmix64) of each (id, location) pair: the same for
    the same set of pairs in any order or grouping."""
    pairs = np.asarray(ids, np.uint64) ^ ((np.asarray(locs, np.uint64) + np.uint64(1)) * _SALT)
    return int(mix64(pairs, 0).sum(dtype=np.uint64))


def _live_records_sum(store: StoreState) -> int:
    """Every live record of every segment read in file order, VERIFY_BATCH records' span at a time, its check word
    checked at its location (refused by name if it fails); the :func:`_pair_sum` of their (id, location) pairs."""
    assert store._bits is not None
    total = 0
    for slot in sorted(store._names):
        live = store._bits.offsets(slot) if slot < len(store._bits.bits) else np.zeros(0, np.int64)
        lo = 0
        while lo < len(live):
            first = int(live[lo])
            hi = int(np.searchsorted(live, first + VERIFY_BATCH))
            span = int(live[hi - 1]) - first + 1
            part = live[lo:hi]
            words = store._reads.segment(slot, span, first).view(np.uint32).reshape(span, store.layout.words)
            words = words[part - first]             # (rows of plain words: a gather of records is far slower)
            locs = (np.uint32(slot) << np.uint32(store._shift)) | part.astype(np.uint32)
            bad = np.flatnonzero(store.layout.checks(words, locs) != words[:, CHECK_WORD])
            if len(bad):
                refuse(store.path / store._names[slot], part[bad])
            ids = np.ascontiguousarray(words[:, :2]).view(np.uint64).reshape(-1)    # (little-endian: the id)
            total = (total + _pair_sum(ids, locs)) & _MASK
            lo = hi
    return total


def refuse(file: Path, bad_offsets: np.ndarray) -> NoReturn:
    raise SegmentError(f"segment {file} is damaged: record {int(bad_offsets[0])} (and "
                       f"{len(bad_offsets) - 1} more of those read) fails its check")
