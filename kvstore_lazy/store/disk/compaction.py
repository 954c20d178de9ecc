"""Compaction: the live records of sealed segments appended anew, the segments then retired.

Owns: which sealed segments are compacted and when (:func:`compact`: every one whose own garbage passes a ratio;
:func:`compact_store`: the emptiest first, amortized, the disk tier's at round ends) and the compaction of one
segment. Does not own: the log it works on. These are operations of a
:class:`~kvstore_lazy.store.segments.SegmentStore` kept in their own unit: they read the store's fill and live
counts by segment slot, its live bits (a store with a RunIndex) or its index (a dense one), and change it only
through the store's own append and retire.

Records are only ever appended to the *active* segment; a full segment is *sealed* and never written again
(rewrites in place aside). A row written again gets a new record; the old one becomes garbage. A segment a
compaction emptied is deleted at once, unless the directory's committed index refers to it (then at the next
commit).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.store.disk.errors import SegmentError
from kvstore_lazy.store.disk.records import pick
from kvstore_lazy.store.disk.state import StoreState
from kvstore_lazy.store.disk.verify import refuse


def sealed(store: StoreState) -> list[int]:
    """The slots of the sealed segments (full, not the active one), ascending."""
    return [slot for slot in sorted(store._names)
            if slot != store._active and store._fill[slot] == store.segment_rows]


def compact(store: StoreState, ratio: float) -> int:
    """Compact every sealed segment whose garbage share passes ``ratio``; returns how many."""
    store._writer.settle()
    done = 0
    for slot in sealed(store):
        if 1.0 - store._live[slot] / store.segment_rows >= ratio:
            compact_segment(store, slot)
            done += 1
    return _counted(store, done)


def compact_store(store: StoreState, ratio: float, limit: int, cheap: float) -> int:
    """Compact the sealed segment with the fewest live records (ties: the lowest slot) while the store's garbage
    passes ``ratio`` of its records written, or while that segment is at least ``cheap`` garbage; at most ``limit``
    segments; returns how many (see :meth:`SegmentStore.compact_store`)."""
    store._writer.settle()
    done = 0
    while done < limit:
        slots = sealed(store)
        if not slots:
            break
        slot = slots[int(np.argmin(store._live[slots]))]      # argmin: the first (lowest slot) of ties
        written = sum(store._fill.values())
        garbage = 1.0 - store._live[slot] / store.segment_rows
        if garbage <= 0.0 or (written - len(store) <= ratio * written and garbage < max(ratio, cheap)):
            break
        compact_segment(store, slot)
        done += 1
    return _counted(store, done)


def _counted(store: StoreState, done: int) -> int:
    if done:
        store.counters["compactions"] += 1
        store.counters["segments_compacted"] += done
    return done


def compact_segment(store: StoreState, slot: int) -> None:
    """Append the live records of a sealed segment anew, then retire it. Its records are read in one call; only
    the live ones are checked (each must carry its check for its place, id included: else a SegmentError),
    garbage is never looked at twice. The live ones are those the store's live bits mark (a RunIndex: no index
    read a record), or (a dense index, in RAM) those whose id the index places there. They are moved with their
    old locations given (no lookup). A segment with no live record is retired unread."""
    if store._live[slot]:
        records = store._reads.segment(slot, store._fill[slot])
        here = np.arange(len(records), dtype=np.uint32) | np.uint32(slot << store._shift)
        if store._bits is not None:
            offsets = store._bits.offsets(slot)
            offsets = offsets[offsets < len(records)]
        else:
            offsets = np.flatnonzero(store._index.lookup(records["id"]) == here)
        live = pick(records, offsets)
        del records
        bad = store.layout.checks(live, here[offsets]) != live["check"]
        if bad.any() or len(offsets) != store._live[slot]:
            # a damaged id reads as a record of another row: say so (the index asked only about those)
            wrong = int((store._index.lookup(live["id"][bad]) != here[offsets][bad]).sum())
            if wrong or len(offsets) != store._live[slot]:
                raise SegmentError(f"segment {store.path / store._names[slot]} is damaged: {len(offsets) - wrong} "
                                   f"of its {int(store._live[slot])} live records carry the id the index has for "
                                   f"them")
            refuse(store.path / store._names[slot], offsets[bad])
        store._append(live, old=here[offsets])
    assert store._live[slot] == 0, "a compacted segment kept live records"
    store._retire(slot)
