"""MXNet 1.9.1's NDArray list file (what ``mx.nd.save`` writes and ``mx.nd.load`` reads), with numpy only.

Owns: reading a file's index (names, storage types, shapes, dtypes and where each array's bytes are) without
loading any data, reading one array's values or row ids (memory-mapped), and writing a file array by array with
the values of each one given in chunks, so that an array larger than memory can be written (a stock reader still
needs the whole array in memory to load it: that is MXNet's format, one contiguous blob per array). It does not
import mxnet: ``python -m kvstore_lazy.persist.checkpoint densify`` runs where mxnet is not installed, and the server
side
of the project (checkpoint.py) must never import it.

Layout, as src/ndarray/ndarray.cc (NDArray::Save, the list Save, TShape/Context Save) of mxnet 1.9.1 writes it,
all little-endian::

    file    u64 0x112 (kMXAPINDArrayListMagic)  u64 0 (reserved)
            u64 n  array x n
            u64 m  (u64 length, bytes) x m        the names; m == 0 (an unnamed list) or m == n
    array   u32 0xF993FAC9 (NDARRAY_V2_MAGIC)  i32 stype (0 default, 1 row_sparse, 2 csr)
            [shape storage_shape]                 sparse only: (rows stored,) + row shape for row_sparse (*)
            shape                                 the logical shape
            i32 dev_type  i32 dev_id              the context it was saved from (1, 0 = cpu(0))
            i32 type_flag                         mshadow: 0 float32, 1 float64, 2 float16, 3 uint8, 4 int32,
                                                  5 int8, 6 int64, 7 bool
            [i32 aux_type shape aux_shape] x nad  sparse only: row_sparse has one aux array, its row ids (int64)
            data                                  prod(storage shape) (dense: prod(shape)) values of type_flag
            [aux data] x nad                      row_sparse: the sorted row ids
    shape   i32 ndim  i64 x ndim

(*) Its first dimension is not what MXNet's loader goes by: the number of values stored follows the index array's
length (row_sparse: the row ids; csr: the column indices). NDArray::Save writes the storage shape *before* it waits
for pending writes to the array, and the rest after, so an array a pending ``copyto`` was giving another row count
is saved with the old count there and the new rows everywhere else (a file mx.nd.load reads as the new rows).

An array of ndim 0 ends after its shape (an empty NDArray). Files in the older formats (V1, the legacy u32 shapes)
and np-shape files (V3 magic, 0xF993FACA) are refused with a clear error: MXNet 1.9.1 writes V2 for every
non-np array.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Iterator

import numpy as np

LIST_MAGIC = 0x112
V2_MAGIC = 0xF993FAC9
V3_MAGIC = 0xF993FACA
DEFAULT, ROW_SPARSE, CSR = 0, 1, 2
STYPES = {DEFAULT: "default", ROW_SPARSE: "row_sparse", CSR: "csr"}
CPU = (1, 0)
# mshadow type flags (mshadow/base.h) <-> numpy
DTYPES: dict[int, np.dtype] = {
    0: np.dtype("float32"), 1: np.dtype("float64"), 2: np.dtype("float16"), 3: np.dtype("uint8"), 4: np.dtype("int32"),
    5: np.dtype("int8"), 6: np.dtype("int64"), 7: np.dtype("bool")}
FLAGS = {dtype: flag for flag, dtype in DTYPES.items()}
_U32, _I32, _U64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<Q")


class NDFileError(ValueError):
    """Not an NDArray file this module can read (or a request it cannot write)."""


@dataclass
class Entry:
    """One array of a file: where its bytes are (offsets from the start of the file), not the bytes."""
    name: str
    stype: str                      # "default" | "row_sparse" | "csr"
    shape: tuple[int, ...]
    dtype: np.dtype | None          # None for an empty NDArray (ndim 0)
    start: int                      # first byte of the array's record
    end: int                        # one past its last byte
    data_offset: int = 0
    data_count: int = 0             # values in the data blob
    aux_offsets: tuple[int, ...] = ()
    aux_counts: tuple[int, ...] = ()
    aux_dtypes: tuple[np.dtype, ...] = ()

    @property
    def rows_stored(self) -> int:
        """Rows a row_sparse array holds (its number of row ids)."""
        return self.aux_counts[0] if self.stype == "row_sparse" else 0


class _Reader:
    def __init__(self, fh: BinaryIO, path: str, size: int):
        self.fh, self.path, self.size = fh, path, size

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise NDFileError(f"{self.path}: truncated at byte {self.fh.tell()} (not an MXNet NDArray file, or cut "
                              f"short)")
        return data

    def u32(self) -> int:
        return _U32.unpack(self.read(4))[0]

    def i32(self) -> int:
        return _I32.unpack(self.read(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.read(8))[0]

    def shape(self) -> tuple[int, ...]:
        ndim = self.i32()
        if not 0 <= ndim <= 32:
            raise NDFileError(f"{self.path}: bad shape (ndim {ndim}) at byte {self.fh.tell() - 4}")
        dims = struct.unpack(f"<{ndim}q", self.read(8 * ndim))
        if any(d < 0 for d in dims):
            raise NDFileError(f"{self.path}: negative dimension in shape {dims}")
        return tuple(dims)

    def skip(self, n: int) -> int:
        at = self.fh.tell()
        if at + n > self.size:
            raise NDFileError(f"{self.path}: truncated (an array's data runs past the end of the file)")
        self.fh.seek(n, os.SEEK_CUR)
        return at

    def dtype(self) -> np.dtype:
        flag = self.i32()
        if flag not in DTYPES:
            raise NDFileError(f"{self.path}: unknown type flag {flag}")
        return DTYPES[flag]


def _read_entry(r: _Reader, index: int) -> Entry:
    start = r.fh.tell()
    magic = r.u32()
    if magic != V2_MAGIC:
        kind = "an np-shape (V3) array" if magic == V3_MAGIC else f"magic {magic:#x}"
        raise NDFileError(f"{r.path}: array {index} is {kind}; only MXNet's V2 arrays (what mx.nd.save writes) are "
                          f"supported")
    stype = r.i32()
    if stype not in STYPES:
        raise NDFileError(f"{r.path}: array {index} has unknown storage type {stype}")
    nad = {DEFAULT: 0, ROW_SPARSE: 1, CSR: 2}[stype]
    storage_shape = r.shape() if nad else ()
    shape = r.shape()
    if len(shape) == 0:
        return Entry("", STYPES[stype], shape, None, start, r.fh.tell())
    r.read(8)   # context
    dtype = r.dtype()
    aux = [(r.dtype(), r.shape()) for _ in range(nad)]
    if nad:
        # the stored count is the index array's length (row ids; csr: column indices), as MXNet's loader takes it
        # (Chunk::set_aux_shape): the storage shape's first dimension can be stale (the module docstring)
        index_shape = aux[0 if stype == ROW_SPARSE else 1][1]
        if len(index_shape) != 1 or len(storage_shape) == 0:
            raise NDFileError(f"{r.path}: array {index} has a bad storage shape {storage_shape} or index shape "
                              f"{index_shape}")
        storage_shape = index_shape + storage_shape[1:]
    count = int(np.prod(storage_shape if nad else shape, dtype=np.int64))
    data_offset = r.skip(count * dtype.itemsize)
    aux_offsets, aux_counts = [], []
    for aux_dtype, aux_shape in aux:
        n = int(np.prod(aux_shape, dtype=np.int64))
        aux_offsets.append(r.skip(n * aux_dtype.itemsize))
        aux_counts.append(n)
    return Entry("", STYPES[stype], shape, dtype, start, r.fh.tell(), data_offset, count, tuple(aux_offsets),
                 tuple(aux_counts), tuple(d for d, _ in aux))


def read_index(path: str | os.PathLike) -> list[Entry]:
    """Every array of the file at `path`, in file order, with its name (NDFileError if it is not such a file)."""
    path = os.fspath(path)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise NDFileError(f"{path}: cannot open ({exc.strerror})") from None
    with fh:
        r = _Reader(fh, path, os.fstat(fh.fileno()).st_size)
        if r.size < 24 or r.u64() != LIST_MAGIC:
            raise NDFileError(f"{path}: not an MXNet NDArray file (no 0x112 header)")
        r.u64()
        n = r.u64()
        if n > r.size:
            raise NDFileError(f"{path}: bad array count {n}")
        entries = [_read_entry(r, i) for i in range(n)]
        m = r.u64()
        if m not in (0, n):
            raise NDFileError(f"{path}: {n} arrays but {m} names")
        for entry in entries[:m]:
            length = r.u64()
            if length > r.size:
                raise NDFileError(f"{path}: bad name length {length}")
            entry.name = r.read(length).decode("utf-8", "replace")
    return entries


def _memmap(path, dtype: np.dtype | None, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def read_values(path, entry: Entry) -> np.ndarray:
    """The values of `entry` (memory-mapped, read-only): `shape` for a dense array, (rows stored,) + row shape for a
    row_sparse one."""
    flat = _memmap(path, entry.dtype, entry.data_offset, entry.data_count)
    if entry.stype == "row_sparse":
        return flat.reshape((entry.rows_stored,) + entry.shape[1:])
    if entry.stype == "default":
        return flat.reshape(entry.shape)
    return flat


def read_row_ids(path, entry: Entry) -> np.ndarray:
    """The row ids a row_sparse `entry` holds (memory-mapped)."""
    if entry.stype != "row_sparse":
        raise NDFileError(f"{entry.name!r} is {entry.stype}, not row_sparse")
    return _memmap(path, entry.aux_dtypes[0], entry.aux_offsets[0], entry.aux_counts[0])


# ----------------------------------------------------------------------------------------------------------------
# writing

def _shape(dims: Iterable[int]) -> bytes:
    dims = [int(d) for d in dims]
    return _I32.pack(len(dims)) + struct.pack(f"<{len(dims)}q", *dims)


class Writer:
    """Write an NDArray list file into an open binary file, one array at a time::

        w = Writer(fh, count=2)
        w.dense("b", (4,), np.float32, [chunk, ...])
        w.row_sparse("w", (10**8, 8), np.float32, rows=n, values=[chunk, ...], row_ids=[chunk, ...])
        w.finish()                      # the names

    Chunks are written as they come; their sizes must add up to what the header announced (checked)."""

    def __init__(self, fh: BinaryIO, count: int):
        self.fh, self.count = fh, int(count)
        self.names: list[str] = []
        fh.write(_U64.pack(LIST_MAGIC) + _U64.pack(0) + _U64.pack(self.count))

    def _chunks(self, name: str, what: str, chunks: Iterable[np.ndarray], dtype: np.dtype, count: int) -> None:
        written = 0
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk, dtype=dtype)
            self.fh.write(chunk.reshape(-1).data.cast("B"))
            written += chunk.size
        if written != count:
            raise NDFileError(f"{name}: {written} {what} written, the header says {count}")

    def _begin(self, name: str, stype: int, shape, dtype) -> np.dtype:
        if len(self.names) >= self.count:
            raise NDFileError(f"{name}: more arrays than the {self.count} announced")
        dtype = np.dtype(dtype)
        if dtype not in FLAGS:
            raise NDFileError(f"{name}: dtype {dtype} has no MXNet type flag")
        self.names.append(name)
        self.fh.write(_U32.pack(V2_MAGIC) + _I32.pack(stype))
        return dtype

    def dense(self, name: str, shape, dtype, values: Iterable[np.ndarray]) -> None:
        dtype = self._begin(name, DEFAULT, shape, dtype)
        self.fh.write(_shape(shape) + _I32.pack(CPU[0]) + _I32.pack(CPU[1]) + _I32.pack(FLAGS[dtype]))
        self._chunks(name, "values", values, dtype, int(np.prod(shape, dtype=np.int64)))

    def row_sparse(self, name: str, shape, dtype, rows: int, values: Iterable[np.ndarray],
                   row_ids: Iterable[np.ndarray]) -> None:
        """`rows` rows of a row_sparse array of full `shape`: their values (rows x row shape, in row order), then
        their ids (sorted, int64)."""
        dtype = self._begin(name, ROW_SPARSE, shape, dtype)
        shape = tuple(int(d) for d in shape)
        self.fh.write(_shape((rows,) + shape[1:]) + _shape(shape) + _I32.pack(CPU[0]) + _I32.pack(CPU[1])
                      + _I32.pack(FLAGS[dtype]) + _I32.pack(FLAGS[np.dtype("int64")]) + _shape((rows,)))
        self._chunks(name, "values", values, dtype, rows * int(np.prod(shape[1:], dtype=np.int64)))
        self._chunks(name, "row ids", row_ids, np.dtype("int64"), rows)

    def copy(self, name: str, src: BinaryIO, entry: Entry, chunk_bytes: int = 16 << 20) -> None:
        """Copy `entry`'s record byte for byte from the open file `src`."""
        if len(self.names) >= self.count:
            raise NDFileError(f"{name}: more arrays than the {self.count} announced")
        self.names.append(name)
        src.seek(entry.start)
        left = entry.end - entry.start
        while left:
            block = src.read(min(left, chunk_bytes))
            if not block:
                raise NDFileError(f"{name}: source file ended early")
            self.fh.write(block)
            left -= len(block)

    def finish(self) -> None:
        if len(self.names) != self.count:
            raise NDFileError(f"{len(self.names)} arrays written, {self.count} announced")
        out = [_U64.pack(len(self.names))]
        for name in self.names:
            raw = name.encode()
            out += [_U64.pack(len(raw)), raw]
        self.fh.write(b"".join(out))


def chunked(n: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive chunks of at most `size` covering range(n)."""
    for start in range(0, int(n), int(size)):
        yield start, min(start + int(size), int(n))
