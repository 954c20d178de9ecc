"""A tracing layer over the file-system calls a server makes, and the crash states built from a trace.

Owns: :class:`Tracer` (wraps ``os``'s, ``shutil``'s and ``open``'s durability calls in this process: every call on
the main thread is a numbered *point*, and a hook runs just before and just after it), :class:`Durable` (what an
fsync of any thread made durable, by inode: the power-loss model), and :func:`copy_state` (the directories as a
process killed at that instant leaves them, hard links kept; or, with a :class:`Durable`, as a power cut leaves
them).
Does not own: the cycle that is traced or what a recovery must give (``crashcycle``).

The crash states, as ALICE (OSDI'14) and CrashMonkey (OSDI'18) build them:

- **process death** (SIGKILL, the OOM killer): the file system is exactly what the calls so far made of it; a copy
  taken just before and just after a point is the state a kill at that instant leaves (``except`` / ``finally``
  clean-ups never run: the copy is taken in the hook, nothing is raised into the code under test).
- **power loss**: metadata operations (create, rename, link, unlink, mkdir) persist in program order (what ext4's
  and XFS's journals give; a prefix of them is an earlier point), and the *data* of every file is what it held at
  its last fsync (by inode; a file never fsynced comes back empty): every write not made durable by an fsync is
  dropped. A file created again at an inode number reused forgets what an older file there had made durable.
"""
from __future__ import annotations

import builtins
import io
import os
import shutil
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_REAL = {name: getattr(os, name) for name in ("rename", "replace", "link", "unlink", "remove", "rmdir", "mkdir",
                                              "fsync", "write", "ftruncate", "posix_fallocate", "open")}
_REAL_RMTREE = shutil.rmtree
_REAL_OPEN = io.open


@dataclass(frozen=True)
class Point:
    index: int
    call: str          # os.rename, os.fsync, open, shutil.rmtree, ...
    target: str        # the path it names (or the file of an fd), for a reader of a failure

    def __str__(self) -> str:
        return f"#{self.index} {self.call}({self.target})"


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


class Durable:
    """inode -> the bytes its last fsync made durable (the power-loss model). Files only; created files start
    empty (nothing of them is durable until an fsync)."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}

    def created(self, fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            self.data[st.st_ino] = b""

    def synced(self, fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            with _REAL_OPEN(f"/proc/self/fd/{fd}", "rb") as fh:
                self.data[st.st_ino] = fh.read()


class Tracer:
    """Install with ``with Tracer(hook):``; ``hook(point, when)`` runs with ``when`` "before" and "after" every
    traced call of the main thread (calls of other threads and of the hook itself pass through untraced)."""

    def __init__(self, hook: Callable[[Point, str], None], durable: Durable | None = None) -> None:
        self.hook = hook
        self.durable = durable
        self.points: list[Point] = []
        self._main = threading.get_ident()
        self._inside = False

    # -- the wrapping

    def _traced(self, call: str, target: Callable[..., str], real: Callable, after: Callable | None = None):
        def wrapper(*args, **kwargs):
            if self._inside or threading.get_ident() != self._main:
                result = real(*args, **kwargs)
                if after is not None and threading.get_ident() != self._main:
                    after(result, *args, **kwargs)      # another thread's fsync makes data durable too (no point)
                return result
            point = Point(len(self.points), call, target(*args, **kwargs))
            self.points.append(point)
            self._call_hook(point, "before")
            result = real(*args, **kwargs)
            if after is not None:
                with self.paused():
                    after(result, *args, **kwargs)
            self._call_hook(point, "after")
            return result
        return wrapper

    def _call_hook(self, point: Point, when: str) -> None:
        with self.paused():
            self.hook(point, when)

    @contextmanager
    def paused(self) -> Iterator[None]:
        inside, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = inside

    def _wrappers(self) -> list[tuple[object, str, Callable]]:
        path = lambda p, *a, **k: os.fspath(p) if not isinstance(p, int) else _fd_path(p)  # noqa: E731
        fd = lambda f, *a, **k: _fd_path(f)  # noqa: E731
        durable = self.durable
        out: list[tuple[object, str, Callable]] = []
        for name in ("rename", "replace", "link", "unlink", "remove", "rmdir", "mkdir"):
            out.append((os, name, self._traced(f"os.{name}", path, _REAL[name])))
        synced = (lambda result, f: durable.synced(f)) if durable is not None else None
        out.append((os, "fsync", self._traced("os.fsync", fd, _REAL["fsync"], synced)))
        for name in ("write", "ftruncate", "posix_fallocate"):
            out.append((os, name, self._traced(f"os.{name}", fd, _REAL[name])))
        out.append((shutil, "rmtree", self._traced("shutil.rmtree", path, _REAL_RMTREE)))
        traced_os_open = self._traced("os.open", path, _REAL["open"])
        traced_open = self._traced("open", path, _REAL_OPEN)

        def fresh(file, truncates: bool) -> bool:
            return durable is not None and (truncates or not os.path.exists(file))

        def os_open(file, flags, *args, **kwargs):
            if not flags & _WRITE_FLAGS:
                return _REAL["open"](file, flags, *args, **kwargs)
            new = fresh(file, bool(flags & os.O_TRUNC))
            fd_ = traced_os_open(file, flags, *args, **kwargs)
            if new and durable is not None:
                durable.created(fd_)
            return fd_
        out.append((os, "open", os_open))

        def py_open(file, mode="r", *args, **kwargs):
            if isinstance(file, int) or not any(c in mode for c in "wax+"):
                return _REAL_OPEN(file, mode, *args, **kwargs)
            new = fresh(file, "w" in mode)
            fh = traced_open(file, mode, *args, **kwargs)
            if new and durable is not None:
                durable.created(fh.fileno())
            return fh
        out += [(builtins, "open", py_open), (io, "open", py_open)]
        return out

    def __enter__(self) -> "Tracer":
        self._saved = []
        for module, name, wrapper in self._wrappers():
            self._saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)


def copy_state(sources: dict[str, Path], into: Path, durable: Durable | None = None) -> None:
    """Copy each source directory to ``into/<name>``, hard links kept (a snapshot's disk tier links the live
    store's segments: the copy must too). With `durable`, every file holds what its last fsync made durable
    (empty if none): the power-loss model."""
    links: dict[tuple[int, int], Path] = {}
    for name, source in sources.items():
        if not source.exists():
            continue
        for root, dirs, files in os.walk(source):
            rel = Path(root).relative_to(source)
            (into / name / rel).mkdir(parents=True, exist_ok=True)
            for file in files:
                src, dst = Path(root) / file, into / name / rel / file
                try:
                    st = os.lstat(src)
                except FileNotFoundError:     # (only a thread of the process under test removes files)
                    continue
                seen = links.get((st.st_dev, st.st_ino))
                if seen is not None:
                    os.link(seen, dst)
                    continue
                if durable is None:
                    shutil.copyfile(src, dst)
                else:
                    with _REAL_OPEN(dst, "wb") as fh:
                        fh.write(durable.data.get(st.st_ino, b""))
                links[(st.st_dev, st.st_ino)] = dst
