"""Shared by the benchmark's worker scripts and by scripts/bench.py (which imports it without mxnet).

- row-id streams: Zipf (a=1.2) ids folded into input_dim, scrambled by a fixed bijection, B unique per step; a
  worker's stream is a pure function of (seed, rank, step), so bench.py can rebuild every worker's ids and count
  the rows seen without shipping them;
- server pids (written by bench.py into the file named by BENCH_PIDS) and their RSS, worker TCP bytes sent;
- results: one JSON object per line appended to <out>.rank<r>.jsonl, so a job that dies keeps what it measured.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:  # the project's helpers (RSS from /proc, TCP bytes from `ss -tinpH`)
    from kvstore_lazy.node.procstats import rss as _rss, tcp_bytes_sent as _tcp_bytes_sent
except ImportError:  # pragma: no cover - a checkout without kvstore_lazy/node/procstats.py
    _rss = _tcp_bytes_sent = None

ZIPF_A = 1.2
_SCRAMBLE = (1_000_003, 999_983, 1_000_033)   # odd primes; id -> id * P mod input_dim is a bijection if coprime


def rss(pid: int) -> int | None:
    """VmRSS of pid in bytes (None once it is gone)."""
    if _rss is not None:
        return _rss(pid)
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tcp_bytes_sent(pid: int | None = None) -> int:
    """Bytes this process has sent over its open TCP sockets (kernel counters)."""
    if _tcp_bytes_sent is not None:
        return _tcp_bytes_sent(pid)
    import re
    import subprocess
    pid = os.getpid() if pid is None else pid
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            mine = f"pid={pid}," in line
        elif mine:
            m = re.search(r"bytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def server_pids(timeout: float = 60.0) -> list[int]:
    """The job's server pids, by rank, from the file bench.py writes right after starting the job."""
    path = os.environ.get("BENCH_PIDS")
    if not path:
        return []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return [int(p) for p in json.loads(Path(path).read_text())["servers"]]
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    return []


def servers_rss(pids: list[int]) -> list[int | None]:
    return [rss(p) for p in pids]


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds pid has used (its threads included), from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def servers_cpu(pids: list[int]) -> list[float | None]:
    return [cpu_seconds(p) for p in pids]


class Results:
    """Appends JSON lines to <out>.rank<r>.jsonl (flushed at once)."""

    def __init__(self, out: str, rank: int) -> None:
        self.path = f"{out}.rank{rank}.jsonl"

    def add(self, **record) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def stock_initial_weight(rank: int, shape: tuple[int, int]):
    """What a stock user passes to kv.init for a row_sparse key: on rank 0 the full Uniform(0.07) weight as
    row_sparse (timed: returned seconds), elsewhere an empty row_sparse array of the shape (only rank 0 pushes)."""
    import mxnet as mx
    if rank != 0:
        return mx.nd.sparse.zeros("row_sparse", shape), 0.0
    t = time.perf_counter()
    value = mx.nd.random.uniform(-0.07, 0.07, shape=shape).tostype("row_sparse")
    value.wait_to_read()
    return value, time.perf_counter() - t


def read_results(out: str, rank: int) -> list[dict]:
    path = Path(f"{out}.rank{rank}.jsonl")
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


# ----------------------------------------------------------------------------------------------------------------
# row ids

def scramble_factor(input_dim: int) -> int:
    for p in _SCRAMBLE:
        if math.gcd(p, input_dim) == 1:
            return p
    return 1


class ZipfRows:
    """B unique row ids per step, Zipf(a) over the naturals folded into [0, input_dim) (k -> (k - 1) mod
    input_dim), then scrambled by the bijection id -> id * P mod input_dim so hot rows spread over the key's range
    (and over servers), as hashed feature ids are. Sorted int64. Deterministic in (seed, rank)."""

    def __init__(self, input_dim: int, batch: int, seed: int, rank: int, a: float = ZIPF_A) -> None:
        if batch > input_dim:
            raise ValueError(f"batch {batch} > input_dim {input_dim}")
        self.input_dim, self.batch, self.a = int(input_dim), int(batch), a
        self.rng = np.random.default_rng([seed, rank])
        self.factor = np.int64(scramble_factor(self.input_dim))
        # products stay below 2**63 as long as input_dim * P does (P ~ 1e6: input_dim up to ~9e12)
        assert self.input_dim * int(self.factor) < 2**63

    def next(self) -> np.ndarray:
        n = self.batch
        draws = np.zeros(0, np.int64)
        while True:
            fresh = (self.rng.zipf(self.a, n) - 1) % self.input_dim
            draws = np.concatenate([draws, fresh])
            uniq, first = np.unique(draws, return_index=True)
            if len(uniq) >= self.batch:
                break
            n *= 2
        ids = draws[np.sort(first)[:self.batch]]   # the first B distinct ids, in draw order
        return np.sort(ids * self.factor % self.input_dim)


class UniformRows:
    """B unique ids per step drawn uniformly from [0, input_dim) (for filling a server fast: nearly all new)."""

    def __init__(self, input_dim: int, batch: int, seed: int, rank: int) -> None:
        self.input_dim, self.batch = int(input_dim), int(batch)
        self.rng = np.random.default_rng([seed, rank, 7])

    def next(self) -> np.ndarray:
        ids = np.unique(self.rng.integers(0, self.input_dim, self.batch + self.batch // 8 + 16, dtype=np.int64))
        while len(ids) < self.batch:
            ids = np.unique(np.concatenate([ids, self.rng.integers(0, self.input_dim, self.batch, dtype=np.int64)]))
        return np.sort(self.rng.permutation(ids)[:self.batch])


class FreshRows:
    """B ids per step that no worker has touched before (while they last): step s of rank r takes counters
    (s * workers + r) * B ... + B - 1, scrambled by the bijection id -> id * P mod input_dim. For filling a server
    with exactly workers * B new rows per step."""

    def __init__(self, input_dim: int, batch: int, seed: int, rank: int, workers: int = 2) -> None:
        self.input_dim, self.batch, self.rank, self.workers = int(input_dim), int(batch), rank, workers
        self.factor = np.int64(scramble_factor(self.input_dim))
        self.offset = (seed * 7919) % self.input_dim
        self.step = 0
        assert self.input_dim * int(self.factor) < 2**63

    def next(self) -> np.ndarray:
        first = (self.step * self.workers + self.rank) * self.batch
        self.step += 1
        counters = (np.arange(first, first + self.batch, dtype=np.int64) + self.offset) % self.input_dim
        return np.sort(counters * self.factor % self.input_dim)


class DriftingCTR:
    """The lifecycle scenario's streaming click data: each example has `fields` ids; an id is the item of rank
    k ~ Zipf(a) among the items born so far, newest first (rank 0 is the item born last), and `drift` items are born
    per step, so the popular set drifts: new items appear at the top and old ones fade down the ranks. Items map to
    row ids by the bijection item -> item * P mod input_dim (field f's items start at f * input_dim // fields).
    A click is Bernoulli(sigmoid(sum over the fields of truth(id))), truth(id) in [-1.5, 1.5] a fixed hash of the
    id: a signal the per-id weights can learn. Deterministic in (seed, rank, step)."""

    def __init__(self, input_dim: int, batch: int, fields: int, seed: int, rank: int, a: float = 1.1,
                 drift: float = 2.0) -> None:
        self.input_dim, self.batch, self.fields = int(input_dim), int(batch), int(fields)
        self.seed, self.rank, self.a, self.drift = seed, rank, a, drift
        self.factor = np.int64(scramble_factor(self.input_dim))
        assert self.input_dim * int(self.factor) < 2**63

    def examples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids (batch, fields) int64, clicks (batch,) float32) of `step`."""
        rng = np.random.default_rng([self.seed, self.rank, step])
        ranks = np.minimum(rng.zipf(self.a, (self.batch, self.fields)) - 1, self.input_dim - 1).astype(np.int64)
        newest = np.int64(int(step * self.drift))
        starts = (np.arange(self.fields, dtype=np.int64) * (self.input_dim // self.fields))[None, :]
        items = (newest - ranks + starts) % self.input_dim
        ids = items * self.factor % self.input_dim
        score = truth(ids).sum(axis=1)
        clicks = (rng.random(self.batch) < 1 / (1 + np.exp(-score))).astype(np.float32)
        return ids, clicks


def truth(ids: np.ndarray) -> np.ndarray:
    """The per-id signal of DriftingCTR: a fixed hash of the id, uniform in [-1.5, 1.5]."""
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (h.astype(np.float64) / 2**24 - 0.5) * 3.0


def row_stream(kind: str, input_dim: int, batch: int, seed: int, rank: int, workers: int = 2):
    if kind == "fresh":
        return FreshRows(input_dim, batch, seed, rank, workers)
    return (ZipfRows if kind == "zipf" else UniformRows)(input_dim, batch, seed, rank)


def percentile(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else None
