"""A worker checkpoint's listing of a key's row ids: the ids that existed at one LAZY_ROWS, read back by position.

Owns: :class:`Listing`, what ``state_transfer`` keeps per requesting node between a LAZY_ROWS command and the
virtual pulls that read it (or a pushed listing and the state pushes that follow it). A key with a disk tier has
the listing written, ascending, to an unnamed temporary file in its store's directory (``O_TMPFILE``: no name, so
nothing is left behind by a crash and nothing else in the directory sees it), streamed from the key's sorted walk
of its rows (``RowKeyStates.row_id_chunks``): its RAM is a piece of :data:`PIECE` ids, whatever the key's size (8
bytes a row of a 20M-row key was 152 MB, twice that while sorted). A key without one keeps the ids in memory (its
rows are in memory too: the listing is 8 bytes beside each row's weights and states). The file is closed (and so
gone) when the listing is dropped: replaced by the node's next one, or the process ends.
Does not own: which rows exist or their order (the key's), the virtual keys' wire layout (``state_transfer``).
"""
from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

PIECE = 1 << 16             # ids read or written at a time (512 KiB)


class Listing:
    """``count`` row ids (uint64, ascending) of key ``key``, in memory (``ids``) or in a temporary file."""

    def __init__(self, key: int, ids: np.ndarray | None = None, fd: int | None = None, count: int = 0) -> None:
        self.key = key
        self._ids = ids
        self._fd = fd                   # (a raw descriptor: closed by close() or when the listing goes)
        self.count = len(ids) if ids is not None else int(count)

    @classmethod
    def of_array(cls, key: int, ids: np.ndarray) -> "Listing":
        return cls(key, ids=np.asarray(ids, np.uint64))

    @classmethod
    def to_file(cls, key: int, pieces: Iterable[np.ndarray], directory: Path) -> "Listing":
        """The ids of ``pieces`` (ascending) written to an unnamed temporary file in ``directory`` (OSError if
        that fails: no file is left)."""
        fd = _unnamed_file(directory)
        count = 0
        try:
            for ids in pieces:
                data = memoryview(np.ascontiguousarray(ids, np.uint64).view(np.uint8).data)
                while len(data):
                    data = data[os.write(fd, data):]
                count += len(ids)
        except BaseException:
            os.close(fd)
            raise
        return cls(key, fd=fd, count=count)

    def __len__(self) -> int:
        return self.count

    @property
    def in_memory(self) -> bool:
        return self._ids is not None

    def ids(self, lo: int, hi: int) -> np.ndarray:
        """Ids ``lo .. hi - 1`` (clipped to the listing), a new array (or a view of the listing in memory)."""
        lo, hi = max(0, lo), min(hi, self.count)
        if hi <= lo:
            return np.zeros(0, np.uint64)
        if self._ids is not None:
            return self._ids[lo:hi]
        out = np.empty(hi - lo, np.uint64)
        view, at = out.view(np.uint8).data, 8 * lo
        while len(view):
            got = os.preadv(self._fd, [view], at)
            if got <= 0:
                raise OSError(f"row listing of key {self.key}: file ended at byte {at}")
            view, at = view[got:], at + got
        return out

    def fill(self, out: np.ndarray, lo: int) -> None:
        """``out`` (1-d, float64: the row-listing key's values) from id ``lo`` on: ids ``lo .. lo + len(out)``
        where there are, the rest untouched; PIECE ids at a time (no second copy of a reply's ids)."""
        end = min(lo + len(out), self.count)
        for at in range(lo, end, PIECE):
            part = self.ids(at, min(at + PIECE, end))
            out[at - lo:at - lo + len(part)] = part

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._ids = None

    def __del__(self) -> None:
        self.close()            # (a server dropped with its listings: the files go with it, quietly)


def _unnamed_file(directory: Path) -> int:
    """A descriptor of a new file in ``directory`` that has no name: O_TMPFILE, or where the file system has none a
    file made and unlinked at once (a crash in between leaves a ``.listing.*`` file in the store's directory, which
    the next start removes with the rest of the store, clear_dir)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, name = tempfile.mkstemp(dir=directory, prefix=".listing.")
    os.unlink(name)
    return fd
