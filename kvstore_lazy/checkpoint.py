"""Atomic files, server snapshots, and what a checkpoint of lazy rows needs to rebuild the rows it does not hold.

Owns: writing a file or a directory so that a crash mid-write leaves the previous version intact (temp file, fsync,
rename, fsync of the directory); the snapshot layout a server writes and reloads; the sidecar that describes the
lazy parameters of a checkpoint file, and ``densify`` (``python -m kvstore_lazy.checkpoint densify IN OUT``), which
writes a stock file with absent rows filled in. numpy only (never mxnet: the server imports this module); snapshots
are ``.npz`` files read with ``allow_pickle=False`` and a JSON manifest checked before anything is loaded; MXNet's
NDArray files are read and written by ``ndfile``.

Snapshot layout (one directory per server rank)::

    <dir>/rank<r>/manifest.json   {"format": 1, "rank": r, "num_servers": S, "keys": {"<key>": {...}},
                                   "writer": {"host": advertised host, "port": p}}
    <dir>/rank<r>/key<k>.npz      row_ids (uint64, global, sorted), weights (rows, row_size), state0, state1, ...

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
import secrets
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .ndfile import Entry, NDFileError, Writer, chunked, read_index, read_row_ids, read_values
from .initializers import InitializerError, parse_initializer

FORMAT = 1
TAGGED_DIR = "tagged"   # <dir>/tagged/rank<r>: the snapshot a LAZY_SNAPSHOT command with a tag asked for
SIDECAR_FORMAT = "kvstore_lazy.checkpoint/1"
SIDECAR_SUFFIX = ".lazy.json"


class SnapshotError(ValueError):
    pass


class CheckpointError(ValueError):
    """A checkpoint or its sidecar that cannot be used as asked (the message names the file and the reason)."""


def fsync_path(path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename in it durable)."""
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync_dir(Path(tmp))
        if lazy:
            _write_sidecar(path, tmp, lazy)
        os.replace(tmp, path)
        if lazy is not None and not lazy:
            sidecar_path(path).unlink(missing_ok=True)
        _fsync_dir(path.parent)
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
    of the server writing it (``node_lifecycle.check_snapshot_owner``)."""
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
    parser = argparse.ArgumentParser(prog="python -m kvstore_lazy.checkpoint",
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
