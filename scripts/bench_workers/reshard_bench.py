"""Restoring server snapshots onto another number of servers (issue 31): time and bytes read per new server.

Writes a synthetic snapshot directory of --from servers (default 2) with the snapshots' own writer
(``kvstore_lazy.persist.snapshots.write_snapshot``, so the files are the real format): one lazy row_sparse key of
--rows rows (default 10M), every row stored, D=--dim float32 values and one optimizer state per row, and a small
dense key. Then restores it onto --to servers (default 4) the way ``KVSTORE_LAZY_RESTORE_FROM`` does
(``persist.reshard.restore_for``: each key's rows of the server's range read by seeking), one new server after the
other, with the source's page cache dropped before each (``posix_fadvise(DONTNEED)``; pass --warm to keep it), and
for comparison the whole-file read the online form did before (``np.load`` of every overlapping source rank's key
file, each member whole). Prints one table: per new server, restore time, bytes read (counted by the reader and as
the process's read syscalls, /proc/self/io rchar) and that against the snapshot's size and the server's share.
Without sockets or servers: what is measured is the read and the re-cut, not a job's start.

    python scripts/bench_workers/reshard_bench.py [--rows 10000000] [--from 2] [--to 4] [--dir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvstore_lazy.persist import ranged, reshard, snapshots  # noqa: E402
from kvstore_lazy.protocol import mxnet as mx  # noqa: E402

KEY, DENSE = 3, 9


def write_source(directory: Path, rows: int, servers: int, dim: int) -> None:
    spec = {"key": KEY, "rows": rows, "row_shape": [dim], "dtype": "float32", "init": "zeros", "seed": 1,
            "bound": 1000000}
    server = {"sync_mode": True, "specs": [spec], "aliases": {},
              "optimizer_counts": {"num_update": 100, "counts": {str(KEY): 100, str(DENSE): 100}}}
    for rank in range(servers):
        first, count = mx.row_partition(rows, servers, rank)
        ids = np.arange(first, first + count, dtype=np.uint64)
        weights = np.empty((count, dim), np.float32)
        weights[:] = np.arange(dim, dtype=np.float32)
        weights += (ids % 1000).astype(np.float32)[:, None]
        tables = {KEY: {"row_ids": ids, "weights": weights, "states": [weights * -0.5],
                        "meta": {"kind": "row_sparse", "dtype": "float32", "row_size": dim, "local_rows": count,
                                 "row_offset": first, "lazy": True, "rank": rank}}}
        if mx.dense_home_server(DENSE, servers) == rank:
            tables[DENSE] = {"row_ids": np.zeros(1, np.uint64), "weights": np.ones((1, 256), np.float32),
                             "states": [np.zeros((1, 256), np.float32)], "meta": {"kind": "dense", "dtype": "float32"}}
        snapshots.write_snapshot(directory, rank, servers, tables, server)
        del tables, weights, ids


def drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def timed(fn, *args) -> tuple[float, int, object]:
    before, start = rchar(), time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, rchar() - before, out


def whole_read(src: Path, rank: int, servers: int, bound: int) -> object:
    """What the online form read before: every overlapping source rank's key files loaded whole."""
    return reshard.rank_state(reshard.Source.open(src), rank, servers, bound)


def one_server(src: Path, rank: int, servers: int, size: int, warm: bool) -> str:
    """One new server's row of the table: the ranged restore, then the whole-file read, each from a cold cache."""
    share = size / servers
    if not warm:
        drop_cache(src)
    counter = ranged.Counter()
    secs, io, loaded = timed(reshard.restore_for, src, rank, servers, 1000000, counter)
    rows = len(loaded.tables[KEY]["row_ids"])          # type: ignore[attr-defined]
    del loaded
    if not warm:
        drop_cache(src)
    wsecs, wio, _ = timed(whole_read, src, rank, servers, 1000000)
    return (f"{rank:>6} {rows:>11,} {share / 2**20:>7.1f}Mi {secs:>9.2f} {counter.rows / 2**20:>9.1f}Mi "
            f"{counter.ids / 2**20:>7.1f}Mi {io / 2**20:>8.1f}Mi {io / size:>11.1%} {io / share:>8.2f} | "
            f"{wsecs:>7.2f} {wio / 2**20:>9.1f}Mi")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--from", dest="src_servers", type=int, default=2)
    p.add_argument("--to", dest="dst_servers", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write the source (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the source directory")
    p.add_argument("--warm", action="store_true", help="do not drop the source's page cache before each restore")
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="reshard-bench-"))
    src = base / "src"
    try:
        start = time.perf_counter()
        write_source(src, args.rows, args.src_servers, args.dim)
        wrote = time.perf_counter() - start
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        print(f"source: {args.rows:,} rows x {args.dim} float32 + 1 state on {args.src_servers} servers, "
              f"{size / 2**20:,.1f} MiB, written in {wrote:.1f} s; restoring onto {args.dst_servers} servers "
              f"({'warm' if args.warm else 'cold'} page cache)\n")
        print(f"{'server':>6} {'rows':>11} {'share':>9} {'restore s':>9} {'read: rows':>11} {'ids+hdr':>9} "
              f"{'rchar':>10} {'of snapshot':>11} {'of share':>8} | {'whole s':>7} {'whole rchar':>11}")
        for rank in range(args.dst_servers):
            print(one_server(src, rank, args.dst_servers, size, args.warm), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
