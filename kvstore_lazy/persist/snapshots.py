"""Server snapshots: a full snapshot (the *base*) plus incremental *deltas*, written atomically and checked before
anything is loaded.

Owns: the snapshot layout a server writes and reloads (one directory per server rank), the chain of deltas after a
base (:class:`SnapshotChain`), folding them back into tables (:func:`load_snapshot`), and the tagged snapshots a
LAZY_SNAPSHOT command with a tag asks for (:func:`common_tag`: what a restarted job's workers resume from). numpy
only (never mxnet: the server imports this module); snapshots are ``.npz`` files read with ``allow_pickle=False``
and JSON manifests checked before anything is loaded.
Does not own: writing atomically (``atomic``), what the tables mean (kvstore_lazy.server), or when to snapshot
(kvstore_lazy.node).

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
                                      rebuilt since: new optimizer, multi-precision; or too many rows removed since
                                      to list them, store.rows.RowTable.changes_complete), as in a base.

A delta holds what changed since the snapshot before it (base or delta), so a restore reads the base and then every
delta in order, the newest's ``server`` state ruling. The loader refuses (SnapshotError naming the file) a delta
whose ``seq`` does not follow its predecessor (a gap), whose ``chain`` is not the base's or whose ``prev`` checksum
is not its predecessor manifest's (a stale delta: left by another chain, or its predecessor was rewritten), or whose
files do not match their checksums (corrupted). A new base replaces the whole ``rank<r>`` directory atomically
(deltas included): that is the compaction, after ``max_deltas`` deltas or once the deltas' bytes pass the base's.
A server restoring (``load_snapshot(pieces=True)``) reads the rows of the base and of every delta a piece at a time,
their ids and tombstones too, folded by id as the table is built (``_fold_all``, ``members.FoldedRows``: a k-way
merge of the sorted ids): never a whole file's rows or ids at once (only the pending ids are read whole).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_lazy import paths
from kvstore_lazy.persist import members
from kvstore_lazy.persist.atomic import atomic_write_dir, file_digest, remove_path, settle_dir
from kvstore_lazy.store.npz import savez

FORMAT = 1
TAGGED_DIR = paths.TAGGED_DIR   # <dir>/tagged/rank<r>: the snapshot a LAZY_SNAPSHOT command with a tag asked for
DELTA_FORMAT = "delta-1"
DEFAULT_MAX_DELTAS = 8
_DELTA_DIR = re.compile(r"delta-(\d{6})")
# per-row arrays by group: the group's id array, its tombstones, and the prefix of its other arrays
_GROUPS = (("row_ids", "dead_ids", None), ("pending_ids", "pending_dead", "pending_"))


SnapshotError = members.SnapshotError


# ----------------------------------------------------------------------------------------------------------------
# a base: one full snapshot (format in the module docstring)

def write_snapshot(directory: str | os.PathLike, rank: int, num_servers: int, tables: dict[int, dict],
                   server: dict | None = None, writer: dict | None = None) -> Path:
    """Write one server's rows (a full snapshot). `tables` maps key -> {"row_ids", "weights", "states", "meta",
    optional "arrays": {name: per-row array}} (meta: JSON-able); `server` is JSON-able server-wide state (mode,
    optimizer, declarations); `writer` the advertised host and port of the server writing it
    (``node_lifecycle.check_snapshot_owner``)."""
    return _write_base(paths.rank_dir(directory, rank), rank, num_servers, tables, server, None, writer)[0]


def _array(value, dtype=None):
    """An array to write: as it is if it comes in pieces (:func:`savez`), else ``np.asarray``."""
    if hasattr(value, "pieces"):
        if dtype is not None and value.dtype != dtype:
            raise ValueError(f"an array in pieces of {value.dtype}, not {dtype}")      # (our bug: the tables')
        return value
    return np.asarray(value, dtype)


def _write_key(directory: Path, key: int, table: dict, checksum: bool) -> dict:
    """key<k>.npz of one key's table (arrays in pieces written piece by piece: :func:`savez`); its manifest
    entry."""
    arrays = {"row_ids": _array(table["row_ids"], np.dtype(np.uint64)), "weights": _array(table["weights"])}
    for i, state in enumerate(table.get("states", [])):
        arrays[f"state{i}"] = _array(state)
    extra = table.get("arrays", {})
    for name, value in extra.items():
        arrays[name] = _array(value)
    path = paths.key_file(directory, key)
    savez(path, arrays)
    entry = dict(table.get("meta", {}), rows=int(len(arrays["row_ids"])), num_states=len(table.get("states", [])),
                 arrays=sorted(extra))
    if "mode" in table:
        entry["mode"] = table["mode"]
    if checksum:
        entry["sha256"] = file_digest(path)[0]
    disk = table.get("disk")
    if disk is not None:     # the key's disk tier: committed into the snapshot, its segments hard-linked
        name = paths.key_disk_name(key)
        disk.commit(into=directory / name)
        entry["disk"], entry["disk_sha256"] = name, file_digest(directory / name / "index.npz")[0]
    return entry


def _disk_of(path: Path, key: str, info: dict) -> Path | None:
    """The disk tier store a snapshot holds for a key (checked against the manifest's checksum of its index)."""
    if not info.get("disk"):
        return None
    where = path / info["disk"]
    index = where / "index.npz"
    if not index.exists() or file_digest(index)[0] != info.get("disk_sha256"):
        raise SnapshotError(f"{index}: the disk tier of key {key} is missing or corrupted (checksum differs from "
                            f"its manifest); refusing to load")
    return where


def _write_base(target: Path, rank: int, num_servers: int, tables: dict[int, dict], server: dict | None,
                chain: str | None, writer: dict | None = None) -> tuple[Path, str, int]:
    """(path, sha256 of its manifest, bytes written)."""
    out: dict = {}

    def fill(tmp: Path) -> None:
        manifest: dict = {"format": FORMAT, "rank": rank, "num_servers": num_servers, "server": server or {},
                          "keys": {}}
        if chain is not None:
            manifest["chain"] = {"id": chain}
        if writer is not None:
            manifest["writer"] = writer
        for key, table in tables.items():
            table = {k: v for k, v in table.items() if k != "mode"}
            manifest["keys"][str(key)] = _write_key(tmp, key, table, checksum=False)
        text = json.dumps(manifest, indent=1).encode()
        paths.manifest(tmp).write_bytes(text)
        out["sha"], out["bytes"] = hashlib.sha256(text).hexdigest(), sum(f.stat().st_size for f in tmp.iterdir())

    atomic_write_dir(target, fill)
    return target, out["sha"], out["bytes"]


def live_dir(directory: str | os.PathLike, rank: int) -> Path:
    """The committed snapshot of `rank` in `directory` (``paths.committed_dir``: ``.rank<r>.new`` while a swap
    interrupted after its commit is not settled, else ``rank<r>``; it may not exist)."""
    return paths.committed_dir(paths.rank_dir(directory, rank))


def snapshot_ranks(directory: str | os.PathLike) -> list[int]:
    """The ranks with a committed snapshot (a manifest) in `directory`, ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    ranks = set()
    for entry in directory.iterdir():
        name = entry.name
        for prefix, suffix in (("rank", ""), (".rank", paths.NEW_SUFFIX)):
            middle = name[len(prefix):len(name) - len(suffix)]
            if name.startswith(prefix) and name.endswith(suffix) and middle.isdigit():
                ranks.add(int(middle))
    return sorted(r for r in ranks if paths.manifest(live_dir(directory, r)).is_file())


def settle(directory: str | os.PathLike, rank: int) -> list[Path]:
    """Bring the snapshots of `rank` in `directory` (its chain and its tagged snapshot) to their committed state:
    an interrupted base swap finished, the temp directories of interrupted bases and deltas removed. What a server
    runs at start, before it reads anything; returns the paths it settled."""
    done = []
    for path in (paths.rank_dir(directory, rank), paths.rank_dir(paths.tagged_dir(directory), rank)):
        if settle_dir(path):
            done.append(path)
        if path.is_dir():
            for leftover in sorted(path.glob(".delta-*")):
                remove_path(leftover)
                done.append(leftover)
    return done


def read_manifest(directory: str | os.PathLike, rank: int) -> dict | None:
    path = paths.manifest(live_dir(directory, rank))
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
    return _read_key(paths.key_file(live_dir(directory, rank), key), expected)


def _read_key(path: Path, expected: dict, pieces: bool = False) -> dict:
    """One key file's arrays; with `pieces` (a row_sparse key) its per-row members (weights, states, columns) and
    its ids (``row_ids``, ``dead_ids``) as ``members.MemberPieces``, read a piece at a time (and checked) when the
    table is built from them; the pending ids (and their tombstones) are read whole. Id arrays must be 1-D arrays of
    integer ids (read whole: sorted and unique too; in pieces, that is checked as they are read), every per-row
    member as long as its ids."""
    per_row = ["weights"] + [f"state{i}" for i in range(expected.get("num_states", 0))]
    per_row += [name for name in expected.get("arrays", []) if name.startswith("col_")]
    lazy = {}
    try:
        if pieces and expected.get("kind") == "row_sparse":
            ids = ["row_ids"] + [name for name in expected.get("arrays", []) if name == "dead_ids"]
            lazy = members.open_members(path, per_row + ids)
        with np.load(path, allow_pickle=False) as data:
            def get(name: str):
                return lazy[name] if name in lazy else data[name]
            row_ids = get("row_ids")
            weights = get("weights")
            states = [get(f"state{i}") for i in range(expected.get("num_states", 0))]
            arrays = {name: get(name) for name in expected.get("arrays", [])}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise SnapshotError(f"{path}: unreadable ({exc})") from None
    if len(row_ids) != expected["rows"] or weights.shape[0] != len(row_ids):
        raise SnapshotError(f"{path}: {len(row_ids)} row ids and {weights.shape[0]} weight rows, manifest says "
                            f"{expected['rows']}")
    if any(s.shape != weights.shape for s in states):
        raise SnapshotError(f"{path}: optimizer state shapes differ from the weights")
    _check_members(path, row_ids, arrays)
    return {"row_ids": row_ids, "weights": weights, "states": states, "arrays": arrays}


def _check_members(path: Path, row_ids, arrays: dict) -> None:
    """The ids of a key file (1-D integer arrays; read whole, sorted and unique) and its per-row arrays (as many
    rows as their group's ids)."""
    groups = {"row_ids": row_ids, "pending_ids": arrays.get("pending_ids")}
    for name in ("row_ids", "dead_ids", "pending_ids", "pending_dead"):
        ids = row_ids if name == "row_ids" else arrays.get(name)
        if ids is None:
            continue
        members.check_ids(ids, f"{path}: member {name!r}")
        if isinstance(ids, np.ndarray) and len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
            raise SnapshotError(f"{path}: member {name!r}: the ids are not sorted and unique")
    for name, values in arrays.items():
        group = "row_ids" if name.startswith("col_") else "pending_ids" if name in ("pending_count", "pending_last") \
            else None
        ids = groups.get(group) if group else None
        if ids is not None and (not values.shape or values.shape[0] != len(ids)):
            raise SnapshotError(f"{path}: member {name!r} of shape {values.shape} is not one row per id of "
                                f"{group!r} ({len(ids)})")


def read_tags(directory: str | os.PathLike) -> dict[int, object]:
    """rank -> tag of the tagged snapshots in `directory` (what a restarted job's workers resume from)."""
    tags = {}
    tagged = paths.tagged_dir(directory)
    for rank in snapshot_ranks(tagged):
        manifest = json.loads(paths.manifest(live_dir(tagged, rank)).read_text())
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
# incremental server snapshots: a base plus deltas (format in the module docstring)

def delta_path(directory: str | os.PathLike, rank: int, seq: int) -> Path:
    return paths.delta_dir(directory, rank, seq)


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
            path, sha, size = _write_base(paths.rank_dir(self.directory, self.rank), self.rank, self.num_servers,
                                          tables, server, chain, self.writer)
            self.state = {"id": chain, "seq": 0, "sha256": sha, "base_bytes": size, "delta_bytes": 0}
            return path, size
        s = self.state
        assert s is not None, "a delta needs a base"
        settle_dir(paths.rank_dir(self.directory, self.rank))   # a delta goes into the committed base only
        seq = s["seq"] + 1
        path = delta_path(self.directory, self.rank, seq)
        out: dict = {}

        def fill(tmp: Path) -> None:
            manifest: dict = {"format": DELTA_FORMAT, "rank": self.rank, "num_servers": self.num_servers,
                        "chain": s["id"], "seq": seq, "prev": {"seq": s["seq"], "sha256": s["sha256"]},
                        "server": server, "keys": {}}
            for key, table in tables.items():
                manifest["keys"][str(key)] = _write_key(tmp, key, dict(table, mode=table.get("mode", "full")),
                                                        checksum=True)
            text = json.dumps(manifest, indent=1).encode()
            paths.manifest(tmp).write_bytes(text)
            out["sha"], out["bytes"] = hashlib.sha256(text).hexdigest(), sum(f.stat().st_size for f in tmp.iterdir())

        atomic_write_dir(path, fill)
        self.state = dict(s, seq=seq, sha256=out["sha"], delta_bytes=s["delta_bytes"] + out["bytes"])
        return path, out["bytes"]



def load_snapshot(directory: str | os.PathLike, rank: int, pieces: bool = False) -> Loaded | None:
    """The snapshot of `rank` in `directory` (base and deltas folded), None if there is none; SnapshotError for a
    gap, a stale or a corrupted delta, or an unreadable file. With `pieces` the per-row arrays of the base's
    row_sparse keys are read piece by piece when used (``members``: a server restores a key without holding the
    file's arrays beside its table); a damaged member is then a SnapshotError at that point."""
    directory = Path(directory)
    manifest = read_manifest(directory, rank)
    if manifest is None:
        return None
    rank_dir = live_dir(directory, rank)
    tables = {int(k): dict(_read_key(paths.key_file(rank_dir, int(k)), info, pieces), meta=info)
              for k, info in manifest["keys"].items()}
    disks = {int(k): _disk_of(rank_dir, k, info) for k, info in manifest["keys"].items()}
    chain = _base_chain(rank_dir, manifest)
    deltas = sorted((int(m.group(1)), p) for p in rank_dir.iterdir()
                    if p.is_dir() and (m := _DELTA_DIR.fullmatch(p.name)))
    if deltas and chain is None:
        raise SnapshotError(f"{rank_dir}: deltas {deltas[0][1].name}... beside a base that starts no chain")
    changes: dict[int, tuple[str, Any]] = {}      # key -> (mode, what the deltas so far make of it)
    server = manifest.get("server", {})
    for seq, path in deltas:
        assert chain is not None
        delta_manifest, sha = _checked_delta(path, seq, chain)
        _read_delta_keys(path, delta_manifest, tables, disks, changes, pieces)
        server = delta_manifest.get("server", {})
        chain = dict(chain, seq=seq, sha256=sha,
                     delta_bytes=chain["delta_bytes"] + sum(f.stat().st_size for f in path.iterdir()))
    for key, (mode, table) in changes.items():
        if mode == "deltas":                # (in pieces: the deltas after the key's base, folded at once)
            tables[key] = _fold_all([tables[key]] + table)
        else:
            tables[key] = _fold(tables[key], table, base=True) if mode == "delta" else table
        tables[key]["meta"] = dict(tables[key]["meta"], rows=len(tables[key]["row_ids"]))
        tables[key]["meta"].pop("mode", None)
    for key, disk in disks.items():
        if disk is not None:
            tables[key]["disk"] = disk
    return Loaded(dict(manifest, server=server), tables, chain)


def _base_chain(rank_dir: Path, manifest: dict) -> dict | None:
    """Where the chain stands at the base: None for a base that starts no chain (written by write_snapshot)."""
    chain_id = manifest.get("chain", {}).get("id")
    if chain_id is None:
        return None
    sha = file_digest(paths.manifest(rank_dir))[0]
    base_bytes = sum(f.stat().st_size for f in rank_dir.iterdir() if f.is_file())
    return {"id": chain_id, "seq": 0, "sha256": sha, "base_bytes": base_bytes, "delta_bytes": 0}


def _checked_delta(path: Path, seq: int, chain: dict) -> tuple[dict, str]:
    """The manifest of delta `seq` at `path` (and its sha256), once it is known to follow `chain`."""
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
    return delta_manifest, sha


def _read_delta_keys(path: Path, delta_manifest: dict, tables: dict, disks: dict,
                     changes: dict[int, tuple[str, Any]], pieces: bool = False) -> None:
    """Read every key file of one delta (checked against its checksum) into `changes`. A key written whole (mode
    full) takes its base's place in `tables`, and the deltas after it fold among themselves before they fold onto it
    once, as onto a base. A delta of a key: without `pieces`, folded on what the earlier deltas made of the key
    (``changes[key] = (mode, table)``); with `pieces` (every per-row member read in pieces), collected
    (``changes[key] = ("deltas", [tables])``) to be folded at once onto its base (:func:`_fold_all`), each member
    then read once, in order."""
    for k, info in delta_manifest["keys"].items():
        file = paths.key_file(path, int(k))
        if not file.exists() or file_digest(file)[0] != info.get("sha256"):
            raise SnapshotError(f"{file}: missing or corrupted (checksum differs from its manifest); refusing "
                                f"to load")
        table, key = dict(_read_key(file, info, pieces), meta=info), int(k)
        disks[key] = _disk_of(path, k, info)       # the newest snapshot's disk tier is the key's
        if info.get("mode") != "delta":
            table["meta"] = {name: value for name, value in info.items() if name != "mode"}
            tables[key] = table
            changes.pop(key, None)
        elif key not in tables:
            raise SnapshotError(f"{file}: a delta of key {key}, which neither the base nor an earlier delta has")
        elif pieces:
            changes.setdefault(key, ("deltas", []))[1].append(table)
        elif key in changes:
            mode, older = changes[key]
            changes[key] = (mode, _fold(older, table, base=mode == "full"))
        else:
            changes[key] = ("delta", table)


def _read_delta_manifest(path: Path) -> tuple[dict, str]:
    file = paths.manifest(path)
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
        cols = {n: _merged(old["cols"][n], keep, new["cols"][n], order) for n in new["cols"]}
        group = {"ids": ids[order], "cols": cols, "dead": None if base else
                 np.setdiff1d(np.union1d(old["dead"], new["dead"]), new["ids"]).astype(np.uint64)}
        _put_group(out, ids_name, dead_name, group)
    if "row_ids" not in out:
        raise SnapshotError("a delta without rows")
    return out


def _merged(old, keep: np.ndarray, new: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``concatenate([old[keep], new])[order]`` (arrays read whole: a fold without pieces)."""
    return np.concatenate([np.asarray(old)[keep], np.asarray(new)])[order]


def _fold_all(parts: list[dict]) -> dict:
    """``parts[0]`` (the key whole: a base, or a delta that wrote it whole) and the deltas after it, in order,
    folded at once into one full table: of each row its newest version, without those a later delta removed
    (``members.FoldedRows``: a k-way merge of their sorted ids, in pieces; each per-row member a
    ``members.FoldedColumn``, each source's read once, in order), so a restore never holds the rows of the base or
    of a delta, nor their ids, beside the table it builds. The pending ids (read whole) are folded whole."""
    out = {"meta": parts[-1]["meta"], "arrays": {}}
    for ids_name, dead_name, prefix in _GROUPS:
        groups = [g for g in (_group(p, ids_name, dead_name, prefix) for p in parts) if g["ids"] is not None]
        if not groups:
            continue
        if any(set(g["cols"]) != set(groups[-1]["cols"]) for g in groups):
            raise SnapshotError(f"key {parts[-1]['meta'].get('kind')}: arrays {sorted(groups[-1]['cols'])} of a "
                                f"delta differ from a predecessor's")
        folded = members.FoldedRows([g["ids"] for g in groups], [g["dead"] for g in groups])
        ids: Any = folded
        cols: dict = {n: folded.column([g["cols"][n] for g in groups]) for n in groups[-1]["cols"]}
        if ids_name != "row_ids":           # the pending ids: arrays (as the policy restores them)
            ids, cols = np.asarray(folded), {n: np.asarray(c) for n, c in cols.items()}
        _put_group(out, ids_name, dead_name, {"ids": ids, "cols": cols, "dead": None})
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

