"""Disk engines for the disk tier, side by side: ``python scripts/bench_workers/disk_engines.py``.

Compares kvstore_lazy's own segment store (kvstore_lazy/store/segments.py) with RocksDB (rocksdict) and LMDB (lmdb)
on what the tier does: batched put and get of B=8192 rows (D=32 float32 weights + 1 state of 32 float32, plus 8
bytes of policy columns: 264 bytes of payload; 256 bytes raw) at random ids out of a few million, after loading
``--rows`` rows. Each engine runs in its own subprocess (so RSS figures are its own). Prints rows/s for batched
get and put (median of the timed batches), bytes on disk per row after compaction (RocksDB: compact_range; LMDB:
a compacting copy; ours: compact()), and memory per row: the index bytes for ours (exact), the RSS growth of the
process over the load for all three. rocksdict and lmdb come from requirements-bench.txt (`make bench` installs
them); they are not dependencies of the server.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

D = 32
PAYLOAD = np.dtype([("w", "<f4", (D,)), ("s0", "<f4", (D,)), ("last", "<i4"), ("count", "<u4")])
RAW = 2 * D * 4


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


class Ours:
    def __init__(self, path: Path) -> None:
        from kvstore_lazy.store.segments import SegmentStore
        self.store = SegmentStore(path / "seg", PAYLOAD, segment_rows=1 << 16)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.store.put(ids, rows)

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self.store.get(ids)

    def delete(self, ids: np.ndarray) -> None:
        self.store.delete(ids)

    def compact(self, path: Path) -> Path:
        self.store.compact(0.01)
        self.store.commit()
        return path / "seg"

    def index_bytes(self) -> float:
        return self.store.index_nbytes() / len(self.store)


class Rocks:
    def __init__(self, path: Path) -> None:
        import rocksdict
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        self.rocksdict = rocksdict
        self.db = rocksdict.Rdict(str(path / "rocks"), options)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        batch = self.rocksdict.WriteBatch(raw_mode=True)
        keys = ids.astype(">u8").tobytes()
        data = rows.tobytes()
        size = PAYLOAD.itemsize
        for i in range(len(ids)):                    # the library's API takes one key and one value at a time
            batch.put(keys[8 * i:8 * i + 8], data[size * i:size * (i + 1)])
        self.db.write(batch)

    def get(self, ids: np.ndarray) -> np.ndarray:
        keys = ids.astype(">u8").tobytes()
        values = self.db[[keys[8 * i:8 * i + 8] for i in range(len(ids))]]    # multi-get
        return np.frombuffer(b"".join(values), PAYLOAD)

    def delete(self, ids: np.ndarray) -> None:
        batch = self.rocksdict.WriteBatch(raw_mode=True)
        keys = ids.astype(">u8").tobytes()
        for i in range(len(ids)):
            batch.delete(keys[8 * i:8 * i + 8])
        self.db.write(batch)

    def compact(self, path: Path) -> Path:
        self.db.flush()
        self.db.compact_range(None, None)
        return path / "rocks"

    def index_bytes(self) -> float:
        return float("nan")


class Lmdb:
    def __init__(self, path: Path) -> None:
        import lmdb
        (path / "lmdb").mkdir()
        self.env = lmdb.open(str(path / "lmdb"), map_size=1 << 40, sync=False, writemap=True)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        keys = ids.astype(">u8").tobytes()
        data = rows.tobytes()
        size = PAYLOAD.itemsize
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti([(keys[8 * i:8 * i + 8], data[size * i:size * (i + 1)]) for i in range(len(ids))])

    def get(self, ids: np.ndarray) -> np.ndarray:
        keys = ids.astype(">u8").tobytes()
        with self.env.begin() as txn:
            values = txn.cursor().getmulti([keys[8 * i:8 * i + 8] for i in range(len(ids))])
            return np.frombuffer(b"".join(v for _, v in values), PAYLOAD)

    def delete(self, ids: np.ndarray) -> None:
        keys = ids.astype(">u8").tobytes()
        with self.env.begin(write=True) as txn:
            for i in range(len(ids)):
                txn.delete(keys[8 * i:8 * i + 8])

    def compact(self, path: Path) -> Path:
        (path / "lmdb-compact").mkdir()
        self.env.copy(str(path / "lmdb-compact"), compact=True)
        return path / "lmdb-compact"

    def index_bytes(self) -> float:
        return float("nan")


ENGINES = {"ours": Ours, "rocksdb": Rocks, "lmdb": Lmdb}


def _noise(ids: np.ndarray, salt: int) -> np.ndarray:
    """(n, D) float32 in [-1, 1), a hash of (id, column): incompressible, like trained weights."""
    x = ids[:, None] * np.uint64(0x9E3779B97F4A7C15) + np.arange(salt, salt + D, dtype=np.uint64)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return ((x >> np.uint64(40)).astype(np.float32) / np.float32(2**23) - np.float32(1.0))


def rows_for(ids: np.ndarray) -> np.ndarray:
    out = np.zeros(len(ids), PAYLOAD)
    out["w"], out["s0"] = _noise(ids, 0), _noise(ids, D)
    out["last"] = (ids % np.uint64(1000)).astype(np.int32)
    out["count"] = 3
    return out


def run_one(name: str, rows: int, space: int, batch: int, batches: int, work: Path) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.choice(space, rows, replace=False).astype(np.uint64)
    before = rss()
    engine = ENGINES[name](work)
    t0 = time.perf_counter()
    for lo in range(0, rows, batch):
        part = np.sort(ids[lo:lo + batch])
        engine.put(part, rows_for(part))
    load_s = time.perf_counter() - t0
    grown = rss() - before

    def timed(fn) -> list[float]:
        out = []
        for _ in range(batches):
            part = np.unique(ids[rng.integers(0, rows, batch)])
            t = time.perf_counter()
            fn(part)
            out.append(len(part) / (time.perf_counter() - t))
        return out

    def check_get(part):
        got = engine.get(part)
        assert got.tobytes() == rows_for(part).tobytes()

    get_rates = timed(check_get)
    put_rates = timed(lambda part: engine.put(part, rows_for(part)))
    # churn before compaction: half the rows deleted then written back (what promotions and demotions do)
    half = ids[: rows // 2]
    for lo in range(0, len(half), batch):
        engine.delete(np.sort(half[lo:lo + batch]))
    for lo in range(0, len(half), batch):
        part = np.sort(half[lo:lo + batch])
        engine.put(part, rows_for(part))
    t = time.perf_counter()
    where = engine.compact(work)
    compact_s = time.perf_counter() - t
    return {"engine": name, "rows": rows, "load_s": round(load_s, 2),
            "get_rows_per_s": float(np.median(get_rates)), "put_rows_per_s": float(np.median(put_rates)),
            "disk_bytes_per_row": dir_bytes(where) / rows, "raw_bytes_per_row": RAW,
            "index_bytes_per_row": engine.index_bytes(), "rss_growth_per_row": grown / rows,
            "compact_s": round(compact_s, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows loaded before timing (default 2M)")
    parser.add_argument("--space", type=int, default=8_000_000, help="ids drawn from [0, space)")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=30, help="timed batches of get and of put")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir under /tmp)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.rows, args.space, args.batch, args.batches, Path(args.dir))))
        return 0
    results = []
    for name in args.engines:
        work = Path(tempfile.mkdtemp(prefix=f"disk-{name}-", dir=args.dir))
        try:
            out = subprocess.run([sys.executable, __file__, "--one", name, "--dir", str(work), "--rows",
                                  str(args.rows), "--space", str(args.space), "--batch", str(args.batch),
                                  "--batches", str(args.batches)], capture_output=True, text=True, timeout=3600)
            if out.returncode:
                print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{args.rows:,} rows of {PAYLOAD.itemsize} B payload ({RAW} B raw: D={D} float32 + 1 state), batches of "
          f"{args.batch} random ids, {os.cpu_count()} cores")
    print(f"{'engine':<8} {'get rows/s':>12} {'put rows/s':>12} {'disk B/row':>11} {'x raw':>6} "
          f"{'index B/row':>12} {'RSS B/row':>10} {'load s':>7}")
    for r in results:
        print(f"{r['engine']:<8} {r['get_rows_per_s']:>12,.0f} {r['put_rows_per_s']:>12,.0f} "
              f"{r['disk_bytes_per_row']:>11.1f} {r['disk_bytes_per_row'] / RAW:>6.2f} "
              f"{r['index_bytes_per_row']:>12.1f} {r['rss_growth_per_row']:>10.1f} {r['load_s']:>7.1f}")
    return 0 if len(results) == len(args.engines) else 1


if __name__ == "__main__":
    sys.exit(main())
