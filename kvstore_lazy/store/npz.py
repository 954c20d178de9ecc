"""An ``.npz`` written piece by piece, and read back piece by piece: an array too large to copy goes to disk and
comes back without ever being whole in memory.

Owns: :class:`Member` (one member of an ``.npz`` read a piece at a time: a disk tier's committed dense index,
``store.disk.commit``) and :func:`savez`, the zip ``np.savez`` writes (members stored uncompressed, zip64) of
arrays some of which come in pieces (anything with ``shape``, ``dtype`` and ``pieces()`` yielding consecutive parts
along the first axis: ``store.pieces.Pieces``, a disk index's ids and locations). Each member is byte for byte what
``np.savez`` writes for the whole array (only the zip entries' times differ, as between any two ``np.savez``), so
``np.load`` reads it.
Does not own: what the arrays mean (a snapshot's key file: ``persist.snapshots``; a disk tier's committed index:
``store.disk.commit``), writing atomically (the callers' temp file and rename).
"""
from __future__ import annotations

import os
import zipfile
from typing import IO, Iterator

import numpy as np


class Member:
    """Member ``name`` of the ``.npz`` at ``path`` (a 1-D or n-D array, C order), read a piece of at most ``rows``
    rows at a time (:meth:`pieces`), as ``np.load`` would read it whole: every byte is checked against the
    member's zip CRC as its last piece is read (zipfile raises ``BadZipFile`` naming the member if it differs); a
    member missing (KeyError), without an npy header, of object dtype or shorter than its header says (ValueError,
    naming it) is refused. Use it as a context manager (the file stays open while the pieces are read)."""

    def __init__(self, path: str | os.PathLike, name: str) -> None:
        self.name = name
        self._zip = zipfile.ZipFile(path)
        try:
            self._file = self._zip.open(name + ".npy")
            version = np.lib.format.read_magic(self._file)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(self._file)
            if fortran or dtype.hasobject or not shape:
                raise ValueError(f"member {name!r} is not a C-ordered array of numbers")
        except BaseException:
            self._zip.close()
            raise
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __enter__(self) -> "Member":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()
        self._zip.close()

    def pieces(self, rows: int) -> Iterator[np.ndarray]:
        """The array in order, at most ``rows`` rows a piece (read-only arrays); the CRC is checked with the last
        (a member of no rows: at once)."""
        row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        total = self.shape[0]
        for lo in range(0, total, rows):
            k = min(rows, total - lo)
            data = self._file.read(k * row_bytes)
            if len(data) != k * row_bytes:
                raise ValueError(f"member {self.name!r} is truncated ({lo * row_bytes + len(data)} of "
                                 f"{total * row_bytes} bytes)")
            yield np.frombuffer(data, self.dtype).reshape((k,) + self.shape[1:])
        if self._file.read(1):        # (at the end: zipfile checks the CRC once every byte is read)
            raise ValueError(f"member {self.name!r} holds more bytes than its header says")


def savez(file: str | os.PathLike | IO[bytes], arrays: dict) -> None:
    """``np.savez(file, **arrays)`` (a path or a file open for writing), an array in pieces written a piece at a
    time (a ValueError, our bug, if its pieces do not add up to its shape)."""
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                if not hasattr(value, "pieces"):
                    np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)
                    continue
                np.lib.format.write_array_header_1_0(member, {"descr": np.lib.format.dtype_to_descr(value.dtype),
                                                              "fortran_order": False, "shape": tuple(value.shape)})
                written = 0
                for piece in value.pieces():
                    piece = np.ascontiguousarray(piece, value.dtype)
                    member.write(piece.reshape(-1).view(np.uint8).data)
                    written += len(piece)
                if written != value.shape[0]:
                    raise ValueError(f"{name}: its pieces hold {written} rows, not {value.shape[0]}")
