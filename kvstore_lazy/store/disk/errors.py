"""The disk tier's two error types, one for what is on disk and one for writing to it.

Owns: :class:`SegmentError` (a store that can't be used as it is on disk) and :class:`DiskError` (writing to the
store's directory failed). Does not own: where they are raised (every unit of the store names the file or the
directory in its message). Both are re-exported by :mod:`kvstore_lazy.store.segments`, where callers import them.
"""
from __future__ import annotations


class SegmentError(ValueError):
    """A store that can't be used as it is on disk: damaged, truncated or missing segments, a foreign layout."""


class DiskError(OSError):
    """Writing to the store's directory failed (full disk, I/O error); names the directory."""
