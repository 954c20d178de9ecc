"""A base snapshot's row arrays read piece by piece: a server restores a key without holding its file's arrays and
the table built from them at once.

Owns: :class:`MemberPieces`, one per-row member of a key file (``weights``, ``state<i>``, ``col_<name>``) read in
order a piece at a time, every byte of it checked against the member's zip CRC once its last piece is read (a
mismatch is a SnapshotError, as a whole read's would be), and :class:`MergedPieces`, such members of a base and
the deltas after it merged by id (some rows of each dropped: ``snapshots._fold_all``), also in pieces.
Does not own: the snapshot format and its checks (``persist.snapshots``), the table they go into
(``store.rows.RowTable.load``, which takes anything with ``pieces()``).

Why reading in place works: ``np.savez`` (and ``snapshots.savez``) stores each member uncompressed (ZIP_STORED) as
an ``.npy`` file, so its rows lie at a fixed offset: the zip local header (30 bytes, its name, its extra field), the
npy header, then the rows in C order (as ``persist.ranged`` reads a row range).
"""
from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

LOAD_CHUNK = 1 << 16            # rows a piece,
LOAD_BYTES = 2 << 20            # and at most this many bytes (16,384 rows at D=32: a restore holds about three
                                # pieces of each member at once, the read, the rows picked, the rows merged)
_LOCAL = struct.Struct("<4s5H3L2H")      # a zip local file header (30 bytes)


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded (``persist.snapshots.SnapshotError``: defined here, where it is raised
    first, so that this module needs nothing of ``snapshots``)."""


def open_members(path: Path, names: list[str], chunk: int | None = None) -> dict[str, "MemberPieces"]:
    """A :class:`MemberPieces` of each member `names` of key file `path` (npy headers read and checked now)."""
    with zipfile.ZipFile(path) as archive:
        infos = {i.filename[:-4]: i for i in archive.infolist() if i.filename.endswith(".npy")}
    out = {}
    with open(path, "rb") as file:
        for name in names:
            info = infos.get(name)
            if info is None:
                raise SnapshotError(f"{path}: member {name!r} is missing")
            if info.compress_type != zipfile.ZIP_STORED:
                raise SnapshotError(f"{path}: member {name!r} is compressed (not written by np.savez)")
            file.seek(info.header_offset)
            head = file.read(_LOCAL.size)
            fields = _LOCAL.unpack(head) if len(head) == _LOCAL.size else None
            if fields is None or fields[0] != b"PK\x03\x04":
                raise SnapshotError(f"{path}: member {name!r} has no zip local header where the directory says")
            start = info.header_offset + _LOCAL.size + fields[9] + fields[10]
            file.seek(start)
            try:
                version = np.lib.format.read_magic(file)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read(file)
            except ValueError as exc:
                raise SnapshotError(f"{path}: member {name!r} has no npy header ({exc})") from None
            offset = file.tell()
            if fortran or dtype.hasobject or not shape:
                raise SnapshotError(f"{path}: member {name!r} is not a C-ordered array of numbers")
            if offset - start + int(np.prod(shape)) * dtype.itemsize != info.file_size:
                raise SnapshotError(f"{path}: member {name!r} holds {info.file_size} bytes, not its header and {shape} "
                             f"{dtype}")
            row_bytes = max(1, int(np.prod(shape[1:])) * dtype.itemsize)
            step = chunk or min(LOAD_CHUNK, max(1024, LOAD_BYTES // row_bytes))
            out[name] = MemberPieces(path, name, start, offset, tuple(shape), dtype, info.CRC, step)
    return out


class _Reader:
    """One pass over a member's rows in order; the CRC of every byte read so far (header included)."""

    def __init__(self, member: "MemberPieces") -> None:
        self.member, self.pos = member, 0
        self.file = open(member.path, "rb")
        self.file.seek(member.start)
        self.crc = zlib.crc32(self.file.read(member.offset - member.start))

    def read(self, hi: int) -> np.ndarray:
        """Rows [pos, hi); pos moves to hi."""
        m = self.member
        out = np.empty((hi - self.pos,) + m.shape[1:], m.dtype)
        view = out.reshape(-1).view(np.uint8)
        if out.nbytes and self.file.readinto(view.data) != out.nbytes:
            raise SnapshotError(f"{m.path}: member {m.name!r} is truncated")
        self.crc = zlib.crc32(view.data, self.crc)
        self.pos = hi
        return out

    def select(self, want: np.ndarray) -> np.ndarray:
        """Rows `want` (ascending, at or past pos), reading past the others a chunk at a time."""
        m = self.member
        out = np.empty((len(want),) + m.shape[1:], m.dtype)
        done = 0
        while done < len(want):
            hi = min(int(want[-1]) + 1, self.pos + m.chunk)
            lo = self.pos
            got = self.read(hi)
            n = int(np.searchsorted(want, hi))
            out[done:n] = got[want[done:n] - lo]
            done = n
        return out

    def close(self) -> None:
        self.file.close()

    def finish(self) -> None:
        """Read what is left and check the whole member against its zip CRC."""
        m = self.member
        while self.pos < m.shape[0]:
            self.read(min(m.shape[0], self.pos + m.chunk))
        self.close()
        if self.crc & 0xFFFFFFFF != m.crc:
            raise SnapshotError(f"{m.path}: member {m.name!r} is corrupted (its zip CRC differs)")


class MemberPieces:
    """One per-row member of a key file, read in order ``chunk`` rows a piece (see the module docstring)."""

    def __init__(self, path: Path, name: str, start: int, offset: int, shape: tuple, dtype: np.dtype, crc: int,
                 chunk: int) -> None:
        self.path, self.name, self.start, self.offset, self.crc = path, name, start, offset, crc
        self.shape, self.dtype, self.chunk = shape, np.dtype(dtype), chunk

    def __len__(self) -> int:
        return self.shape[0]

    def reader(self) -> _Reader:
        return _Reader(self)

    def pieces(self):
        reader = self.reader()
        try:
            for lo in range(0, self.shape[0], self.chunk):
                yield reader.read(min(self.shape[0], lo + self.chunk))
            reader.finish()
        finally:                # (also when the pieces are left unread: an error elsewhere)
            reader.close()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        reader = self.reader()
        try:
            whole = reader.read(self.shape[0])
            reader.finish()
        finally:
            reader.close()
        return whole if dtype is None else whole.astype(dtype, copy=False)


class MergedPieces:
    """Rows ``kept[s]`` (ascending indices) of each source ``s`` (a member in pieces, or an array), merged in the
    order ``order`` of their concatenation ``[sources[0][kept[0]], sources[1][kept[1]], ...]`` (sorted by id: so
    each source's rows come in ascending order and a member in pieces is read once, in order). A base and the
    deltas after it, each a source (``snapshots._fold_all``): the rows of all of them are never in memory at once."""

    def __init__(self, sources: list, kept: list[np.ndarray], order: np.ndarray) -> None:
        first = sources[0]
        self.dtype = np.dtype(first.dtype)
        self.sources = [s if isinstance(s, MemberPieces) else np.asarray(s, self.dtype) for s in sources]
        self.kept, self.order = kept, order
        self.starts = np.cumsum([0] + [len(k) for k in kept])
        self.shape = (len(order),) + tuple(first.shape[1:])
        chunks = [s.chunk for s in self.sources if isinstance(s, MemberPieces)]
        self.chunk = min(chunks) if chunks else LOAD_CHUNK

    def __len__(self) -> int:
        return self.shape[0]

    def pieces(self):
        readers = [s.reader() if isinstance(s, MemberPieces) else None for s in self.sources]
        try:
            for lo in range(0, len(self.order), self.chunk):
                at = self.order[lo:lo + self.chunk]
                source = np.searchsorted(self.starts, at, side="right") - 1
                out = np.empty((len(at),) + self.shape[1:], self.dtype)
                for s in np.unique(source).tolist():
                    mine = source == s
                    want = self.kept[s][at[mine] - self.starts[s]]
                    reader = readers[s]
                    out[mine] = reader.select(want) if reader is not None else self.sources[s][want]
                yield out
            for reader in readers:
                if reader is not None:
                    reader.finish()
        finally:
            for reader in readers:
                if reader is not None:
                    reader.close()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate(list(self.pieces()) or [np.zeros(self.shape, self.dtype)])
        return whole if dtype is None else whole.astype(dtype, copy=False)


def merged(sources: list, kept: list[np.ndarray], order: np.ndarray):
    """``concatenate([s[k] for s, k in zip(sources, kept)])[order]``: an array if every source is one, else a
    :class:`MergedPieces` (read when the table is built)."""
    if not any(isinstance(s, MemberPieces) for s in sources):
        return np.concatenate([np.asarray(s)[k] for s, k in zip(sources, kept)])[order]
    return MergedPieces(sources, kept, order)
