"""`make bench`: kvstore_lazy's server against MXNet 1.9.1's stock C++ server, side by side, in one run.

Every measurement is a real ps-lite job on this machine: the stock scheduler, the servers under test (ours:
``python -m kvstore_lazy.server``; stock: ``DMLC_ROLE=server python -c "import mxnet"``) and stock MXNet workers
running scripts/bench_workers/*.py, started and supervised by kvstore_lazy.launch.Job, each job with a
deadline and every process ended by PID. The same worker script, sizes and seeds run against both servers.

Scenarios (--scenarios, default all):
  init        kv.init of row_sparse keys, input_dim 1e5..1e7 (both servers), 1e8 and 2**40 (ours; a stock
              worker cannot describe such a key, so a pure-pyzmq ps-lite worker drives our server there), D 32/64:
              wall time, TCP bytes the workers sent, server RSS after init.
  memory      Zipf(1.2) row ids, B unique rows per step, SGD-momentum and Adam, K steps: rows seen, rows stored,
              server RSS, bytes per stored row against the raw bytes per row (D x 4 x (1 + states)).
  throughput  rows/s per worker and p50/p99 of row_sparse_pull + push (each step waited to completion), B 1024
              and 8192, 1 and 2 servers, dist_sync and dist_async; server CPU per step; dense push+pull latency of
              2x3 and 1000x1000 arrays.
  scale       ours: fill one server with D=64 Adam rows (every step's ids new) and fit RSS against rows;
              the largest row count within 8 GiB (measured, or extrapolated from the fit: said so in the table);
              stock: the largest input_dim one server can init (one init message must stay under 2 GiB).
  step        a CTR training step as a Gluon Trainer issues it (scripts/bench_workers/step.py): 8 row_sparse keys
              (embeddings and wide weights of 4 features, 256 Zipf rows each per worker) and 6 dense MLP keys,
              push all then pull all, 1 and 2 servers, dist_sync and dist_async: steps/s, p50/p99 step latency,
              server CPU per step.
  lifecycle   ours only (row admission and eviction have no stock counterpart): streaming CTR training (ids from
              a Zipf law whose popular set drifts, a learnable click signal), 2 workers, 2 servers, dist_sync,
              Adam, a (input_dim, 8) key with input_dim x 8 < 2^31; runs unbounded / memory budget /
              admit_min_count 2 / both: rows stored, server RSS over time (and lifecycle_rss.png), last-interval
              loss against the unbounded run, share of ids seen once; a run with snapshots every second measures
              a delta snapshot of a step touching 1% of the rows against a full one.
  saturation  one server under N = 1, 2, 4, 8, 16 simulated workers (scripts/bench_workers/loadgen_job.py: one
              low-CPU pyzmq process, each worker its own identity registered through the stock scheduler, sending
              what stock workers send), row_sparse pull + push of B = 512 and 8192 Zipf rows (D=32, SGD momentum),
              dist_sync and dist_async, ours and stock in the same run: closed-loop rows/s, server cores, server
              CPU per row, p50/p99 step latency; open-loop latency against offered load and its knee (p99
              doubled); the numpy row-gather limit of the machine in the same table; saturation_latency_B*.png.
  learning    issue 32: what Adam's row_sparse semantics do to learning (scripts/bench_workers/ctr_learning.py): a
              synthetic CTR task (Zipf ids, clicks from a known logistic model, so the best achievable held-out
              loss is known), 2 workers, 2 servers, dist_sync, weight decay; Adam lazy_update=True (stock's
              default) and lazy_update=False (the dense semantics) on both servers, and the per-row step counter
              (KVSTORE_LAZY_ADAM_ROW_STEPS=on) on ours: held-out log loss and AUC against the floor, server CPU
              and wall time per step, and whether ours predicts exactly what stock does.
  disk-scale  issue 29, opt-in (run only when named): one server with KVSTORE_LAZY_MEMORY_BUDGET (--budget) and a
              disk tier, a (2^40, 8) SGD-momentum key with hashed ids, 2 simulated workers
              (scripts/bench_workers/scale_job.py: stock workers' bytes) fill --rows fresh rows, then a full
              snapshot (LAZY_SNAPSHOT: tagged + the chain's base), Zipf steps, a delta (tagged + the chain's
              delta), fetch_rows' requests over the whole key; a second job restarts the server on that chain
              (KVSTORE_LAZY_RESUME=latest) and stops it (shutdown snapshot). Per phase: the server's peak RSS
              (VmHWM reset per phase, VmRSS sampled every 0.1 s) against the budget, rows in memory / on disk, the
              disk index's RAM per disk row, disk bytes per row against raw, the fill's rows/s; and whether every
              row was kept, fetched and restored with its trained value.

Writes <out>/results.json, <out>/tables.txt, <out>/memory_vs_rows.png, <out>/lifecycle_rss.png,
<out>/saturation_latency_B<B>.png, and every job's log under <out>/runs/.
Exit status 0 unless one of our jobs failed (stock failures where stock cannot do something are expected).

    python scripts/bench.py [--quick] [--scenarios init,memory,throughput,scale,step,lifecycle,tiered,saturation,
                                                   learning,disk-scale]
                            [--out bench-results] [--profile] [--no-stock] [--verbose] [--report-only]
                            [--rows N] [--budget SIZE]      (disk-scale only)

--quick takes ~3 minutes (18 jobs: 10, plus the step scenario's 8 in 30 s on 2026-12-01), plus the lifecycle
scenario's 5 (~40 s on 2026-12-01); the default (full) preset ~6 minutes on the 2-core dev VM (17 jobs in 335 s on
2026-11-30) plus the step scenario's 8 and the lifecycle scenario's 5 (about 5 minutes: its unbounded run stores
10.3M rows, ~620 MiB per server), and up to ~8 GiB of RAM for one server (scale: 10M rows of D=64 Adam) plus ~5 GiB
for a stock worker building a (1e7, 64) weight. --report-only rebuilds the tables, JSON and plots from the job
records a run left in --out. The tiered scenario (the disk tier) takes ~30 s with --quick and ~10 minutes full (3
Zipf pairs), and writes ~14 GB of segments under --out in its full scale run (checked against the free space first;
deleted after). The saturation scenario takes under 2 minutes with --quick (N = 1 and 8: 8 jobs) and ~10 minutes
full (20 jobs). The learning scenario: 5 jobs, ~100 s with --quick and ~7 minutes full on 2026-12-03, most of
both in our dense-Adam job (a row read is caught up over every step it missed).
The disk-scale scenario (`make bench-scale`, or --scenarios disk-scale) is not in the default list: its full preset
(300M rows under 1 GiB, ~28 GB of segments, index runs and snapshots under --out, checked against the free space
first and deleted after) took 31 minutes on 2026-12-04 on a 2-core VM whose page cache that data exceeds;
--quick (5M rows under 64 MiB) under a minute; --rows and --budget set its size.
scripts/bench_workers/replay.py measures the server's CPU per step in-process (no
sockets), steady enough for an optimisation's before/after.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import pstats
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "scripts" / "bench_workers"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(WORKERS))

import gather_limit  # noqa: E402
import plots  # noqa: E402
import saturation_report  # noqa: E402
from common import DriftingCTR, read_results, row_stream  # noqa: E402
from kvstore_lazy.launch import SERVER_PREFIX, Job, LineSink  # noqa: E402
from kvstore_lazy.node.procstats import RssSampler  # noqa: E402
from kvstore_lazy.server.lifecycle import parse_bytes  # noqa: E402

MiB, GiB = 2**20, 2**30
KEY_ROWS_2_40 = 2**40
BUDGET = 8 * GiB
ROW_KEY = 3                     # the row_sparse key of rows.py
NUM_WORKERS = 2
SCENARIOS = ("init", "memory", "throughput", "scale", "step", "lifecycle", "tiered", "saturation", "learning",
             "disk-scale")
OPT_IN = ("disk-scale",)        # run only when named in --scenarios (the full preset: half an hour, 28 GB)
STATES = {"sgd": 1, "adam": 2}  # optimizer state slots per row (SGD with momentum: 1)
IMPLS = ("lazy", "stock")

PRESETS = {
    "quick": {
        "init": {"dims": [100_000, 1_000_000], "lazy_only_dims": [10_000_000], "pyzmq_dims": [10**8, 2**40],
                 "D": [32, 64], "stock_timeout": 240},
        "memory": {"input_dim": 1_000_000, "dim": 32, "batch": 1024, "steps": 40, "optimizers": ["sgd", "adam"]},
        "throughput": {"input_dim": 1_000_000, "dim": 32, "batches": [[1024, 20], [8192, 12]], "warmup": 3,
                       "configs": [[1, "dist_sync"], [2, "dist_async"]],
                       "dense": [["2x3", 100], ["1000x1000", 12]]},
        "scale": {"input_dim": 33_000_000, "dim": 64, "batch": 65536, "rows": 1_000_000, "optimizer": "adam"},
        "step": {"features": [200_000, 100_000, 50_000, 10_000], "emb_dim": 16, "hidden": [256, 128], "rows": 256,
                 "steps": 150, "warmup": 10, "optimizer": "adam", "repeats": 3,
                 "configs": [[1, "dist_sync"], [1, "dist_async"], [2, "dist_sync"], [2, "dist_async"]]},
        "lifecycle": {"input_dim": 10_000_000, "dim": 8, "fields": 4, "batch": 2048, "steps": 120, "drift": 2,
                      "budget": "8MiB", "snapshot_interval": 1, "probe_wait": 2.5, "env": {}},
        "tiered": {"dim": 32, "batch": 8192, "scale_rows": 2_000_000, "scale_input_dim": 4_000_000,
                   "scale_budget": "128MiB", "zipf_budget": "16MiB", "zipf_steps": 40},
        "saturation": {"workers": [1, 8], "batches": [512, 8192], "modes": ["dist_sync", "dist_async"],
                       "input_dim": 200_000, "dim": 32, "warmup": 0.3, "closed": 0.8, "open": 0.5,
                       "levels": [0.1, 0.8, 1.0], "min_steps": 20, "dense_seconds": 0.5, "timeout": 120},
        "learning": {"dims": [100_000, 30_000, 10_000], "zipf": 1.2, "emb_dim": 8, "batch": 1024, "steps": 200,
                     "held_out": 20_000, "evals": 2, "lr": [0.01], "wd": 1e-4, "servers": 2, "timeout": 300},
        "disk_scale": {"rows": 5_000_000, "budget": "64MiB", "dim": 8, "batch": 16384, "workers": 2,
                       "zipf_steps": 10, "sample": 4096, "timeout": 900},
        "timeout": 240,
    },
    "full": {
        "init": {"dims": [100_000, 1_000_000, 10_000_000], "lazy_only_dims": [], "pyzmq_dims": [10**8, 2**40],
                 "D": [32, 64], "stock_timeout": 900},
        "memory": {"input_dim": 10_000_000, "dim": 32, "batch": 8192, "steps": 300, "optimizers": ["sgd", "adam"]},
        "throughput": {"input_dim": 1_000_000, "dim": 32, "batches": [[1024, 100], [8192, 60]], "warmup": 5,
                       "configs": [[1, "dist_sync"], [1, "dist_async"], [2, "dist_sync"], [2, "dist_async"]],
                       "dense": [["2x3", 500], ["1000x1000", 60]]},
        "scale": {"input_dim": 33_000_000, "dim": 64, "batch": 65536, "rows": 10_000_000, "optimizer": "adam"},
        "step": {"features": [2_000_000, 1_000_000, 500_000, 100_000], "emb_dim": 16, "hidden": [256, 128],
                 "rows": 256, "steps": 300, "warmup": 20, "optimizer": "adam", "repeats": 3,
                 "configs": [[1, "dist_sync"], [1, "dist_async"], [2, "dist_sync"], [2, "dist_async"]]},
        # over 10M rows stored by the unbounded run (input_dim x 8 < 2^31: what a stock worker can declare)
        "lifecycle": {"input_dim": 268_000_000, "dim": 8, "fields": 4, "batch": 8192, "steps": 1200, "drift": 4,
                      "budget": "256MiB", "snapshot_interval": 20, "probe_wait": 45,
                      "env": {"KVSTORE_LAZY_ADMIT_CAP": "4000000"}},
        # 50M rows of D=32 SGD momentum under 1 GiB (~14 GB of segments: checked against df first)
        "tiered": {"dim": 32, "batch": 8192, "scale_rows": 50_000_000, "scale_input_dim": 60_000_000,
                   "scale_budget": "1GiB", "zipf_budget": "256MiB", "zipf_steps": 120, "zipf_repeats": 3},
        "saturation": {"workers": [1, 2, 4, 8, 16], "batches": [512, 8192], "modes": ["dist_sync", "dist_async"],
                       "input_dim": 1_000_000, "dim": 32, "warmup": 0.5, "closed": 2.0, "open": 1.2,
                       "levels": [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0], "min_steps": 40, "dense_seconds": 1.0,
                       "timeout": 300},
        # lr: 0.005 is where lazy Adam (stock's default) does best at these sizes (ctr_learning.py --replay lazy, lr
        # 0.0025, 0.005 and 0.01: 0.4860, 0.4843, 0.4868), 0.02 where the per-row bias correction overtakes it; a
        # list runs every arm at each
        "learning": {"dims": [500_000, 200_000, 100_000, 50_000], "zipf": 1.2, "emb_dim": 8, "batch": 2048,
                     "steps": 600, "held_out": 100_000, "evals": 3, "lr": [0.005, 0.02], "wd": 1e-4, "servers": 2,
                     "timeout": 900},
        # issue 29: 300M rows of a (2^40, 8) key under 1 GiB (~25 GB of segments: checked against df first)
        "disk_scale": {"rows": 300_000_000, "budget": "1GiB", "dim": 8, "batch": 16384, "workers": 2,
                       "zipf_steps": 20, "sample": 4096, "timeout": 8 * 3600},
        "timeout": 1800,
    },
}


# ----------------------------------------------------------------------------------------------------------------
# machine

def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine() -> dict:
    info = {"cores": os.cpu_count(), "loadavg": loadavg(), "kernel": platform.release(),
            "python": platform.python_version()}
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        info["mem_total_gib"] = round(int(mem["MemTotal"].split()[0]) * 1024 / GiB, 1)
        info["mem_available_gib"] = round(int(mem["MemAvailable"].split()[0]) * 1024 / GiB, 1)
    except (OSError, KeyError, ValueError):
        pass
    try:
        model = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        info["cpu"] = model[0].split(":", 1)[1].strip() if model else platform.processor()
    except OSError:
        pass
    for pkg in ("mxnet", "numpy", "pyzmq"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        info["git"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=10).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                                                capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# ----------------------------------------------------------------------------------------------------------------
# jobs

STATS_JSON = re.compile(rf"^{SERVER_PREFIX} .*? INFO stats: (\{{.*\}})\s*$")
STATS_SHUTDOWN = re.compile(rf"^{SERVER_PREFIX} .*? INFO stats \(at shutdown\): key (\d+) rows (\d+) bytes (\d+)")
ERRORS = re.compile(r"(Error|error|Check failed|Traceback|exited with|deadline|Killed|Segmentation|terminate)")


class Sink(LineSink):
    """Job's output: every line to <run>/job.log, lazy servers' stats lines parsed, echoed if verbose."""

    def __init__(self, path: Path | None, verbose: bool) -> None:
        super().__init__()
        self.fh = open(path, "w", buffering=1) if path is not None else None   # None: parse only
        self.verbose = verbose
        self.stats: dict[int, list[dict]] = {}
        self.shutdown: dict[int, dict[int, int]] = {}
        self.tail: list[str] = []

    def on_line(self, line: str) -> None:
        if self.fh is not None:
            self.fh.write(line + "\n")
        if self.verbose:
            print("    " + line, flush=True)
        m = STATS_JSON.match(line)
        if m:
            try:
                self.stats.setdefault(int(m.group(1)), []).append(json.loads(m.group(2)))
            except ValueError:
                pass
        m = STATS_SHUTDOWN.match(line)
        if m:
            self.shutdown.setdefault(int(m.group(1)), {})[int(m.group(2))] = int(m.group(3))
        if ERRORS.search(line):
            self.tail = (self.tail + [line])[-12:]

    def close(self) -> None:
        super().close()
        if self.fh is not None:
            self.fh.close()


@dataclass
class Run:
    name: str
    server: str
    status: int
    wall: float
    records: list[list[dict]]
    log: str
    stats: dict[int, list[dict]] = field(default_factory=dict)
    shutdown: dict[int, dict[int, int]] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    profiles: list[str] = field(default_factory=list)
    server_peaks: list = field(default_factory=list)     # peak RSS (VmHWM) per server, when sampled

    @property
    def ok(self) -> bool:
        return self.status == 0

    def of(self, kind: str, rank: int | None = 0) -> list[dict]:
        ranks = range(len(self.records)) if rank is None else [rank]
        return [r for k in ranks if k < len(self.records) for r in self.records[k] if r.get("kind") == kind]

    def summary(self) -> dict:
        return {"name": self.name, "server": self.server, "status": self.status, "wall_seconds": round(self.wall, 2),
                "log": self.log, "loadavg_1min_before_after": self.load, "errors": self.errors,
                "profiles": self.profiles, "server_peaks": self.server_peaks}


class Bench:
    def __init__(self, args, cfg: dict) -> None:
        self.args = args
        self.cfg = cfg
        self.out = Path(args.out)
        self.runs_dir = self.out / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.runs: list[Run] = []
        self.previous: dict[tuple[str, str], dict] = {}
        if args.report_only and (self.out / "results.json").exists():
            for j in json.loads((self.out / "results.json").read_text()).get("jobs", []):
                self.previous[(j["name"], j["server"])] = j

    def load(self, name: str, server: str, num_workers: int) -> Run:
        """--report-only: a job as an earlier run left it (records, log, status) instead of running it."""
        run_dir = self.runs_dir / f"{name}-{server}"
        summary = {}
        if (run_dir / "run.json").exists():
            summary = json.loads((run_dir / "run.json").read_text())
        summary = summary or self.previous.get((name, server), {})
        sink = Sink(None, False)
        if (run_dir / "job.log").exists():
            sink.write((run_dir / "job.log").read_text(errors="replace"))
        sink.close()
        run = Run(name=name, server=server, status=int(summary.get("status", 1 if not summary else 0)),
                  wall=float(summary.get("wall_seconds", 0)),
                  records=[read_results(str(run_dir / "res"), r) for r in range(num_workers)],
                  log=str(run_dir / "job.log"), stats=sink.stats, shutdown=sink.shutdown,
                  load=summary.get("loadavg_1min_before_after", []), errors=summary.get("errors", []),
                  profiles=[str(p) for p in run_dir.glob("prof.*.prof")],
                  server_peaks=summary.get("server_peaks", []))
        label = "ours " if server == "lazy" else "stock"
        print(f"  [{label}] {name}: loaded from {run_dir} (status {run.status})", flush=True)
        self.runs.append(run)
        return run

    def job(self, name: str, server: str, command: list[str], num_workers: int = NUM_WORKERS,
            num_servers: int = 1, timeout: float | None = None, profile: bool = False,
            env: dict | None = None, server_env: dict | None = None, sample_peaks: bool = False,
            finish_grace: float = 30.0) -> Run:
        if self.args.report_only:
            return self.load(name, server, num_workers)
        run_dir = self.runs_dir / f"{name}-{server}"
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in list(run_dir.glob("res.rank*.jsonl")) + list(run_dir.glob("prof.*.prof")):
            old.unlink()
        out = str(run_dir / "res")
        pids_file = run_dir / "pids.json"
        pids_file.unlink(missing_ok=True)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
               "BENCH_PIDS": str(pids_file), **(env or {})}
        server_env = {"KVSTORE_LAZY_STATS_INTERVAL": "86400", **(server_env or {})}
        if profile and server == "lazy":
            server_env["KVSTORE_LAZY_PROFILE"] = str(run_dir / "prof")
        sink = Sink(run_dir / "job.log", self.args.verbose)
        job = Job(command=command + ["--out", out], num_workers=num_workers, num_servers=num_servers,
                       server=server, env=env, server_env=server_env, out=sink, finish_grace=finish_grace)
        timeout = timeout or self.cfg["timeout"]
        label = "ours " if server == "lazy" else "stock"
        print(f"  [{label}] {name}: {num_workers} worker(s), {num_servers} server(s) ... ", end="", flush=True)
        load_before = loadavg()[:1]
        started = time.monotonic()
        sampler = None
        try:
            job.start()
            servers = [n.popen.pid for n in job.nodes if n.role == "server"]
            pids_file.write_text(json.dumps({"servers": servers,
                                             "workers": [n.popen.pid for n in job.nodes if n.role == "worker"]}))
            if sample_peaks:
                sampler = RssSampler(servers, interval=0.1).start()
            status = job.supervise(timeout)
        finally:
            if sampler is not None:
                sampler.stop()
            job.stop()
            sink.close()
        wall = time.monotonic() - started
        run = Run(name=name, server=server, status=status, wall=wall,
                  records=[read_results(out, r) for r in range(num_workers)], log=str(run_dir / "job.log"),
                  stats=sink.stats, shutdown=sink.shutdown, load=load_before + loadavg()[:1],
                  errors=[] if status == 0 else sink.tail, profiles=[str(p) for p in run_dir.glob("prof.*.prof")],
                  server_peaks=[sampler.peak.get(p) for p in sampler.pids] if sampler is not None else [])
        print(f"{'ok' if status == 0 else f'FAILED (status {status})'} in {wall:.1f}s "
              f"(load {run.load[0] if run.load else '?'} -> {run.load[-1] if run.load else '?'})", flush=True)
        (run_dir / "run.json").write_text(json.dumps(run.summary(), indent=1))
        self.runs.append(run)
        return run


def worker(script: str) -> list[str]:
    return [sys.executable, str(WORKERS / script)]


# ----------------------------------------------------------------------------------------------------------------
# formatting

def mib(n) -> str:
    return "-" if n is None else f"{n / MiB:,.1f} MiB"


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    if abs(n) < 10 * 1024:
        return f"{n:,.0f} B"
    if abs(n) < 10 * MiB:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / MiB:,.1f} MiB"


def ms(x) -> str:
    return "-" if x is None else (f"{x:,.2f} ms" if x < 10 else f"{x:,.1f} ms")


def num(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def ratio(a, b) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b or a is None:
        return "-"
    r = a / b
    if r >= 100 or r < 0.01:
        return f"{r:.2g}x"
    return f"{r:.2f}x"


def table(title: str, headers: list[str], rows: list[list[str]], notes: list[str] = ()) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]

    def fmt(cells):
        return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [title, "=" * len(title), fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    lines += [f"  * {n}" for n in notes]
    return "\n".join(lines)


def verdict(ok: bool | None, text: str) -> str:
    if ok is None:
        return text
    return ("met: " if ok else "MISSED: ") + text


def dim_name(n: int) -> str:
    if n >= 2**30 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    exp = math.log10(n)
    return f"1e{exp:.0f}" if exp == int(exp) else f"{n:,}"


def percentile(values, q):
    return float(np.percentile(values, q)) if len(values) else None


def fit_line(xs, ys):
    """Least squares y = a + b x; None if fewer than 2 distinct x."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) < 2 or np.ptp(xs) == 0:
        return None
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


# ----------------------------------------------------------------------------------------------------------------
# rows seen, rebuilt from the workers' deterministic id streams

def rows_seen_at(job: "RowsJob", steps: list[int]) -> dict[int, int]:
    """Distinct row ids all workers touched after each global step in `steps` (streams as rows.py makes them)."""
    wanted = sorted(set(steps))
    result: dict[int, int] = {}
    seen = np.zeros(0, np.int64)
    pending: list[np.ndarray] = []
    step = 0
    streams = []
    for index, (_, batch, count, kind) in enumerate(job.phases):
        streams.append([row_stream(kind, job.input_dim, batch, job.seed + 1000 * index, r, NUM_WORKERS)
                        for r in range(NUM_WORKERS)])
    for index, (_, batch, count, kind) in enumerate(job.phases):
        for _ in range(count):
            if not wanted or step >= wanted[-1]:
                break
            for stream in streams[index]:
                pending.append(stream.next())
            step += 1
            if step in wanted:
                seen = np.union1d(seen, np.concatenate(pending))
                pending = []
                result[step] = int(len(seen))
    if 0 in wanted:
        result[0] = 0
    return result


# ----------------------------------------------------------------------------------------------------------------
# scenario 1: init

def scenario_init(bench: Bench) -> tuple[str, dict]:
    c = bench.cfg["init"]
    keys = [(n, d) for n in c["dims"] for d in c["D"]]
    lazy_keys = keys + [(n, d) for n in c["lazy_only_dims"] for d in c["D"]]
    stock_keys = [(n, d) for n, d in keys if n * d < 2**31 - 1]
    # keys whose init message is over 2 GiB are expected to fail on stock: their own job, a short deadline
    stock_big = [(n, d) for n, d in stock_keys if n * d * 4 >= 2**31]
    stock_keys = [k for k in stock_keys if k not in stock_big]
    runs = {}
    runs["lazy"] = bench.job("init", "lazy", worker("init_keys.py") + [
        "--server", "lazy", "--keys", ",".join(f"{n}:{d}" for n, d in lazy_keys)])
    if not bench.args.no_stock:
        runs["stock"] = bench.job("init", "stock", worker("init_keys.py") + [
            "--server", "stock", "--keys", ",".join(f"{n}:{d}" for n, d in stock_keys)],
            timeout=bench.cfg["init"].get("stock_timeout", 600))
        if stock_big:
            runs["stock-over-2GiB"] = bench.job("init-over-2GiB", "stock", worker("init_keys.py") + [
                "--server", "stock", "--keys", ",".join(f"{n}:{d}" for n, d in stock_big)], timeout=420)
            stock_keys += stock_big
    pyzmq_keys = [(n, d) for n in c["pyzmq_dims"] for d in c["D"]]
    runs["pyzmq"] = bench.job("init-pyzmq", "lazy", worker("pyzmq_init.py") + [
        "--keys", ",".join(f"{n}:{d}" for n, d in pyzmq_keys)], num_workers=1)

    def measured(run: Run | None, n: int, d: int) -> dict | None:
        if run is None:
            return None
        recs = run.records
        r0 = [r for r in (recs[0] if recs else []) if r.get("kind") == "init" and r["rows"] == n and r["dim"] == d]
        if not r0:
            return None
        sent = sum(r["bytes_sent"] for rank in recs for r in rank
                   if r.get("kind") == "init" and r["rows"] == n and r["dim"] == d)
        idle = next((r["rss"][0] for r in recs[0] if r.get("kind") == "rss" and r["what"] == "idle"), None)
        rec = r0[0]
        out = {"seconds": rec["seconds"], "bytes_sent": sent, "rss": rec["rss"][0] if rec["rss"] else None,
               "rss_before": (rec.get("rss_before") or [idle])[0], "idle_rss": idle,
               "build_seconds": rec.get("build_seconds"), "touch": rec.get("touch_values_ok")}
        if run.server == "stock" and sent < n * d * 4 / 2:
            # kv.init returned, but the weight never went out: the stock worker dropped it without an error
            out["silent_failure"] = True
        return out

    rows, data = [], []
    for n, d in sorted(set(lazy_keys + pyzmq_keys)):
        via = "pyzmq worker" if (n, d) in pyzmq_keys and (n, d) not in lazy_keys else "stock worker"
        ours = measured(runs["pyzmq"] if via == "pyzmq worker" else runs["lazy"], n, d)
        big = n * d * 4 >= 2**31
        stock_run = runs.get("stock-over-2GiB" if big else "stock")
        stock = measured(stock_run, n, d)
        if n * d >= 2**31 - 1:
            stock_note = ("n/a: stock worker cannot create it (shape overflows)" if n >= 2**32 else
                          f"n/a: stock worker cannot create it ({n * d:.2g} elements >= 2^31)")
        elif bench.args.no_stock:
            stock_note = "not run (--no-stock)"
        elif (n, d) not in stock_keys:
            stock_note = "not run (--quick)"
        elif stock is None:
            stock_note = "FAILED (see log)" if stock_run and not stock_run.ok else "-"
            if big and stock_run is not None:
                why = ("deadline" if stock_run.status == 124 else f"exit status {stock_run.status}")
                stock_note = f"FAILED ({why}): init message {n * d * 4 / GiB:.2f} GiB >= 2 GiB"
        else:
            stock_note = None
        if stock is not None and stock.get("silent_failure"):
            grew = (stock["rss"] or 0) - (stock["rss_before"] or 0)
            stock_note = (f"FAILED silently: returned, sent {fmt_bytes(stock['bytes_sent'])} of "
                          f"{n * d * 4 / GiB:.2f} GiB, server +{grew / MiB:.0f} MiB")
        config = f"{dim_name(n)} x {d}"
        if ours is None and stock is None:
            rows.append([config, "kv.init", "FAILED" if via else "-", stock_note or "-", "", ""])
            data.append({"input_dim": n, "dim": d, "via": via, "ours": None, "stock": None, "stock_note": stock_note})
            continue
        o_ms = ours["seconds"] * 1e3 if ours else None
        s_ms = stock["seconds"] * 1e3 if stock else None
        rows.append([config, f"kv.init wall time ({via})", ms(o_ms), stock_note or ms(s_ms),
                     "" if stock_note else ratio(o_ms, s_ms),
                     verdict(o_ms is not None and o_ms < 50, "< 50 ms") if ours else ""])
        o_b = ours["bytes_sent"] if ours else None
        s_b = stock["bytes_sent"] if stock else None
        rows.append(["", "bytes sent by the workers", fmt_bytes(o_b), "" if stock_note else fmt_bytes(s_b),
                     "" if stock_note else ratio(o_b, s_b),
                     verdict(o_b is not None and o_b < 4096, "< 4 KB") if ours else ""])
        rows.append(["", "server RSS after init", mib(ours and ours["rss"]), "" if stock_note else mib(stock["rss"]),
                     "" if stock_note else ratio(ours and ours["rss"], stock and stock["rss"]), ""])
        o_d = ours["rss"] - ours["rss_before"] if ours and ours["rss"] and ours["rss_before"] else None
        s_d = stock["rss"] - stock["rss_before"] if stock and stock["rss"] and stock["rss_before"] else None
        rows.append(["", "  growth of server RSS by this init", mib(o_d), "" if stock_note else mib(s_d), "", ""])
        if stock and stock.get("build_seconds"):
            rows.append(["", "  (stock: building the full weight, untimed)", "",
                         ms(stock["build_seconds"] * 1e3), "", ""])
        data.append({"input_dim": n, "dim": d, "via": via, "ours": ours, "stock": stock, "stock_note": stock_note})
    notes = [
             "stock inits whose workers sent less than half the weight's bytes are reported as silent failures "
             "(seen at 1e7 x 64: a 2.38 GiB init message; kv.init returns, nothing reaches the server)",
             "one job per server kind, keys initialized one after the other, smallest first (RSS after init is the "
             "server's total; 'growth' is this key's share)",
             "bytes sent: TCP bytes all workers sent during kv.init (kernel counters, `ss -tinpH`), barrier messages "
             "included; stock: only rank 0 pushes the weight",
             "stock init = what a stock user does: the full initial weight as row_sparse (rank 0); "
             "ours = kvstore_lazy.worker.init_lazy (a declaration + an empty row_sparse init)",
             "pyzmq worker: 1e8 x 32+ and 2^40 rows cannot be described by a stock worker at all, so a pure-pyzmq "
             "ps-lite worker (scripts/bench_workers/pyzmq_init.py, 1 worker, same stock scheduler) sends what "
             "init_lazy sends, then pulls and pushes the last 64 rows of the range"]
    for name, run in runs.items():
        if not run.ok:
            notes.append(f"{name} job FAILED (status {run.status}): {run.log}" +
                         (f"; last error lines: {' | '.join(run.errors[-3:])[:400]}" if run.errors else ""))
    for n, d in pyzmq_keys:
        rec = measured(runs["pyzmq"], n, d)
        if rec is not None and rec["touch"] is not None:
            notes.append(f"{dim_name(n)} x {d}: pulling rows {n - 64}..{n - 1} returned initializer values: "
                         f"{'yes' if rec['touch'] else 'NO'}")
    return table("Scenario 1: init of a row_sparse key", ["config", "metric", "ours", "stock", "ours/stock",
                                                         "target"], rows, notes), \
        {"keys": data, "runs": {k: v.summary() for k, v in runs.items()}}


# ----------------------------------------------------------------------------------------------------------------
# row jobs (memory, throughput, scale share them)

@dataclass
class RowsJob:
    name: str
    servers: int
    mode: str
    optimizer: str
    input_dim: int
    dim: int
    phases: list = field(default_factory=list)       # (tag, batch, steps, ids)
    dense: list = field(default_factory=list)        # ("RxC", iterations)
    rss_every: int = 0
    impls: tuple = IMPLS
    seed: int = 1
    timeout: float | None = None
    runs: dict = field(default_factory=dict)         # impl -> Run

    def argv(self, impl: str) -> list[str]:
        return worker("rows.py") + [
            "--server", impl, "--mode", self.mode, "--input-dim", str(self.input_dim), "--dim", str(self.dim),
            "--key", str(ROW_KEY), "--optimizer", self.optimizer, "--seed", str(self.seed),
            "--phases", ",".join(f"{b}:{s}:{k}" for _, b, s, k in self.phases),
            "--rss-every", str(self.rss_every), "--dense", ",".join(f"{s}:{i}" for s, i in self.dense)]

    def phase_index(self, tag: str, batch: int | None = None) -> int | None:
        for i, (t, b, _, _) in enumerate(self.phases):
            if t == tag and (batch is None or b == batch):
                return i
        return None


def plan_rows_jobs(cfg: dict, scenarios) -> dict[str, RowsJob]:
    jobs: dict[tuple, RowsJob] = {}

    def get(name, servers, mode, optimizer, input_dim, dim, impls=IMPLS) -> RowsJob:
        key = (servers, mode, optimizer, input_dim, dim, impls)
        if key not in jobs:
            jobs[key] = RowsJob(name, servers, mode, optimizer, input_dim, dim, impls=impls)
        return jobs[key]

    if "memory" in scenarios:
        m = cfg["memory"]
        for opt in m["optimizers"]:
            j = get(f"memory-{opt}", 1, "dist_sync", opt, m["input_dim"], m["dim"])
            j.phases.append(("memory", m["batch"], m["steps"], "zipf"))
            j.rss_every = max(1, m["steps"] // 10)
    if "throughput" in scenarios:
        t = cfg["throughput"]
        for servers, mode in t["configs"]:
            j = get(f"throughput-{servers}s-{mode.split('_')[1]}", servers, mode, "sgd", t["input_dim"], t["dim"])
            if j.name.startswith("memory"):
                j.name = f"memory-sgd+throughput-{servers}s-{mode.split('_')[1]}"
            j.phases += [("throughput", b, s, "zipf") for b, s in t["batches"]]
            j.dense += [tuple(x) for x in t["dense"]]
    if "scale" in scenarios:
        s = cfg["scale"]
        j = get("scale", 1, "dist_sync", s["optimizer"], s["input_dim"], s["dim"], impls=("lazy",))
        steps = -(-s["rows"] // (s["batch"] * NUM_WORKERS))
        j.phases.append(("scale", s["batch"], steps, "fresh"))
        j.rss_every = max(1, steps // 16)
        j.timeout = max(cfg["timeout"], steps * 30)
    return {j.name: j for j in jobs.values()}


def run_rows_jobs(bench: Bench, jobs: dict[str, RowsJob]) -> None:
    for job in jobs.values():
        for impl in job.impls:
            if impl == "stock" and bench.args.no_stock:
                continue
            profile = bench.args.profile and any(t == "throughput" for t, *_ in job.phases)
            job.runs[impl] = bench.job(job.name, impl, job.argv(impl), num_servers=job.servers,
                                       timeout=job.timeout, profile=profile)


def rss_points(job: RowsJob, run: Run) -> tuple[int | None, list[tuple[int, int]]]:
    """(idle RSS, [(global step, summed server RSS)]) from rank 0's records."""
    idle = None
    points = []
    for r in run.of("rss"):
        if None in (r.get("rss") or [None]):
            continue
        total = sum(r["rss"])
        if r["what"] == "idle":
            idle = total
        elif r["what"] in ("step", "phase"):   # not "end": it comes after the dense keys
            points.append((r["step"], total))
    return idle, sorted(set(points))


def lazy_rows_stored(run: Run, phase: int | None) -> int | None:
    """Rows of ROW_KEY on all servers after a phase (the stats rank 0 requested after it) or at shutdown."""
    if phase is not None and run.stats and all(len(v) > phase for v in run.stats.values()):
        return sum(int(v[phase]["sparse"].get(str(ROW_KEY), {}).get("rows", 0)) for v in run.stats.values())
    if run.shutdown:
        return sum(v.get(ROW_KEY, 0) for v in run.shutdown.values())
    return None


# ----------------------------------------------------------------------------------------------------------------
# scenario 2: memory

def scenario_memory(bench: Bench, jobs: dict[str, RowsJob]) -> tuple[str, dict, list[dict]]:
    m = bench.cfg["memory"]
    rows, data, series = [], {}, []
    colors = {("lazy", "sgd"): "blue", ("lazy", "adam"): "green", ("stock", "sgd"): "red",
              ("stock", "adam"): "orange"}
    for opt in m["optimizers"]:
        job = next(j for j in jobs.values() if j.phase_index("memory") is not None and j.optimizer == opt)
        phase = job.phase_index("memory")
        end_step = sum(s for _, _, s, _ in job.phases[:phase + 1])
        row_steps = sum(s for _, _, s, _ in job.phases)
        raw = job.dim * 4 * (1 + STATES[opt])
        res = {}
        for impl, run in job.runs.items():
            idle, points = rss_points(job, run)
            after = next((r["rss"] for r in run.of("rss") if r["what"] == "phase" and r.get("phase") == phase), None)
            after = sum(after) if after and None not in after else None
            res[impl] = {"ok": run.ok, "idle_rss": idle, "rss": after, "points": points}
        steps_needed = [s for impl in res for s, _ in res[impl]["points"]] + [end_step]
        seen_at = rows_seen_at(job, steps_needed)
        seen = seen_at.get(end_step)
        for impl, r in res.items():
            stored = lazy_rows_stored(job.runs[impl], phase) if impl == "lazy" else job.input_dim
            r["rows_stored"] = stored
            r["rows_seen"] = seen
            grown = r["rss"] - r["idle_rss"] if r["rss"] is not None and r["idle_rss"] is not None else None
            r["bytes_per_stored_row"] = grown / stored if grown is not None and stored else None
            r["bytes_per_seen_row"] = grown / seen if grown is not None and seen else None
            pts = [(seen_at[s], v) for s, v in r["points"] if s in seen_at and s <= end_step and s > 0]
            fit = fit_line([p[0] for p in pts[len(pts) // 2:]], [p[1] for p in pts[len(pts) // 2:]]) \
                if impl == "lazy" else None
            r["fit"] = fit
            r["curve"] = [(seen_at[s], v) for s, v in r["points"] if s in seen_at and s <= row_steps]
            label = f"{'ours' if impl == 'lazy' else 'stock'} {opt}, input_dim {dim_name(job.input_dim)}, D {job.dim}"
            series.append({"x": [x for x, _ in r["curve"]], "y": [v / MiB for _, v in r["curve"]],
                           "label": label, "color": colors[(impl, opt)], "dash": impl == "stock"})
        o, s = res.get("lazy", {}), res.get("stock", {})
        title = f"{opt}{' (momentum)' if opt == 'sgd' else ''}, {dim_name(job.input_dim)} x {job.dim}"
        rows.append([title, "rows seen (distinct ids pulled+pushed)", num(seen), num(seen), "", ""])
        rows.append(["", "rows stored", num(o.get("rows_stored")), num(s.get("rows_stored")),
                     ratio(o.get("rows_stored"), s.get("rows_stored")),
                     verdict(o.get("rows_stored") == seen, "= rows seen") if o else ""])
        rows.append(["", "server RSS idle (before init)", mib(o.get("idle_rss")), mib(s.get("idle_rss")),
                     ratio(o.get("idle_rss"), s.get("idle_rss")), verdict(
                         o.get("idle_rss") is not None and o["idle_rss"] < 150 * MiB, "fixed < 150 MB")
                     if o.get("idle_rss") else ""])
        rows.append(["", f"server RSS after {job.phases[phase][2]} steps of B={job.phases[phase][1]}",
                     mib(o.get("rss")), mib(s.get("rss")), ratio(o.get("rss"), s.get("rss")), ""])
        rows.append(["", "bytes per stored row ((RSS - idle) / rows stored)", num(o.get("bytes_per_stored_row")),
                     num(s.get("bytes_per_stored_row")),
                     ratio(o.get("bytes_per_stored_row"), s.get("bytes_per_stored_row")),
                     verdict(o.get("bytes_per_stored_row") is not None and o["bytes_per_stored_row"] <= 1.25 * raw,
                             f"<= 1.25 x raw = {1.25 * raw:.0f}") if o.get("bytes_per_stored_row") else ""])
        if o.get("fit"):
            a, b = o["fit"]
            rows.append(["", "  marginal bytes per row (RSS fit over the 2nd half)", num(b), "", "",
                         verdict(b <= 1.25 * raw, f"<= {1.25 * raw:.0f}")])
            rows.append(["", "  fixed part of that fit (RSS at 0 rows)", mib(a), "", "",
                         verdict(a < 150 * MiB, "< 150 MB")])
        rows.append(["", "bytes per seen row ((RSS - idle) / rows seen)", num(o.get("bytes_per_seen_row")),
                     num(s.get("bytes_per_seen_row")),
                     ratio(o.get("bytes_per_seen_row"), s.get("bytes_per_seen_row")), ""])
        rows.append(["", f"raw bytes per row (D x 4 x (1 + {STATES[opt]}))", num(raw), num(raw), "", ""])
        for impl, r in res.items():
            if not r["ok"]:
                rows.append(["", f"{impl} job FAILED", job.runs[impl].log, "", "", ""])
        data[opt] = {"job": job.name, "input_dim": job.input_dim, "dim": job.dim, "raw_bytes_per_row": raw,
                     "batch": job.phases[phase][1], "steps": job.phases[phase][2],
                     **{impl: r for impl, r in res.items()}}
    notes = ["one server, 2 workers, dist_sync; each worker pulls then pushes B distinct Zipf(1.2) ids per step "
             "(folded into input_dim, scrambled by a fixed bijection so hot rows are spread)",
             "rows seen: rebuilt from the workers' seeded id streams; rows stored: our servers' own count "
             "(stats command), stock: the whole key",
             "RSS: VmRSS of the server process(es), read by rank 0 after a barrier",
             "ratio < 1: ours needs less"]
    return (table("Scenario 2: server memory at steady state", ["config", "metric", "ours", "stock",
                                                               "ours/stock", "target"], rows, notes), data, series)


# ----------------------------------------------------------------------------------------------------------------
# scenario 3: throughput

def phase_stats(run: Run, index: int, warmup: int) -> dict | None:
    per_worker = [r for r in run.of("phase", None) if r["index"] == index]
    if len(per_worker) != len(run.records) or not per_worker:
        return None
    lat, rates, pulls, pushes = [], [], [], []
    for r in per_worker:
        steps = np.asarray(r["pull_ms"]) + np.asarray(r["push_ms"])
        steps = steps[warmup:] if len(steps) > warmup else steps
        lat += steps.tolist()
        pulls += r["pull_ms"][warmup:]
        pushes += r["push_ms"][warmup:]
        rates.append(r["batch"] / (steps.mean() / 1e3))
    cpu = next((r.get("server_cpu") for r in per_worker if r.get("server_cpu")), None)
    cpu_ms = sum(cpu) / per_worker[0]["steps"] * 1e3 if cpu and None not in cpu else None
    return {"batch": per_worker[0]["batch"], "steps": per_worker[0]["steps"], "warmup": warmup,
            "rows_per_s_per_worker": float(np.mean(rates)), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "pull_p50_ms": percentile(pulls, 50), "push_p50_ms": percentile(pushes, 50),
            "server_cpu_ms_per_step": cpu_ms}


def dense_stats(run: Run, shape: list[int], warmup: int) -> dict | None:
    per_worker = [r for r in run.of("dense", None) if r["shape"] == shape]
    if len(per_worker) != len(run.records) or not per_worker:
        return None
    lat = []
    for r in per_worker:
        steps = (np.asarray(r["push_ms"]) + np.asarray(r["pull_ms"]))[warmup:]
        lat += steps.tolist()
    cpu = next((r.get("server_cpu") for r in per_worker if r.get("server_cpu")), None)
    iters = len(per_worker[0]["push_ms"])
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "iterations": iters,
            "server_cpu_ms_per_iter": sum(cpu) / iters * 1e3 if cpu and None not in cpu else None}


def scenario_throughput(bench: Bench, jobs: dict[str, RowsJob]) -> tuple[str, dict]:
    t = bench.cfg["throughput"]
    warmup = t["warmup"]
    rows, data = [], []
    for servers, mode in t["configs"]:
        job = next(j for j in jobs.values() if j.servers == servers and j.mode == mode and
                   j.phase_index("throughput") is not None)
        for batch, _ in t["batches"]:
            index = job.phase_index("throughput", batch)
            res = {impl: phase_stats(run, index, warmup) for impl, run in job.runs.items()}
            o, s = res.get("lazy") or {}, res.get("stock") or {}
            config = f"{servers} server{'s' if servers > 1 else ''}, {mode}, B={batch}"
            target = verdict(None if not o or not s else o["rows_per_s_per_worker"] >= s["rows_per_s_per_worker"],
                             ">= 1.0x stock") if batch == 8192 and job.dim == 32 else ""
            rows.append([config, "rows/s per worker (pull+push)", num(o.get("rows_per_s_per_worker")),
                         num(s.get("rows_per_s_per_worker")),
                         ratio(o.get("rows_per_s_per_worker"), s.get("rows_per_s_per_worker")), target])
            rows.append(["", "latency p50 (pull+push)", ms(o.get("p50_ms")), ms(s.get("p50_ms")),
                         ratio(o.get("p50_ms"), s.get("p50_ms")), ""])
            rows.append(["", "latency p99", ms(o.get("p99_ms")), ms(s.get("p99_ms")),
                         ratio(o.get("p99_ms"), s.get("p99_ms")), ""])
            rows.append(["", "  p50 of pull / of push", f"{ms(o.get('pull_p50_ms'))} / {ms(o.get('push_p50_ms'))}",
                         f"{ms(s.get('pull_p50_ms'))} / {ms(s.get('push_p50_ms'))}", "", ""])
            rows.append(["", "server CPU per step (all servers)", ms(o.get("server_cpu_ms_per_step")),
                         ms(s.get("server_cpu_ms_per_step")),
                         ratio(o.get("server_cpu_ms_per_step"), s.get("server_cpu_ms_per_step")), ""])
            data.append({"servers": servers, "mode": mode, "batch": batch, "dim": job.dim,
                         "input_dim": job.input_dim, "job": job.name, "ours": res.get("lazy"),
                         "stock": res.get("stock")})
        for size, _ in job.dense:
            shape = [int(x) for x in size.split("x")]
            res = {impl: dense_stats(run, shape, warmup) for impl, run in job.runs.items()}
            o, s = res.get("lazy") or {}, res.get("stock") or {}
            bound = 1.5 if shape[0] * shape[1] < 10_000 else 1.1
            ok = None if not o or not s else o["p50_ms"] <= bound * s["p50_ms"]
            config = f"{servers} server{'s' if servers > 1 else ''}, {mode}, dense {size}"
            rows.append([config, "push+pull latency p50", ms(o.get("p50_ms")), ms(s.get("p50_ms")),
                         ratio(o.get("p50_ms"), s.get("p50_ms")), verdict(ok, f"<= {bound}x stock")])
            rows.append(["", "push+pull latency p99", ms(o.get("p99_ms")), ms(s.get("p99_ms")),
                         ratio(o.get("p99_ms"), s.get("p99_ms")), ""])
            rows.append(["", "server CPU per push+pull", ms(o.get("server_cpu_ms_per_iter")),
                         ms(s.get("server_cpu_ms_per_iter")),
                         ratio(o.get("server_cpu_ms_per_iter"), s.get("server_cpu_ms_per_iter")), ""])
            data.append({"servers": servers, "mode": mode, "dense": shape, "job": job.name, "ours": res.get("lazy"),
                         "stock": res.get("stock")})
        for impl, run in job.runs.items():
            if not run.ok:
                rows.append([f"{servers} server(s), {mode}", f"{impl} job FAILED", run.log, "", "", ""])
    notes = [f"2 workers, key {dim_name(t['input_dim'])} x {t['dim']}, SGD-momentum on the servers; each step "
             f"pulls B distinct Zipf ids then pushes their gradients, both waited to completion; the first "
             f"{warmup} steps of each phase are left out of rows/s and latency (their new rows are the most)",
             "rows/s per worker = B / mean step latency, averaged over workers; latency percentiles pool both "
             "workers' steps",
             "server CPU: user+system CPU of the server processes over the phase (all steps), per step: steadier "
             "than latency on a loaded machine",
             "ratio: ours/stock (rows/s: > 1 is better; latency and CPU: < 1 is better)"]
    return table("Scenario 3: throughput and latency", ["config", "metric", "ours", "stock", "ours/stock",
                                                       "target"], rows, notes), {"results": data}


# ----------------------------------------------------------------------------------------------------------------
# scenario 4: scale

def scenario_scale(bench: Bench, jobs: dict[str, RowsJob], init_data: dict | None) -> tuple[str, dict, list[dict]]:
    s = bench.cfg["scale"]
    job = jobs["scale"]
    run = job.runs["lazy"]
    raw = s["dim"] * 4 * (1 + STATES[s["optimizer"]])
    idle, points = rss_points(job, run)
    seen_at = rows_seen_at(job, [p for p, _ in points])
    curve = [(seen_at[p], v) for p, v in points if p in seen_at]
    stored = lazy_rows_stored(run, 0)
    rows, series = [], []
    fit = fit_line([x for x, _ in curve[len(curve) // 2:]], [y for _, y in curve[len(curve) // 2:]])
    max_seen, max_rss = (curve[-1] if curve else (None, None))
    within = within_fit = within_avg = None
    if fit and fit[1] > 0:
        within_fit = int((BUDGET - fit[0]) / fit[1])
    if max_seen and max_rss and idle is not None and max_rss > idle:
        # every byte above idle counted as per-row (batch buffers included): the low estimate
        within_avg = int((BUDGET - idle) / ((max_rss - idle) / max_seen))
    candidates = [w for w in (within_fit, within_avg) if w is not None]
    within = min(candidates) if candidates else None          # the low extrapolation
    held = max((x for x, v in curve if v <= BUDGET), default=None)    # the most rows measured within budget
    if held is not None:
        within = max(held, within or 0)
    target_rows = 10_000_000
    at_target = next((v for x, v in curve if x >= target_rows), None)
    extrapolated_target = (fit[0] + fit[1] * target_rows) if fit else None
    ours_cfg = f"ours: {s['optimizer']}, D={s['dim']}"
    rows.append([ours_cfg, "rows seen = rows stored (measured)", f"{num(max_seen)} = {num(stored)}", "", "",
                 verdict(max_seen == stored, "equal") if stored is not None else ""])
    rows.append(["", "server RSS at that point (measured)", mib(max_rss), "", "", ""])
    rows.append(["", "server RSS idle", mib(idle), "", "", ""])
    if fit:
        rows.append(["", "marginal bytes per row (fit over the 2nd half)", num(fit[1]), "", "",
                     verdict(fit[1] <= 1.25 * raw, f"<= 1.25 x raw {raw} = {1.25 * raw:.0f}")])
        rows.append(["", "fixed part of the fit", mib(fit[0]), "", "", verdict(fit[0] < 150 * MiB, "< 150 MB")])
    if at_target is not None:
        rows.append(["", f"RSS at {target_rows / 1e6:.0f}M seen rows (measured)", mib(at_target), "", "",
                     verdict(at_target <= BUDGET, "<= 8 GiB")])
    elif extrapolated_target is not None:
        rows.append(["", f"RSS at {target_rows / 1e6:.0f}M seen rows (EXTRAPOLATED from the fit)",
                     mib(extrapolated_target), "", "", verdict(extrapolated_target <= BUDGET, "<= 8 GiB")])
    label = "measured" if held is not None and (held >= (within or 0) or max_rss > BUDGET) else "EXTRAPOLATED"
    if held is not None and max_rss is not None and max_rss > BUDGET:
        within = held   # the run went past the budget: the measured point below it is the answer
    if max_seen and max_rss is not None and idle is not None and max_rss > idle:
        rows.append(["", "average bytes per row above idle at that point", num((max_rss - idle) / max_seen), "", "",
                     ""])
    if held is not None:
        rss_held = next(v for x, v in curve if x == held)
        rows.append(["", "most seen rows measured within 8 GiB", f"{num(held)} ({mib(rss_held)})", "", "", ""])
    rows.append(["", "largest seen-row count within 8 GiB (EXTRAPOLATED: low = average bytes/row above idle, "
                     "high = fit)", f"{num(within_avg)} .. {num(within_fit)}", "", "", ""])
    # stock: one init message carries the whole key (per server, the server's share if partitioned)
    limit_message = (2**31 - 1) // (s["dim"] * 4)
    stock_idle = None
    for j in jobs.values():
        if "stock" in j.runs:
            stock_idle = rss_points(j, j.runs["stock"])[0] or stock_idle
    limit_memory = int((BUDGET - (stock_idle or 0)) / raw)
    stock_cfg = f"stock: {s['optimizer']}, D={s['dim']}, 1 server"
    rows.append([stock_cfg, "largest input_dim: init message < 2 GiB", "", num(limit_message), "", ""])
    rows.append(["", "largest input_dim: weight+states within 8 GiB", "", num(limit_memory), "", ""])
    measured_fail = None
    if init_data:
        for k in init_data.get("keys", []):
            if k["dim"] == s["dim"] and k["input_dim"] * s["dim"] * 4 >= 2**31 and k["input_dim"] * s["dim"] < 2**31:
                measured_fail = k
    if measured_fail is not None:
        note = measured_fail.get("stock_note") or ("ok" if measured_fail.get("stock") else "failed")
        rows.append(["", f"measured: init of {dim_name(measured_fail['input_dim'])} x {s['dim']} (scenario 1)", "",
                     note[:60] + ("..." if len(note) > 60 else ""), "", ""])
    stock_rows = min(limit_message, limit_memory)
    rows.append(["rows one server holds in 8 GiB", f"ours ({label}): seen rows; stock: input_dim (all rows)",
                 num(within), num(stock_rows), ratio(within, stock_rows),
                 verdict(within is not None and within >= target_rows, ">= 10M seen rows D=64 Adam")])
    series.append({"x": [x for x, _ in curve], "y": [v / MiB for _, v in curve],
                   "label": f"ours {s['optimizer']}, D {s['dim']} (new rows only)", "color": "purple"})
    if fit and max_seen and within and within > max_seen and max_rss:
        series.append({"x": [max_seen, within], "y": [max_rss / MiB, BUDGET / MiB],
                       "label": "ours, extrapolated (low estimate)", "color": "purple", "dash": True,
                       "marker": False})
    stock_rss = (stock_idle or 0) + stock_rows * raw
    series.append({"x": [1000, stock_rows], "y": [stock_rss / MiB, stock_rss / MiB],
                   "label": f"stock {s['optimizer']}, D {s['dim']}, input_dim {stock_rows / 1e6:.1f}M (max; computed)",
                   "color": "brown", "dash": True, "marker": False})
    notes = [f"ours: one server, 2 workers, dist_sync, B={s['batch']} ids per worker per step that no worker "
             f"touched before (every pull creates B rows), key {dim_name(s['input_dim'])} x {s['dim']} "
             f"(a stock worker's NDArray limit), "
             f"run up to {s['rows']:,} rows; beyond the run, RSS is extrapolated (low: the average bytes per row "
             f"above idle at the last point, buffers included; high: a line fitted to the 2nd half of the points)",
             "stock: the limit is on input_dim, whatever the job touches; its server holds input_dim x D x 4 x "
             f"(1 + {STATES[s['optimizer']]}) bytes + idle RSS; the message limit applies to one server (with S "
             "servers each gets 1/S of the rows)",
             "8 GiB = 8 x 2^30 bytes"]
    if not run.ok:
        notes.append(f"scale job FAILED: {run.log}")
    data = {"ours": {"curve": curve, "fit": fit, "rows_within_budget": within, "rows_within_budget_fit": within_fit,
                     "rows_within_budget_average": within_avg, "label": label, "idle_rss": idle,
                     "rows_stored": stored, "rss_at_10M": at_target, "rss_at_10M_extrapolated": extrapolated_target,
                     "raw_bytes_per_row": raw},
            "stock": {"input_dim_limit_message": limit_message, "input_dim_limit_memory": limit_memory,
                      "idle_rss": stock_idle}}
    return table("Scenario 4: scale (one server, 8 GiB)", ["config", "metric", "ours", "stock", "ours/stock",
                                                          "target"], rows, notes), data, series


# ----------------------------------------------------------------------------------------------------------------
# scenario 5: a CTR training step

# Every node of a step job, ours and stock alike, runs with one OpenMP thread, as `make demo` does: on a 2-core
# machine the stock server's (and the workers') spinning OpenMP threads otherwise take the cores from everyone.
STEP_ENV = {"OMP_NUM_THREADS": "1"}


def step_stats(run: Run) -> dict | None:
    """Steps/s, latency percentiles and server CPU per step of a step.py job (both workers' records)."""
    per_worker = run.of("step", None)
    if len(per_worker) != len(run.records) or not per_worker:
        return None
    lat = [x for r in per_worker for x in r["latency_ms"]]
    steps = per_worker[0]["steps"]
    cpu = next((r.get("server_cpu") for r in per_worker if r.get("server_cpu")), None)
    return {"steps": steps, "steps_per_s": float(np.mean([1e3 / np.mean(r["latency_ms"]) for r in per_worker])),
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "server_cpu_ms_per_step": sum(cpu) / steps * 1e3 if cpu and None not in cpu else None,
            "keys": [per_worker[0]["sparse_keys"], per_worker[0]["dense_keys"]]}


def median_stats(rounds: list[dict]) -> dict:
    """Every figure of step_stats over rounds of one job, as their median."""
    out = dict(rounds[0])
    for k in ("steps_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_step"):
        got = [r[k] for r in rounds if r.get(k) is not None]
        out[k] = float(np.median(got)) if got else None
    return out


def scenario_step(bench: Bench) -> tuple[str, dict]:
    c = bench.cfg["step"]
    argv = ["--features", ",".join(map(str, c["features"])), "--emb-dim", str(c["emb_dim"]),
            "--hidden", ",".join(map(str, c["hidden"])), "--rows", str(c["rows"]), "--steps", str(c["steps"]),
            "--warmup", str(c["warmup"]), "--optimizer", c["optimizer"]]
    rows, data, failed, spreads = [], [], [], []
    for servers, mode in c["configs"]:
        name = f"step-{servers}s-{mode.split('_')[1]}"
        rounds: dict[str, list] = {impl: [] for impl in IMPLS}
        for rep in range(c["repeats"]):   # ours and stock alternate: the machine's load moves both alike
            for impl in IMPLS:
                if impl == "stock" and bench.args.no_stock:
                    continue
                run = bench.job(f"{name}-r{rep}", impl, worker("step.py") + ["--server", impl, "--mode", mode] + argv,
                                num_servers=servers, profile=bench.args.profile and rep == 0, env=STEP_ENV)
                stats = step_stats(run)
                if stats is not None:
                    rounds[impl].append(stats)
                if not run.ok:
                    failed.append(f"{name} round {rep} {impl} FAILED (status {run.status}): {run.log}")
        res = {impl: median_stats(got) for impl, got in rounds.items() if got}
        pairs = list(zip(rounds["lazy"], rounds["stock"]))
        if len(pairs) > 1:
            spreads.append(f"{name}: " + ", ".join(f"{o['steps_per_s'] / s['steps_per_s']:.2f}x" for o, s in pairs))
        o, s = res.get("lazy") or {}, res.get("stock") or {}
        config = f"{servers} server{'s' if servers > 1 else ''}, {mode}"
        ok = None if not o or not s else o["steps_per_s"] >= 1.3 * s["steps_per_s"]
        rows.append([config, "steps/s per worker", f"{o['steps_per_s']:.1f}" if o else "-",
                     f"{s['steps_per_s']:.1f}" if s else "-", ratio(o.get("steps_per_s"), s.get("steps_per_s")),
                     verdict(ok, ">= 1.3x stock")])
        rows.append(["", "step latency p50", ms(o.get("p50_ms")), ms(s.get("p50_ms")),
                     ratio(o.get("p50_ms"), s.get("p50_ms")), ""])
        rows.append(["", "step latency p99", ms(o.get("p99_ms")), ms(s.get("p99_ms")),
                     ratio(o.get("p99_ms"), s.get("p99_ms")), ""])
        rows.append(["", "server CPU per step (all servers)", ms(o.get("server_cpu_ms_per_step")),
                     ms(s.get("server_cpu_ms_per_step")),
                     ratio(o.get("server_cpu_ms_per_step"), s.get("server_cpu_ms_per_step")), ""])
        data.append({"servers": servers, "mode": mode, "ours": res.get("lazy"), "stock": res.get("stock"),
                     "rounds": rounds})
    layers = [len(c["features"]) * c["emb_dim"]] + c["hidden"] + [1]
    notes = [f"2 workers; {len(c['features'])} features (input_dim {', '.join(f'{n:,}' for n in c['features'])}): "
             f"{len(c['features'])} embeddings (D={c['emb_dim']}) and {len(c['features'])} wide weights (D=1), "
             f"row_sparse; MLP {'-'.join(map(str, layers))}: {2 * (len(layers) - 1)} dense keys; "
             f"{c['optimizer']} on the servers",
             f"a step = push every key's gradient, then pull every dense key and row_sparse_pull {c['rows']} "
             f"distinct Zipf ids per feature (the next step's), all queued at once as a Gluon Trainer does, "
             f"waited to completion (scripts/bench_workers/step.py); {c['steps']} steps measured after "
             f"{c['warmup']} warm-up steps",
             f"each configuration runs {c['repeats']} rounds of one job on our servers then one on stock ones; "
             f"every figure is the median over the rounds"
             + (f" (steps/s ours/stock round by round: {'; '.join(spreads)})" if spreads else ""),
             "every node (scheduler, servers, workers) runs with OMP_NUM_THREADS=1, as make demo does",
             "steps/s per worker = 1 / mean step latency, averaged over workers; latency percentiles pool both "
             "workers' steps",
             "server CPU: user+system CPU of the server processes over the measured steps, divided by the steps "
             "of one worker (so it covers both workers' requests)",
             "ratio: ours/stock (steps/s: > 1 is better; latency and CPU: < 1 is better)"] + failed
    return table("Scenario 5: a CTR training step (many small requests)", ["config", "metric", "ours", "stock",
                                                                           "ours/stock", "target"], rows, notes), \
        {"results": data, "config": c}


# ----------------------------------------------------------------------------------------------------------------
# scenario 6: row lifecycle

SNAPSHOT_LINE = re.compile(rf"^{SERVER_PREFIX} .*? snapshot written to \S+ \((base|delta)\): \d+ keys, (\d+) rows, "
                           r"(\d+) bytes")
LIFECYCLE_RUNS = [    # name, init_lazy policy, the budget on?, color
    ("unbounded", {}, False, "red"), ("budget", {}, True, "blue"), ("min-count 2", {"admit_min_count": 2}, False,
                                                                    "green"),
    ("both", {"admit_min_count": 2}, True, "purple")]


def lifecycle_seen(c: dict) -> tuple[int, int]:
    """(distinct ids the workers pushed, of which pushed in one round only), from the seeded streams."""
    streams = [DriftingCTR(c["input_dim"], c["batch"], c["fields"], 1, r, drift=c["drift"])
               for r in range(NUM_WORKERS)]
    rounds = [np.unique(np.concatenate([st.examples(step)[0].ravel() for st in streams]))
              for step in range(1, c["steps"] + 1)]
    _, counts = np.unique(np.concatenate(rounds), return_counts=True)
    return int(len(counts)), int((counts == 1).sum())


def scenario_lifecycle(bench: Bench) -> tuple[str, dict, list[dict]]:
    c = bench.cfg["lifecycle"]
    budget = parse_bytes(c["budget"])
    base = worker("lifecycle.py") + ["--input-dim", str(c["input_dim"]), "--dim", str(c["dim"]), "--fields",
                                     str(c["fields"]), "--batch", str(c["batch"]), "--steps", str(c["steps"]),
                                     "--drift", str(c["drift"]), "--rss-every", str(max(1, c["steps"] // 40))]
    timeout = max(bench.cfg["timeout"], c["steps"] * 3)
    runs = {}
    for name, policy, budgeted, _ in LIFECYCLE_RUNS:
        env = dict(c.get("env", {}), **({"KVSTORE_LAZY_MEMORY_BUDGET": str(budget)} if budgeted else {}))
        runs[name] = bench.job(f"lifecycle-{name.replace(' ', '')}", "lazy", base + ["--policy", json.dumps(policy)],
                               num_servers=2, timeout=timeout, server_env=env, sample_peaks=True)
    snap_dir = bench.runs_dir / "lifecycle-snapshots-lazy" / "snap"
    if not bench.args.report_only and snap_dir.exists():
        shutil.rmtree(snap_dir)
    runs["snapshots"] = bench.job("lifecycle-snapshots", "lazy", base + ["--delta-probe", str(c["probe_wait"])],
                                  num_servers=2, timeout=timeout + 4 * c["probe_wait"],
                                  server_env={"KVSTORE_LAZY_SNAPSHOT_DIR": str(snap_dir),
                                              "KVSTORE_LAZY_SNAPSHOT_INTERVAL": str(c["snapshot_interval"]),
                                              "KVSTORE_LAZY_SNAPSHOT_DELTAS": "1000000"})
    seen, once = lifecycle_seen(c)

    def final_stats(run: Run) -> dict:
        out = {"rows": 0, "pending": 0, "admitted": 0, "dropped": 0, "evicted": 0, "bytes": 0}
        for per_server in run.stats.values():
            s = per_server[-1]["sparse"].get(str(ROW_KEY), {}) if per_server else {}
            for k in out:
                out[k] += int(s.get(k, 0)) + (int(s.get("pending_bytes", 0)) if k == "bytes" else 0)
        return out

    def losses(run: Run) -> np.ndarray:
        per_step = {}
        for r in run.of("loss", None):
            per_step.setdefault(r["step"], []).append(r["loss"])
        return np.array([np.mean(per_step[s]) for s in sorted(per_step)])

    def last_interval(values: np.ndarray) -> float | None:
        k = max(1, len(values) // 10)
        return float(values[-k:].mean()) if len(values) else None

    data, rows, series = {}, [], []
    reference = last_interval(losses(runs["unbounded"]))
    for name, policy, budgeted, color in LIFECYCLE_RUNS:
        run = runs[name]
        st = final_stats(run)
        rss_curve = [(r["step"], max(r["rss"])) for r in run.of("rss") if r["what"] in ("step", "end")
                     and None not in r["rss"]]
        peak = max((p for p in run.server_peaks if p), default=None)
        loss = last_interval(losses(run))
        data[name] = {"ok": run.ok, "stats": st, "rss_curve": rss_curve, "peak_rss": run.server_peaks,
                      "last_interval_loss": loss, "policy": policy, "budget": budget if budgeted else None}
        timed = [(r["seconds"], max(r["rss"])) for r in run.of("rss") if r["what"] in ("step", "end")
                 and None not in r["rss"] and "seconds" in r]
        series.append({"x": [x for x, _ in timed], "y": [v / MiB for _, v in timed], "label": name,
                       "color": color, "lifecycle": True})
        config = f"{name}" + (f" ({c['budget']} per server)" if budgeted else "")
        rows.append([config, "rows stored (2 servers)", num(st["rows"]),
                     ratio(st["rows"], data["unbounded"]["stats"]["rows"]), ""])
        if policy or budgeted:
            rows.append(["", "pending / dropped gradient rows / evicted", f"{num(st['pending'])} / "
                         f"{num(st['dropped'])} / {num(st['evicted'])}", "", ""])
        quarters = [min(rss_curve, key=lambda p: abs(p[0] - q * c["steps"] / 4))[1] for q in range(1, 5)] \
            if rss_curve else []
        growing = bool(quarters) and all(b > a for a, b in zip([rss_curve[0][1]] + quarters, quarters))
        rows.append(["", "server RSS at 1/4, 1/2, 3/4, end of the run (largest server)",
                     " ".join(f"{v / MiB:.0f}" for v in quarters) + " MiB", "",
                     verdict(growing, "keeps growing") if name == "unbounded" else ""])
        rows.append(["", "server peak RSS (VmHWM, largest server)", mib(peak), "",
                     verdict(peak <= budget + 150 * MiB, f"<= budget + 150 MB = {mib(budget + 150 * MiB)}")
                     if budgeted and peak else ""])
        accounted = max((v[-1].get("lifecycle", {}).get("accounted_bytes", 0) for v in run.stats.values() if v),
                        default=None)
        rows.append(["", "accounted table bytes at the end (largest server)", mib(accounted), "",
                     verdict(accounted <= budget, "<= budget") if budgeted and accounted is not None else ""])
        rows.append(["", "loss, last 10% of the steps", "-" if loss is None else f"{loss:.4f}",
                     ratio(loss, reference), verdict(loss <= 1.01 * reference, "at most 1% above unbounded")
                     if name == "min-count 2" and loss and reference else ""])
        if name == "min-count 2":
            fall = 1 - st["rows"] / data["unbounded"]["stats"]["rows"] if data["unbounded"]["stats"]["rows"] else None
            rows.append(["", "rows stored fall by / share of ids pushed in one round only",
                         f"{100 * fall:.1f}% / {100 * once / seen:.1f}%" if fall is not None and seen else "-", "",
                         verdict(fall is not None and abs(fall - once / seen) < 0.02, "equal (within 2 points)")])
        if not run.ok:
            rows.append(["", "job FAILED", run.log, "", ""])
    # snapshots: the delta the probe step wrote against the full snapshot at shutdown
    snap = runs["snapshots"]
    lines = [SNAPSHOT_LINE.match(line) for line in open(snap.log, errors="replace")] if os.path.exists(snap.log) \
        else []
    per_server: dict[str, list] = {}
    for m in filter(None, lines):
        per_server.setdefault(m.group(1), []).append((m.group(2), int(m.group(3)), int(m.group(4))))
    probe = next((r for r in snap.of("probe")), None)
    # per server: the last base (shutdown; an empty delta may follow it, written during the final barrier) and the
    # last delta with rows before it (the probe's step)
    last_base = {k: max(i for i, x in enumerate(v) if x[0] == "base") for k, v in per_server.items()
                 if any(x[0] == "base" for x in v)}
    full = sum(per_server[k][i][2] for k, i in last_base.items())
    deltas = [[x for x in per_server[k][:i] if x[0] == "delta" and x[1] > 0] for k, i in last_base.items()]
    delta = sum(d[-1][2] for d in deltas if d) if all(deltas) and deltas else None
    delta_rows = sum(d[-1][1] for d in deltas if d) if all(deltas) and deltas else None
    rows.append(["snapshots (unbounded, every "
                 f"{c['snapshot_interval']} s)", "full snapshot at shutdown (2 servers)", fmt_bytes(full), "", ""])
    rows.append(["", f"delta of one step touching 1% of the rows ({num(delta_rows)} rows of "
                     f"{num(probe and probe['seen'])})", fmt_bytes(delta), ratio(delta, full),
                 verdict(delta is not None and full and delta < 0.05 * full, "< 5% of the full snapshot")])
    data["snapshots"] = {"full_bytes": full, "probe_delta_bytes": delta, "probe_delta_rows": delta_rows,
                         "probe": probe, "snapshot_lines": per_server}
    data["ids"] = {"seen": seen, "seen_in_one_round": once}
    notes = [f"2 workers, 2 servers, dist_sync, Adam; key {dim_name(c['input_dim'])} x {c['dim']}; each worker "
             f"{c['steps']} steps of {c['batch']} examples x {c['fields']} ids (common.DriftingCTR: Zipf(1.1) ranks "
             f"over items born {c['drift']:g} per step, newest first); {num(seen)} distinct ids pushed",
             "budget: KVSTORE_LAZY_MEMORY_BUDGET per server, LRU, low watermark 0.9; min-count 2: "
             "init_lazy(..., admit_min_count=2)",
             "loss: progressive (each step's log loss with the weights pulled before it trains), both workers; "
             "ratio against the unbounded run",
             "RSS: rank 0 reads both servers' VmRSS every few steps (the curve in lifecycle_rss.png); peak: "
             "VmHWM sampled by the bench every 0.1 s",
             "snapshots: a separate unbounded run whose servers write periodic snapshots (base + deltas); after "
             "training it waits, pushes one step of 1% of the rows, waits: that delta against the shutdown base"]
    return (table("Scenario 6: row lifecycle (ours only)", ["run", "metric", "value", "vs unbounded", "target"],
                  rows, notes), data, series)


# ----------------------------------------------------------------------------------------------------------------
# scenario 7: the disk tier (KVSTORE_LAZY_DISK_DIR under KVSTORE_LAZY_MEMORY_BUDGET)

# accounted bytes of one memory row of the tiered jobs: D=32 float32 weights + momentum, 8 B of policy columns, 8 B id
TIER_ROW_BYTES = 2 * 32 * 4 + 8 + 8
TIER_RECORD_BYTES = 8 + 4 + 2 * 32 * 4 + 8      # a segment record: id, check, weights, momentum, columns


SPREAD_FACTOR = 0x9E3779B1          # prime: id -> id x this mod the key's rows is one to one (their gcd is 1)
# rows.py as it is, its id streams (common.row_stream over BENCH_SPREAD_FROM ids) mapped one to one over the
# BENCH_SPREAD_OVER rows of its key: the same rows and traffic, spread as hashed ids are
SPREAD_ROWS_WORKER = f"""
import os, runpy, sys
import numpy as np
rows_py = sys.argv.pop(1)
sys.path.insert(0, os.path.dirname(rows_py))
import common
inner, rows, over = common.row_stream, int(os.environ["BENCH_SPREAD_FROM"]), int(os.environ["BENCH_SPREAD_OVER"])
class Spread:
    def __init__(self, stream):
        self.stream = stream
    def next(self):
        return np.sort(self.stream.next() * np.int64({SPREAD_FACTOR}) % np.int64(over))
common.row_stream = lambda kind, input_dim, batch, seed, rank, workers=2: \\
    Spread(inner(kind, rows, batch, seed, rank, workers))
runpy.run_path(rows_py, run_name="__main__")
"""


def tiered_disk_dir(bench: Bench, name: str) -> Path:
    path = bench.runs_dir / f"tiered-disk-{name}"
    if not bench.args.report_only and path.exists():
        shutil.rmtree(path)
    return path


def tier_stats(run: Run) -> dict:
    """The last stats line of the (one) server for the row key: memory and disk rows, bytes, hit rate."""
    per_server = next(iter(run.stats.values()), [])
    return per_server[-1]["sparse"].get(str(ROW_KEY), {}) if per_server else {}


def per_worker_rates(run: Run, phase: int) -> tuple[float | None, float | None]:
    """(rows/s per worker: mean over workers of rows pulled+pushed per second of their own request time, p99 ms of
    one pull + push) in phase `phase`."""
    rates, lat = [], []
    for rank in range(NUM_WORKERS):
        rec = next((r for r in run.of("phase", rank) if r["index"] == phase), None)
        if rec is None:
            continue
        steps = [a + b for a, b in zip(rec["pull_ms"], rec["push_ms"])]
        rates.append(rec["batch"] * len(steps) / (sum(steps) / 1e3))
        lat += steps
    return (float(np.mean(rates)) if rates else None,
            float(np.percentile(lat, 99)) if lat else None)


def scenario_tiered(bench: Bench) -> tuple[str, dict]:
    c = bench.cfg["tiered"]
    batch, dim = c["batch"], c["dim"]
    per_step = NUM_WORKERS * batch
    rows: list[list[str]] = []
    data: dict = {}
    # (a) scale: fill one server with scale_rows fresh rows under scale_budget
    scale_budget = parse_bytes(c["scale_budget"])
    disk = tiered_disk_dir(bench, "scale")
    need = c["scale_rows"] * TIER_RECORD_BYTES * 1.2
    free = shutil.disk_usage(bench.runs_dir).free
    if need > free and not bench.args.report_only:
        raise RuntimeError(f"the scale run needs ~{fmt_bytes(need)} free in {bench.runs_dir}, {fmt_bytes(free)} are")
    steps = -(-c["scale_rows"] // per_step)
    base = worker("rows.py") + ["--server", "lazy", "--dim", str(dim), "--optimizer", "sgd"]
    env = {"KVSTORE_LAZY_MEMORY_BUDGET": str(scale_budget), "KVSTORE_LAZY_DISK_DIR": str(disk)}
    run = bench.job("tiered-scale", "lazy", base + ["--input-dim", str(c["scale_input_dim"]), "--phases",
                                                    f"{batch}:{steps}:fresh", "--rss-every", str(max(1, steps // 20))],
                    timeout=max(bench.cfg["timeout"], steps * 2), server_env=env, sample_peaks=True)
    st = tier_stats(run)
    peak = max((p for p in run.server_peaks if p), default=None)
    stored = int(st.get("rows", 0)) + int(st.get("disk_rows", 0))
    wall = next((r["wall"] for r in run.of("phase") if r["index"] == 0), None)
    raw = 2 * dim * 4
    disk_per_row = st.get("disk_bytes", 0) / st["disk_rows"] if st.get("disk_rows") else None
    rows.append(["(a) scale, 1 server", "rows stored (memory + disk)", f"{num(st.get('rows'))} + "
                 f"{num(st.get('disk_rows'))} = {num(stored)}", "",
                 verdict(stored >= c["scale_rows"], f">= {num(c['scale_rows'])}")])
    rows.append(["", f"server peak RSS (VmHWM), budget {mib(scale_budget)}", mib(peak), "",
                 verdict(peak is not None and peak <= scale_budget + 150 * MiB,
                         f"<= budget + 150 MB = {mib(scale_budget + 150 * MiB)}")])
    rows.append(["", "accounted bytes (memory rows + disk index) / disk index bytes per disk row",
                 f"{mib(st.get('bytes', 0) + st.get('disk_index_bytes', 0))} / "
                 f"{st.get('disk_index_bytes', 0) / max(1, st.get('disk_rows', 1)):.1f} B", "", ""])
    rows.append(["", "filling: rows/s (2 workers, pull + push of fresh rows)",
                 f"{stored / wall:,.0f}" if wall else "-", "", ""])
    rows.append(["(c) bytes on disk", "per row on disk, after the fill", f"{disk_per_row:.1f} B"
                 if disk_per_row else "-", ratio(disk_per_row, raw),
                 verdict(disk_per_row is not None and disk_per_row <= 1.5 * raw, f"<= 1.5 x raw ({raw} B)")])
    if not run.ok:
        rows.append(["", "job FAILED", run.log, "", ""])
    data["scale"] = {"stats": st, "peak_rss": peak, "budget": scale_budget, "wall": wall, "status": run.status}
    shutil.rmtree(disk, ignore_errors=True)
    # (b) Zipf(1.2) over a working set 5x the budget: everything in memory vs the tier, side by side
    zipf_budget = parse_bytes(c["zipf_budget"])
    working = -(-5 * zipf_budget // TIER_ROW_BYTES // per_step) * per_step
    fill = working // per_step
    phases = ["--phases", f"{batch}:{fill}:fresh,{batch}:{c['zipf_steps']}:zipf"]
    # repeats: pairs of jobs back to back, alternating which goes first (one job's rate moves +-20% on a shared
    # 2-core VM, mostly the in-memory one's); the verdict is on the median of the pairs' ratios. Two arms, their
    # pairs interleaved: the key of exactly the working set (its disk index dense), and the same id streams spread
    # one to one over the most rows a stock worker declares (2^31 values: its dense index would take 4 bytes of each
    # of them, past a quarter of the budget, so the tier indexes the rows on disk with the RunIndex)
    repeats = int(c.get("zipf_repeats", 1))
    spread = (2**31 - 1) // dim
    assert math.gcd(SPREAD_FACTOR, spread) == 1 and 4 * spread * 4 > zipf_budget
    arms = {"dense": {"command": base + ["--input-dim", str(working)] + phases, "env": {}},
            "spread": {"command": [sys.executable, "-c", SPREAD_ROWS_WORKER, str(WORKERS / "rows.py")] + base[2:]
                       + ["--input-dim", str(spread)] + phases,
                       "env": {"BENCH_SPREAD_FROM": str(working), "BENCH_SPREAD_OVER": str(spread)}}}
    pairs_of: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(repeats):
        for arm, how in arms.items():
            pair = {}
            for name in ("memory", "tier") if r % 2 == 0 else ("tier", "memory"):
                disk = tiered_disk_dir(bench, name)
                env = {} if name == "memory" else {"KVSTORE_LAZY_MEMORY_BUDGET": str(zipf_budget),
                                                   "KVSTORE_LAZY_DISK_DIR": str(disk)}
                run = bench.job(f"tiered-zipf-{name}" + ("-spread" if arm == "spread" else "")
                                + (f"-{r + 1}" if repeats > 1 else ""), "lazy", how["command"],
                                timeout=max(bench.cfg["timeout"], (fill + c["zipf_steps"]) * 3), server_env=env,
                                env=how["env"], sample_peaks=True)
                rate, p99 = per_worker_rates(run, 1)
                pair[name] = {"rate": rate, "p99_ms": p99, "stats": tier_stats(run), "status": run.status,
                              "peak_rss": max((p for p in run.server_peaks if p), default=None)}
                shutil.rmtree(disk, ignore_errors=True)
            pair["ratio"] = pair["tier"]["rate"] / pair["memory"]["rate"] \
                if pair["tier"]["rate"] and pair["memory"]["rate"] else None
            pairs_of[arm].append(pair)
    medians: dict[str, tuple] = {}
    for arm, pairs in pairs_of.items():
        ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
        mid = float(np.median(ratios)) if ratios else None
        # the pair whose ratio is the median (the lower middle one of an even number) speaks for the rest
        results = min((p for p in pairs if p["ratio"] is not None), key=lambda p: abs(p["ratio"] - mid)) \
            if mid is not None else pairs[0]
        medians[arm] = (ratios, mid, results)
    ratios, mid, results = medians["dense"]
    pairs = pairs_of["dense"]
    mem, tier = results["memory"], results["tier"]
    each = f" (pairs: {', '.join(f'{x:.2f}x' for x in ratios)})" if len(ratios) > 1 else ""
    rows.append([f"(b) Zipf(1.2), {num(working)} rows", "rows/s per worker: all in memory / tier" +
                 (f", the median pair of {len(pairs)}" if len(pairs) > 1 else ""),
                 f"{num(mem['rate'])} / {num(tier['rate'])}{each}", f"{mid:.2f}x" if mid is not None else "-",
                 verdict(bool(mid is not None and mid >= 0.5), ">= 50% of in memory")])
    rows.append(["", "p99 of pull + push (ms): in memory / tier",
                 f"{mem['p99_ms']:.1f} / {tier['p99_ms']:.1f}" if mem["p99_ms"] and tier["p99_ms"] else "-", "", ""])
    ts = tier["stats"]
    rows.append(["", f"tier: rows in memory / on disk (budget {mib(zipf_budget)}), hit rate, promoted, demoted",
                 f"{num(ts.get('rows'))} / {num(ts.get('disk_rows'))}, {ts.get('hit_rate', 0):.3f}, "
                 f"{num(ts.get('promoted'))}, {num(ts.get('demoted'))}", "", ""])
    rows.append(["", "server peak RSS: in memory / tier", f"{mib(mem['peak_rss'])} / {mib(tier['peak_rss'])}", "",
                 ""])
    h_ratios, h_mid, h_results = medians["spread"]
    h_mem, h_tier = h_results["memory"], h_results["tier"]
    each = f" (pairs: {', '.join(f'{x:.2f}x' for x in h_ratios)})" if len(h_ratios) > 1 else ""
    rows.append([f"(b) the same ids spread over {num(spread)} rows (RunIndex)", "rows/s per worker: all in memory / "
                 "tier" + (f", the median pair of {len(pairs_of['spread'])}" if len(pairs_of["spread"]) > 1 else ""),
                 f"{num(h_mem['rate'])} / {num(h_tier['rate'])}{each}",
                 f"{h_mid:.2f}x" if h_mid is not None else "-",
                 verdict(bool(h_mid is not None and h_mid >= 0.5), ">= 50% of in memory")])
    rows.append(["", "p99 of pull + push (ms): in memory / tier",
                 f"{h_mem['p99_ms']:.1f} / {h_tier['p99_ms']:.1f}" if h_mem["p99_ms"] and h_tier["p99_ms"] else "-",
                 "", ""])
    hs = h_tier["stats"]
    rows.append(["", "tier: rows in memory / on disk, hit rate; disk index: bytes of RAM a row on disk, block "
                 "reads a lookup", f"{num(hs.get('rows'))} / {num(hs.get('disk_rows'))}, "
                 f"{hs.get('hit_rate', 0):.3f}; {hs.get('disk_index_bytes', 0) / max(1, hs.get('disk_rows', 0)):.2f}"
                 f" B, {hs.get('disk_index_reads_per_lookup', 0):.3f}", "", ""])
    zipf_disk = ts.get("disk_bytes", 0) / ts["disk_rows"] if ts.get("disk_rows") else None
    rows.append(["(c) bytes on disk", "per row on disk after the Zipf phase (promotions leave garbage; the "
                 "emptiest sealed segments are compacted while the store is past 25% garbage)",
                 f"{zipf_disk:.1f} B" if zipf_disk else "-",
                 ratio(zipf_disk, raw), verdict(zipf_disk is not None and zipf_disk <= 1.5 * raw,
                                                f"<= 1.5 x raw ({raw} B)")])
    data["zipf"] = dict(results, working_rows=working, budget=zipf_budget, pairs=pairs, median_ratio=mid)
    data["zipf_spread"] = dict(h_results, working_rows=working, key_rows=spread, budget=zipf_budget,
                               pairs=pairs_of["spread"], median_ratio=h_mid)
    notes = [f"1 server, 2 stock workers, dist_sync, SGD momentum, D={dim}, B={batch} unique rows per worker "
             f"per step (scripts/bench_workers/rows.py); KVSTORE_LAZY_DISK_DIR under the runs directory",
             f"(a) {num(steps)} steps of fresh rows fill the server; (b) the key has exactly the working set "
             f"(5 x budget / {TIER_ROW_BYTES} B a row), filled with fresh rows first, then {c['zipf_steps']} steps "
             "of Zipf(1.2) ids; rows/s per worker: rows pulled and pushed per second of that worker's request time",
             f"(b) spread: the same id streams mapped one to one over {num(spread)} rows (id x {SPREAD_FACTOR:#x} mod "
             "that; the most rows a stock worker declares at this D: 2^31 values), as hashed ids are: a dense disk "
             "index of them would take more than a quarter of the budget, so the tier's is the RunIndex (a stock "
             "worker cannot declare the 2^40 rows of scripts/bench_workers/tiered.py --hashed)",
             f"raw bytes of a row: weights + momentum ({raw} B); a disk record adds its id, a check and the 8 B "
             f"of policy columns ({TIER_RECORD_BYTES} B); disk bytes count whole fixed-size segment files"]
    return (table("Scenario 7: disk tier (ours only)", ["run", "metric", "value", "ratio", "target"], rows, notes),
            data)


# ----------------------------------------------------------------------------------------------------------------
# scenario 8: saturation (N simulated workers against one server)

def saturation_argv(c: dict, impl: str, mode: str) -> list[str]:
    return worker("loadgen_job.py") + [
        "--server", impl, "--mode", mode, "--input-dim", str(c["input_dim"]), "--dim", str(c["dim"]),
        "--batches", ",".join(map(str, c["batches"])), "--warmup-seconds", str(c["warmup"]),
        "--closed-seconds", str(c["closed"]), "--open-seconds", str(c["open"]),
        "--levels", ",".join(map(str, c["levels"])), "--min-steps", str(c["min_steps"]),
        "--dense-seconds", str(c["dense_seconds"])]


def scenario_saturation(bench: Bench) -> tuple[str, dict]:
    c = bench.cfg["saturation"]
    earlier = bench.out / "results.json"
    gather = None
    if bench.args.report_only and earlier.exists():   # the limit the run measured, not today's
        gather = json.loads(earlier.read_text()).get("scenarios", {}).get("saturation", {}).get("gather")
    gather = gather or gather_limit.measure(1_000_000, c["dim"], max(c["batches"]))
    jobs, failed, loads = [], [], []
    for mode in c["modes"]:
        for n in c["workers"]:
            for impl in IMPLS:   # ours then stock, one pair per (mode, N): the machine's load moves both alike
                if impl == "stock" and bench.args.no_stock:
                    continue
                run = bench.job(f"saturation-{mode.split('_')[1]}-{n}w", impl, saturation_argv(c, impl, mode),
                                num_workers=1, timeout=c["timeout"], profile=bench.args.profile,
                                env={**STEP_ENV, "DMLC_NUM_WORKER": str(n)})
                loads += run.load
                if not run.ok:
                    failed.append(f"saturation {mode} N={n} {impl} FAILED (status {run.status}): {run.log}")
                jobs.append({"server": "ours" if impl == "lazy" else "stock", "mode": mode, "workers": n,
                             "records": run.records[0] if run.records else []})
    rows, data, lines = saturation_report.build(jobs, gather, c["modes"])
    load = f"{min(loads, default=0):.1f}..{max(loads, default=0):.1f}"
    data["loadavg_1min"] = load
    notes = [f"one server, one row_sparse key ({c['input_dim']:,} x {c['dim']} float32, SGD momentum 0.9), "
             f"N simulated workers in one pyzmq process (loadgen_job.py; its CPU: loadgen cores); a step = "
             f"row_sparse_pull of B distinct Zipf rows, then the push of their gradients, waited to its reply; "
             f"rows/s = B x steps/s over all workers (each row is gathered once and updated once per step)",
             f"closed-loop ({c['closed']} s after {c['warmup']} s warm-up): each worker starts its next step when "
             f"the last one is answered; this is the saturation point at that N. Open-loop ({c['open']} s each): "
             f"steps start at {', '.join(f'{x:g}' for x in c['levels'])} x that rate (dist_sync: all workers at "
             f"the same instants), one step in flight per worker, each level lasting until {c['min_steps']} steps "
             f"were due (at most {3 * c['open']:g} s); latency counts from when a step was due",
             "knee: the lowest open-loop offered load whose p99 is at least twice the p99 at the lightest level "
             "(- : it never doubled within the levels run)",
             "server cores: the server process's CPU seconds (all threads, /proc/<pid>/stat) per wall second of "
             "the measurement; rows/s per core = rows/s / server cores; CPU us/row = server cores / rows/s",
             f"gather limit: {gather['method']}, {gather['table_rows']:,} x {gather['dim']} table, B={gather['batch']}:"
             f" {gather['rows_per_cpu_s']:,.0f} rows per CPU second ({gather['rows_per_s']:,.0f} per wall second, "
             f"{gather['bytes_per_s'] / 1e9:.2f} GB/s)",
             f"every node runs with OMP_NUM_THREADS=1; 1-min load average during these jobs {load} on "
             f"{os.cpu_count()} cores shared with other work"] + lines + failed
    for batch in c["batches"]:
        n = 8 if 8 in c["workers"] else max(c["workers"])
        saturation_report.plot(bench.out / f"saturation_latency_B{batch}.png", data["curves"], batch, n,
                               [f"{time.strftime('%Y-%m-%d')}; open-loop levels {c['levels']} of each server's "
                                f"own closed-loop rate; solid: ours, dashed: stock; load average {load}"])
    return table("Scenario 8: saturation (one server, N simulated workers, D=32)", saturation_report.HEADERS,
                 rows, notes), data


# ----------------------------------------------------------------------------------------------------------------
# scenario 9: learning (issue 32): what Adam's row_sparse semantics do to a model's quality

ROW_STEPS_VAR = "KVSTORE_LAZY_ADAM_ROW_STEPS"
LEARNING_ARMS = [   # name, what it is, Adam's lazy_update, our servers' extra environment, the servers it runs on
    ("lazy", "Adam lazy_update=True (stock's row_sparse default): only a batch's rows move, bias correction by the "
             "key's step t", 1, {}, IMPLS),
    ("dense", "Adam lazy_update=False (the dense semantics): every row moves every step, rows without gradient "
              "with g = wd x w", 0, {}, IMPLS),
    ("row-steps", f"lazy Adam, bias correction by the row's own update count ({ROW_STEPS_VAR}=on, ours only)", 1,
     {ROW_STEPS_VAR: "on"}, ("lazy",)),
]
LEARNING_HEADERS = ["arm", "server", "held-out log loss", "above floor", "AUC", "server CPU / step", "wall / step",
                    "predictions vs stock"]


def learning_argv(c: dict, impl: str, arm: str, lazy_update: int, lr: float) -> list[str]:
    return worker("ctr_learning.py") + [
        "--server", impl, "--arm", arm, "--dims", ",".join(map(str, c["dims"])), "--zipf", str(c["zipf"]),
        "--emb-dim", str(c["emb_dim"]), "--batch", str(c["batch"]), "--steps", str(c["steps"]),
        "--held-out", str(c["held_out"]), "--evals", str(c["evals"]), "--lr", str(lr), "--wd", str(c["wd"]),
        "--lazy-update", str(lazy_update)]


def row_steps_taken(run: Run) -> bool | None:
    """Whether our servers took KVSTORE_LAZY_ADAM_ROW_STEPS: True if their settings line names it, False if they
    warned that it is not a setting (a server from before the per-row counter), None if the log says neither."""
    if not os.path.exists(run.log):
        return None
    taken = ignored = False
    with open(run.log, errors="replace") as fh:
        for line in fh:
            if ROW_STEPS_VAR not in line:
                continue
            if "not a kvstore_lazy setting" in line:
                ignored = True
            elif "settings:" in line and f"{ROW_STEPS_VAR}=" in line:
                taken = True
    return False if ignored else (True if taken else None)


def learning_stats(run: Run) -> dict | None:
    """Rank 0's records of a ctr_learning.py job: the last evaluation, the curve, CPU and wall per step."""
    config = next(iter(run.of("config")), None)
    evals = run.of("eval")
    train = next(iter(run.of("train")), None)
    if config is None or not evals:
        return None
    out = {"config": config, "curve": [[e["step"], e["logloss"], e["auc"]] for e in evals],
           "logloss": evals[-1]["logloss"], "auc": evals[-1]["auc"], "step": evals[-1]["step"],
           "train_logloss_last": evals[-1]["train_logloss"], "server_cpu_ms_per_step": None, "wall_ms_per_step": None,
           "segments": [], "finished": train is not None}
    for e in evals:   # server CPU and wall per step over the steps since the previous evaluation
        cpu = e.get("segment_server_cpu")
        if e.get("segment_steps") and cpu and None not in cpu:
            out["segments"].append([e["step"], sum(cpu) / e["segment_steps"] * 1e3,
                                    e["segment_wall"] / e["segment_steps"] * 1e3])
    if train is None and out["segments"]:   # a job that did not finish: over the steps it evaluated
        ends = [x[0] for x in out["segments"]]
        lengths = [b - a for a, b in zip([0] + ends, ends)]
        out["server_cpu_ms_per_step"] = sum(n * x[1] for n, x in zip(lengths, out["segments"])) / sum(lengths)
        out["wall_ms_per_step"] = sum(n * x[2] for n, x in zip(lengths, out["segments"])) / sum(lengths)
    if train is not None and train["steps"]:
        cpu = train.get("server_cpu")
        out["server_cpu_ms_per_step"] = sum(cpu) / train["steps"] * 1e3 if cpu and None not in cpu else None
        out["wall_ms_per_step"] = train["wall"] / train["steps"] * 1e3
        eval_cpu = train.get("eval_server_cpu")
        out["eval_server_cpu_s"] = sum(eval_cpu) if eval_cpu and None not in eval_cpu else None
    return out


def learning_predictions(run: Run) -> np.ndarray | None:
    path = Path(run.log).parent / "res.pred.npy"
    return np.load(path) if path.exists() else None


def compare_predictions(ours: np.ndarray | None, other: np.ndarray | None) -> tuple[str, dict]:
    if ours is None or other is None or ours.shape != other.shape:
        return "-", {}
    if np.array_equal(ours, other):
        return "identical (bit for bit)", {"identical": True, "max_abs_diff": 0.0}
    diff = np.abs(ours.astype(np.float64) - other.astype(np.float64))
    return (f"differ: max |dp| {diff.max():.2g}, mean {diff.mean():.2g}",
            {"identical": False, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())})


def scenario_learning(bench: Bench) -> tuple[str, dict]:
    c = bench.cfg["learning"]
    lrs = c["lr"] if isinstance(c["lr"], list) else [c["lr"]]
    runs: dict[tuple[float, str, str], Run] = {}
    loads, failed = [], []
    for lr in lrs:
        for arm, _, lazy_update, arm_env, impls in LEARNING_ARMS:
            for impl in impls:   # ours then stock, one arm after the other: the machine's load moves both alike
                if impl == "stock" and bench.args.no_stock:
                    continue
                name = f"learning-{arm}" + (f"-lr{lr:g}" if len(lrs) > 1 else "")
                if not bench.args.report_only:
                    (bench.runs_dir / f"{name}-{impl}" / "res.pred.npy").unlink(missing_ok=True)
                run = bench.job(name, impl, learning_argv(c, impl, arm, lazy_update, lr), num_servers=c["servers"],
                                timeout=c["timeout"], env=STEP_ENV, server_env=arm_env if impl == "lazy" else {})
                runs[(lr, arm, impl)] = run
                loads += run.load
                if not run.ok:
                    failed.append(f"{name} on {'ours' if impl == 'lazy' else 'stock'} FAILED (status "
                                  f"{run.status}): {run.log}")
    stats = {k: learning_stats(r) for k, r in runs.items()}
    preds = {k: learning_predictions(r) for k, r in runs.items()}
    config = next((s["config"] for s in stats.values() if s), None)
    floors = {round(s["config"]["floor_logloss"], 12) for s in stats.values() if s}
    rows, data = [], {"config": c, "runs": {}, "arms": {a: what for a, what, *_ in LEARNING_ARMS}}
    floor = config["floor_logloss"] if config else None
    if config:
        rows.append(["floor: the true model", "-", f"{config['floor_logloss']:.4f}", "0",
                     f"{config['floor_auc']:.4f}", "", "", ""])
        rows.append(["constant: the held-out CTR", "-", f"{config['constant_logloss']:.4f}",
                     f"+{config['constant_logloss'] - floor:.4f}", "0.5000", "", "", ""])
        data.update({key: config[key] for key in ("floor_logloss", "floor_auc", "constant_logloss", "held_out_ctr",
                                                  "held_out_distinct")})
    curves, segments = [], []
    for (lr, arm, impl), run in runs.items():
        st = stats[(lr, arm, impl)] or {}
        server = "ours" if impl == "lazy" else "stock"
        versus, cmp = "", {}
        if impl == "lazy" and (lr, arm, "stock") in runs:
            versus, cmp = compare_predictions(preds[(lr, arm, impl)], preds[(lr, arm, "stock")])
        elif arm == "row-steps":
            taken = row_steps_taken(run)
            if taken is False:
                versus = f"NOT APPLIED: the servers ignore {ROW_STEPS_VAR} (this run is lazy Adam)"
            else:
                same, cmp = compare_predictions(preds[(lr, arm, impl)], preds.get((lr, "lazy", "lazy")))
                versus = "" if same == "-" else f"(vs lazy on ours: {same})"
            cmp["applied"] = taken
        label = arm + (f", lr {lr:g}" if len(lrs) > 1 else "")
        loss = st.get("logloss")
        partial = f" (step {st['step']} of {st['config']['steps']})" if st and not st["finished"] else ""
        rows.append([label, server, "-" if loss is None else f"{loss:.4f}{partial}",
                     "-" if loss is None or floor is None else f"+{loss - floor:.4f}",
                     "-" if st.get("auc") is None else f"{st['auc']:.4f}", ms(st.get("server_cpu_ms_per_step")),
                     ms(st.get("wall_ms_per_step")), versus if run.ok else f"job FAILED: {run.log}"])
        data["runs"][f"{arm}/{server}" + (f"/lr{lr:g}" if len(lrs) > 1 else "")] = {
            **{k: v for k, v in st.items() if k != "config"}, "lr": lr, "vs": cmp, "ok": run.ok}
        if st.get("curve"):
            curves.append(f"{label} on {server}: " + ", ".join(f"{x:.4f}" for _, x, _ in st["curve"]))
        if st.get("segments"):
            segments.append(f"{label} on {server}: " + ", ".join(f"{cpu:.1f}" for _, cpu, _ in st["segments"]))
    load = f"{min(loads, default=0):.1f}..{max(loads, default=0):.1f}"
    data["loadavg_1min"] = load
    steps_at = ", ".join(str(x) for x, _, _ in next((st["curve"] for st in stats.values() if st), []))
    notes = [f"2 workers, {c['servers']} servers, dist_sync; data: {len(c['dims'])} categorical fields of "
             f"{', '.join(f'{n:,}' for n in c['dims'])} ids, Zipf({c['zipf']}) ranks scrambled into the ids; a click "
             f"is Bernoulli(sigmoid(b0 + sum of the ids' true weights)), true weights Normal(0, 0.8), b0 = -1.5 "
             f"(scripts/bench_workers/ctr_learning.py, ZipfLogistic)",
             f"model: per field a wide weight (row_sparse, D=1, Zero) and an embedding (row_sparse, D="
             f"{c['emb_dim']}, Uniform(0.05)), a Dense(1) over the embeddings and a bias (2 dense keys); "
             f"{c['steps']} steps of {c['batch']} examples per worker; Adam lr {', '.join(f'{x:g}' for x in lrs)}, "
             f"wd {c['wd']:g}, beta1 0.9, beta2 0.999, eps 1e-8, rescale_grad 1 / (batch x workers)",
             "arms: " + "; ".join(f"{a}: {what}" for a, what, *_ in LEARNING_ARMS),
             f"held-out: {c['held_out']:,} examples from a stream apart from the training data, evaluated by rank 0 "
             "after the last step (it pulls the rows they need); floor: the log loss and AUC of the true "
             "probabilities on the same examples (the best any model can do); AUC from the logits (numpy)",
             "server CPU: user+system CPU of the server processes over the training steps (evaluations left out), "
             "per step; wall: rank 0's training time per step (pull, numpy forward/backward, push, waited)",
             "predictions vs stock: the held-out probabilities of ours against stock's, same arm (lazy: should be "
             "identical; dense: identical once our servers catch rows up as stock moves them)",
             f"held-out log loss during training (at steps {steps_at}): " + "; ".join(curves),
             "server CPU per step (ms) over the steps up to each of those: " + "; ".join(segments),
             f"every node runs with OMP_NUM_THREADS=1; 1-min load average during these jobs {load}"] + failed
    if len(floors) > 1:
        notes.append(f"WARNING: the runs' floors differ ({sorted(floors)}): not the same held-out set")
    return table("Scenario 9: effect on learning (Adam on row_sparse keys, issue 32)", LEARNING_HEADERS, rows,
                 notes), data


# ----------------------------------------------------------------------------------------------------------------
# scenario 10: disk scale (issue 29): hashed ids over 2^40 rows, one server under a budget with a disk tier, every
# phase of a job's life measured (scripts/bench_workers/scale_job.py)

DISK_SCALE_HEADERS = ["job / phase", "seconds", "peak RSS", "peak - budget", "rows in memory / on disk",
                      "RAM index B / disk row", "disk B / disk row (x raw)", "target"]
SCALE_RECORD_EXTRA = 8 + 4 + 8     # a segment record besides weights and momentum: id, check, policy columns


def disk_scale_argv(c: dict, role: str, dirs: list[Path], expect: Path | None = None) -> list[str]:
    argv = worker("scale_job.py") + ["--role", role, "--rows", str(c["rows"]), "--dim", str(c["dim"]),
                                     "--batch", str(c["batch"]), "--zipf-steps", str(c["zipf_steps"]),
                                     "--sample", str(c["sample"]), "--dirs", ",".join(map(str, dirs)),
                                     "--progress", str(max(1, c["rows"] // (c["workers"] * c["batch"]) // 10))]
    return argv + (["--expect", str(expect)] if expect is not None else [])


def scenario_disk_scale(bench: Bench) -> tuple[str, dict]:
    c = bench.cfg["disk_scale"]
    budget, dim = parse_bytes(c["budget"]), c["dim"]
    raw = 8 + 2 * dim * 4                     # id, weights and momentum (float32)
    root = bench.runs_dir / "disk-scale-data"
    disk, snap = root / "disk", root / "snap"
    if not bench.args.report_only:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        # segments (records of raw + 12 bytes, up to ~1.33x while garbage waits for compaction), index runs, and
        # the segments the snapshots keep while the live store compacts: 2x the records with margin
        need = c["rows"] * (raw + SCALE_RECORD_EXTRA) * 2
        free = shutil.disk_usage(root).free
        if need > free:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"disk-scale with {c['rows']:,} rows needs ~{fmt_bytes(need)} free in {root}, "
                               f"{fmt_bytes(free)} are (--out elsewhere, or fewer --rows)")
    env = {"KVSTORE_LAZY_MEMORY_BUDGET": str(budget), "KVSTORE_LAZY_DISK_DIR": str(disk),
           "KVSTORE_LAZY_SNAPSHOT_DIR": str(snap), "KVSTORE_LAZY_SNAPSHOT_INTERVAL": "0"}
    workers_env = {"DMLC_NUM_WORKER": str(c["workers"])}
    try:
        # the train job leaves without kStopServer: the launcher stops its server after finish_grace, with no
        # shutdown snapshot, so the restore below folds the chain's base and delta
        train = bench.job("disk-scale-train", "lazy", disk_scale_argv(c, "train", [disk, snap]), num_workers=1,
                          timeout=c["timeout"], env=workers_env, server_env=env, sample_peaks=True, finish_grace=2)
        expect = Path(train.log).parent / "res.sample.npz"
        restore = bench.job("disk-scale-restore", "lazy", disk_scale_argv(c, "restore", [disk, snap], expect),
                            num_workers=1, timeout=c["timeout"], env=workers_env, sample_peaks=True,
                            server_env=dict(env, KVSTORE_LAZY_RESUME="latest"))
    finally:
        if not bench.args.report_only:
            shutil.rmtree(root, ignore_errors=True)
    phases = [r for run in (train, restore) for r in run.of("phase")]
    by_name = {r["phase"]: r for r in phases}
    fill = by_name.get("fill", {})
    rows, failed = [], []
    for rec in phases:
        st = rec.get("stats", {}).get("key", {})
        on_disk = st.get("disk_rows")
        over = rec["peak"] - budget
        index_ram = st["disk_index_bytes"] / on_disk if on_disk else None
        on_disk_bytes = st.get("disk_bytes", 0) + st.get("disk_index_disk_bytes", 0)
        per_row = on_disk_bytes / on_disk if on_disk else None
        extra = ""
        if rec["phase"] == "fill":
            extra = f"; {rec['rows_per_s']:,.0f} rows/s"
        rows.append([f"{rec['role']}: {rec['phase']}", f"{rec['seconds']:,.1f}", mib(rec["peak"]),
                     f"{over / MiB:+,.1f} MiB" + ("" if rec.get("hwm_reset", True) else " (since start)"),
                     f"{num(st.get('rows'))} / {num(on_disk)}" if st else "-",
                     f"{index_ram:.2f}" if index_ram is not None else "-",
                     f"{per_row:.1f} ({per_row / raw:.2f}x)" if per_row else "-",
                     verdict(over <= 100 * MiB, "<= budget + 100 MiB") + extra])
    listing, fetched = by_name.get("fetch_rows: listing", {}), by_name.get("fetch_rows: rows", {})
    restored = by_name.get("restored: count and sample", {})
    trained_rows = fill.get("rows")
    checks = [
        ("rows kept: listed by fetch_rows = trained", listing.get("listed"), trained_rows,
         listing.get("listed") == trained_rows and trained_rows is not None),
        ("listed ids = trained ids (order-free hash of each set)", listing.get("listed"), trained_rows,
         listing.get("listed_hash") == listing.get("trained_hash") and "listed_hash" in listing),
        ("sample rows fetched = init - lr x grad (untouched by Zipf)", fetched.get("sample_untouched_equal_trained"),
         fetched.get("sample_untouched"),
         fetched.get("sample_untouched") and fetched.get("sample_untouched_equal_trained") ==
         fetched.get("sample_untouched")),
        ("restored rows = trained", restored.get("restored_rows"), trained_rows,
         restored.get("restored_rows") == trained_rows and trained_rows is not None),
        ("restored sample = fetched, bit for bit", restored.get("sample_equal_fetched"), restored.get("sample"),
         restored.get("sample") and restored.get("sample_equal_fetched") == restored.get("sample")),
    ]
    idle = next((r.get("idle", {}).get("VmRSS") for r in train.of("setup")), None)
    rows.insert(0, ["train: server before the key (idle)", "", mib(idle), "", "", "", "", ""])
    for what, got, want, ok in checks:
        rows.append([what, "", "", "", f"{num(got)} of {num(want)}", "", "", verdict(bool(ok), "equal")])
    last = next((r for r in reversed(phases) if r.get("stats")), {})
    st = last.get("stats", {}).get("key", {})
    du = max((r.get("disk_usage", 0) for r in phases), default=0)
    if trained_rows:
        rows.append(["disk in use, disk tier + snapshots (each file once), largest", "", "", "",
                     fmt_bytes(du), "", f"{du / trained_rows:.1f} ({du / trained_rows / raw:.2f}x)",
                     verdict(du / trained_rows <= 1.5 * raw, f"<= 1.5 x raw ({raw} B)")])
    stock = KEY_ROWS_2_40 * dim * 4 * 2      # weight and momentum, dense
    rows.append([f"stock: the (2^40, {dim}) weight + momentum in RAM (computed)", "", f"{stock / 2**40:,.0f} TiB",
                 f"{(stock - budget) / 2**40:+,.0f} TiB", f"{num(KEY_ROWS_2_40)} / 0", "", "",
                 "a stock worker cannot create it"])
    for name, run in (("train", train), ("restore", restore)):
        if not run.ok:
            failed.append(f"{name} job FAILED (status {run.status}): {run.log}; "
                          f"{' | '.join(run.errors[-3:])[:400]}")
    whole = max((p for run in (train, restore) for p in run.server_peaks if p), default=None)
    notes = [f"one server, {c['workers']} simulated workers (scripts/bench_workers/scale_job.py: stock workers' "
             f"bytes, one pyzmq process), dist_sync, SGD momentum 0.9, a (2^40, {dim}) float32 key declared lazy; "
             f"ids: a bijection of [0, 2^40) of counters, B={c['batch']} fresh ids per worker per step; "
             f"KVSTORE_LAZY_MEMORY_BUDGET={c['budget']}, KVSTORE_LAZY_DISK_DIR and KVSTORE_LAZY_SNAPSHOT_DIR on "
             f"{bench.runs_dir} (deleted after)",
             "phases: fill; LAZY_SNAPSHOT (kvstore_lazy.worker.snapshot: the tagged snapshot before its answer, then "
             f"the chain's base); {c['zipf_steps']} Zipf(1.2) pull + push steps; LAZY_SNAPSHOT again (tagged, then "
             "the chain's delta); fetch_rows' requests (listing, then rows in pieces of 262,144; checked and "
             "dropped); the train job then ends without kStopServer (its server stopped by the launcher, no "
             "shutdown snapshot); a new job's server restores base + delta (KVSTORE_LAZY_RESUME=latest), the "
             "workers check it, kStopServer (the shutdown snapshot, full)",
             "peak RSS: the server process's VmHWM, reset at each phase's start (/proc/<pid>/clear_refs), and its "
             "VmRSS sampled every 0.1 s, the larger; the restore's counts from the process's start; rows, index and "
             "disk bytes: the server's stats (LAZY_STATS) after the phase: disk_index_bytes (RAM) per disk row, "
             "disk_bytes + disk_index_disk_bytes (segment files, index runs) per disk row",
             f"raw bytes of a row: id + weights + momentum = 8 + {dim} x 4 x 2 = {raw} B; stock holds the dense "
             f"weight and momentum of every possible row (2^40 x {dim} x 4 B x 2), and a stock worker cannot even make "
             f"the key's NDArray (2^40 x {dim} elements >= 2^31)",
             f"the whole run's peak of the server (the launcher's sampler, both jobs): {mib(whole)}"]
    if fill:
        notes.append(f"fill: {fill['rows']:,} rows in {fill['fill_seconds']:,.0f} s ({fill['rows_per_s']:,.0f} "
                     f"rows/s, {fill['steps']:,} dist_sync steps); server CPU over the fill "
                     f"{fill.get('server_cpu') or 0:,.0f} s")
    data = {"config": c, "budget": budget, "raw_bytes_per_row": raw, "phases": phases, "checks": [
        {"what": what, "got": got, "want": want, "ok": bool(ok)} for what, got, want, ok in checks],
        "disk_usage_max": du, "stock_bytes": stock, "last_stats": st, "whole_run_peak": whole}
    return table(f"Scenario 10: disk scale ({num(trained_rows)} rows of a (2^40, {dim}) key, one server, budget "
                 f"{c['budget']})", DISK_SCALE_HEADERS, rows, notes + failed), data


# ----------------------------------------------------------------------------------------------------------------
# profiles

def profile_report(runs: list[Run], top: int = 14) -> str:
    lines = []
    for run in runs:
        for path in run.profiles:
            stats = pstats.Stats(path)
            total = stats.total_tt
            entries = []
            for (file, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():
                short = f"{Path(file).name}:{line}({func})"
                entries.append((tt, ct, nc, short))
            entries.sort(reverse=True)
            busy = total - sum(tt for tt, _, _, name in entries if "poll" in name)
            lines.append(f"{run.name} ({path}): {total:.2f} s CPU in the server process, {busy:.2f} s outside "
                         f"zmq poll")
            lines.append(f"  {'CPU s':>7}  {'% busy':>6}  {'cum s':>7}  {'calls':>7}  function")
            for tt, ct, nc, name in entries[:top]:
                lines.append(f"  {tt:7.3f}  {100 * tt / busy if busy else 0:5.1f}%  {ct:7.3f}  {nc:7d}  {name}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    parser.add_argument("--scenarios", default=",".join(s for s in SCENARIOS if s not in OPT_IN),
                        help=f"comma list of {', '.join(SCENARIOS)} (default: all but {', '.join(OPT_IN)})")
    parser.add_argument("--out", default=str(ROOT / "bench-results"), help="output directory (default bench-results/)")
    parser.add_argument("--profile", action="store_true",
                        help="run our servers of the throughput, step and saturation jobs under cProfile (CPU time) "
                             "and print hot spots; their numbers then carry the profiler's overhead")
    parser.add_argument("--no-stock", action="store_true", help="only our server (no side by side)")
    parser.add_argument("--verbose", action="store_true", help="echo every job's output")
    parser.add_argument("--rows", type=int, default=None,
                        help="disk-scale: rows to train (default: the preset's, 300M full, 5M with --quick)")
    parser.add_argument("--budget", default=None,
                        help="disk-scale: the server's memory budget (default: the preset's, 1GiB full, 64MiB quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the tables, JSON and plot from the job records an earlier run "
                             "with the same preset left in --out")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    preset = "quick" if args.quick else "full"
    cfg = json.loads(json.dumps(PRESETS[preset]))
    if args.rows is not None:
        cfg["disk_scale"]["rows"] = args.rows
    if args.budget is not None:
        try:
            parse_bytes(args.budget)      # a bad size stops here, not after the other scenarios ran
        except ValueError as exc:
            parser.error(f"--budget: {exc}")
        cfg["disk_scale"]["budget"] = args.budget
    bench = Bench(args, cfg)
    started = time.monotonic()
    info = machine()
    print(f"kvstore_lazy benchmark ({preset}), {time.strftime('%Y-%m-%d %H:%M:%S')}; machine: {info.get('cores')} "
          f"cores, {info.get('mem_total_gib')} GiB ({info.get('mem_available_gib')} GiB available), "
          f"{info.get('cpu', '?')}; load average {' '.join(map(str, info['loadavg']))}; mxnet {info.get('mxnet')}, "
          f"numpy {info.get('numpy')}, pyzmq {info.get('pyzmq')}; git {info.get('git')}"
          f"{' (uncommitted changes)' if info.get('git_dirty') else ''}", flush=True)
    print(f"output: {bench.out}", flush=True)

    results = {"preset": preset, "config": cfg, "machine_start": info, "scenarios": {}}
    texts, series = [], []
    report_errors = []

    def report(name: str, build) -> object:
        """A table that cannot be built (a bug, or a job that left nothing) must not cost the other tables."""
        try:
            out = build()
        except Exception:   # noqa: BLE001 - report and carry on; the raw records stay in the job dirs
            import traceback
            trace = traceback.format_exc()
            report_errors.append(f"{name}: {trace.strip().splitlines()[-1]}")
            texts.append(f"{name}: could not build the table:\n{trace}")
            return None
        texts.append(out[0])
        results["scenarios"][name] = out[1]
        if len(out) > 2:
            series.extend(out[2])
        (bench.out / "results.json").write_text(json.dumps(results, indent=1, default=float))
        return out[1]

    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        init_data = None
        if "init" in scenarios:
            print("scenario 1: init", flush=True)
            init_data = report("init", lambda: scenario_init(bench))
        jobs = plan_rows_jobs(cfg, scenarios)
        if jobs:
            print("scenarios 2-4: row jobs", flush=True)
            run_rows_jobs(bench, jobs)
        if "memory" in scenarios:
            report("memory", lambda: scenario_memory(bench, jobs))
        if "throughput" in scenarios:
            report("throughput", lambda: scenario_throughput(bench, jobs))
        if "scale" in scenarios:
            report("scale", lambda: scenario_scale(bench, jobs, init_data))
        if "step" in scenarios:
            print("scenario 5: step", flush=True)
            report("step", lambda: scenario_step(bench))
        if "lifecycle" in scenarios:
            print("scenario 6: lifecycle", flush=True)
            report("lifecycle", lambda: scenario_lifecycle(bench))
        if "tiered" in scenarios:
            print("scenario 7: tiered (disk tier)", flush=True)
            report("tiered", lambda: scenario_tiered(bench))
        if "saturation" in scenarios:
            print("scenario 8: saturation", flush=True)
            report("saturation", lambda: scenario_saturation(bench))
        if "learning" in scenarios:
            print("scenario 9: learning (Adam's row_sparse semantics)", flush=True)
            report("learning", lambda: scenario_learning(bench))
        if "disk-scale" in scenarios:
            print("scenario 10: disk-scale (hashed ids, a disk tier, every phase under the budget)", flush=True)
            report("disk-scale", lambda: scenario_disk_scale(bench))
    except KeyboardInterrupt:
        print("\ninterrupted; every process of the running job was stopped", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)

    end = machine()
    wall = time.monotonic() - started
    loads = [r.load[0] for r in bench.runs if r.load]
    if args.report_only and bench.previous:
        info = json.loads((bench.out / "results.json").read_text()).get("machine_start", info) \
            if (bench.out / "results.json").exists() else info
        wall = sum(r.wall for r in bench.runs)
    rebuilt = " (tables rebuilt from the run's job records with --report-only)" if args.report_only else ""
    header = (f"kvstore_lazy vs stock MXNet 1.9.1 server, {preset} preset{rebuilt}, {time.strftime('%Y-%m-%d')}; "
              f"{info.get('cores')} cores, {info.get('mem_total_gib')} GiB, {info.get('cpu', '?')}; "
              f"1-min load average during the jobs {min(loads, default=0):.1f}..{max(loads, default=0):.1f} "
              f"(other work on the machine shares the cores: latencies and rows/s move with it, server CPU less); "
              f"{len(bench.runs)} jobs in {wall:.0f}s; command: python scripts/bench.py "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    report = header + "\n\n" + "\n\n".join(texts)
    if args.profile:
        prof = profile_report([r for r in bench.runs if r.profiles])
        if prof:
            report += "\n\nHot spots of our server (cProfile, CPU time)\n" + prof
    print("\n" + report)
    results["machine_end"] = end
    results["wall_seconds"] = wall
    results["jobs"] = [r.summary() for r in bench.runs]
    (bench.out / "tables.txt").write_text(report + "\n")
    (bench.out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    lifecycle_series = [x for x in series if x.get("lifecycle")]
    series = [x for x in series if not x.get("lifecycle")]
    if series:
        plots.memory_vs_rows(bench.out / "memory_vs_rows.png", series, budget_mib=BUDGET / MiB,
                             title="Server memory vs rows seen (one server)",
                             notes=[f"{preset} preset, {time.strftime('%Y-%m-%d')}; dashed: stock (its memory "
                                    f"follows input_dim, not rows seen) and extrapolations"])
    if lifecycle_series:
        budget = parse_bytes(cfg["lifecycle"]["budget"])
        plots.line_plot(bench.out / "lifecycle_rss.png", lifecycle_series,
                        title="Server RSS over time, row lifecycle runs (largest of 2 servers)",
                        xlabel="seconds of training", ylabel="server RSS (MiB)",
                        hlines=[(budget / MiB, f"budget {budget / MiB:g} MiB (budget runs)"),
                                ((budget + 150 * MiB) / MiB, "budget + 150 MB")],
                        notes=[f"{preset} preset, {time.strftime('%Y-%m-%d')}; 2 servers, 2 workers, dist_sync"])
    print(f"\nwrote {bench.out / 'tables.txt'}, {bench.out / 'results.json'}"
          f"{', ' + str(bench.out / 'memory_vs_rows.png') if series else ''}"
          f"{', ' + str(bench.out / 'lifecycle_rss.png') if lifecycle_series else ''}; job logs under {bench.runs_dir}")
    failed = [r for r in bench.runs if r.server == "lazy" and not r.ok]
    for r in failed:
        print(f"our job {r.name} FAILED (status {r.status}): {r.log}\n    " + "\n    ".join(r.errors[-5:]))
    for e in report_errors:
        print(f"table not built: {e}")
    return 1 if failed or report_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
