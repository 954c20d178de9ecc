"""Atomic files and server snapshots: only the rows that exist, with their optimizer states.

Owns: writing a file or a directory so that a crash mid-write leaves the previous version intact (temp file, fsync,
rename, fsync of the directory), and the snapshot layout a server writes and reloads. numpy only; snapshots are
``.npz`` files read with ``allow_pickle=False`` and a JSON manifest checked before anything is loaded.

Snapshot layout (one directory per server rank)::

    <dir>/rank<r>/manifest.json   {"format": 1, "rank": r, "num_servers": S, "keys": {"<key>": {...}},
                                   "writer": {"host": advertised host, "port": p}}
    <dir>/rank<r>/key<k>.npz      row_ids (uint64, global, sorted), weights (rows, row_size), state0, state1, ...
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

FORMAT = 1
TAGGED_DIR = "tagged"   # <dir>/tagged/rank<r>: the snapshot a LAZY_SNAPSHOT command with a tag asked for


class SnapshotError(ValueError):
    pass


def fsync_path(path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename in it durable)."""
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[object], None], mode: str = "wb") -> None:
    """Write `path` via `write(fileobj)` into a temp file beside it, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Build a directory with `fill(tmpdir)` and swap it in for `path`; the old one stays until the swap."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        fill(tmp)
        for child in tmp.iterdir():
            with open(child, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_snapshot(directory: str | os.PathLike, rank: int, num_servers: int, tables: dict[int, dict],
                   server: dict | None = None, writer: dict | None = None) -> Path:
    """Write one server's rows. `tables` maps key -> {"row_ids", "weights", "states", "meta"} (meta: JSON-able);
    `server` is JSON-able server-wide state (mode, optimizer, declarations); `writer` the advertised host and port
    of the server writing it (``lifecycle.check_snapshot_owner``)."""
    target = Path(directory) / f"rank{rank}"

    def fill(tmp: Path) -> None:
        manifest = {"format": FORMAT, "rank": rank, "num_servers": num_servers, "server": server or {}, "keys": {}}
        if writer is not None:
            manifest["writer"] = writer
        for key, table in tables.items():
            arrays = {"row_ids": np.asarray(table["row_ids"], np.uint64), "weights": np.asarray(table["weights"])}
            for i, state in enumerate(table.get("states", [])):
                arrays[f"state{i}"] = np.asarray(state)
            np.savez(tmp / f"key{key}.npz", **arrays)
            manifest["keys"][str(key)] = dict(table.get("meta", {}), rows=int(len(arrays["row_ids"])),
                                              num_states=len(table.get("states", [])))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))

    atomic_write_dir(target, fill)
    return target


def read_manifest(directory: str | os.PathLike, rank: int) -> dict | None:
    path = Path(directory) / f"rank{rank}" / "manifest.json"
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{path}: not JSON ({exc})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("keys"), dict):
        raise SnapshotError(f"{path}: unknown snapshot format {manifest.get('format')!r}")
    return manifest


def read_snapshot_key(directory: str | os.PathLike, rank: int, key: int, expected: dict) -> dict:
    """Load one key's arrays, checking them against the manifest entry `expected`."""
    path = Path(directory) / f"rank{rank}" / f"key{key}.npz"
    with np.load(path, allow_pickle=False) as data:
        row_ids = data["row_ids"]
        weights = data["weights"]
        states = [data[f"state{i}"] for i in range(expected.get("num_states", 0))]
    if len(row_ids) != expected["rows"] or weights.shape[0] != len(row_ids):
        raise SnapshotError(f"{path}: {len(row_ids)} row ids and {weights.shape[0]} weight rows, manifest says "
                            f"{expected['rows']}")
    if any(s.shape != weights.shape for s in states):
        raise SnapshotError(f"{path}: optimizer state shapes differ from the weights")
    return {"row_ids": row_ids, "weights": weights, "states": states}


def read_tags(directory: str | os.PathLike) -> dict[int, object]:
    """rank -> tag of the tagged snapshots in `directory` (what a restarted job's workers resume from)."""
    tags = {}
    for path in sorted((Path(directory) / TAGGED_DIR).glob("rank*/manifest.json")):
        manifest = json.loads(path.read_text())
        tags[int(manifest["rank"])] = manifest.get("server", {}).get("tag")
    return tags


def common_tag(directory: str | os.PathLike, num_servers: int):
    """The tag every server's tagged snapshot carries, or None if there are none; SnapshotError if they differ
    (a job killed while its servers were writing them) or some server has none."""
    tags = read_tags(directory)
    if not tags:
        return None
    values = {json.dumps(tags.get(rank), sort_keys=True) for rank in range(num_servers)}
    if len(values) != 1 or set(tags) != set(range(num_servers)):
        raise SnapshotError(f"the tagged snapshots in {directory} do not agree: {tags} (for {num_servers} servers); "
                            f"resume from an older checkpoint")
    return tags[0]
