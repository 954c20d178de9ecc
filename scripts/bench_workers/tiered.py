"""The disk tier in-process, no sockets: ``python scripts/bench_workers/tiered.py``.

Plays two stock workers (the frames they send, through the wire codec: core_step.Worker) against one in-process
:class:`KVServer` with a memory budget and ``--disk-dir`` (or none: ``--budget 0``): fills a (rows, D) lazy key with
fresh rows, then runs Zipf(1.2) pull + push steps of B rows per worker over it. Prints the process RSS (VmRSS, and
the growth over the RSS before the key existed: mxnet is imported for the optimizer pickle), the server's CPU per
step (all threads, and the request thread's own) and its rows/s per worker, and with ``--profile`` the hot spots
(cProfile, the request thread). ``--index-times`` (with ``--hashed``): the wall time a Zipf step the request thread
spends in the disk index's calls (lookups, and within them the groups' probes, their filters and fences, and the
block reads, checks and searches on that thread; removals; sets), without cProfile's cost a call. For tuning the
tier; ``make bench`` (scenario tiered) holds the end-to-end numbers with real workers.

``--hashed``: the key declared with 2^40 rows and its ids spread one to one over them (id x an odd factor mod
2^40), so the tier indexes its rows on disk with the RunIndex (store/disk/runs.py) instead of a dense index; the
disk index's counters are printed too (block reads, cache hits, flushes, merges). ``--memtable``: its memtable's
entries (default: the tier's share of the budget).

``--rss-trace``: where the RSS peak comes from. The process's high-water mark (VmHWM) is reset
(``/proc/self/clear_refs``) on entry to each of the tier's and the budget's functions (:data:`TRACED`) and read on
exit, so each one's own transient above the RSS it started at is exact, not sampled; printed per function with
the absolute peak and the RSS before the key existed.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))

from core_step import KEY, start  # noqa: E402
from kvstore_lazy.protocol import mxnet as mx  # noqa: E402
from kvstore_lazy.server.lifecycle import Settings, parse_bytes  # noqa: E402
from kvstore_lazy.worker import lazy_spec_body  # noqa: E402


def rss() -> int:
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


# (module, class, method) whose memory transients --rss-trace measures
TRACED = [("kvstore_lazy.server.lifecycle", "Lifecycle", "enforce_budget"),
          ("kvstore_lazy.server.keys", "RowSparseKey", "evict"),
          ("kvstore_lazy.server.keys", "RowSparseKey", "apply"),
          ("kvstore_lazy.server.keys", "RowSparseKey", "pull"),
          ("kvstore_lazy.store.tier", "DiskTier", "demote"),
          ("kvstore_lazy.store.tier", "DiskTier", "promote"),
          ("kvstore_lazy.store.tier", "DiskTier", "compact"),
          ("kvstore_lazy.store.segments", "SegmentStore", "put"),
          ("kvstore_lazy.store.rows", "RowTable", "remove_slots"),
          ("kvstore_lazy.store.rows", "RowTable", "ensure"),
          ("kvstore_lazy.store.rows", "RowIndex", "_grow_table"),
          ("kvstore_lazy.store.rows", "RowIndex", "remove"),
          ("kvstore_lazy.store.rows", "RowTable", "export"),
          ("kvstore_lazy.store.rows", "Arena", "grow"),
          ("kvstore_lazy.store.rows", "Arena", "clear"),
          ("kvstore_lazy.store.segments", "SegmentStore", "put_records"),
          ("kvstore_lazy.store.segments", "SegmentStore", "new_records")]


def replace(module: str, name: str, wrap) -> None:
    """Put ``wrap(f)`` in the place of ``f``, the attribute ``name`` (dotted: ``Class.method``) of ``module``."""
    owner = importlib.import_module(module)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, attr, wrap(getattr(owner, attr)))


class HwmTrace:
    """Each traced function's peak RSS above the RSS at its entry (VmHWM reset at every entry and exit of a traced
    call; an inner call passes what it saw on to the calls around it)."""

    def __init__(self) -> None:
        self.rise: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.peak = 0
        self.stack: list[list] = []          # [label, rss at entry, max VmHWM seen]
        for module, cls, name in TRACED:
            replace(module, f"{cls}.{name}", lambda fn, label=f"{cls}.{name}": self._wrap(label, fn))

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def _seen(self) -> None:
        hwm = _status("VmHWM")
        self.peak = max(self.peak, hwm)
        for frame in self.stack:
            frame[2] = max(frame[2], hwm)

    def _wrap(self, label: str, fn):
        def traced(*args, **kwargs):
            self._seen()
            self._reset()
            self.stack.append([label, _status("VmRSS"), 0])
            try:
                return fn(*args, **kwargs)
            finally:
                self._seen()
                frame = self.stack.pop()
                self.rise[label] = max(self.rise.get(label, 0), frame[2] - frame[1])
                self.calls[label] = self.calls.get(label, 0) + 1
                self._reset()
        return traced

    def report(self, base: int) -> str:
        self._seen()
        lines = [f"rss trace: peak {self.peak / 2**20:.1f} MiB (VmHWM, exact), {(self.peak - base) / 2**20:.1f} MiB "
                 "above the RSS before the key; each function's largest rise above its entry RSS:"]
        for label, rise in sorted(self.rise.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {rise / 2**20:8.1f} MiB  {label} ({self.calls[label]:,} calls)")
        return "\n".join(lines)


# (owner module, attribute, label) of the disk index's calls --index-times times on the request thread; nested
# ones (a probe within a lookup) count in both
INDEX_CALLS = [("kvstore_lazy.store.disk.runs", "RunIndex.lookup", "lookup"),
               ("kvstore_lazy.store.disk.runfile", "Probe.__call__", "  groups' probes"),
               ("kvstore_lazy.store.disk.runcalls", "runs_probe", "    filters and fences"),
               ("kvstore_lazy.store.disk.runcalls", "runs_read_search", "    block reads, checks, searches"),
               ("kvstore_lazy.store.disk.runs", "RunIndex.remove", "remove"),
               ("kvstore_lazy.store.disk.runs", "RunIndex.set", "set")]


class IndexTimes:
    """Wall time and calls of each of :data:`INDEX_CALLS` made on the thread that made this (the request thread):
    the block reads a lookup hands to a pool thread are not in it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.wall = {label: 0.0 for _, _, label in INDEX_CALLS}
        self.calls = dict.fromkeys(self.wall, 0)
        for module, name, label in INDEX_CALLS:
            replace(module, name, lambda fn, label=label: self._wrap(label, fn))

    def _wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            if threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed

    def clear(self) -> None:
        for label in self.wall:
            self.wall[label], self.calls[label] = 0.0, 0

    def report(self, steps: int) -> str:
        lines = ["disk index, wall ms a Zipf step on the request thread (calls a step):"]
        for label, wall in self.wall.items():
            lines.append(f"  {label:<36} {wall / steps * 1e3:6.2f} ({self.calls[label] / steps:.1f})")
        return "\n".join(lines)


def zipf_ids(rng, rows: int, batch: int) -> np.ndarray:
    ids: set[int] = set()
    while len(ids) < batch:
        ids.update(((rng.zipf(1.2, batch) - 1) * 0x9E3779B1 % rows).tolist())
    return np.sort(np.fromiter(ids, np.int64)[:batch])


HASH_SPACE = 1 << 40                    # --hashed: the key's rows, ids spread over them by ...
HASH_FACTOR = 0x9E3779B97F4A7C15 & (HASH_SPACE - 1) | 1     # ... an odd factor: a bijection of [0, 2^40)


def spread(ids: np.ndarray) -> np.ndarray:
    """``ids`` (< 2^40) mapped one to one over [0, 2^40), sorted: the rows of a key of hashed ids."""
    return np.sort((ids.astype(np.uint64) * np.uint64(HASH_FACTOR)) & np.uint64(HASH_SPACE - 1)).astype(np.int64)


def moved(server) -> dict:
    """The tier's counters of rows moved and records read/written so far (empty without a tier)."""
    disk = server.keys[KEY].disk
    if disk is None:
        return {}
    index = getattr(disk.store._index, "counters", {})          # a RunIndex's (hashed ids): lookups, block reads
    return {**{f"index_{k}": v for k, v in index.items()}, "promoted": disk.counters["promoted"],
            "demoted": disk.counters["demoted"],
            "updated_in_place": disk.counters["updated_in_place"],
            "records_read": disk.store.counters["records_read"],
            "records_written": disk.store.counters["records_written"],
            "records_rewritten": disk.store.counters["records_rewritten"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--budget", default="64MiB", help="memory budget (0: none, everything in memory)")
    parser.add_argument("--disk-dir", default=None, help="default: a temp dir")
    parser.add_argument("--steps", type=int, default=30, help="Zipf steps after the fill")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rss-trace", action="store_true", help="each tier function's RSS transient (VmHWM)")
    parser.add_argument("--pread", action="store_true", help="read with pread, not an io_uring")
    parser.add_argument("--read-threads", type=int, default=None, help="segments.READ_THREADS")
    parser.add_argument("--sort", default="tottime", help="cProfile order (tottime, cumulative)")
    parser.add_argument("--top", type=int, default=24, help="cProfile lines")
    parser.add_argument("--evict", default="lru", help="eviction policy (KVSTORE_LAZY_EVICT: lru, lfu)")
    parser.add_argument("--admit-window", type=int, default=None,
                        help="KVSTORE_LAZY_DISK_ADMIT_WINDOW (rounds; 0: every touched row comes back)")
    parser.add_argument("--hashed", action="store_true",
                        help="ids hashed over 2^40 (the key declared with 2^40 rows): the disk index is a RunIndex")
    parser.add_argument("--index-times", action="store_true",
                        help="with --hashed: the request thread's wall time in the disk index's calls a Zipf step")
    parser.add_argument("--memtable", type=int, default=None,
                        help="the RunIndex's memtable entries (default: the tier's share of the budget)")
    parser.add_argument("--append-rewrites", action="store_true",
                        help="rows updated on disk are appended anew, not written in place (segments.REWRITE_IN_PLACE)")
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    from kvstore_lazy.store import kernels, segments
    segments.READ_RING = not args.pread
    segments.REWRITE_IN_PLACE = not args.append_rewrites
    segments.READ_THREADS = args.read_threads or segments.READ_THREADS
    print(f"reads: {'pread' if args.pread or not kernels.uring_available() else 'io_uring'}, "
          f"{segments.READ_THREADS} threads")
    temp = None if args.disk_dir else tempfile.TemporaryDirectory(prefix="tiered-")   # removed at exit
    disk = args.disk_dir or temp.name
    window = {} if args.admit_window is None else {"disk_admit_window": args.admit_window}
    settings = Settings(memory_budget=budget, disk_dir=disk if budget else "", evict=args.evict, **window)
    if args.memtable:
        from kvstore_lazy.server.keys import row_disk
        row_disk.memtable_entries = lambda budget: args.memtable
    ids_of = spread if args.hashed else (lambda ids: ids)
    server, workers, handle = start("sgd", lifecycle=settings)
    handle(workers[0].command(mx.LAZY_DECLARE, lazy_spec_body(KEY, (HASH_SPACE if args.hashed else args.rows,
                                                                    args.dim), "float32",
                                                               '["uniform", {"scale": 0.07}]', 1)))
    handle(workers[0].rows(np.zeros(0, np.int64), np.zeros((0, args.dim), np.float32)))
    base = rss()
    trace = HwmTrace() if args.rss_trace else None
    times = IndexTimes() if args.index_times else None
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((args.batch, args.dim)).astype(np.float32) * 0.01
    profile = cProfile.Profile(time.process_time) if args.profile else None     # CPU, the kernel's included

    walls: list[float] = []
    threads: list[float] = []

    def step(ids_per_worker) -> float:
        t, wall, own = time.process_time(), time.perf_counter(), time.thread_time()
        for w, ids in zip(workers, ids_per_worker):
            handle(w.rows(ids, None))
        for w, ids in zip(workers, ids_per_worker):
            handle(w.rows(ids, grad[:len(ids)]))
        walls.append(time.perf_counter() - wall)
        threads.append(time.thread_time() - own)
        return time.process_time() - t

    peak, order = base, rng.permutation(args.rows)
    per = len(workers) * args.batch
    t = time.perf_counter()
    fill_cpu = 0.0
    for lo in range(0, args.rows, per):
        part = order[lo:lo + per]
        fill_cpu += step([ids_of(np.sort(part[i::len(workers)])) for i in range(len(workers))])
        peak = max(peak, rss())
    fill_wall = time.perf_counter() - t
    before = moved(server)
    if profile:                 # the Zipf phase only
        profile.enable()
    walls.clear()
    threads.clear()
    if times:
        times.clear()
    cpu = [step([ids_of(zipf_ids(rng, args.rows, args.batch)) for _ in workers]) for _ in range(args.steps)]
    if profile:
        profile.disable()
    after = moved(server)
    peak = max(peak, rss())
    st = server.stats()["sparse"][str(KEY)]
    print(f"{args.rows:,} rows of D={args.dim} (SGD momentum), budget {args.budget}, disk {disk if budget else '-'}, "
          f"evict {settings.evict}, admit window {settings.disk_admit_window}")
    print(f"fill: {args.rows / fill_wall:,.0f} rows/s wall, {fill_cpu / max(1, args.rows // per) * 1e3:.1f} ms CPU "
          f"per step; RSS before the key {base / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB (growth "
          f"{(peak - base) / 2**20:.1f} MiB)")
    print(f"zipf: {np.mean(cpu) * 1e3:.1f} ms CPU per step (2 workers' pull + push), {args.batch / np.mean(cpu):,.0f} "
          f"rows/s per worker if the server were the only cost; p99 {np.percentile(cpu, 99) * 1e3:.1f} ms; wall "
          f"{np.mean(walls) * 1e3:.1f} ms per step; the request thread's own CPU {np.mean(threads) * 1e3:.1f} ms "
          "(the rest: the read threads' and the disk index's background thread's)")
    print("stats:", {k: st[k] for k in ("rows", "bytes", "disk_rows", "disk_bytes", "disk_index_bytes", "promoted",
                                        "demoted", "hit_rate") if k in st})
    index = server.keys[KEY].disk.store._index if server.keys[KEY].disk is not None else None
    if index is not None and hasattr(index, "counters"):
        print("disk index (RunIndex):", {k: v for k, v in index.stats().items() if k != "run_entries"})
    if after:
        print("zipf phase, per step: " + ", ".join(f"{k} {(after[k] - before[k]) / max(1, args.steps):,.0f}"
                                                  for k in after))
    if times:
        print(times.report(max(1, args.steps)))
    if trace:
        print(trace.report(base))
    else:
        print(f"peak RSS (VmHWM) {_status('VmHWM') / 2**20:.1f} MiB")
    if profile:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
