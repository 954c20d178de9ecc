"""The name of every file and directory the project writes (as LevelDB's ``db/filename.h`` names its files).

Owns: the layout of a snapshot directory (``KVSTORE_LAZY_SNAPSHOT_DIR``), of a disk tier directory
(``KVSTORE_LAZY_DISK_DIR``), of a disk tier store, the names of temporary files and directories an interrupted
write leaves, and the sidecar beside a worker checkpoint. Every module that makes or finds one of these paths asks
here, so a reader sees the whole layout in one screen and a change of name is one change.
Does not own: what the files hold (``persist.snapshots``, ``persist.journal``, ``store.segments``, ``node.placement``
say that) or when they are written.

Layout::

    <snapshot dir>/rank<r>/manifest.json            a server's base snapshot (and its key<k>.npz, key<k>.disk/)
    <snapshot dir>/rank<r>/delta-000001/             the deltas after it, in order
    <snapshot dir>/tagged/rank<r>/                   the last snapshot a worker asked for with a tag
    <snapshot dir>/journal.rank<r>.<epoch>.<seq>     the requests since the snapshot at journal seq <seq>
    <snapshot dir>/node.rank<r>.json                 who the server was in its job (for a rejoin)
    <disk dir>/rank<r>/key<k>/store.json             a key's disk tier store: layout, index.npz, seg-000001.dat...,
                                                     idx-000001.run... (its index runs)
    <file>.lazy.json                                 beside a worker checkpoint: how its absent rows are computed
    .<name>.<pid>.<hex>.tmp, .<name>.XXXX.tmp/, .<name>.old   what an interrupted atomic write leaves beside <name>
    .<name>.new/                                     a new version of directory <name>, COMMITTED, not yet swapped in
    <file>.tmp                                       the journal's and a disk tier store's temp files

A directory (a base, a delta, a tagged snapshot) is replaced in four steps (``persist.atomic.atomic_write_dir``):
built as ``.<name>.XXXX.tmp``, renamed to ``.<name>.new`` (the commit point), ``<name>`` renamed to
``.<name>.old``, ``.<name>.new`` renamed to ``<name>``. So the committed version is ``.<name>.new`` when it
exists, else ``<name>`` (:func:`committed_dir`); everything else :func:`leftovers` lists is garbage.
"""
from __future__ import annotations

import os
from pathlib import Path

PathLike = str | os.PathLike

TAGGED_DIR = "tagged"
MANIFEST = "manifest.json"
STORE_FILE = "store.json"
INDEX_FILE = "index.npz"
SEGMENT_GLOB = "seg-*.dat"
RUN_PREFIX, RUN_SUFFIX = "idx-", ".run"             # a disk tier store's index runs: idx-000001.run ...
SIDECAR_SUFFIX = ".lazy.json"
TEMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
NEW_SUFFIX = ".new"


# ---- a snapshot directory

def rank_dir(directory: PathLike, rank: int) -> Path:
    """A server's snapshot chain: its base, with the deltas inside."""
    return Path(directory) / f"rank{rank}"


def tagged_dir(directory: PathLike) -> Path:
    return Path(directory) / TAGGED_DIR


def manifest(snapshot: PathLike) -> Path:
    """The manifest of a base or a delta directory."""
    return Path(snapshot) / MANIFEST


def key_file(snapshot: PathLike, key: int) -> Path:
    return Path(snapshot) / f"key{key}.npz"


def key_disk_name(key: int) -> str:
    """The name, inside a snapshot, of the copy of a key's disk tier store."""
    return f"key{key}.disk"


def delta_dir(directory: PathLike, rank: int, seq: int) -> Path:
    return rank_dir(directory, rank) / f"delta-{seq:06d}"


def journal(directory: PathLike, rank: int, epoch: int, base_seq: int) -> Path:
    return Path(directory) / f"journal.rank{rank}.{epoch:016x}.{base_seq}"


def journals(directory: PathLike, rank: int) -> list[Path]:
    """Every journal file of `rank` in `directory`."""
    return sorted(Path(directory).glob(f"journal.rank{rank}.*"))


def membership(directory: PathLike, rank: int) -> Path:
    return Path(directory) / f"node.rank{rank}.json"


def memberships(directory: PathLike) -> list[Path]:
    return sorted(Path(directory).glob("node.rank*.json"))


# ---- a disk tier

def disk_store(disk_dir: PathLike, rank: int, key: int) -> Path:
    """One key's disk tier store on one server."""
    return Path(disk_dir) / f"rank{rank}" / f"key{key}"


def segment(store: PathLike, number: int) -> Path:
    return Path(store) / f"seg-{number:06d}.dat"


def index_run(store: PathLike, number: int) -> Path:
    """The ``number``-th index run a disk tier store's RunIndex wrote (``store.disk.runfile``)."""
    return Path(store) / f"{RUN_PREFIX}{number:06d}{RUN_SUFFIX}"


# ---- worker checkpoints

def sidecar(checkpoint: PathLike) -> Path:
    path = Path(checkpoint)
    return path.with_name(path.name + SIDECAR_SUFFIX)


# ---- what atomic writes leave while they run

def temp_file(path: PathLike, tag: str) -> Path:
    """A temporary name beside `path` (``.<name>.<tag>.tmp``): renamed over `path` when complete."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}{TEMP_SUFFIX}")


def temp_dir_prefix(path: PathLike) -> str:
    """The prefix of the temporary directories (``tempfile.mkdtemp``, suffix :data:`TEMP_SUFFIX`) a new version of
    directory `path` is built in."""
    return f".{Path(path).name}."


def old_dir(path: PathLike) -> Path:
    """Where the previous version of directory `path` stands while the new one is renamed in."""
    path = Path(path)
    return path.with_name(f".{path.name}{OLD_SUFFIX}")


def new_dir(path: PathLike) -> Path:
    """Where a complete new version of directory `path` is committed (one rename) before it is swapped in."""
    path = Path(path)
    return path.with_name(f".{path.name}{NEW_SUFFIX}")


def committed_dir(path: PathLike) -> Path:
    """The committed version of directory `path`: its ``.new`` if a swap was interrupted after the commit, else
    `path` itself (which may not exist)."""
    new = new_dir(path)
    return new if new.is_dir() else Path(path)


def leftovers(path: PathLike) -> list[Path]:
    """What interrupted atomic writes of `path` left beside it: temp files and directories (``.<name>.*``: ours
    end in ``.tmp``; older versions made ``.<name>.XXXXXXXX/``), the previous version ``.<name>.old`` and the
    journal's ``<name>.tmp``; never the committed ``.<name>.new``."""
    path = Path(path)
    new = new_dir(path)
    found = [p for p in path.parent.glob(f".{_glob_escape(path.name)}.*") if p != new]
    plain = temp_of(path)
    if plain.exists() or plain.is_symlink():
        found.append(plain)
    return sorted(found)


def temp_of(path: PathLike) -> Path:
    """``<name>.tmp``: the temp file of a write that is renamed over `path` (the journal's, a disk tier store's)."""
    path = Path(path)
    return path.with_name(path.name + TEMP_SUFFIX)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
