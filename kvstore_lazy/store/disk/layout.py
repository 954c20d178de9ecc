"""The on-disk record and segment layout, and the check word every record carries.

Owns: the record dtype made from the caller's payload dtype, the location of a record (``slot << shift |
offset``: a segment slot and the record number in it, one ``uint32``), the check word (how it is computed, in C
and in numpy, and sealed into a record), and the ``store.json`` description of the layout (format name, payload
fields, segment size, record size, and the row range of a dense index). Does not own: reading or writing files
(:mod:`.files`, :mod:`.reads`, :mod:`.writer`).

A *record* is ``id`` (uint64), ``check`` (uint32) and the payload (a numpy structured dtype chosen by the caller:
the weights, every optimizer state and the per-row policy columns of one row, together), padded with ``pad`` to
a whole number of 32-bit words. A segment file is exactly ``segment_rows`` records (a power of two).

The check is a position-weighted sum of the record's 32-bit words (the check word itself weighted 0), its location
and id mixed in (:meth:`RecordLayout.checks_numpy` spells it out): a record read from the wrong place, torn or
damaged fails it, so a damaged segment is an error naming the file, never wrong values.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.store import kernels

FORMAT = "kvstore-lazy-segments/1"
MAX_SLOTS_BITS = 32
_SALT = np.uint64(0x9E3779B97F4A7C15)
CHECK_WORD = 2                  # the check's position in a record, in 32-bit words (after the 8-byte id)


class RecordLayout:
    """The records of a store of ``payload_dtype`` payloads in segments of ``segment_rows`` records."""

    def __init__(self, payload_dtype: np.dtype, segment_rows: int) -> None:
        self.payload_dtype = np.dtype(payload_dtype)
        if self.payload_dtype.names is None:
            raise ValueError("the payload dtype must be a structured dtype (named fields)")
        if segment_rows < 1 or segment_rows & (segment_rows - 1):
            raise ValueError(f"segment_rows must be a power of two, got {segment_rows}")
        self.segment_rows = int(segment_rows)
        self.shift = self.segment_rows.bit_length() - 1
        self.max_slots = (1 << (MAX_SLOTS_BITS - self.shift)) - 1    # (the last location is DenseIndex.EMPTY)
        pad = -self.payload_dtype.itemsize % 4
        fields = [("id", "<u8"), ("check", "<u4"), ("payload", self.payload_dtype)]
        if pad:
            fields.append(("pad", f"V{pad}"))
        self.record_dtype = np.dtype(fields)
        self.record_bytes = self.record_dtype.itemsize
        self.segment_bytes = self.segment_rows * self.record_bytes
        self.words = self.record_bytes // 4
        self.mult = (np.arange(self.words, dtype=np.uint64) * np.uint64(2) + np.uint64(0x2545F491)) \
            & np.uint64(0xFFFFFFFF)
        self.mult[CHECK_WORD] = 0                           # the check word itself (after the 8-byte id)

    def checks(self, records: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """The check of each record at its location (compiled: kernels.record_checks; :meth:`checks_numpy` is
        the same function in numpy)."""
        records = np.ascontiguousarray(records)
        return kernels.record_checks(records.view(np.uint32).reshape(len(records), self.words), self.mult, locs)

    def checks_numpy(self, records: np.ndarray, locs: np.ndarray) -> np.ndarray:
        words = np.ascontiguousarray(records).view(np.uint32).reshape(len(records), self.words).astype(np.uint64)
        total = (words * self.mult).sum(axis=1, dtype=np.uint64)
        total ^= (locs.astype(np.uint64) + np.uint64(1)) * _SALT
        total ^= total >> np.uint64(29)
        total *= np.uint64(0xBF58476D1CE4E5B9)
        total ^= total >> np.uint64(32)
        return (total & np.uint64(0xFFFFFFFF)).astype(np.uint32)

    def seal(self, records: np.ndarray, locs: np.ndarray) -> None:
        """Set the check word of each record (C-contiguous, writable) for its location ``locs``, in place."""
        kernels.record_seal(records.view(np.uint32).reshape(len(records), self.words), self.mult, locs, CHECK_WORD)

    def to_json(self, rows: tuple[int, int] | None) -> dict:
        """The ``store.json`` document of this layout (and of the dense index's row range, if any)."""
        layout = {"format": FORMAT, "payload": dtype_json(self.payload_dtype), "segment_rows": self.segment_rows,
                  "record_bytes": self.record_bytes}
        if rows is not None:
            layout["rows"] = list(rows)
        return layout


def dtype_json(dtype: np.dtype) -> list:
    return [[name, dtype.fields[name][0].base.str, list(dtype.fields[name][0].shape)] for name in dtype.names]


def dtype_from_json(fields: list) -> np.dtype:
    return np.dtype([(str(name), np.dtype(str(base)), tuple(int(d) for d in shape)) for name, base, shape in fields])
