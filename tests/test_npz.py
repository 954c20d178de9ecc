"""store.npz.savez: an .npz written piece by piece is what np.savez writes for the whole arrays."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from kvstore_lazy.store.npz import savez


class InPieces:
    def __init__(self, array: np.ndarray, step: int) -> None:
        self.array, self.step = array, step
        self.shape, self.dtype = array.shape, array.dtype
        self.read = 0

    def pieces(self):
        for lo in range(0, len(self.array), self.step):
            self.read += 1
            yield self.array[lo:lo + self.step]


def members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        return {i.filename: z.read(i) for i in z.infolist()}


def test_members_in_pieces_are_byte_for_byte_np_savez():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((1000, 7)).astype(np.float32)
    ids = np.sort(rng.choice(10**12, 1000, replace=False)).astype(np.uint64)
    meta = np.frombuffer(b'{"a": 1}', np.uint8)
    whole, pieces = io.BytesIO(), io.BytesIO()
    np.savez(whole, ids=ids, rows=rows, meta=meta)
    given = InPieces(rows, 128)
    savez(pieces, {"ids": InPieces(ids, 333), "rows": given, "meta": meta})
    assert given.read == 8
    assert members(pieces.getvalue()) == members(whole.getvalue())
    with np.load(io.BytesIO(pieces.getvalue()), allow_pickle=False) as z:
        assert z["rows"].tobytes() == rows.tobytes() and z["ids"].tolist() == ids.tolist()


def test_pieces_that_do_not_add_up_to_the_shape_are_refused():
    short = InPieces(np.arange(10, dtype=np.int64), 4)
    short.shape = (11,)
    with pytest.raises(ValueError, match="its pieces hold 10 rows, not 11"):
        savez(io.BytesIO(), {"ids": short})
