"""Atomic files, server snapshots, and what a checkpoint of lazy rows needs to rebuild the rows it does not hold.

Owns: writing a file or a directory so that a crash mid-write leaves the previous version intact (temp file, fsync,
rename, fsync of the directory); the snapshot layout a server writes and reloads: a full snapshot (the *base*)
plus incremental *deltas*; the sidecar that describes the lazy parameters of a checkpoint file, and ``densify``
(``python -m kvstore_lazy.persist.checkpoint densify IN OUT``), which writes a stock file with absent rows filled in.
numpy
only (never mxnet: the server imports this module); snapshots are ``.npz`` files read with ``allow_pickle=False``
and JSON manifests checked before anything is loaded; MXNet's NDArray files are read and written by ``ndfile``.

Snapshot layout (one directory per server rank)::

    <dir>/rank<r>/manifest.json   {"format": 1, "rank": r, "num_servers": S, "server": {...}, "chain": {"id": C},
                                   "writer": {"host": advertised host, "port": p},
                                   "keys": {"<key>": {meta..., "rows": n, "num_states": s, "arrays": [names]}}}
    <dir>/rank<r>/key<k>.npz      row_ids (uint64, global, sorted), weights (rows, row_size), state0, state1, ...,
                                  and the named per-row arrays: col_<name> (row columns: a policy's last push
                                  round, count...), pending_ids/pending_count/pending_last (ids waiting for
                                  admission, sorted)
    <dir>/rank<r>/delta-000001/   the first delta after the base, then delta-000002, ... (see below)

Incremental snapshots (:class:`SnapshotChain`, :func:`load_snapshot`)::

    rank<r>/manifest.json ──sha256──┐          ┌──sha256──┐
      "chain": {"id": C}            │          │          │
    rank<r>/delta-000001/manifest.json         │     rank<r>/delta-000002/manifest.json   ...
      {"format": "delta-1", "chain": C, "seq": 1,         {"chain": C, "seq": 2,
       "prev": {"seq": 0, "sha256": <base manifest>},       "prev": {"seq": 1, "sha256": <delta 1 manifest>},
       "server": {...state now...},                         ...}
       "keys": {"<k>": {"mode": "delta"|"full", "sha256": <key<k>.npz>, meta...}}}
    rank<r>/delta-000001/key<k>.npz   mode delta: the rows created or written since the previous snapshot (same
                                      arrays as a base, those rows only), dead_ids (sorted): rows removed since
                                      then and not re-created (tombstones: a removed row is *absent*, never a value),
                                      pending_dead likewise for the pending ids; mode full: the whole key (new, or
                                      rebuilt since: new optimizer, multi-precision), as in a base.

A delta holds what changed since the snapshot before it (base or delta), so a restore reads the base and then every
delta in order, the newest's ``server`` state ruling. The loader refuses (SnapshotError naming the file) a delta
whose ``seq`` does not follow its predecessor (a gap), whose ``chain`` is not the base's or whose ``prev`` checksum
is not its predecessor manifest's (a stale delta: left by another chain, or its predecessor was rewritten), or whose
files do not match their checksums (corrupted). A new base replaces the whole ``rank<r>`` directory atomically
(deltas included): that is the compaction, after ``max_deltas`` deltas or once the deltas' bytes pass the base's.
Checkpoint sidecar. A checkpoint (``mx.nd.save`` format) holds a lazy parameter as a RowSparseNDArray of the rows
that exist; what the absent rows are is said beside it, in ``<file>.lazy.json``, not in the file: stock readers
must keep loading the file unchanged, and an extra entry breaks two of them (Gluon ``load_parameters`` refuses a
name it has no parameter for unless ``ignore_extra``, and so does ``SymbolBlock.imports``; ``BaseModule.load_params``
refuses a name that is not ``arg:``/``aux:``; only ``mx.nd.load`` and ``mx.model.load_checkpoint`` ignore one)::

    {"format": "kvstore_lazy.checkpoint/1",
     "versions": [{"sha256": "<hex of the whole file>", "bytes": <its size>,
                   "params": {"<entry name>": {"key": <kv key id>, "rows": <full rows>, "row_shape": [...],
                                               "dtype": "float32", "init": "<Initializer.dumps()>", "seed": <seed>},
                              ...}},
                  ...]}

A row absent from the file has the value ``parse_initializer(init).rows(seed, key, [row], (rows,) + row_shape,
dtype)``: the function the servers computed it with. Each version names the exact file it describes (sha256 and
size), so a sidecar is never applied to a file it was not written for. Order of a save (:func:`atomic_path`): the
new file is written and fsynced under a temp name, the sidecar is rewritten (atomically) with the new version first
and the version describing the file still in place second, then the file is renamed over the old one. A crash at
any point leaves a file whose version the sidecar holds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kvstore_lazy.persist.ndfile import Entry, NDFileError, Writer, chunked, read_index, read_row_ids, read_values
from kvstore_lazy.numerics.initializers import InitializerError, parse_initializer
from kvstore_lazy.store.segments import fsync_path

FORMAT = 1
TAGGED_DIR = "tagged"   # <dir>/tagged/rank<r>: the snapshot a LAZY_SNAPSHOT command with a tag asked for
SIDECAR_FORMAT = "kvstore_lazy.checkpoint/1"
SIDECAR_SUFFIX = ".lazy.json"


class SnapshotError(ValueError):
    pass


class CheckpointError(ValueError):
    """A checkpoint or its sidecar that cannot be used as asked (the message names the file and the reason)."""


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
def atomic_path(path: str | os.PathLike, lazy: dict | None = None) -> Iterator[str]:
    """Yield a temp path beside `path` to write the new file to; then fsync it and rename it over `path` (and fsync
    the directory). On any error the temp file is removed and `path` is untouched.

    `lazy` (entry name -> declaration of the lazy parameter it holds, see the module docstring) also writes the
    sidecar describing the new file, in the crash-safe order above; an empty dict removes a sidecar left by an
    older version of `path`; None leaves sidecars alone (files that are not checkpoints)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp(path)
    try:
        yield tmp
        fsync_path(Path(tmp))
        if lazy:
            _write_sidecar(path, tmp, lazy)
        os.replace(tmp, path)
        if lazy is not None and not lazy:
            sidecar_path(path).unlink(missing_ok=True)
        fsync_path(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, write: Callable[[object], None], mode: str = "wb",
                 lazy: dict | None = None) -> None:
    """Write `path` via `write(fileobj)` into a temp file beside it, fsync, then rename over `path`."""
    with atomic_path(path, lazy) as tmp, open(tmp, mode) as fh:
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


def write_snapshot(directory: str | os.PathLike, rank: int, num_servers: int, tables: dict[int, dict],
                   server: dict | None = None, writer: dict | None = None) -> Path:
    """Write one server's rows (a full snapshot). `tables` maps key -> {"row_ids", "weights", "states", "meta",
    optional "arrays": {name: per-row array}} (meta: JSON-able); `server` is JSON-able server-wide state (mode,
    optimizer, declarations); `writer` the advertised host and port of the server writing it
    (``node_lifecycle.check_snapshot_owner``)."""
    return _write_base(Path(directory) / f"rank{rank}", rank, num_servers, tables, server, None, writer)[0]


def _write_key(directory: Path, key: int, table: dict, checksum: bool) -> dict:
    """key<k>.npz of one key's table; its manifest entry."""
    arrays = {"row_ids": np.asarray(table["row_ids"], np.uint64), "weights": np.asarray(table["weights"])}
    for i, state in enumerate(table.get("states", [])):
        arrays[f"state{i}"] = np.asarray(state)
    extra = table.get("arrays", {})
    for name, value in extra.items():
        arrays[name] = np.asarray(value)
    path = directory / f"key{key}.npz"
    np.savez(path, **arrays)
    entry = dict(table.get("meta", {}), rows=int(len(arrays["row_ids"])), num_states=len(table.get("states", [])),
                 arrays=sorted(extra))
    if "mode" in table:
        entry["mode"] = table["mode"]
    if checksum:
        entry["sha256"] = _file_digest(path)[0]
    disk = table.get("disk")
    if disk is not None:     # the key's disk tier: committed into the snapshot, its segments hard-linked
        name = f"key{key}.disk"
        disk.commit(into=directory / name)
        entry["disk"], entry["disk_sha256"] = name, _file_digest(directory / name / "index.npz")[0]
    return entry


def _disk_of(path: Path, key: str, info: dict) -> Path | None:
    """The disk tier store a snapshot holds for a key (checked against the manifest's checksum of its index)."""
    if not info.get("disk"):
        return None
    where = path / info["disk"]
    index = where / "index.npz"
    if not index.exists() or _file_digest(index)[0] != info.get("disk_sha256"):
        raise SnapshotError(f"{index}: the disk tier of key {key} is missing or corrupted (checksum differs from "
                            f"its manifest); refusing to load")
    return where


def _write_base(target: Path, rank: int, num_servers: int, tables: dict[int, dict], server: dict | None,
                chain: str | None, writer: dict | None = None) -> tuple[Path, str, int]:
    """(path, sha256 of its manifest, bytes written)."""
    out = {}

    def fill(tmp: Path) -> None:
        manifest = {"format": FORMAT, "rank": rank, "num_servers": num_servers, "server": server or {}, "keys": {}}
        if chain is not None:
            manifest["chain"] = {"id": chain}
        if writer is not None:
            manifest["writer"] = writer
        for key, table in tables.items():
            table = {k: v for k, v in table.items() if k != "mode"}
            manifest["keys"][str(key)] = _write_key(tmp, key, table, checksum=False)
        text = json.dumps(manifest, indent=1).encode()
        (tmp / "manifest.json").write_bytes(text)
        out["sha"], out["bytes"] = hashlib.sha256(text).hexdigest(), sum(f.stat().st_size for f in tmp.iterdir())

    atomic_write_dir(target, fill)
    return target, out["sha"], out["bytes"]


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
    """Load one key's arrays of a base, checking them against the manifest entry `expected`."""
    return _read_key(Path(directory) / f"rank{rank}" / f"key{key}.npz", expected)


def _read_key(path: Path, expected: dict) -> dict:
    try:
        with np.load(path, allow_pickle=False) as data:
            row_ids = data["row_ids"]
            weights = data["weights"]
            states = [data[f"state{i}"] for i in range(expected.get("num_states", 0))]
            arrays = {name: data[name] for name in expected.get("arrays", [])}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise SnapshotError(f"{path}: unreadable ({exc})") from None
    if len(row_ids) != expected["rows"] or weights.shape[0] != len(row_ids):
        raise SnapshotError(f"{path}: {len(row_ids)} row ids and {weights.shape[0]} weight rows, manifest says "
                            f"{expected['rows']}")
    if any(s.shape != weights.shape for s in states):
        raise SnapshotError(f"{path}: optimizer state shapes differ from the weights")
    return {"row_ids": row_ids, "weights": weights, "states": states, "arrays": arrays}


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


# ----------------------------------------------------------------------------------------------------------------
# checkpoint sidecars: the lazy parameters of a checkpoint file (format in the module docstring)

_SPEC_FIELDS = ("key", "rows", "row_shape", "dtype", "init", "seed")
_LAZY_DTYPES = ("float16", "float32", "float64")


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{SIDECAR_SUFFIX}")


def lazy_spec(declaration: dict) -> dict:
    """What a sidecar records of a LAZY_DECLARE body (kvstore_lazy.worker.lazy_spec_body): key, full shape, dtype,
    initializer and seed."""
    return {name: declaration[name] for name in _SPEC_FIELDS}


def _file_digest(path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(1 << 20)
            if not block:
                return digest.hexdigest(), size
            digest.update(block)
            size += len(block)


def _read_sidecar(side: Path) -> list[dict]:
    try:
        doc = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{side}: unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT or not isinstance(doc.get("versions"), list):
        raise CheckpointError(f"{side}: not a kvstore_lazy checkpoint sidecar (format {SIDECAR_FORMAT})")
    return doc["versions"]


def _write_sidecar(path: Path, new_file: str, lazy: dict) -> None:
    """Describe `new_file` (about to be renamed to `path`) first and whatever `path` is now second."""
    digest, size = _file_digest(new_file)
    versions = [{"sha256": digest, "bytes": size, "params": {name: lazy_spec(spec) for name, spec in lazy.items()}}]
    side = sidecar_path(path)
    try:
        old = _read_sidecar(side) if side.exists() else []
    except CheckpointError:
        old = []   # overwritten: it described no file this save keeps
    if old and path.exists():
        current_size = path.stat().st_size
        if any(v.get("bytes") == current_size for v in old):
            current = _file_digest(path)
            versions += [v for v in old if (v.get("sha256"), v.get("bytes")) == current][:1]
    atomic_write(side, lambda fh: fh.write(json.dumps({"format": SIDECAR_FORMAT, "versions": versions}, indent=1)),
                 mode="w")


def _checked_spec(side: Path, name: str, spec) -> dict:
    try:
        out = {"key": int(spec["key"]), "rows": int(spec["rows"]),
               "row_shape": [int(d) for d in spec["row_shape"]], "dtype": np.dtype(spec["dtype"]).name,
               "init": str(spec["init"]), "seed": int(spec["seed"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{side}: bad entry for {name!r} ({exc!r})") from None
    if out["rows"] <= 0 or not out["row_shape"] or min(out["row_shape"]) <= 0 or out["dtype"] not in _LAZY_DTYPES:
        raise CheckpointError(f"{side}: bad shape or dtype for {name!r}: {spec}")
    try:
        parse_initializer(out["init"])
    except InitializerError as exc:
        raise CheckpointError(f"{side}: the initializer of {name!r} cannot be computed: {exc}") from None
    return out


def lazy_params(path: str | os.PathLike) -> dict[str, dict] | None:
    """The lazy parameters of checkpoint `path`, by entry name, from its sidecar: None if it has none (a stock
    file). CheckpointError if the sidecar is unreadable, describes another version of the file, or disagrees with
    the file (an entry missing, not row_sparse, or of another shape or dtype)."""
    path = Path(path)
    side = sidecar_path(path)
    if not side.exists():
        return None
    versions = _read_sidecar(side)
    current = _file_digest(path)
    found = [v for v in versions if isinstance(v, dict) and (v.get("sha256"), v.get("bytes")) == current]
    if not found or not isinstance(found[0].get("params"), dict):
        raise CheckpointError(f"{side} does not describe {path} (written for another version of that file, e.g. one "
                              f"saved by code without kvstore_lazy); remove it to read {path.name} as a stock file")
    params = {name: _checked_spec(side, name, spec) for name, spec in found[0]["params"].items()}
    entries = {entry.name: entry for entry in read_index(path)}
    for name, spec in params.items():
        entry = entries.get(name)
        shape = (spec["rows"],) + tuple(spec["row_shape"])
        if entry is None or entry.stype != "row_sparse" or entry.shape != shape or entry.dtype != spec["dtype"]:
            got = "absent" if entry is None else f"{entry.stype} {entry.shape} {entry.dtype}"
            raise CheckpointError(f"{path}: {name!r} is {got}, its sidecar says row_sparse {shape} {spec['dtype']}")
    return params


def lazy_rows(spec: dict, row_ids: np.ndarray, stored_ids: np.ndarray, stored_values: np.ndarray) -> np.ndarray:
    """The values of rows `row_ids` (int64) of the lazy parameter `spec`: a row's stored value where `stored_ids`
    (sorted, with `stored_values` in that order) holds it, else the initial value the servers compute for it.
    Shape (len(row_ids),) + row_shape."""
    row_shape = tuple(spec["row_shape"])
    dtype = np.dtype(spec["dtype"])
    row_ids = np.asarray(row_ids, np.int64)
    out = np.empty((len(row_ids),) + row_shape, dtype)
    pos = np.minimum(np.searchsorted(stored_ids, row_ids), max(len(stored_ids) - 1, 0))
    hit = stored_ids[pos] == row_ids if len(stored_ids) else np.zeros(len(row_ids), bool)
    out[hit] = stored_values[pos[hit]]
    absent = row_ids[~hit]
    if len(absent):
        values = parse_initializer(spec["init"]).rows(spec["seed"], spec["key"], absent.astype(np.uint64),
                                                      (spec["rows"],) + row_shape, dtype)
        out[~hit] = values.reshape((len(absent),) + row_shape)
    return out


# ----------------------------------------------------------------------------------------------------------------
# incremental server snapshots: a base plus deltas (format in the module docstring)

DELTA_FORMAT = "delta-1"
DEFAULT_MAX_DELTAS = 8
_DELTA_DIR = re.compile(r"delta-(\d{6})")
# per-row arrays by group: the group's id array, its tombstones, and the prefix of its other arrays
_GROUPS = (("row_ids", "dead_ids", None), ("pending_ids", "pending_dead", "pending_"))


def delta_path(directory: str | os.PathLike, rank: int, seq: int) -> Path:
    return Path(directory) / f"rank{rank}" / f"delta-{seq:06d}"


@dataclass
class Loaded:
    """A snapshot as :func:`load_snapshot` folds it: the base manifest with the newest ``server`` state, the tables
    per key (``{"row_ids", "weights", "states", "arrays", "meta"}``) and where the chain stands."""

    manifest: dict
    tables: dict
    chain: dict | None        # {"id", "seq", "sha256", "base_bytes", "delta_bytes"}: where the next delta goes


class SnapshotChain:
    """Where one server's periodic snapshots go: the next delta of the chain on disk, or a new base (a fresh chain,
    after ``max_deltas`` deltas, once the deltas' bytes pass ``compact_ratio`` x the base's, or when asked)."""

    def __init__(self, directory: str | os.PathLike, rank: int, num_servers: int,
                 max_deltas: int = DEFAULT_MAX_DELTAS, compact_ratio: float = 1.0, writer: dict | None = None) -> None:
        self.directory, self.rank, self.num_servers = Path(directory), rank, num_servers
        self.max_deltas, self.compact_ratio = max_deltas, compact_ratio
        self.writer = writer              # recorded in every base (node_lifecycle.check_snapshot_owner)
        self.state: dict | None = None

    def resume(self, loaded: Loaded | None) -> None:
        """Continue the chain a restored server was loaded from."""
        self.state = dict(loaded.chain) if loaded is not None and loaded.chain else None

    def next_is_delta(self) -> bool:
        s = self.state
        return (s is not None and self.max_deltas > 0 and s["seq"] < self.max_deltas
                and s["delta_bytes"] <= self.compact_ratio * s["base_bytes"])

    def write(self, server: dict, tables: dict[int, dict], delta: bool) -> tuple[Path, int]:
        """Write `tables` (``KVServer.snapshot(delta=...)`` of the same `delta` as :meth:`next_is_delta` said) as the
        next delta or as a new base; returns (path, bytes written)."""
        if not delta:
            chain = secrets.token_hex(8)
            path, sha, size = _write_base(self.directory / f"rank{self.rank}", self.rank, self.num_servers, tables,
                                          server, chain, self.writer)
            self.state = {"id": chain, "seq": 0, "sha256": sha, "base_bytes": size, "delta_bytes": 0}
            return path, size
        s = self.state
        assert s is not None, "a delta needs a base"
        seq = s["seq"] + 1
        path = delta_path(self.directory, self.rank, seq)
        out = {}

        def fill(tmp: Path) -> None:
            manifest = {"format": DELTA_FORMAT, "rank": self.rank, "num_servers": self.num_servers,
                        "chain": s["id"], "seq": seq, "prev": {"seq": s["seq"], "sha256": s["sha256"]},
                        "server": server, "keys": {}}
            for key, table in tables.items():
                manifest["keys"][str(key)] = _write_key(tmp, key, dict(table, mode=table.get("mode", "full")),
                                                        checksum=True)
            text = json.dumps(manifest, indent=1).encode()
            (tmp / "manifest.json").write_bytes(text)
            out["sha"], out["bytes"] = hashlib.sha256(text).hexdigest(), sum(f.stat().st_size for f in tmp.iterdir())

        atomic_write_dir(path, fill)
        self.state = dict(s, seq=seq, sha256=out["sha"], delta_bytes=s["delta_bytes"] + out["bytes"])
        return path, out["bytes"]


def load_snapshot(directory: str | os.PathLike, rank: int) -> Loaded | None:
    """The snapshot of `rank` in `directory` (base and deltas folded), None if there is none; SnapshotError for a
    gap, a stale or a corrupted delta, or an unreadable file."""
    directory = Path(directory)
    manifest = read_manifest(directory, rank)
    if manifest is None:
        return None
    rank_dir = directory / f"rank{rank}"
    tables = {int(k): dict(_read_key(rank_dir / f"key{k}.npz", info), meta=info)
              for k, info in manifest["keys"].items()}
    disks = {int(k): _disk_of(rank_dir, k, info) for k, info in manifest["keys"].items()}
    chain_id = manifest.get("chain", {}).get("id")
    chain = None
    if chain_id is not None:
        sha = _file_digest(rank_dir / "manifest.json")[0]
        base_bytes = sum(f.stat().st_size for f in rank_dir.iterdir() if f.is_file())
        chain = {"id": chain_id, "seq": 0, "sha256": sha, "base_bytes": base_bytes, "delta_bytes": 0}
    deltas = sorted((int(m.group(1)), p) for p in rank_dir.iterdir()
                    if p.is_dir() and (m := _DELTA_DIR.fullmatch(p.name)))
    if deltas and chain is None:
        raise SnapshotError(f"{rank_dir}: deltas {deltas[0][1].name}... beside a base that starts no chain")
    changes: dict[int, tuple[str, dict]] = {}     # key -> (mode, what the deltas so far make of it)
    server = manifest.get("server", {})
    for seq, path in deltas:
        if seq != chain["seq"] + 1:
            follows = "the base" if chain["seq"] == 0 else f"delta {chain['seq']}"
            raise SnapshotError(f"{path}: delta {seq} follows {follows}: delta {chain['seq'] + 1} is missing (a gap "
                                f"in the chain); refusing to load")
        delta_manifest, sha = _read_delta_manifest(path)
        if delta_manifest.get("chain") != chain["id"]:
            raise SnapshotError(f"{path}: a stale delta (of chain {delta_manifest.get('chain')!r}, the base starts "
                                f"chain {chain['id']!r}); refusing to load")
        prev = delta_manifest.get("prev") or {}
        if prev.get("seq") != chain["seq"] or prev.get("sha256") != chain["sha256"]:
            raise SnapshotError(f"{path}: does not follow its predecessor (its checksum of "
                                f"{'the base' if chain['seq'] == 0 else 'delta %d' % chain['seq']} differs): a stale "
                                f"delta, or its predecessor was rewritten; refusing to load")
        for k, info in delta_manifest["keys"].items():
            file = path / f"key{k}.npz"
            if not file.exists() or _file_digest(file)[0] != info.get("sha256"):
                raise SnapshotError(f"{file}: missing or corrupted (checksum differs from its manifest); refusing "
                                    f"to load")
            table, key = dict(_read_key(file, info), meta=info), int(k)
            disks[key] = _disk_of(path, k, info)       # the newest snapshot's disk tier is the key's
            if info.get("mode") != "delta":
                changes[key] = ("full", table)
            elif key in changes:
                mode, older = changes[key]
                changes[key] = (mode, _fold(older, table, base=mode == "full"))
            elif key in tables:
                changes[key] = ("delta", table)
            else:
                raise SnapshotError(f"{file}: a delta of key {key}, which neither the base nor an earlier delta has")
        server = delta_manifest.get("server", {})
        chain = dict(chain, seq=seq, sha256=sha,
                     delta_bytes=chain["delta_bytes"] + sum(f.stat().st_size for f in path.iterdir()))
    for key, (mode, table) in changes.items():
        tables[key] = _fold(tables[key], table, base=True) if mode == "delta" else table
        tables[key]["meta"] = dict(tables[key]["meta"], rows=len(tables[key]["row_ids"]))
        tables[key]["meta"].pop("mode", None)
    for key, disk in disks.items():
        if disk is not None:
            tables[key]["disk"] = disk
    return Loaded(dict(manifest, server=server), tables, chain)


def _read_delta_manifest(path: Path) -> tuple[dict, str]:
    file = path / "manifest.json"
    try:
        text = file.read_bytes()
        manifest = json.loads(text)
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{file}: unreadable ({exc}); refusing to load") from None
    if manifest.get("format") != DELTA_FORMAT or not isinstance(manifest.get("keys"), dict):
        raise SnapshotError(f"{file}: not a delta manifest (format {manifest.get('format')!r})")
    return manifest, hashlib.sha256(text).hexdigest()


def _group(table: dict, ids_name: str, dead_name: str, prefix: str | None) -> dict:
    arrays = table["arrays"]
    if ids_name == "row_ids":
        ids = table["row_ids"]
        cols = {"weights": table["weights"], **{f"state{i}": s for i, s in enumerate(table["states"])},
                **{n: a for n, a in arrays.items() if n.startswith("col_")}}
    else:
        ids = arrays.get(ids_name)
        cols = {n: a for n, a in arrays.items() if n.startswith(prefix) and n not in (ids_name, dead_name)}
    return {"ids": ids, "cols": cols, "dead": arrays.get(dead_name, np.zeros(0, np.uint64))}


def _fold(older: dict, newer: dict, base: bool = False) -> dict:
    """`newer` (mode delta) applied on `older` (a base, or the deltas before it folded): rows and pending ids of
    `newer` replace or add, its tombstones remove; with `base`, the result is a full table."""
    out = {"meta": newer["meta"], "arrays": {}}
    for ids_name, dead_name, prefix in _GROUPS:
        old, new = _group(older, ids_name, dead_name, prefix), _group(newer, ids_name, dead_name, prefix)
        if new["ids"] is None:
            if old["ids"] is not None:
                _put_group(out, ids_name, dead_name, old if not base else dict(old, dead=None))
            continue
        if old["ids"] is None:
            old = {"ids": np.zeros(0, np.uint64), "cols": {n: a[:0] for n, a in new["cols"].items()},
                   "dead": np.zeros(0, np.uint64)}
        if set(old["cols"]) != set(new["cols"]):
            raise SnapshotError(f"key {newer['meta'].get('kind')} arrays {sorted(new['cols'])} of a delta differ "
                                f"from its predecessor's {sorted(old['cols'])}")
        gone = np.concatenate([new["ids"], new["dead"]]).astype(np.uint64)
        keep = ~_members(old["ids"], gone)
        ids = np.concatenate([old["ids"][keep], new["ids"]])
        order = np.argsort(ids, kind="stable")
        cols = {n: np.concatenate([old["cols"][n][keep], new["cols"][n]])[order] for n in new["cols"]}
        group = {"ids": ids[order], "cols": cols, "dead": None if base else
                 np.setdiff1d(np.union1d(old["dead"], new["dead"]), new["ids"]).astype(np.uint64)}
        _put_group(out, ids_name, dead_name, group)
    if "row_ids" not in out:
        raise SnapshotError("a delta without rows")
    return out


def _members(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which of `sorted_ids` (sorted, unique) are in `ids`: O(len(ids) log len(sorted_ids))."""
    hit = np.zeros(len(sorted_ids), bool)
    if len(sorted_ids) and len(ids):
        at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
        hit[at[sorted_ids[at] == ids]] = True
    return hit


def _put_group(out: dict, ids_name: str, dead_name: str, group: dict) -> None:
    cols = group["cols"]
    if ids_name == "row_ids":
        out["row_ids"], out["weights"] = group["ids"], cols["weights"]
        out["states"] = [cols[f"state{i}"] for i in range(sum(1 for n in cols if n.startswith("state")))]
        out["arrays"].update({n: a for n, a in cols.items() if n.startswith("col_")})
    else:
        out["arrays"][ids_name] = group["ids"]
        out["arrays"].update(cols)
    if group.get("dead") is not None:
        out["arrays"][dead_name] = group["dead"]


# ----------------------------------------------------------------------------------------------------------------
# densify: a stock file with absent rows filled in, streamed

CHUNK_VALUES = 1 << 21   # at most this many values (8 MiB of float32) ...
CHUNK_ROWS = 1 << 17     # ... and rows (ids, positions and generator states take 8 bytes a row each) per chunk


def read_row_ids_file(path: str | os.PathLike) -> np.ndarray:
    """Row ids from a text file (integers separated by whitespace or commas), sorted and unique."""
    try:
        tokens = Path(path).read_text().replace(",", " ").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the rows file ({exc})") from None
    try:
        ids = np.array(tokens, dtype=np.int64)
    except (ValueError, OverflowError):
        bad = next((t for t in tokens if not t.lstrip("+-").isdigit() or abs(int(t)) >= 1 << 63), "?")
        raise CheckpointError(f"{path}: {bad!r} is not a row id") from None
    if len(ids) and ids.min() < 0:
        raise CheckpointError(f"{path}: row id {int(ids.min())} is negative")
    return np.unique(ids)


def _stored(src: Path, entry: Entry, name: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    ids = read_row_ids(src, entry)
    if len(ids) and (np.any(ids[1:] <= ids[:-1]) or ids[0] < 0 or ids[-1] >= rows):
        raise CheckpointError(f"{src}: the row ids of {name!r} are not sorted, unique and within [0, {rows})")
    return ids, read_values(src, entry)


def _chunk_ids(out_ids: np.ndarray | None, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1 of the output: row ids themselves when every row is written, else out_ids[start:stop]."""
    return np.arange(start, stop, dtype=np.int64) if out_ids is None else out_ids[start:stop]


def densify(src: str | os.PathLike, dst: str | os.PathLike, rows: np.ndarray | None = None,
            rows_from: str = "the rows asked for") -> list[str]:
    """Write `dst`: checkpoint `src` with every row (or, with `rows`, the stored rows and `rows`) of each lazy
    parameter present, absent ones with their initial values; other entries copied byte for byte. Everything is
    checked before `dst` is created; values are written chunk by chunk (CHUNK_VALUES values or CHUNK_ROWS rows at a
    time), so memory does not grow with the parameters' sizes. With `rows`, `dst` gets a sidecar (rows are still
    absent); without, it is a plain stock file. Returns one line per lazy parameter saying what was written."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise CheckpointError(f"{src}: no such file")
    params = lazy_params(src)
    if params is None:
        raise CheckpointError(f"{src} is not a kvstore_lazy checkpoint (no {sidecar_path(src).name} beside it)")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: the output must not be the input")
    if rows is not None:
        rows = np.unique(np.asarray(rows, np.int64))
        if len(rows) and rows[0] < 0:
            raise CheckpointError(f"row id {int(rows[0])} in {rows_from} is negative")
    entries = read_index(src)
    plan = {}
    for entry in entries:
        spec = params.get(entry.name)
        if spec is None:
            continue
        ids, values = _stored(src, entry, entry.name, spec["rows"])
        if rows is not None and len(rows) and rows[-1] >= spec["rows"]:
            raise CheckpointError(f"row id {int(rows[-1])} in {rows_from} is out of range for {entry.name!r} "
                                  f"({spec['rows']:,} rows: 0 to {spec['rows'] - 1:,})")
        out_ids = np.union1d(ids, rows).astype(np.int64) if rows is not None else None
        plan[entry.name] = (spec, ids, values, out_ids)
    report = []

    def write(fh) -> None:
        writer = Writer(fh, len(entries))
        with open(src, "rb") as source:
            for entry in entries:
                if entry.name not in plan:
                    writer.copy(entry.name, source, entry)
                    continue
                spec, ids, values, out_ids = plan[entry.name]
                total = spec["rows"] if out_ids is None else len(out_ids)
                step = max(1, min(CHUNK_ROWS, CHUNK_VALUES // int(np.prod(spec["row_shape"]))))
                chunks = list(chunked(total, step))
                writer.row_sparse(entry.name, entry.shape, entry.dtype, total,
                                  (lazy_rows(spec, _chunk_ids(out_ids, a, b), ids, values) for a, b in chunks),
                                  (_chunk_ids(out_ids, a, b) for a, b in chunks))
                report.append(f"{entry.name}: {total:,} of {spec['rows']:,} rows ({len(ids):,} stored, "
                              f"{total - len(ids):,} initial values)")
        writer.finish()

    rest = {name: plan_[0] for name, plan_ in plan.items()} if rows is not None else {}
    atomic_write(dst, write, lazy=rest)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore_lazy.persist.checkpoint",
                                     description="Tools for kvstore_lazy checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("densify", help="write a stock MXNet file with the absent rows of lazy parameters filled in",
                       description="Write OUT: checkpoint IN (an mx.nd.save file with a .lazy.json sidecar) with "
                                   "every row of each lazy parameter (or, with --rows, the stored rows and the "
                                   "rows listed) present, absent ones with the initial values the servers would "
                                   "compute. Streamed: memory does not grow with the parameters' sizes. Nothing is "
                                   "written if anything is wrong.")
    p.add_argument("input", metavar="IN")
    p.add_argument("output", metavar="OUT")
    p.add_argument("--rows", metavar="FILE", help="text file of row ids (whitespace or comma separated)")
    args = parser.parse_args(argv)
    try:
        rows = read_row_ids_file(args.rows) if args.rows else None
        for line in densify(args.input, args.output, rows, rows_from=args.rows or ""):
            print(line)
    except (CheckpointError, NDFileError, OSError) as exc:
        print(f"densify: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
