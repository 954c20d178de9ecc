"""Server snapshots re-cut for another number of servers: a job grown or shrunk keeps its model, its optimizer
states and its rows' lifecycle.

Owns: reading a snapshot directory of S servers as one job-wide view (:class:`Source`: every rank present, one
format, base + deltas folded and verified), cutting it for N servers the way stock MXNet workers route keys
(:func:`rank_state`: the rows, dense parts and server state one new rank holds), the offline form
(:func:`reshard`: a directory for N servers, written atomically) and what the online form reads
(:func:`restore_for`, ``KVSTORE_LAZY_RESTORE_FROM``).
Does not own: the snapshot format and its checks (``persist.snapshots``), restoring tables into a server
(``server.core.KVServer.restore``), when a server restores (``node.durability``), the disk tier's files
(``store.segments``).

How keys move (src/kvstore/kvstore_dist.h of MXNet 1.9.1; ``protocol.mxnet``):

- a row_sparse key of at least MXNET_KVSTORE_BIGARRAY_BOUND elements is split by contiguous row ranges
  (``row_partition(rows, N, r)``); a new rank takes exactly the stored rows of its range from the source ranks
  whose ranges overlap it, with every optimizer state, the lifecycle columns (``col_*``: last push round, counts)
  and the ids waiting for admission (``pending_*``). A declared (lazy) key's size and bound are its declaration's;
  rows never stored need nothing: their value is a function of (seed, key, row id);
- a smaller key lives whole on ``(key * 9973) % N``;
- a big dense key is split by element ranges (``dense_partition``): its parts are joined in rank order and cut
  again. Whether a dense or undeclared row_sparse key was split is read from the source (on several ranks: split);
  a source of one server cannot show it, so there the bound decides (``--bigarray-bound``, else the
  MXNET_KVSTORE_BIGARRAY_BOUND of the environment, else MXNet's 1000000).

Server state: the optimizer, sync mode, compression, declarations and aliases of the source; each key's update
count on the new rank that holds it (the same on every source rank holding it: every worker pushes every server of
a key each step), ``num_update`` the largest count of the keys it holds (MXNet's rule); a key's policy state
(round, pushes, last sweep) from its first source holder, its stats counters summed on its lowest new holder. The
journal position and a resume gate of the old job are dropped: they name the old job's requests.

Disk tier stores in the source (``key<k>.disk``) are read whole (a hard-linked copy is opened, since opening a
store removes segment files its index does not list: the source is never changed) and their rows written as
ordinary rows of the new base: the new servers' memory budget moves them back to disk at its first pass, by the
same deterministic rule as any other rows.

What is read: the offline form reads every file of the source (and verifies it: a delta's files by their
checksums, a base's key files by the zip CRC of every member, a key's entry ``sha256`` where the manifest has one).
The online form (:func:`restore_for`, ``Source.open(by_range=True)``) reads, per server, the manifests of every
rank and then, of each row_sparse key, only the rows of its range from the source ranks whose range overlaps it,
by seeking into the key files (``persist.ranged``: the ids whole and CRC-checked, then the slice of weights,
states, columns and pending ids), its deltas whole and checked, and of a disk tier store only its range's records.
Dense keys are read whole by the server that holds them (a big dense key split by elements: every source part, by
each new holder). Growing S -> N, a server reads about 1/N of the rows plus the ids of the source ranks it overlaps.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore_lazy import paths
from kvstore_lazy.persist import ranged, snapshots
from kvstore_lazy.persist.atomic import file_digest, fsync_path
from kvstore_lazy.persist.snapshots import SnapshotError
from kvstore_lazy.protocol import mxnet as mx

DEFAULT_BOUND = 1_000_000          # MXNET_KVSTORE_BIGARRAY_BOUND's default in MXNet 1.9.1
DROPPED_SERVER_STATE = ("journal", "resume_gate")
_ENTRY_FIELDS = ("rows", "num_states", "arrays", "sha256", "mode", "disk", "disk_sha256", "buckets")


class ReshardError(SnapshotError):
    """A source that cannot be re-cut (missing ranks, a key laid out as no MXNet worker lays it out...)."""


def bound_from_env(env=None) -> int:
    """MXNET_KVSTORE_BIGARRAY_BOUND as the workers read it (MXNet's default when unset)."""
    text = (os.environ if env is None else env).get("MXNET_KVSTORE_BIGARRAY_BOUND", "")
    try:
        return int(text) if text.strip() else DEFAULT_BOUND
    except ValueError:
        raise ReshardError(f"MXNET_KVSTORE_BIGARRAY_BOUND={text!r} is not an integer") from None


# ----------------------------------------------------------------------------------------------------------------
# the source: every rank's manifest now, its tables when asked


@dataclass
class Source:
    """A snapshot directory of S servers: the manifests of every rank (read and checked at once) and each rank's
    tables, folded and verified when first asked for (:meth:`tables`)."""

    directory: Path
    num_servers: int
    manifests: list[dict]
    servers: list[dict]                       # each rank's newest server state (its last delta's, else the base's)
    by_range: bool = False                    # read a key's rows by range (online), not every rank whole (offline)
    counter: ranged.Counter = field(default_factory=ranged.Counter)
    _loaded: dict[int, dict] = field(default_factory=dict)
    _keys: dict[tuple, dict] = field(default_factory=dict)

    @classmethod
    def open(cls, directory: str | os.PathLike, by_range: bool = False, counter: ranged.Counter | None = None
             ) -> "Source":
        """The source in `directory`; `by_range`: its keys read by :meth:`key_table` a range at a time, the bytes
        read added to `counter`."""
        directory = Path(directory)
        ranks = snapshots.snapshot_ranks(directory)
        if not ranks:
            raise ReshardError(f"{directory}: no server snapshot here (no rank<r>/manifest.json)")
        manifests = [snapshots.read_manifest(directory, r) for r in ranks]   # SnapshotError: unknown format
        counts = {int(m.get("num_servers", -1)) for m in manifests if m is not None}
        if len(counts) != 1:
            raise ReshardError(f"{directory}: the ranks' manifests disagree on the number of servers: {sorted(counts)}")
        num_servers = counts.pop()
        missing = [r for r in range(num_servers) if r not in ranks]
        if missing or ranks != list(range(num_servers)):
            where = paths.manifest(paths.rank_dir(directory, missing[0] if missing else ranks[-1]))
            raise ReshardError(f"{where}: a partial source: written by {num_servers} servers, ranks {ranks} found "
                               f"(missing {missing or 'none'}); refusing to reshard")
        checked = [m for m in manifests if m is not None]
        source = cls(directory, num_servers, checked, [_newest_server(directory, r, m) for r, m in enumerate(checked)],
                     by_range, counter or ranged.Counter())
        source.counter.manifests += sum(paths.manifest(snapshots.live_dir(directory, r)).stat().st_size for r in ranks)
        return source

    def tables(self, rank: int) -> dict:
        """Rank `rank`'s tables (key -> table), its deltas folded; SnapshotError naming a damaged file."""
        if rank not in self._loaded:
            loaded = snapshots.load_snapshot(self.directory, rank)
            if loaded is None:
                raise ReshardError(f"{paths.manifest(paths.rank_dir(self.directory, rank))}: vanished while reading")
            _check_base_files(snapshots.live_dir(self.directory, rank), self.manifests[rank])
            self._loaded[rank] = loaded.tables
        return self._loaded[rank]

    def key_table(self, rank: int, key: int, span: tuple[int, int] | None = None) -> dict:
        """Key `key` of rank `rank`: from :meth:`tables` (offline), else only its rows whose stored id is in
        `span` ([lo, hi); None: all), read by seeking (``persist.ranged``; rows outside `span` may remain)."""
        if not self.by_range or rank in self._loaded:
            return self.tables(rank)[key]
        if (rank, key, span) not in self._keys:
            self._keys[rank, key, span] = ranged.key_range(self.directory, rank, key, self.manifests[rank], span,
                                                           self.counter)
        return self._keys[rank, key, span]

    def dense_size(self, rank: int, key: int) -> int:
        """Elements of dense key `key` on rank `rank` (online: from its file's npy header)."""
        if not self.by_range or rank in self._loaded:
            return int(self.tables(rank)[key]["weights"].size)
        return ranged.dense_size(paths.key_file(snapshots.live_dir(self.directory, rank), key), self.counter)

    def holders(self, key: int) -> list[int]:
        """The source ranks holding `key`, ascending."""
        return [r for r, m in enumerate(self.manifests) if str(key) in m["keys"]]

    def keys(self) -> list[int]:
        return sorted({int(k) for m in self.manifests for k in m["keys"]})

    def specs(self) -> dict[int, dict]:
        """Every declaration (key -> its JSON form) of every rank; ReshardError if two ranks disagree."""
        out: dict[int, dict] = {}
        for rank, server in enumerate(self.servers):
            for spec in server.get("specs", []):
                known = out.setdefault(int(spec["key"]), spec)
                if known != spec:
                    raise ReshardError(f"{self.directory}: rank {rank} declares key {spec['key']} as {spec}, an "
                                       f"earlier rank as {known}")
        return out


def _newest_server(directory: Path, rank: int, manifest: dict) -> dict:
    """The server state of `rank`'s newest snapshot (its last delta's, else its base's): what a fold ends with."""
    live = snapshots.live_dir(directory, rank)
    deltas = sorted(p for p in live.iterdir() if p.is_dir() and snapshots._DELTA_DIR.fullmatch(p.name))
    if not deltas:
        return dict(manifest.get("server", {}))
    path = paths.manifest(deltas[-1])
    try:
        return dict(json.loads(path.read_text()).get("server", {}))
    except (OSError, ValueError) as exc:
        raise ReshardError(f"{path}: unreadable ({exc}); refusing to reshard") from None


def _check_base_files(live: Path, manifest: dict) -> None:
    """A base's key files against the checksums its manifest has for them (load_snapshot read every member whole,
    so the zip CRCs are checked already)."""
    for key, info in manifest["keys"].items():
        if "sha256" in info:
            path = paths.key_file(live, int(key))
            if file_digest(path)[0] != info["sha256"]:
                raise ReshardError(f"{path}: corrupted (checksum differs from its manifest); refusing to reshard")


# ----------------------------------------------------------------------------------------------------------------
# the layout of one key over S and over N servers


@dataclass(frozen=True)
class Layout:
    """Where a key lives: ``kind``, its size (rows or elements), whether MXNet splits it, and how its stored ids
    become global (``local``: an undeclared row_sparse key stores the ids local to each server's part)."""

    kind: str
    total: int
    split: bool
    local: bool = False

    def part(self, num_servers: int, rank: int, key: int) -> tuple[int, int] | None:
        """(first, count) of the key on `rank` of `num_servers`, or None if it holds none of it."""
        if self.split:
            cut = mx.row_partition if self.kind == "row_sparse" else mx.dense_partition
            return cut(self.total, num_servers, rank)
        return (0, self.total) if mx.dense_home_server(key, num_servers) == rank else None


def layout_of(source: Source, key: int, bound: int) -> Layout:
    """How `key` lies in `source` (and so in the new job: the same workers route it)."""
    holders = source.holders(key)
    info = source.manifests[holders[0]]["keys"][str(key)]
    kind = info["kind"]
    spec = source.specs().get(key)
    if kind == "row_sparse" and info.get("lazy") and spec is not None:
        rows, row_size = int(spec["rows"]), int(np.prod(spec["row_shape"]))
        return Layout(kind, rows, rows * row_size >= int(spec.get("bound", DEFAULT_BOUND)))
    if kind == "row_sparse":
        rows = sum(int(source.manifests[r]["keys"][str(key)]["local_rows"]) for r in holders)
        row_size = int(info["row_size"])
    else:
        sizes = [source.dense_size(r, key) for r in holders]
        rows, row_size = sum(sizes), 1
    split = len(holders) > 1 if source.num_servers > 1 else rows * row_size >= bound
    layout = Layout(kind, rows, split, local=kind == "row_sparse")
    for r in holders:                        # the source must be laid out as MXNet lays it out
        part = layout.part(source.num_servers, r, key)
        have = (int(source.manifests[r]["keys"][str(key)]["local_rows"]) if kind == "row_sparse"
                else source.dense_size(r, key))
        if part is None or part[1] != have:
            raise ReshardError(f"{paths.rank_dir(source.directory, r)}: key {key} holds {have} "
                               f"{'rows' if kind == 'row_sparse' else 'elements'} on rank {r}, not the part MXNet "
                               f"gives it ({part}); is the bound ({bound}) the job's?")
    return layout


def _source_part(source: Source, key: int, rank: int, layout: Layout) -> tuple[int, int]:
    if layout.kind == "row_sparse" and not layout.local:
        info = source.manifests[rank]["keys"][str(key)]
        return int(info["row_offset"]), int(info["local_rows"])
    part = layout.part(source.num_servers, rank, key)
    assert part is not None
    return part


# ----------------------------------------------------------------------------------------------------------------
# one new rank's tables


def _all_rows(table: dict) -> dict:
    """A row_sparse table's rows in memory and in its disk tier store together, sorted by id."""
    rows = {"row_ids": table["row_ids"], "weights": table["weights"], "states": list(table["states"]),
            "cols": {n: a for n, a in table["arrays"].items() if n.startswith("col_")}}
    disk = table.get("disk")
    if disk is None:
        return rows
    parts = [rows, _disk_rows(Path(disk), len(rows["states"]), list(rows["cols"]), table.get("disk_span"))]
    ids = np.concatenate([p["row_ids"] for p in parts])
    order = np.argsort(ids, kind="stable")
    return {"row_ids": ids[order],
            "weights": np.concatenate([p["weights"] for p in parts])[order],
            "states": [np.concatenate([p["states"][i] for p in parts])[order] for i in range(len(rows["states"]))],
            "cols": {n: np.concatenate([p["cols"][n] for p in parts])[order] for n in rows["cols"]}}


def _disk_rows(store_dir: Path, num_states: int, cols: list[str], span: tuple[int, int] | None = None) -> dict:
    """Every row of a disk tier store a snapshot holds (only those whose id is in `span` if given), read from a
    hard-linked copy (opening a store deletes segment files its index does not list: the source must not change):
    every record verified at open without `span`, with it each record read checked on its read."""
    from kvstore_lazy.store.segments import SegmentError, SegmentStore, link_or_copy
    copy = Path(tempfile.mkdtemp(prefix=".reshard-disk-", dir=store_dir.parent))
    try:
        for file in sorted(store_dir.iterdir()):
            link_or_copy(file, copy / file.name)
        try:
            store = SegmentStore.open(copy, verify=span is None)
        except SegmentError as exc:
            raise ReshardError(f"{store_dir}: the disk tier store is damaged ({exc}); refusing to reshard") from None
        ids, payload = store.row_ids(), None
        if span is not None:
            ids = ids[(ids >= np.uint64(max(span[0], 0))) & (ids < np.uint64(max(span[1], 0)))]
        payload = store.get(ids) if len(ids) else np.zeros(0, store.payload_dtype)
        store.close()
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return {"row_ids": ids.astype(np.uint64), "weights": np.ascontiguousarray(payload["w"]),
            "states": [np.ascontiguousarray(payload[f"s{i}"]) for i in range(num_states)],
            "cols": {n: np.ascontiguousarray(payload["c_" + n[4:]]) for n in cols}}


def _rows_in(table: dict, base: int, lo: int, hi: int) -> tuple[dict, dict]:
    """The rows (and pending ids) of `table` whose global id (stored id + `base`) is in [lo, hi)."""
    rows = _all_rows(table)
    ids = rows["row_ids"].astype(np.uint64) + np.uint64(base)
    a, b = np.searchsorted(ids, np.uint64(lo)), np.searchsorted(ids, np.uint64(hi))
    kept = {"row_ids": ids[a:b], "weights": rows["weights"][a:b], "states": [s[a:b] for s in rows["states"]],
            "cols": {n: c[a:b] for n, c in rows["cols"].items()}}
    pending: dict = {}
    arrays = table["arrays"]
    if "pending_ids" in arrays:
        pids = arrays["pending_ids"].astype(np.uint64) + np.uint64(base)
        a, b = np.searchsorted(pids, np.uint64(lo)), np.searchsorted(pids, np.uint64(hi))
        pending = {n: arrays[n][a:b] for n in arrays if n.startswith("pending_") and n != "pending_dead"}
        pending["pending_ids"] = pids[a:b]
    return kept, pending


def _row_table(source: Source, key: int, layout: Layout, lo: int, count: int, rank: int) -> dict:
    """Key `key`'s rows [lo, lo + count) gathered from the source ranks that hold some of them."""
    parts, pendings, metas = [], [], []
    for r in source.holders(key):
        first, size = _source_part(source, key, r, layout)
        if first + size <= lo or first >= lo + count:
            continue
        table = source.key_table(r, key, (lo - first, lo + count - first) if layout.local else (lo, lo + count))
        rows, pending = _rows_in(table, first if layout.local else 0, lo, lo + count)
        parts.append(rows)
        pendings.append(pending)
        metas.append(table["meta"])
    if not parts:
        raise ReshardError(f"{source.directory}: no source rank holds rows [{lo}, {lo + count}) of key {key}")
    ids = np.concatenate([p["row_ids"] for p in parts])
    order = np.argsort(ids, kind="stable")
    arrays = {n: np.concatenate([p["cols"][n] for p in parts])[order] for n in parts[0]["cols"]}
    if any(pendings):
        pids = np.concatenate([p.get("pending_ids", np.zeros(0, np.uint64)) for p in pendings])
        by = np.argsort(pids, kind="stable")
        for name in ("pending_ids", "pending_count", "pending_last"):
            arrays[name] = np.concatenate([p[name] for p in pendings if p])[by]
        if layout.local:
            arrays["pending_ids"] = arrays["pending_ids"] - np.uint64(lo)
    if any(m.get("history") != metas[0].get("history") for m in metas):
        raise ReshardError(f"{source.directory}: key {key}'s step history (dense semantics: its optimizer's steps) "
                           f"differs between the source ranks holding rows [{lo}, {lo + count}), so their rows "
                           f"cannot share one server; restore onto the same number of servers")
    meta = {k: v for k, v in metas[0].items() if k not in _ENTRY_FIELDS}
    meta.update(local_rows=int(count), row_offset=0 if layout.local else int(lo), rank=rank)
    if "policy_state" in meta:
        first_holder = 0 if layout.split else rank    # an unsplit key has one holder
        meta["policy_state"] = _policy_state([m["policy_state"] for m in metas], rank == first_holder)
    ids = ids[order] - np.uint64(lo) if layout.local else ids[order]
    return {"row_ids": ids, "weights": np.concatenate([p["weights"] for p in parts])[order],
            "states": [np.concatenate([p["states"][i] for p in parts])[order] for i in range(len(parts[0]["states"]))],
            "meta": meta, "arrays": arrays}


def _policy_state(states: list[dict], first: bool) -> dict:
    """A key's policy state on a new rank: the first holder's clock (every server of a key sees its every round),
    the job's stats counters on the key's lowest new holder."""
    out = dict(states[0], pending_buckets=None)
    counters = {name: sum(int(s["counters"].get(name, 0)) for s in states) for name in states[0]["counters"]}
    out["counters"] = counters if first else dict.fromkeys(counters, 0)
    return out


def _dense_table(source: Source, key: int, layout: Layout, first: int, count: int) -> dict:
    holders = source.holders(key)
    tables = [source.key_table(r, key) for r in holders]
    weights = np.concatenate([t["weights"].reshape(-1) for t in tables])[first:first + count]
    num_states = {len(t["states"]) for t in tables}
    if len(num_states) != 1:
        raise ReshardError(f"{source.directory}: key {key} has {sorted(num_states)} optimizer states on its ranks")
    states = [np.concatenate([t["states"][i].reshape(-1) for t in tables])[first:first + count]
              for i in range(num_states.pop())]
    meta = {k: v for k, v in tables[0]["meta"].items() if k not in _ENTRY_FIELDS}
    return {"row_ids": np.zeros(1, np.uint64), "weights": weights.reshape(1, -1),
            "states": [s.reshape(1, -1) for s in states], "meta": meta}


def rank_state(source: Source, rank: int, num_servers: int, bound: int) -> tuple[dict, dict[int, dict]]:
    """(server state, key -> table) of rank `rank` of a job of `num_servers` servers restored from `source`."""
    tables: dict[int, dict] = {}
    for key in source.keys():
        layout = layout_of(source, key, bound)
        part = layout.part(num_servers, rank, key)
        if part is None:
            continue
        if layout.kind == "row_sparse":
            tables[key] = _row_table(source, key, layout, part[0], part[1], rank)
        else:
            tables[key] = _dense_table(source, key, layout, part[0], part[1])
    return _server_state(source, set(tables)), tables


def _server_state(source: Source, held: set[int]) -> dict:
    server = {k: v for k, v in source.servers[0].items() if k not in DROPPED_SERVER_STATE}
    server["specs"] = [source.specs()[k] for k in sorted(source.specs())]
    counts: dict[int, int] = {}
    for state in source.servers:
        for key, n in ((state.get("optimizer_counts") or {}).get("counts") or {}).items():
            if int(key) in held:
                counts[int(key)] = max(counts.get(int(key), 0), int(n))
    if server.get("optimizer_counts") is not None:
        server["optimizer_counts"] = {"num_update": max(counts.values(), default=0),
                                      "counts": {str(k): n for k, n in sorted(counts.items())}}
    clocks = [s.get("lifecycle") or {} for s in source.servers]
    server["lifecycle"] = {"clock": max(float(c.get("clock", 0.0)) for c in clocks),
                           "budget_passes": max(int(c.get("budget_passes", 0)) for c in clocks)}
    return server


# ----------------------------------------------------------------------------------------------------------------
# the two forms


def restore_for(directory: str | os.PathLike, rank: int, num_servers: int, bound: int | None = None,
                counter: ranged.Counter | None = None) -> snapshots.Loaded:
    """What server `rank` of a job of `num_servers` servers restores from the snapshot directory `directory`
    (written by any number of servers): KVSTORE_LAZY_RESTORE_FROM. Reads the manifests, and of each key only the
    rows of its range (``persist.ranged``: by seeking), the bytes read added to `counter`."""
    source = Source.open(directory, by_range=True, counter=counter)
    server, tables = rank_state(source, rank, num_servers, bound_from_env() if bound is None else bound)
    for table in tables.values():
        table["meta"] = dict(table["meta"], rows=len(table["row_ids"]))
    manifest = {"format": snapshots.FORMAT, "rank": rank, "num_servers": num_servers, "server": server,
                "keys": {str(k): t["meta"] for k, t in tables.items()}}
    return snapshots.Loaded(manifest, tables, None)


def reshard(src: str | os.PathLike, dst: str | os.PathLike, num_servers: int, bound: int | None = None,
            log=print) -> Path:
    """Write the snapshot directory `dst` (which must not exist) for a job of `num_servers` servers from `src`
    (never changed): every rank built in a temp directory beside `dst`, then one rename."""
    src, dst = Path(src), Path(dst)
    if num_servers < 1:
        raise ReshardError(f"--servers must be at least 1, got {num_servers}")
    if dst.exists():
        raise ReshardError(f"{dst}: already exists; give a new directory")
    if dst.resolve().is_relative_to(src.resolve()):
        raise ReshardError(f"{dst}: inside the source {src}; give a directory outside it")
    bound = bound_from_env() if bound is None else bound
    source = Source.open(src)
    for rank in range(source.num_servers):
        source.tables(rank)           # every file read and verified before anything is written
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=paths.temp_dir_prefix(dst), suffix=paths.TEMP_SUFFIX, dir=dst.parent))
    try:
        for rank in range(num_servers):
            server, tables = rank_state(source, rank, num_servers, bound)
            snapshots.write_snapshot(tmp, rank, num_servers, tables, server)
            rows = sum(len(t["row_ids"]) for t in tables.values() if t["meta"]["kind"] == "row_sparse")
            log(f"rank {rank}: {len(tables)} keys, {rows} rows")
        fsync_path(tmp)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(dst.parent)
    log(f"{src} ({source.num_servers} servers) -> {dst} ({num_servers} servers)")
    return dst


def reshard_main(argv: list[str] | None = None, prog: str = "kvstore-lazy reshard") -> int:
    """``kvstore-lazy reshard SRC DST --servers N``: 0 once DST is written; 1 with one line naming what is wrong."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog=prog, description="Write a server snapshot directory for N servers from one written by any number of "
                               "servers (base and deltas folded, every file verified; SRC is never changed). Start "
                               "the new job with KVSTORE_LAZY_SNAPSHOT_DIR=DST and N servers, or skip this step "
                               "with KVSTORE_LAZY_RESTORE_FROM=SRC.")
    parser.add_argument("src", metavar="SRC", help="the snapshot directory of the old job (rank<r>/ inside)")
    parser.add_argument("dst", metavar="DST", help="the directory to write (must not exist)")
    parser.add_argument("--servers", "-s", type=int, required=True, metavar="N", help="servers of the new job")
    parser.add_argument("--bigarray-bound", type=int, default=None, metavar="ELEMENTS",
                        help="the workers' MXNET_KVSTORE_BIGARRAY_BOUND (default: this environment's, else "
                             f"{DEFAULT_BOUND}); only needed for a source written by one server")
    args = parser.parse_args(argv)
    try:
        reshard(args.src, args.dst, args.servers, args.bigarray_bound)
    except (SnapshotError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(reshard_main(prog="python -m kvstore_lazy.persist.reshard"))
