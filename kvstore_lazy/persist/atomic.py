"""Atomic files and directories: a crash mid-write leaves the previous version intact.

Owns: writing a file (temp file beside it, fsync, rename over it, fsync of the directory) or a whole directory
(built under a temp name, swapped in by renames) so that there is never a moment without a valid version; the
sha256 of a file. A *companion* may run between the fsync of the new file and its rename, and after the rename:
that is how a checkpoint's sidecar describes the new file before it replaces the old one (``sidecar``).
Does not own: what is in the files (``snapshots``, ``sidecar``, ``journal``, ``ndfile``).

New files are created with mode 0666 less the umask, as open() would create them, not tempfile.mkstemp's 0600
(which would make every checkpoint private to its writer).
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Protocol

from kvstore_lazy.store.segments import fsync_path


class Companion(Protocol):
    """What else an atomic write of `path` changes, in the crash-safe order: `before_rename` once the new file
    (`new_file`, fsynced) is complete and `path` still holds the old one; `after_rename` once `path` is the new."""

    def before_rename(self, path: Path, new_file: str) -> None: ...

    def after_rename(self, path: Path) -> None: ...


def _new_temp(path: Path) -> str:
    """A new empty file beside `path`, created with mode 0666 less the umask, as open() would create `path` itself
    (tempfile.mkstemp's 0600 would make every checkpoint private to its writer)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name beside {path}")


@contextmanager
def atomic_path(path: str | os.PathLike, companion: Companion | None = None) -> Iterator[str]:
    """Yield a temp path beside `path` to write the new file to; then fsync it and rename it over `path` (and fsync
    the directory). On any error the temp file is removed and `path` is untouched. `companion` (see
    :class:`Companion`) runs around the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp(path)
    try:
        yield tmp
        fsync_path(Path(tmp))
        if companion is not None:
            companion.before_rename(path, tmp)
        os.replace(tmp, path)
        if companion is not None:
            companion.after_rename(path)
        fsync_path(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, write: Callable, mode: str = "wb",
                 companion: Companion | None = None) -> None:
    """Write `path` via `write(fileobj)` into a temp file beside it, fsync, then rename over `path`."""
    with atomic_path(path, companion) as tmp, open(tmp, mode) as fh:
        write(fh)
        fh.flush()


def atomic_write_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Build a directory with `fill(tmpdir)` and swap it in for `path`; the old one stays until the swap."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        fill(tmp)
        for child in tmp.iterdir():
            if child.is_dir():        # a disk tier's store: committed (fsynced) by its own commit
                continue
            with open(child, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_path(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_path(path.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of the file at `path`, read 1 MiB at a time."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(1 << 20)
            if not block:
                return digest.hexdigest(), size
            digest.update(block)
            size += len(block)
