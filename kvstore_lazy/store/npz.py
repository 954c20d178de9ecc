"""An ``.npz`` written piece by piece: an array too large to copy goes to disk without ever being whole in memory.

Owns: :func:`savez`, the zip ``np.savez`` writes (members stored uncompressed, zip64) of arrays some of which come
in pieces (anything with ``shape``, ``dtype`` and ``pieces()`` yielding consecutive parts along the first axis:
``store.pieces.Pieces``, a disk index's ids and locations). Each member is byte for byte what ``np.savez`` writes
for the whole array (only the zip entries' times differ, as between any two ``np.savez``), so ``np.load`` reads it.
Does not own: what the arrays mean (a snapshot's key file: ``persist.snapshots``; a disk tier's committed index:
``store.disk.commit``), writing atomically (the callers' temp file and rename).
"""
from __future__ import annotations

import os
import zipfile
from typing import IO

import numpy as np


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
