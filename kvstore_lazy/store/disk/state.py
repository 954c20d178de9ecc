"""What the units read and change of the store that composes them: the one contract between
:class:`~kvstore_lazy.store.segments.SegmentStore` and the units of this package that work on its log
(:mod:`.commit`, :mod:`.compaction`, :mod:`.rewrite`, :mod:`.verify`), so that none of them imports the facade.

Owns: :class:`StoreState`, a typing Protocol (no code runs here). Does not own: the state itself (the store's).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from kvstore_lazy.store.disk.index import DenseIndex, LiveBits, RunIndex
from kvstore_lazy.store.disk.layout import RecordLayout
from kvstore_lazy.store.disk.reads import Reads
from kvstore_lazy.store.disk.writer import Writer


class StoreState(Protocol):
    """A SegmentStore as its units see it: the segments by slot (file name, records written, live records), the
    active segment, the index and the live bits, what the next commit must fsync or delete, and the log's own
    operations."""

    path: Path
    layout: RecordLayout
    rows: tuple[int, int] | None
    segment_rows: int
    record_bytes: int
    counters: dict[str, int]
    version: int
    memtable_entries: int
    _index: DenseIndex | RunIndex
    _bits: LiveBits | None                  # a bit a record slot: live (a store with a RunIndex)
    _names: dict[int, str]                  # segment slot -> file name
    _fill: dict[int, int]                   # segment slot -> records written
    _live: np.ndarray                       # segment slot -> live records
    _active: int | None
    _next_number: int
    _shift: int
    _dirty: set[str]
    _retired: list[str]
    _committed: set[str]
    _writer: Writer
    _reads: Reads

    def __len__(self) -> int: ...

    def verify(self) -> None: ...

    def _append(self, records: np.ndarray, later: bool = False, old: np.ndarray | None = None) -> None: ...

    def _retire(self, slot: int) -> None: ...

    def _ensure_bits(self) -> None: ...

    def _read(self, ids: np.ndarray, locs: np.ndarray) -> np.ndarray: ...

    def _read_ordered(self, ids: np.ndarray, locs: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
