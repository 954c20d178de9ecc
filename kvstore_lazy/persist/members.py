"""A base snapshot's row arrays read piece by piece: a server restores a key without holding its file's arrays and
the table built from them at once.

Owns: :class:`MemberPieces`, one per-row member of a key file (``weights``, ``state<i>``, ``col_<name>``, and its
ids: ``row_ids``, ``dead_ids``) read in order a piece at a time, every byte of it checked against the member's zip
CRC once its last piece is read (a mismatch is a SnapshotError, as a whole read's would be), and
:class:`FoldedRows` / :class:`FoldedColumn`: a base and the deltas after it folded by id (``snapshots._fold_all``)
as a k-way merge of their sorted ids, in pieces: the merged ids, and of each per-row member the rows each source
gives (each source's member read once, in order). The checks of the ids as they are read: a 1-D array of integer
ids, sorted and unique in each source.
Does not own: the snapshot format and its other checks (``persist.snapshots``), the table they go into
(``store.rows.RowTable.load``, which takes anything with ``pieces()``, its ids included).

Why reading in place works: ``np.savez`` (and ``store.npz.savez``) stores each member uncompressed (ZIP_STORED) as
an ``.npy`` file, so its rows lie at a fixed offset: the zip local header (30 bytes, its name, its extra field), the
npy header, then the rows in C order (as ``persist.ranged`` reads a row range).
"""
from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from kvstore_lazy.store.pieces import ascends_after

LOAD_CHUNK = 1 << 16            # rows a piece,
LOAD_BYTES = 2 << 20            # and at most this many bytes (16,384 rows at D=32: a restore holds about three
                                # pieces of each member at once, the read, the rows picked, the rows merged)
IDS_CHUNK = 1 << 13             # ids a piece of an ids member (row_ids, dead_ids): a fold's merge of one piece of
                                # every source holds ~10 times their bytes, once for each member the table reads
IDS = ("row_ids", "dead_ids")
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
            step = chunk or min(LOAD_CHUNK, IDS_CHUNK if name in IDS else LOAD_CHUNK,
                                max(1024, LOAD_BYTES // row_bytes))
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


def _ids_chunks(ids):
    """The pieces of a source's ids: a member's, or an array's LOAD_CHUNK at a time."""
    if hasattr(ids, "pieces"):
        yield from ids.pieces()
        return
    ids = np.asarray(ids)
    for lo in range(0, len(ids), LOAD_CHUNK):
        yield ids[lo:lo + LOAD_CHUNK]


def _what(ids) -> str:
    return f"{ids.path}: member {ids.name!r}" if isinstance(ids, MemberPieces) else "an array of row ids"


def check_ids(ids, what: str) -> None:
    """SnapshotError unless `ids` (a member in pieces, or an array) is a 1-D array of integer ids."""
    if len(ids.shape) != 1 or np.dtype(ids.dtype).kind not in "iu":
        raise SnapshotError(f"{what} is not a 1-D array of integer ids ({ids.dtype}, shape {ids.shape})")


class _IdStream:
    """One source's sorted ids taken in order by id: a buffer (the rest of the piece read last) and the pieces
    after it, each piece checked as it is read (ascending, unique, also across pieces)."""

    def __init__(self, ids) -> None:
        check_ids(ids, _what(ids))
        self.what, self._pieces = _what(ids), _ids_chunks(ids)
        self.buffer = np.zeros(0, np.uint64)
        self.at = 0                     # the position in the source of buffer[0]
        self._last = -1                 # the last id read (-1: none yet; ids are >= 0)

    def fill(self) -> bool:
        """A buffer that is not empty (the next piece read if needed); False once the source is exhausted."""
        while not len(self.buffer):
            piece = next(self._pieces, None)
            if piece is None:
                return False
            piece = np.asarray(piece).astype(np.uint64, copy=False)
            if not ascends_after(piece, self._last):
                raise SnapshotError(f"{self.what}: the ids are not sorted and unique")
            if len(piece):
                self._last = int(piece[-1])
            self.buffer = piece
        return True

    def take(self, hi: int) -> tuple[np.ndarray, int]:
        """The buffered ids up to `hi` (inclusive) and the position of the first; they leave the buffer."""
        n = int(np.searchsorted(self.buffer, np.uint64(hi), side="right"))
        out, at = self.buffer[:n], self.at
        self.buffer, self.at = self.buffer[n:], self.at + n
        return out, at


class FoldedRows:
    """The ids of a base and the deltas after it (``sources``: each one's sorted ids, a member in pieces or an
    array, oldest first) folded by id: of each id its newest source's row, without the ids a newer source removed
    (``dead[s]``: the tombstones of source ``s``, sorted; those of the first are not used). A k-way merge in steps,
    each step taking from every source its ids up to the least of the last ids buffered (so every id's versions
    meet in one step): what it holds is about a piece of each source (ids and tombstones), never a whole source
    nor an order of all rows. :meth:`pieces` gives the merged ids; :meth:`column` the rows of one per-row member
    (:class:`FoldedColumn`), found by the same merge. ``len`` (the rows kept) costs one merge of the ids."""

    def __init__(self, sources: list, dead: list) -> None:
        self.sources, self.dead = sources, dead
        for ids in [*sources, *(d for d in dead[1:] if d is not None)]:
            check_ids(ids, _what(ids))
        self.dtype = np.dtype(np.uint64)
        self._rows: int | None = None

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        if self._rows is None:
            self._rows = sum(len(ids) for ids, _, _ in self.steps())
        return self._rows

    def steps(self):
        """(ids, source, position in that source) of the rows kept, ascending by id, a step at a time."""
        streams = [(s, _IdStream(ids), False) for s, ids in enumerate(self.sources)]
        streams += [(s, _IdStream(d), True) for s, d in enumerate(self.dead) if s and d is not None]
        while True:
            live = [entry for entry in streams if entry[1].fill()]
            if not live:
                return
            if len(live) == 1:          # one source left: its ids as they are (a tombstone's: nothing)
                s, stream, dead = live[0]
                got, at = stream.take(int(stream.buffer[-1]))
                if not dead:
                    yield got, np.full(len(got), s, np.int32), np.arange(at, at + len(got), dtype=np.int64)
                continue
            hi = min(int(stream.buffer[-1]) for _, stream, _ in live)
            ids, source, pos = [], [], []
            for s, stream, dead in live:
                got, at = stream.take(hi)
                ids.append(got)
                source.append(np.full(len(got), s, np.int32))
                pos.append(np.full(len(got), -1, np.int64) if dead else np.arange(at, at + len(got), dtype=np.int64))
            all_ids, all_sources, all_pos = np.concatenate(ids), np.concatenate(source), np.concatenate(pos)
            # by id; of one id the newest source first, and of one source its row before a tombstone
            order = np.lexsort((all_pos < 0, -all_sources, all_ids))
            all_ids, all_sources, all_pos = all_ids[order], all_sources[order], all_pos[order]
            keep = all_pos >= 0
            keep[1:] &= all_ids[1:] != all_ids[:-1]
            yield all_ids[keep], all_sources[keep], all_pos[keep]

    def pieces(self):
        for ids, _, _ in self.steps():
            if len(ids):
                yield ids

    def column(self, sources: list) -> "FoldedColumn":
        return FoldedColumn(self, sources)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate([np.zeros(0, np.uint64), *self.pieces()])
        return whole if dtype is None else whole.astype(dtype, copy=False)


class FoldedColumn:
    """One per-row member (weights, a state, a column) of the sources of a :class:`FoldedRows` (``sources``: the
    member of each, in pieces or an array), in the order of its merged ids, in pieces: each step's rows picked from
    each source (:meth:`_Reader.select`: each source's member read once, in order, and checked against its CRC)."""

    def __init__(self, rows: FoldedRows, sources: list) -> None:
        first = sources[0]
        self.dtype = np.dtype(first.dtype)
        self.sources = [s if isinstance(s, MemberPieces) else np.asarray(s, self.dtype) for s in sources]
        self.rows, self._row_shape = rows, tuple(first.shape[1:])

    @property
    def shape(self) -> tuple:
        return (len(self.rows),) + self._row_shape

    def __len__(self) -> int:
        return len(self.rows)

    def pieces(self):
        readers = [s.reader() if isinstance(s, MemberPieces) else None for s in self.sources]
        try:
            for _, source, pos in self.rows.steps():
                if not len(pos):
                    continue
                out = np.empty((len(pos),) + self._row_shape, self.dtype)
                for s in np.unique(source).tolist():
                    mine = source == s
                    reader = readers[s]
                    out[mine] = reader.select(pos[mine]) if reader is not None else self.sources[s][pos[mine]]
                yield out
            for reader in readers:
                if reader is not None:
                    reader.finish()
        finally:
            for reader in readers:
                if reader is not None:
                    reader.close()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate([np.zeros((0,) + self._row_shape, self.dtype), *self.pieces()])
        return whole if dtype is None else whole.astype(dtype, copy=False)
