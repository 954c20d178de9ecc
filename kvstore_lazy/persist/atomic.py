"""Atomic files and directories: a crash mid-write leaves the previous version intact.

Owns: writing a file (temp file beside it, fsync, rename over it, fsync of the directory) or a whole directory
(built under a temp name, committed by one rename, then swapped in: :func:`atomic_write_dir`) so that there is
never a moment without a committed version; finishing or undoing what an interrupted write left
(:func:`settle_dir`); the sha256 of a file. A *companion* may run between the fsync of the new file and its
rename, and after the rename: that is how a checkpoint's sidecar describes the new file before it replaces the
old one (``sidecar``).
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

from kvstore_lazy import paths
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
        tmp = paths.temp_file(path, f"{os.getpid()}.{secrets.token_hex(4)}")
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
    """Build a directory with `fill(tmpdir)` and swap it in for `path`, so that whatever instant the process dies
    (or the power goes), the directory committed is the previous version or the new one, whole:

    1. ``.<name>.XXXX.tmp`` is made and filled; its files and then the directory itself are fsynced;
    2. it is renamed to ``.<name>.new`` and the parent fsynced: **the commit point** (the new version is complete
       and durable under a name a restart looks for);
    3. ``<name>`` is renamed to ``.<name>.old``, ``.<name>.new`` to ``<name>``, the parent fsynced;
    4. ``.<name>.old`` is removed.

    ``paths.committed_dir`` says which one is committed at any moment (``.new`` if it exists, else ``<name>``), and
    :func:`settle_dir` (run first here, and by a server at start) finishes steps 3-4 of an interrupted swap and
    removes what an interrupted one left (temp directories, ``.old``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    settle_dir(path)
    tmp = Path(tempfile.mkdtemp(prefix=paths.temp_dir_prefix(path), suffix=paths.TEMP_SUFFIX, dir=path.parent))
    try:
        fill(tmp)
        for child in sorted(tmp.iterdir()):
            if child.is_dir():        # a disk tier's store: committed (fsynced) by its own commit
                continue
            fsync_path(child)
        fsync_path(tmp)
        os.rename(tmp, paths.new_dir(path))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(path.parent)          # committed
    _swap_in(path)


def _swap_in(path: Path) -> None:
    """Steps 3 and 4 of :func:`atomic_write_dir`: the committed ``.<name>.new`` becomes `path`."""
    new, old = paths.new_dir(path), paths.old_dir(path)
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
    os.rename(new, path)
    fsync_path(path.parent)
    if old.exists():
        shutil.rmtree(old)


def settle_dir(path: str | os.PathLike) -> bool:
    """Bring directory `path` to its committed version: finish a swap interrupted after its commit (the committed
    ``.<name>.new`` swapped in), then remove every leftover beside it (``paths.leftovers``: temp directories and
    files, ``.old``). Returns whether there was anything to do. Safe to run at any moment no write of `path` is
    under way, and again after a crash in the middle of it."""
    path = Path(path)
    did = False
    if paths.new_dir(path).is_dir():
        _swap_in(path)
        did = True
    for leftover in paths.leftovers(path):
        remove_path(leftover)
        did = True
    if did and path.parent.exists():
        fsync_path(path.parent)
    return did


def remove_path(path: Path) -> None:
    """Remove a file or a directory tree (a leftover; gone already is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
