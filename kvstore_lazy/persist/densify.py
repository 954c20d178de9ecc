"""Densify and inspect checkpoints: the tools an operator runs on files a job wrote.

Owns: ``densify`` (a stock MXNet file with the absent rows of lazy parameters filled in, streamed), ``inspect``
(what a checkpoint file and its sidecar, or a server snapshot directory, holds), and their command line:
``python -m kvstore_lazy.persist.checkpoint densify IN OUT`` / ``inspect PATH`` (also ``kvstore-lazy densify`` and
``kvstore-lazy inspect``). An error is one line on stderr, ``<command>: error: <path>: <reason>``, and status 1.
numpy only: densify runs where mxnet is not installed.
Does not own: the formats (``sidecar``, ``snapshots``, ``ndfile``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from kvstore_lazy.persist.ndfile import Entry, NDFileError, Writer, chunked, read_index, read_row_ids, read_values
from kvstore_lazy.persist.sidecar import CheckpointError, lazy_params, lazy_rows, sidecar_path, write_checkpoint
from kvstore_lazy.persist.snapshots import TAGGED_DIR, SnapshotError, load_snapshot, snapshot_ranks

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
    write_checkpoint(dst, write, lazy=rest)
    return report


# ----------------------------------------------------------------------------------------------------------------
# inspect: what a checkpoint or a snapshot directory holds

def inspect(path: str | os.PathLike) -> list[str]:
    """Lines saying what `path` holds: a checkpoint file (its entries, and the lazy parameters its sidecar
    declares) or a server snapshot directory (a ``rank<r>`` directory, or one holding them: every key of every
    rank, base and deltas folded). CheckpointError naming `path` when it is neither."""
    path = Path(path)
    if path.is_file():
        return _inspect_file(path)
    if path.is_dir():
        ranks = _snapshot_ranks(path)
        if ranks:
            return [line for directory, rank in ranks for line in _inspect_snapshot(directory, rank)]
        raise CheckpointError(f"{path}: not a server snapshot directory (no manifest.json in it or in a rank<r>/ "
                              f"inside it)")
    raise CheckpointError(f"{path}: no such file or directory")


def _inspect_file(path: Path) -> list[str]:
    entries = read_index(path)
    params = lazy_params(path) or {}
    side = sidecar_path(path)
    lines = [f"{path}: MXNet NDArray file, {len(entries)} entries; "
             + (f"sidecar {side.name}: {len(params)} lazy parameters" if side.exists() else
                "no sidecar (a stock file)")]
    for entry in entries:
        line = f"  {entry.name}: {entry.stype} {entry.shape} {entry.dtype}"
        if entry.stype == "row_sparse":
            line += f", {entry.rows_stored:,} rows stored"
        spec = params.get(entry.name)
        if spec is not None:
            line += (f"; lazy: key {spec['key']}, {spec['rows']:,} rows of {tuple(spec['row_shape'])} "
                     f"{spec['dtype']}, init {spec['init']}, seed {spec['seed']}")
        lines.append(line)
    return lines


def _snapshot_ranks(path: Path) -> list[tuple[Path, int]]:
    """(snapshot directory, rank) of each server snapshot at `path`: a rank<r> directory itself, or the rank<r>
    directories in it and in its tagged/ directory."""
    if (path / "manifest.json").is_file() and path.name.startswith("rank") and path.name[4:].isdigit():
        return [(path.parent, int(path.name[4:]))]
    return [(directory, rank) for directory in (path, path / TAGGED_DIR) for rank in snapshot_ranks(directory)]


def _inspect_snapshot(directory: Path, rank: int) -> list[str]:
    loaded = load_snapshot(directory, rank)
    assert loaded is not None, "a rank directory with a manifest"
    manifest, chain = loaded.manifest, loaded.chain
    deltas = f", chain {chain['id']}: base + {chain['seq']} deltas" if chain else ""
    tag = manifest.get("server", {}).get("tag")
    lines = [f"{directory / f'rank{rank}'}: server snapshot, rank {rank} of {manifest.get('num_servers')}, "
             f"{len(loaded.tables)} keys{deltas}" + ("" if tag is None else f", tag {tag!r}")]
    for key in sorted(loaded.tables):
        table = loaded.tables[key]
        weights = table["weights"]
        line = (f"  key {key}: {table['meta'].get('kind', '?')}, {len(table['row_ids']):,} rows of "
                f"{tuple(weights.shape[1:])} {weights.dtype}, {len(table['states'])} optimizer states")
        if table["arrays"]:
            line += f", arrays {sorted(table['arrays'])}"
        if table.get("disk") is not None:
            line += ", a disk tier"
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------------------------
# command line

DENSIFY_HELP = "write a stock MXNet file with the absent rows of lazy parameters filled in"
DENSIFY_DESCRIPTION = ("Write OUT: checkpoint IN (an mx.nd.save file with a .lazy.json sidecar) with every row of "
                       "each lazy parameter (or, with --rows, the stored rows and the rows listed) present, absent "
                       "ones with the initial values the servers would compute. Streamed: memory does not grow "
                       "with the parameters' sizes. Nothing is written if anything is wrong.")
INSPECT_HELP = "print what a checkpoint file (and its sidecar) or a server snapshot directory holds"
INSPECT_DESCRIPTION = ("Print what PATH holds: for a checkpoint file (mx.nd.save format), every entry's storage "
                       "type, shape and dtype, the rows stored, and the lazy parameters its .lazy.json sidecar "
                       "declares (key, rows, row shape, initializer, seed); for a server snapshot directory (the "
                       "snapshot dir, or one rank<r>/ in it), every rank's keys, rows, row shapes and optimizer "
                       "states, base and deltas folded.")


def add_densify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN")
    p.add_argument("output", metavar="OUT")
    p.add_argument("--rows", metavar="FILE", help="text file of row ids (whitespace or comma separated)")


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="a checkpoint file or a server snapshot directory")


def run_densify(args: argparse.Namespace) -> int:
    try:
        rows = read_row_ids_file(args.rows) if args.rows else None
        for line in densify(args.input, args.output, rows, rows_from=args.rows or ""):
            print(line)
    except (CheckpointError, NDFileError, OSError) as exc:
        print(f"densify: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        lines = inspect(args.path)
    except (CheckpointError, SnapshotError, NDFileError, OSError) as exc:   # each names the file
        print(f"inspect: error: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


def densify_main(argv: list[str] | None = None, prog: str = "kvstore-lazy densify") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=DENSIFY_DESCRIPTION)
    add_densify_arguments(parser)
    return run_densify(parser.parse_args(argv))


def inspect_main(argv: list[str] | None = None, prog: str = "kvstore-lazy inspect") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=INSPECT_DESCRIPTION)
    add_inspect_arguments(parser)
    return run_inspect(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore_lazy.persist.checkpoint densify|inspect ...``."""
    parser = argparse.ArgumentParser(prog="python -m kvstore_lazy.persist.checkpoint",
                                     description="Tools for kvstore_lazy checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_densify_arguments(sub.add_parser("densify", help=DENSIFY_HELP, description=DENSIFY_DESCRIPTION))
    add_inspect_arguments(sub.add_parser("inspect", help=INSPECT_HELP, description=INSPECT_DESCRIPTION))
    args = parser.parse_args(argv)
    return run_densify(args) if args.command == "densify" else run_inspect(args)


if __name__ == "__main__":
    sys.exit(main())
