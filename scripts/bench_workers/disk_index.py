"""The disk index out of RAM against the hash index it replaced: ``python scripts/bench_workers/disk_index.py``.

Builds an index of ``--rows`` rows (hashed 64-bit ids, in random order) through the API in batches of ``--batch``
(8192) as the disk tier's demotions would (each id given a record location; a demotion's rows are not on disk, so
``set`` is told so and looks nothing up, unless ``--set-looks-up``), once as a
:class:`~kvstore_lazy.store.disk.runs.RunIndex` (memtable ``--memtable`` entries, ``--bloom-bits`` bits an entry)
and once as the hash index the disk tier used before it (a RowTable of one uint32 column at a load of 0.8), then looks
up batches of ``--batch`` ids: present ids uniform and Zipf(1.2) over the rows, and absent ids. Prints RAM and disk
bytes per entry (RAM: the index's own count, the process's RSS growth over the build once glibc gave its free heap
back, and its peak during the build), the build rate, and per lookup kind the ids/s and the block reads per id (the
run index's counters). The run files stay in the page cache (the machine's memory holds them); ``--cold`` also times
present lookups with the run files dropped from the page cache before each batch (``posix_fadvise(DONTNEED)``): the
same reads, from the device. ``--block-bytes``: the index's block (what a cold lookup reads and checks; 8 bytes of
fence a block in RAM).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from kvstore_lazy.store.disk.runs import EMPTY, RunIndex  # noqa: E402
from kvstore_lazy.store.disk import runfile  # noqa: E402
from kvstore_lazy.store.disk.runfile import mix64  # noqa: E402
from kvstore_lazy.store.rows import RowTable  # noqa: E402


def hashed(x: np.ndarray) -> np.ndarray:
    """splitmix64 of ``x``: a bijection of uint64, so distinct ids from distinct counters (hashed ids)."""
    return mix64(x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15), 0)   # (the bloom filter's finalizer)


def workloads(rows: int, batch: int, batches: int, seed: int) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "present uniform": [hashed(rng.integers(0, rows, batch)) for _ in range(batches)],
        "present zipf": [hashed((rng.zipf(1.2, batch) - 1) % rows) for _ in range(batches)],
        "absent": [hashed(rng.integers(rows, 2 * rows, batch)) for _ in range(batches)],
    }


def drop_cache(directory: Path) -> None:
    for file in directory.glob("idx-*.run"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def reset_peak() -> None:
    """The process's high-water mark (VmHWM) reset to its RSS now (as tiered.py --rss-trace does)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def grown(before: int) -> tuple[int, int]:
    """(RSS growth over ``before`` once glibc gave its free heap back (malloc_trim), peak growth since reset_peak)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss() - before, rss("VmHWM") - before


def fix_malloc() -> None:
    """glibc's mmap threshold fixed at 4 MiB and its trim threshold at 16 MiB, as the disk tier fixes them in the
    server (store/tier.py): freed temporaries go back to the kernel, so the RSS growth is what the index holds."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 4 << 20)
        libc.mallopt(-1, 16 << 20)
    except (OSError, AttributeError):
        pass


def run_index(args, directory: Path, loads: dict[str, list[np.ndarray]]) -> dict:
    before = rss()
    reset_peak()
    index = RunIndex(directory, memtable_entries=args.memtable, bloom_bits=args.bloom_bits,
                     block_bytes=args.block_bytes)
    start = time.perf_counter()
    for lo in range(0, args.rows, args.batch):
        n = min(args.batch, args.rows - lo)
        # a demotion's rows are not on disk: it tells set so (no lookup), unless --set-looks-up
        old = None if args.set_looks_up else np.full(n, EMPTY, np.uint32)
        index.set(hashed(np.arange(lo, lo + n)), np.arange(lo, lo + n, dtype=np.uint64) & np.uint64(0x7FFFFFFF), old)
    index.committed(index.commit())
    build = time.perf_counter() - start
    now, peak = grown(before)
    out = {"ram": index.ram_bytes() / len(index), "rss": now / len(index), "peak": peak / len(index),
           "disk": index.disk_bytes() / len(index),
           "build": args.rows / build, "runs": index.stats()["run_entries"],
           "written": index.counters["entries_written"] / args.rows}
    for kind, batches in loads.items():
        c0 = dict(index.counters)
        start = time.perf_counter()
        found = sum(int((index.lookup(q) != EMPTY).sum()) for q in batches)
        took = time.perf_counter() - start
        ids = sum(len(q) for q in batches)
        assert found == (0 if kind == "absent" else ids), (kind, found, ids)
        out[kind] = (ids / took, (index.counters["blocks_read"] - c0["blocks_read"]) / ids)
    if args.cold:
        batches = loads["present uniform"][:args.cold]
        took = 0.0
        for q in batches:
            drop_cache(directory)
            start = time.perf_counter()
            index.lookup(q)
            took += time.perf_counter() - start
        out["present uniform, cold"] = (sum(len(q) for q in batches) / took, float("nan"))
    index.close()
    return out


def hash_index(args, loads: dict[str, list[np.ndarray]]) -> dict:
    before = rss()
    reset_peak()
    index = RowTable(1, np.uint32, max_load=0.8, lean_rehash=True)
    start = time.perf_counter()
    for lo in range(0, args.rows, args.batch):
        n = min(args.batch, args.rows - lo)
        slots = index.ensure(hashed(np.arange(lo, lo + n)), lambda new: np.zeros((len(new), 1), np.uint32))
        index.arrays()[0][slots, 0] = np.arange(lo, lo + n, dtype=np.uint64) & np.uint64(0x7FFFFFFF)
    build = time.perf_counter() - start
    now, peak = grown(before)
    out = {"ram": index.nbytes() / len(index), "rss": now / len(index), "peak": peak / len(index),
           "disk": 0.0, "build": args.rows / build}
    locs = index.arrays()[0]
    for kind, batches in loads.items():
        start = time.perf_counter()
        for q in batches:
            slots = index.lookup(q)
            np.where(slots >= 0, locs[np.maximum(slots, 0), 0], EMPTY)
        took = time.perf_counter() - start
        out[kind] = (sum(len(q) for q in batches) / took, 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=50, help="lookup batches of each kind")
    parser.add_argument("--memtable", type=int, default=1 << 17)
    parser.add_argument("--bloom-bits", type=float, default=10.0)
    parser.add_argument("--block-bytes", type=int, default=runfile.BLOCK_BYTES,
                        help="bytes of an index block (the unit of a lookup's read; 8 bytes of fence each in RAM)")
    parser.add_argument("--cold", type=int, default=0, help="also time this many present batches from the device")
    parser.add_argument("--set-looks-up", action="store_true", help="set looks the previous locations up")
    parser.add_argument("--dir", default=None, help="where the run files go (default: a temporary directory)")
    args = parser.parse_args()
    fix_malloc()
    loads = workloads(args.rows, args.batch, args.batches, seed=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ours = run_index(args, Path(tmp), loads)
    theirs = hash_index(args, loads)
    print(f"{args.rows:,} rows, batches of {args.batch}, memtable {args.memtable:,} entries, "
          f"{args.bloom_bits:g} bloom bits an entry, blocks of {args.block_bytes} bytes; runs {ours['runs']}, "
          "entries written per row "
          f"{ours['written']:.2f}")
    print(f"{'':28} {'run index':>22} {'hash index (RowTable)':>24}")
    print(f"{'RAM bytes / entry':28} {ours['ram']:>22.3f} {theirs['ram']:>24.2f}")
    print(f"{'RSS growth / entry':28} {ours['rss']:>22.3f} {theirs['rss']:>24.2f}")
    print(f"{'peak RSS growth / entry':28} {ours['peak']:>22.3f} {theirs['peak']:>24.2f}")
    print(f"{'disk bytes / entry':28} {ours['disk']:>22.2f} {theirs['disk']:>24.2f}")
    print(f"{'build (set) ids/s':28} {ours['build']:>22,.0f} {theirs['build']:>24,.0f}")
    for kind in [k for k in ours if k.startswith(("present", "absent"))]:
        rate, reads = ours[kind]
        other = f"{theirs[kind][0]:>24,.0f}" if kind in theirs else f"{'':>24}"
        print(f"{kind + ' ids/s':28} {rate:>22,.0f} {other}")
        if reads == reads:
            print(f"{kind + ' blocks / id':28} {reads:>22.4f} {'0 (in RAM)':>24}")


if __name__ == "__main__":
    main()
