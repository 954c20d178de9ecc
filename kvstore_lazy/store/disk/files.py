"""The files of a store directory: their names, and the file-system steps that write them safely.

Owns: the names of the files a store writes, as :mod:`kvstore_lazy.paths` spells them (``store.json``,
``index.npz``, ``seg-NNNNNN.dat``, the ``.tmp`` of an atomic write), creating a segment with its space reserved,
atomic replacement (temp file, fsync, rename, fsync of the directory), fsync by path, and hard-linking a segment
into another directory (a snapshot).
Does not own: what goes into the files (:mod:`.layout`, :mod:`.commit`) or when they are written.

Space for a segment is reserved when it is created (``posix_fallocate``), so a full disk shows up there, never as
a half-written record, as a :class:`~.errors.DiskError` naming the directory.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from kvstore_lazy import paths
from kvstore_lazy.store.disk.errors import DiskError

STORE_FILE = paths.STORE_FILE     # the record layout, written once
INDEX_FILE = paths.INDEX_FILE     # the committed index: the commit point
SEGMENT_GLOB = paths.SEGMENT_GLOB


def segment_name(number: int) -> str:
    """The file name of the ``number``-th segment a store made (numbers are never reused; slots are)."""
    return paths.segment(".", number).name


def fsync_path(path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(target: Path, data) -> None:
    """Write ``target`` atomically: ``data`` (bytes, or a function writing to the open file)."""
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data) if isinstance(data, bytes) else data(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_path(target.parent)


def create_segment(directory: Path, name: str, nbytes: int) -> None:
    """A new segment file ``name`` of ``nbytes`` bytes, its space reserved (a full disk: DiskError, no file left)."""
    file = directory / name
    fd = -1
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError as exc:
        if fd >= 0:
            file.unlink(missing_ok=True)
        raise DiskError(exc.errno, f"disk tier {directory}: cannot create a segment of {nbytes} bytes: "
                                   f"{exc.strerror or exc}") from exc


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link (segments are never rewritten below a committed fill), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(source, target)
