"""The memory budget in every phase of a server's life, in-process: ``python scripts/bench_workers/phases.py``.

Plays two stock workers (their frames, through the wire codec: core_step.Worker) against one in-process
:class:`KVServer` with a memory budget and a disk tier, and runs the phases a job goes through, each one's peak RSS
measured exactly (VmHWM reset on entry, ``/proc/self/clear_refs``):

- ``train``: B fresh rows per worker and step until ``--rows`` rows exist (promotions, demotions, compaction);
- ``zipf``: Zipf(1.2) steps over them;
- ``fetch_rows``: what ``kvstore_lazy.worker.fetch_rows`` asks of a server (LAZY_ROWS, the ROWS_HEADER_KEY pulls
  of the header and of the listed ids, then the rows, in pieces of FETCH_BYTES of reply);
- ``fetch_states``: what ``fetch_states`` asks (the flat-state keys' pulls, FETCH_BYTES at a time);
- ``snapshot_base``, then ``zipf`` steps and ``snapshot_delta``: a base and a delta of the snapshot chain;
- ``restore``: a new server restored from the chain in a fresh process, as a restarted server is (load_snapshot
  in pieces, KVServer.restore); its growth is over that process's RSS before it.

The server tracks changes (as one with a snapshot directory does: the delta is a real delta). The harness keeps
nothing of its own that grows with the rows, as a separate worker process's memory would not count: the fresh ids
come from a bijection of the row numbers, the worker's copy of a listing goes to a temporary file, the pulls' ids
are made a piece at a time.

Prints per phase the peak RSS, its growth over the RSS before the key existed (mxnet is imported for the optimizer
pickle) and that growth less the budget: what the issue's target (peak <= budget + 100 MB) is about. The issue's
job: ``--rows 1600000 --input-dim 60000000 --batch 16384 --budget 32MiB``. ``--rss-trace`` adds each traced
function's own transient (tiered.HwmTrace).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))

import tiered  # noqa: E402
from core_step import KEY, start  # noqa: E402
from kvstore_lazy.persist import snapshots  # noqa: E402
from kvstore_lazy.protocol import mxnet as mx  # noqa: E402
from kvstore_lazy.protocol.message import KVPairs  # noqa: E402
from kvstore_lazy.server.core import KVServer  # noqa: E402
from kvstore_lazy.server.lifecycle import Settings, parse_bytes  # noqa: E402
from kvstore_lazy.worker import FETCH_BYTES, lazy_spec_body, piece_rows  # noqa: E402

SPREAD = 1_000_000_007     # see train()
ROW_SPARSE_F64 = mx.command_code(mx.ROW_SPARSE, mx.DTYPE_FLAGS[np.dtype(np.float64)])
ROW_SPARSE_F32 = mx.command_code(mx.ROW_SPARSE, 0)
TRACED = [("kvstore_lazy.server.state_transfer", "StateTransfer", "pull"),
          ("kvstore_lazy.server.state_transfer", "StateTransfer", "list_rows"),
          ("kvstore_lazy.server.core", "KVServer", "handle"),
          ("kvstore_lazy.server.core", "KVServer", "_rows_pull"),
          ("kvstore_lazy.server.fastpath", "FastPath", "answer"),
          ("kvstore_lazy.store.segments", "SegmentStore", "contains"),
          ("kvstore_lazy.store.segments", "SegmentStore", "get_records"),
          ("kvstore_lazy.store.rows", "RowTable", "lookup"),
          ("kvstore_lazy.server.keys", "RowSparseKey", "snapshot"),
          ("kvstore_lazy.server.keys", "RowSparseKey", "delta"),
          ("kvstore_lazy.server.keys", "RowSparseKey", "restore"),
          ("kvstore_lazy.store.tier", "DiskTier", "read_weights"),
          ("kvstore_lazy.store.tier", "DiskTier", "read"),
          ("kvstore_lazy.persist.snapshots", "SnapshotChain", "write"),
          ("kvstore_lazy.server.core", "KVServer", "restore")]


def pull_virtual(worker, key: int, rows: np.ndarray, head: int):
    """A stock worker's row_sparse pull of `rows` of virtual key `key` (one server: ids as they are)."""
    keys = np.concatenate([[key], key + rows.astype(np.uint64)]).astype(np.uint64)
    return worker._message(head, pull=True, kv=KVPairs(keys, b"", np.zeros(0, np.int32)))


class Phases:
    def __init__(self, budget: int, base: int) -> None:
        self.budget, self.base = budget, base
        self.rows: list[tuple] = []

    def run(self, name: str, fn, accounted=None):
        gc.collect()
        tiered.HwmTrace._reset()
        entry = tiered.rss()
        t = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t
        peak = tiered._status("VmHWM")
        self.rows.append((name, entry, peak, wall, accounted() if accounted else None))
        return out

    def report(self) -> str:
        mib = 2 ** 20
        lines = [f"RSS before the key {self.base / mib:.1f} MiB; budget {self.budget / mib:.1f} MiB",
                 f"{'phase':16} {'entry MiB':>10} {'peak MiB':>10} {'growth':>8} {'over budget':>12} "
                 f"{'accounted':>10} {'seconds':>8}"]
        for name, entry, peak, wall, accounted in self.rows:
            growth = peak - self.base
            acc = "" if accounted is None else f"{accounted / mib:.1f}"
            lines.append(f"{name:16} {entry / mib:10.1f} {peak / mib:10.1f} {growth / mib:8.1f} "
                         f"{(growth - self.budget) / mib:12.1f} {acc:>10} {wall:8.1f}")
        return "\n".join(lines)


def restore_only(root: Path, budget: int) -> int:
    """The restore phase: a new server restored from the snapshot chain in `root` (load_snapshot in pieces, as
    node.durability loads it, then KVServer.restore); prints its RSS figures as one JSON line."""
    gc.collect()
    base = tiered.rss()
    tiered.HwmTrace._reset()
    t = time.perf_counter()
    loaded = snapshots.load_snapshot(root / "snap", 0, pieces=True)
    fresh = KVServer(0, 1, 2, lifecycle=Settings(memory_budget=budget, disk_dir=str(root / "disk2"),
                                                 track_changes=True))
    fresh.restore(loaded.manifest.get("server", {}), loaded.tables)
    print(json.dumps({"base": base, "entry": base, "peak": tiered._status("VmHWM"),
                      "seconds": time.perf_counter() - t, "accounted": fresh.lifecycle.accounted(fresh.keys)}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_600_000, help="rows trained (all fresh)")
    parser.add_argument("--input-dim", type=int, default=60_000_000, help="the key's rows (shape[0])")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--budget", default="32MiB")
    parser.add_argument("--zipf-steps", type=int, default=10)
    parser.add_argument("--dir", default=None, help="where the disk tiers and snapshots go (default: a temp dir)")
    parser.add_argument("--rss-trace", action="store_true", help="each traced function's own transient")
    parser.add_argument("--skip", default="", help="phases to skip, comma-separated (fetch_rows, fetch_states, "
                                                   "snapshot, restore)")
    parser.add_argument("--materialize", default="push", help="KVSTORE_LAZY_MATERIALIZE (push, touch)")
    parser.add_argument("--restore-only", default=None, help=argparse.SUPPRESS)   # (the restore phase's process)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    budget = parse_bytes(args.budget)
    if args.restore_only:
        return restore_only(Path(args.restore_only), budget)
    temp = None if args.dir else tempfile.TemporaryDirectory(prefix="phases-")   # removed at exit
    root = Path(args.dir or temp.name)
    settings = Settings(memory_budget=budget, disk_dir=str(root / "disk"), track_changes=True)   # (snapshots on)
    server, workers, handle = start("sgd", lifecycle=settings, materialize=args.materialize)
    libc = ctypes.CDLL(None)
    gc.collect()
    libc.malloc_trim(0)
    base = tiered.rss()         # before the key: its declaration and init count (a dense disk index is made there)
    handle(workers[0].command(mx.LAZY_DECLARE, lazy_spec_body(KEY, (args.input_dim, args.dim), "float32",
                                                               '["uniform", {"scale": 0.07}]', 1)))
    handle(workers[0].rows(np.zeros(0, np.int64), np.zeros((0, args.dim), np.float32)))
    if args.rss_trace:
        tiered.TRACED.extend(TRACED)
    trace = tiered.HwmTrace() if args.rss_trace else None
    phases = Phases(budget, base)
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((args.batch, args.dim)).astype(np.float32) * 0.01

    def accounted() -> int:
        return server.lifecycle.accounted(server.keys)

    def step(ids_per_worker) -> None:
        for w, ids in zip(workers, ids_per_worker):
            handle(w.rows(ids, None))
        for w, ids in zip(workers, ids_per_worker):
            handle(w.rows(ids, grad[:len(ids)]))
        server.lifecycle.run_due()

    def train() -> None:
        # the i-th fresh row is (i * SPREAD) mod input_dim, a bijection of [0, input_dim) (SPREAD a prime that does
        # not divide it): distinct ids spread over the key with no list of them (the harness's memory is not the
        # server's; 8 B a row of a permutation would count here)
        if args.input_dim % SPREAD == 0:
            raise SystemExit(f"--input-dim must not be a multiple of {SPREAD}")
        per = len(workers) * args.batch
        for lo in range(0, args.rows, per):
            part = np.arange(lo, min(lo + per, args.rows), dtype=np.uint64) * np.uint64(SPREAD) % \
                np.uint64(args.input_dim)
            step([np.sort(part[i::len(workers)].astype(np.int64)) for i in range(len(workers))])

    def zipf() -> None:
        for _ in range(args.zipf_steps):
            step([tiered.zipf_ids(rng, args.input_dim, args.batch) for _ in workers])

    phases.run("train", train, accounted)
    phases.run("zipf", zipf, accounted)
    w = workers[0]

    def listing():
        """LAZY_ROWS and the listing's pulls, as the worker makes them; the ids go to a temporary file (the worker's
        memory is not the server's: a worker holding 8 B a row would count here), ``(file, count)``."""
        handle(w.command(mx.LAZY_ROWS, json.dumps({"key": KEY}).encode()))
        header = None
        for _, reply in server.handle(pull_virtual(w, mx.ROWS_HEADER_KEY, np.array([0]), ROW_SPARSE_F64)):
            header = reply
        count = int(np.frombuffer(header.data[1], np.float64)[0])
        virtual = -(-count // mx.ROWS_WIDTH)
        ids = tempfile.TemporaryFile(dir=root)
        piece = piece_rows(mx.ROWS_WIDTH * 8)
        for lo in range(0, virtual, piece):
            rows = 1 + np.arange(lo, min(lo + piece, virtual))
            for _, reply in server.handle(pull_virtual(w, mx.ROWS_HEADER_KEY, rows, ROW_SPARSE_F64)):
                got = np.frombuffer(reply.data[1], np.float64)
                for at in range(0, len(got), 1 << 16):
                    ids.write(got[at:at + (1 << 16)].astype(np.int64).tobytes())
                del reply, got
        return ids, count

    def fetch_rows() -> int:
        ids, count = listing()
        got = 0
        with ids:
            step = piece_rows(4 * args.dim)
            for lo in range(0, count, step):
                n = min(step, count - lo)
                piece = np.frombuffer(os.pread(ids.fileno(), 8 * n, 8 * lo), np.int64)
                for _, reply in server.handle(w.rows(piece, None)):
                    got += len(reply.data[1]) // (4 * args.dim) if len(reply.data) > 1 else 0
                    del reply           # (sent: a server holds no reply while it makes the next)
                del piece
        assert server.bad_requests == 0 and got == count
        return got

    def fetch_states() -> int:
        ids, count = listing()
        ids.close()
        virtual = -(-count * args.dim // mx.ROWS_WIDTH)
        got = 0
        piece = piece_rows(mx.ROWS_WIDTH * 4)
        for lo in range(0, virtual, piece):     # (a piece's rows at a time: 8 B a virtual row)
            rows = np.arange(lo, min(lo + piece, virtual))
            for _, reply in server.handle(pull_virtual(w, mx.flat_state_key(0), rows, ROW_SPARSE_F32)):
                got += len(reply.data[1])
                del reply
        assert server.bad_requests == 0
        return got

    if "fetch_rows" not in skip:
        phases.run("fetch_rows", fetch_rows, accounted)
    if "fetch_states" not in skip:
        phases.run("fetch_states", fetch_states, accounted)
    chain = snapshots.SnapshotChain(root / "snap", 0, 1)

    def snapshot(delta: bool) -> None:
        meta, tables = server.snapshot(delta=delta, stream=True)     # (as node.durability writes them)
        chain.write(meta, tables, delta)
        server.snapshot_written()

    if "snapshot" not in skip:
        phases.run("snapshot_base", lambda: snapshot(False), accounted)
        phases.run("zipf", zipf, accounted)
        phases.run("snapshot_delta", lambda: snapshot(True), accounted)
    stats = server.stats()["sparse"][str(KEY)]
    if "restore" not in skip and "snapshot" not in skip:
        for entry in server.keys.values():
            if getattr(entry, "disk", None) is not None:
                entry.disk.store.close()
        # in a fresh process, as a restarted server restores: its RSS before is the interpreter's and the modules'
        child = subprocess.run([sys.executable, __file__, "--restore-only", str(root), "--budget", args.budget],
                               capture_output=True, text=True, timeout=1800, check=True)
        got = json.loads(child.stdout.strip().splitlines()[-1])
        phases.rows.append(("restore", got["entry"] - got["base"] + base, got["peak"] - got["base"] + base,
                            got["seconds"], got["accounted"]))
    print(f"{args.rows:,} rows trained of a ({args.input_dim:,}, {args.dim}) key (SGD momentum), B={args.batch}, "
          f"budget {args.budget}, fetch pieces of {FETCH_BYTES >> 20} MiB")
    print("stats:", {k: stats[k] for k in ("rows", "bytes", "disk_rows", "disk_index_bytes") if k in stats})
    print(phases.report())
    if trace:
        print(trace.report(base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
