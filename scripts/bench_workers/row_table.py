"""The memory row store's rates and bytes per row, in process: ``python scripts/bench_workers/row_table.py``.

Builds a :class:`~kvstore_lazy.store.rows.RowIndex` and a :class:`~kvstore_lazy.store.rows.RowTable` of ``n``
random 40-bit ids in batches and prints rates and bytes per row. Rates are given per wall-clock second and per CPU
second of this process (the latter is steadier on a shared machine). (It was ``kvstore_lazy/store/rows.py``'s
``_benchmark``, run as ``python -m kvstore_lazy.store.rows``: a benchmark is a script that prints a table.)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))

from kvstore_lazy.store.rows import RowIndex, RowTable  # noqa: E402  (the repo is on sys.path from here)


def timed(what, count, run) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{what:<48} {count / wall / 1e6:6.2f} M/s wall  {count / cpu / 1e6:6.2f} M/s cpu")


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def bench_index(base: np.ndarray, fresh: np.ndarray, batches, rng, batch: int) -> None:
    n = len(base)
    index = RowIndex()
    timed(f"RowIndex insert 0 -> {n:,} (incl. rehashes)", n, lambda: [index.insert(b) for b in batches(base)])
    present = [base[rng.integers(0, n, batch)] for _ in range(200)]
    timed(f"RowIndex lookup, present, at {len(index):,}", 200 * batch, lambda: [index.lookup(p) for p in present])
    absent = batches(fresh[:200 * batch])
    timed(f"RowIndex lookup, absent, at {len(index):,}", 200 * batch, lambda: [index.lookup(p) for p in absent])
    timed(f"RowIndex insert at {len(index):,} (no rehash)", 200 * batch, lambda: [index.insert(b) for b in absent])
    print(f"RowIndex bytes/row at {len(index):,}: {index.nbytes() / len(index):.1f}")


def bench_table(base: np.ndarray, fresh: np.ndarray, batches, rng, batch: int, row_size: int,
                num_states: int) -> None:
    n = len(base)

    def make_rows(new_ids):
        return np.full((len(new_ids), row_size), 0.01, np.float32)

    before = rss()
    table = RowTable(row_size, np.float32, num_states)

    def fill():
        for b in batches(base):
            table.set_states(table.ensure(b, make_rows), [np.ones((len(b), row_size), np.float32)] * num_states)

    timed(f"RowTable ensure (all new) + set_states 0 -> {n:,}", n, fill)
    grown = rss() - before
    raw = row_size * table.dtype.itemsize * (1 + num_states)
    print(f"RowTable {len(table):,} rows: nbytes/row {table.nbytes() / n:.1f}, RSS growth/row {grown / n:.1f}, "
          f"raw/row {raw}, ratio {grown / n / raw:.3f}")
    mixed = [np.concatenate([base[rng.integers(0, n, batch // 2)], b[:batch // 2]])
             for b in batches(fresh[200 * batch:])]

    def update():
        for m in mixed:
            slots = table.ensure(m, make_rows)
            table.set_weights(slots, table.weights(slots))

    timed("RowTable ensure (half new) + weights + set_weights", len(mixed) * batch, update)


def main(n: int = 10_000_000, batch: int = 8192, row_size: int = 32, num_states: int = 2) -> None:
    rng = np.random.default_rng(0)
    extra = 300 * batch
    ids = np.unique(rng.integers(0, 2**40, int((n + extra) * 1.01), dtype=np.uint64))
    ids = rng.permutation(ids)[:n + extra]
    base, fresh = ids[:n], ids[n:]

    def batches(a):
        return [a[lo:lo + batch] for lo in range(0, len(a), batch)]

    bench_index(base, fresh, batches, rng, batch)     # (its index is freed before the table is built)
    bench_table(base, fresh, batches, rng, batch, row_size, num_states)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--row-size", type=int, default=32)
    parser.add_argument("--states", type=int, default=2)
    args = parser.parse_args()
    main(args.rows, args.batch, args.row_size, args.states)
