"""A server's write-ahead journal: every request it received since its last snapshot, so a restarted server can
rebuild exactly the state it had (applied updates *and* half-finished dist_sync rounds) and answer what it owed.

Owns: the journal file format, appending (a request is in the file before it is ACKed or handled), reading it back
after a crash (a torn last record is ignored: that request was never ACKed, so the worker resends it), and rotating
it when a snapshot makes its records redundant. numpy-free, sans-policy: the runtime decides what goes in.

File ``<snapshot dir>/journal.rank<r>.<epoch hex>.<base seq>``::

    header  b"KVLJ" u32 version u64 epoch u64 base_seq
            u32 n  u64 x n          signatures of recently received requests (duplicate detection after a restart)
            u32 m  m x (u32 recver, frames)   replies sent but not yet ACKed when the journal was rotated
    records u8 kind u32 length payload
            kind b"M": u64 seq u32 sender frames        one received request (meta + data frames)
            kind b"A": u64 x k                          signatures of our replies the peers ACKed
    frames  u32 count, u32 length x count, the bytes

``epoch`` names one run of snapshots+journal (a new one at every fresh start); ``seq`` numbers requests within it.
A snapshot records (epoch, seq of the last request it includes) and so names the journal file that continues it.
Rotation is crash-safe by order: the new journal file is created (its header carries the unACKed replies) and made
durable (file and directory fsynced, whatever ``fsync`` says: the snapshot about to commit names it), then the
snapshot is written, then older journal files are removed; a server that dies in between finds the pair that
matches whichever snapshot is committed (and removes the other at start). Records are durable against the process
dying once ``append`` returns, against power loss only with ``fsync=True`` (KVSTORE_LAZY_JOURNAL_FSYNC): without it
a power cut may keep any prefix of the records written since the header, which reads as a torn tail.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvstore_lazy import paths

MAGIC = b"KVLJ"
VERSION = 1
_HEADER = struct.Struct("<4sIQQ")
_RECORD = struct.Struct("<cI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MSG = struct.Struct("<QI")


class JournalError(ValueError):
    pass


def journal_path(directory: str | os.PathLike, rank: int, epoch: int, base_seq: int) -> Path:
    return paths.journal(directory, rank, epoch, base_seq)


def remove_others(directory: str | os.PathLike, rank: int, keep: Path) -> None:
    """Delete this rank's journal files other than `keep` (after a snapshot made them redundant, or at the start
    of a recovery: a journal created for a snapshot that never committed), and the temp files of interrupted
    header writes."""
    for path in paths.journals(directory, rank):
        if path != keep:
            path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pack_frames(frames) -> bytes:
    frames = [bytes(f) for f in frames]
    return b"".join([_U32.pack(len(frames))] + [_U32.pack(len(f)) for f in frames] + frames)


def _unpack_frames(buf: memoryview, pos: int) -> tuple[list[bytes], int]:
    (count,) = _U32.unpack_from(buf, pos)
    pos += 4
    lengths = struct.unpack_from(f"<{count}I", buf, pos)
    pos += 4 * count
    frames = []
    for n in lengths:
        if pos + n > len(buf):
            raise JournalError("frame runs past the end of its record")
        frames.append(bytes(buf[pos:pos + n]))
        pos += n
    return frames, pos


@dataclass
class Entry:
    seq: int
    sender: int
    frames: list[bytes]          # meta, data...


@dataclass
class Contents:
    epoch: int
    base_seq: int
    seen: list[int] = field(default_factory=list)
    pending: list[tuple[int, list[bytes]]] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    acked: set[int] = field(default_factory=set)
    torn_bytes: int = 0          # bytes of an incomplete last record (ignored)


def read(path: str | os.PathLike) -> Contents | None:
    """The journal at `path`, or None if there is none."""
    path = Path(path)
    if not path.exists():
        return None
    data = memoryview(path.read_bytes())
    if len(data) < _HEADER.size:
        raise JournalError(f"{path}: {len(data)} bytes, shorter than a header")
    magic, version, epoch, base_seq = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise JournalError(f"{path}: not a kvstore_lazy journal (magic {magic!r}, version {version})")
    pos = _HEADER.size
    try:
        (n,) = _U32.unpack_from(data, pos)
        seen = list(struct.unpack_from(f"<{n}Q", data, pos + 4))
        pos += 4 + 8 * n
        (m,) = _U32.unpack_from(data, pos)
        pos += 4
        pending = []
        for _ in range(m):
            (recver,) = _U32.unpack_from(data, pos)
            frames, pos = _unpack_frames(data, pos + 4)
            pending.append((recver, frames))
    except (struct.error, JournalError) as exc:
        raise JournalError(f"{path}: damaged header ({exc})") from None
    out = Contents(epoch, base_seq, seen, pending)
    while pos < len(data):
        if pos + _RECORD.size > len(data):
            out.torn_bytes = len(data) - pos
            break
        kind, length = _RECORD.unpack_from(data, pos)
        body_at = pos + _RECORD.size
        if body_at + length > len(data) or (kind == b"\0" and not any(data[pos:])):
            # an incomplete last record, or zeros where a power cut left the file longer than its data
            out.torn_bytes = len(data) - pos
            break
        body = data[body_at:body_at + length]
        if kind == b"M":
            seq, sender = _MSG.unpack_from(body, 0)
            frames, end = _unpack_frames(body, _MSG.size)
            if end != length:
                raise JournalError(f"{path}: request record {seq} has {length - end} stray bytes")
            out.entries.append(Entry(seq, sender, frames))
        elif kind == b"A":
            out.acked.update(struct.unpack_from(f"<{length // 8}Q", body, 0))
        else:
            raise JournalError(f"{path}: unknown record kind {kind!r} at byte {pos}")
        pos = body_at + length
    return out


class Journal:
    """The open journal of one server. `append` is durable against the process dying (the bytes are in the kernel
    when it returns; with ``fsync=True`` also against the machine dying)."""

    def __init__(self, path: str | os.PathLike, epoch: int, seq: int, fsync: bool = False) -> None:
        self.path = Path(path)
        self.epoch = epoch
        self.seq = seq                  # seq of the last request appended
        self.fsync = fsync
        self._fd: int | None = None
        self._acks: list[int] = []
        self.bytes_written = 0

    @classmethod
    def create(cls, path, epoch: int, base_seq: int = 0, seen=(), pending=(), fsync: bool = False) -> "Journal":
        journal = cls(path, epoch, base_seq, fsync)
        journal._write_header(base_seq, seen, pending)
        return journal

    @classmethod
    def reopen(cls, path, contents: Contents, fsync: bool = False) -> "Journal":
        """Continue appending to an existing journal (after replaying it); a torn tail is cut off first."""
        journal = cls(path, contents.epoch, contents.entries[-1].seq if contents.entries else contents.base_seq,
                      fsync)
        journal._fd = os.open(journal.path, os.O_WRONLY | os.O_APPEND)
        if contents.torn_bytes:
            os.ftruncate(journal._fd, os.fstat(journal._fd).st_size - contents.torn_bytes)
        return journal

    def _write_header(self, base_seq: int, seen, pending) -> None:
        seen = list(seen)
        parts = [_HEADER.pack(MAGIC, VERSION, self.epoch, base_seq), _U32.pack(len(seen)),
                 struct.pack(f"<{len(seen)}Q", *seen), _U32.pack(len(pending))]
        for recver, frames in pending:
            parts += [_U32.pack(recver), _pack_frames(frames)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(b"".join(parts))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)       # always (once a rotation): the snapshot about to commit names this file
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.seq = base_seq

    def append(self, sender: int, frames) -> int:
        """Write one received request (its meta and data frames); returns its seq."""
        self.seq += 1
        payload = _MSG.pack(self.seq, sender) + _pack_frames(frames)
        self._write(self._ack_record() + _RECORD.pack(b"M", len(payload)) + payload)
        return self.seq

    def ack(self, signature: int) -> None:
        """Note that a peer ACKed one of our replies (written with the next request, or by `flush`)."""
        self._acks.append(signature)

    def flush(self) -> None:
        if self._acks:
            self._write(self._ack_record())

    def _ack_record(self) -> bytes:
        if not self._acks:
            return b""
        body = struct.pack(f"<{len(self._acks)}Q", *self._acks)
        self._acks.clear()
        return _RECORD.pack(b"A", len(body)) + body

    def _write(self, data: bytes) -> None:
        assert self._fd is not None, "a write after close"
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self._fd)
        self.bytes_written += len(data)

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.flush()
            finally:
                os.close(self._fd)
                self._fd = None
