"""The row-gather limit of this machine: how many random D=32 float32 rows one core copies out of a table per second.

Owns: that one measurement (numpy ``np.take(table, ids, axis=0, out=buf)`` of B uniformly random row ids from a
(rows, D) float32 table, best of several rounds, wall and CPU time of this process). It is the yardstick of the
saturation scenario: a server answering a row_sparse pull must at least gather each row once, so rows/s per
server core is compared with it in the same table.
Does not own: anything a server does beyond that one copy (hashing row ids to slots, the wire, the optimizer).

    python scripts/bench_workers/gather_limit.py [--rows 1000000] [--dim 32] [--batch 8192]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def measure(rows: int = 1_000_000, dim: int = 32, batch: int = 8192, rounds: int = 7,
            seconds_per_round: float = 0.2, seed: int = 0) -> dict:
    """Best rows/s over `rounds` rounds of gathers of `batch` random rows (fresh ids per gather, drawn up front)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((rows, dim), dtype=np.float32)
    out = np.empty((batch, dim), np.float32)
    pool = [rng.integers(0, rows, batch) for _ in range(32)]
    np.take(table, pool[0], axis=0, out=out)          # page the table in
    best_wall = best_cpu = 0.0
    for _ in range(rounds):
        gathers, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - wall0 < seconds_per_round:
            for ids in pool:
                np.take(table, ids, axis=0, out=out)
            gathers += len(pool)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        best_wall = max(best_wall, gathers * batch / wall)
        best_cpu = max(best_cpu, gathers * batch / cpu) if cpu > 0 else best_cpu
    return {"rows_per_s": best_wall, "rows_per_cpu_s": best_cpu, "table_rows": rows, "dim": dim, "batch": batch,
            "bytes_per_s": best_wall * dim * 4, "method": "np.take(table, ids, axis=0, out=buf), uniform ids"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=8192)
    args = p.parse_args()
    print(json.dumps(measure(args.rows, args.dim, args.batch)))


if __name__ == "__main__":
    main()
