"""kvstore_lazy.persist.ndfile against the real thing: files mx.nd.save (stock mxnet 1.9.1) writes are indexed and
read back
exactly; what Writer writes is byte for byte what mx.nd.save writes for the same arrays, so mx.nd.load reads it;
anything else is refused with an NDFileError naming the file."""
import io

import mxnet as mx
import numpy as np
import pytest

from kvstore_lazy.persist import ndfile


def arrays():
    rng = np.random.RandomState(3)
    return {
        "arg:dense32": mx.nd.array(rng.randn(3, 4), dtype="float32"),
        "aux:dense64": mx.nd.array(rng.randn(5), dtype="float64"),
        "half": mx.nd.array(rng.randn(2, 2, 3), dtype="float16"),
        "ints": mx.nd.array(np.arange(7), dtype="int64"),
        "rsp": mx.nd.sparse.row_sparse_array((rng.randn(3, 2, 2).astype(np.float32), np.array([0, 5, 9])),
                                             shape=(10, 2, 2)),
        "rsp-empty": mx.nd.sparse.zeros("row_sparse", (1000, 8), dtype="float64"),
    }


def write_like(fh, named: dict) -> None:
    """The same arrays through ndfile.Writer, values in chunks of 2 rows (or 2 values)."""
    writer = ndfile.Writer(fh, len(named))
    for name, value in named.items():
        if value.stype == "row_sparse":
            data, ids = value.data.asnumpy(), value.indices.asnumpy()
            writer.row_sparse(name, value.shape, data.dtype, len(ids),
                              (data[i:i + 2] for i in range(0, len(ids), 2)),
                              (ids[i:i + 2] for i in range(0, len(ids), 2)))
        else:
            flat = value.asnumpy().reshape(-1)
            writer.dense(name, value.shape, flat.dtype, (flat[i:i + 2] for i in range(0, len(flat), 2)))
    writer.finish()


def test_writer_is_byte_identical_to_mx_nd_save(tmp_path):
    named = arrays()
    mx.nd.save(str(tmp_path / "stock.params"), named)
    buf = io.BytesIO()
    write_like(buf, named)
    assert buf.getvalue() == (tmp_path / "stock.params").read_bytes()


def test_index_and_values_of_a_stock_file(tmp_path):
    named = arrays()
    path = tmp_path / "stock.params"
    mx.nd.save(str(path), named)
    entries = ndfile.read_index(path)
    assert [e.name for e in entries] == list(named)
    for entry in entries:
        value = named[entry.name]
        assert (entry.stype, entry.shape, entry.dtype) == (value.stype, value.shape, np.dtype(value.dtype))
        if value.stype == "row_sparse":
            assert entry.rows_stored == value.indices.shape[0]
            np.testing.assert_array_equal(ndfile.read_row_ids(path, entry), value.indices.asnumpy())
            np.testing.assert_array_equal(ndfile.read_values(path, entry), value.data.asnumpy())
        else:
            np.testing.assert_array_equal(ndfile.read_values(path, entry), value.asnumpy())
    assert entries[-1].end == path.stat().st_size - sum(8 + len(n) for n in named) - 8


def test_copy_keeps_records_byte_for_byte(tmp_path):
    named = arrays()
    mx.nd.save(str(tmp_path / "a.params"), named)
    entries = ndfile.read_index(tmp_path / "a.params")
    with open(tmp_path / "b.params", "wb") as out, open(tmp_path / "a.params", "rb") as src:
        writer = ndfile.Writer(out, len(entries))
        for entry in entries:
            writer.copy(entry.name, src, entry, chunk_bytes=7)
        writer.finish()
    assert (tmp_path / "b.params").read_bytes() == (tmp_path / "a.params").read_bytes()


@pytest.mark.parametrize("damage,message", [
    (lambda b: b"not an ndarray file at all, no", "no 0x112 header"),
    (lambda b: b[:-30], "truncated"),
    (lambda b: b[:24] + b"\x00\x00\x00\x00" + b[28:], "only MXNet's V2 arrays"),
    (lambda b: b[:28] + b"\x07\x00\x00\x00" + b[32:], "unknown storage type 7"),
    (lambda b: b"", "no 0x112 header"),
])
def test_refuses_what_is_not_a_v2_ndarray_file(tmp_path, damage, message):
    mx.nd.save(str(tmp_path / "good.params"), {"a": mx.nd.ones((2, 3))})
    bad = tmp_path / "bad.params"
    bad.write_bytes(damage((tmp_path / "good.params").read_bytes()))
    with pytest.raises(ndfile.NDFileError, match=message) as err:
        ndfile.read_index(bad)
    assert str(bad) in str(err.value)


def test_refuses_np_shape_files_and_missing_files(tmp_path):
    with mx.util.np_shape(True), mx.util.np_array(True):
        mx.npx.save(str(tmp_path / "np.params"), {"a": mx.np.ones((2, 3))})
    with pytest.raises(ndfile.NDFileError, match="np-shape"):
        ndfile.read_index(tmp_path / "np.params")
    with pytest.raises(ndfile.NDFileError, match="cannot open"):
        ndfile.read_index(tmp_path / "absent.params")


def test_writer_checks_what_the_header_announced():
    writer = ndfile.Writer(io.BytesIO(), 1)
    with pytest.raises(ndfile.NDFileError, match="3 values written, the header says 4"):
        writer.dense("a", (2, 2), np.float32, [np.zeros(3, np.float32)])
    writer = ndfile.Writer(io.BytesIO(), 1)
    with pytest.raises(ndfile.NDFileError, match="1 row ids written, the header says 2"):
        writer.row_sparse("w", (9, 2), np.float32, 2, [np.zeros((2, 2))], [np.array([1])])
    writer = ndfile.Writer(io.BytesIO(), 1)
    with pytest.raises(ndfile.NDFileError, match="0 arrays written, 1 announced"):
        writer.finish()
