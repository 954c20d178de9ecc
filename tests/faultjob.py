"""Fault-test jobs: tests/workers/fault_train.py under kvstore_lazy.launch.Job (this machine or network namespaces),
a fault injected at a given training step, and what came out: status, timings, final model, update counts.

The job runs in the fault-tolerant configuration (PS_RESEND=1 with a 3 s resend timeout, server journal, a snapshot
every second between rounds, one restart per server). Two servers (the dense key on one, the row_sparse key split
over both), two workers, dist_sync, SGD with momentum: every (server, key) applies exactly one update per step, and
the final model is a bit-exact function of the updates applied, so "updates lost" is measured, not guessed.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore_lazy.persist import checkpoint  # noqa: E402
from kvstore_lazy.launch import Job  # noqa: E402

STEPS = 60
FAULT_ENV = {"OMP_NUM_THREADS": "1", "PS_RESEND": "1", "PS_RESEND_TIMEOUT": "3000",
             "MXNET_KVSTORE_BIGARRAY_BOUND": "10000", "PYTHONPATH": str(ROOT)}


class Log(io.TextIOBase):
    """The job's output, kept in memory and in a file."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "a")
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.fh.write(text)
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        self.fh.flush()

    def text(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        self.fh.close()


def make_job(out: Path, placer=None, restart: int = 1, resume: bool = False, checkpoint_every: int = 0,
             steps: int = STEPS, sleep: float = 0.1, log_name: str = "job.log", server_env: dict | None = None) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "tests" / "workers" / "fault_train.py"), "--out", str(out), "--steps",
               str(steps), "--sleep", str(sleep), "--snapshot-dir", str(out / "snap")]
    if checkpoint_every:
        command += ["--checkpoint-every", str(checkpoint_every)]
    if resume:
        command.append("--resume")
    server_env = {"KVSTORE_LAZY_SNAPSHOT_DIR": str(out / "snap"), "KVSTORE_LAZY_JOURNAL": "1",
                  "KVSTORE_LAZY_SNAPSHOT_INTERVAL": "1", **(server_env or {})}
    job = Job(command, 2, 2, env=dict(FAULT_ENV), server_env=server_env, out=Log(out / log_name), placer=placer,
              restart_servers=restart)
    return job


def progress(out: Path, rank: int = 0) -> list[tuple[int, float]]:
    """(step, unix time) of every step worker `rank` finished (its updates answered)."""
    try:
        lines = (out / f"progress.rank{rank}").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(int(a), float(b)) for a, b in (line.split() for line in lines if line.count(" ") == 1)]


@dataclass
class Outcome:
    code: int
    job: Job
    out: Path
    fault_wall: float | None = None       # time.time() the fault was injected
    fault_mono: float | None = None       # time.monotonic() of the same moment
    fault_step: int | None = None         # last step finished before it
    ended_mono: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def log(self) -> str:
        return self.job.out.text()

    def first_step_after(self, wall: float) -> float | None:
        """Seconds from `wall` until worker 0 next finished a step (None if it never did)."""
        after = [t for s, t in progress(self.out) if t > wall]
        return after[0] - wall if after else None

    def recovered_after(self, wall: float) -> float | None:
        """Seconds from `wall` to the end of the longest pause in worker 0's steps that ends after `wall` (the
        stall a fault caused, whichever step it hit)."""
        steps = progress(self.out)
        gaps = [(b - a, b) for (_, a), (_, b) in zip(steps, steps[1:]) if b > wall]
        return max(gaps)[1] - wall if gaps else None

    def event(self, what: str, name: str | None = None) -> float | None:
        for t, w, n, _ in self.job.events:
            if w == what and (name is None or n == name) and (self.fault_mono is None or t >= self.fault_mono):
                return t
        return None


def run(job: Job, out: Path, fault=None, at_step: int = 20, timeout: float = 150.0) -> Outcome:
    """Start `job`; once worker 0 finished `at_step`, call `fault(job)` in a thread; supervise to the end."""
    outcome = Outcome(code=-1, job=job, out=out)

    def inject() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = progress(out)
            if done and done[-1][0] >= at_step:
                outcome.fault_step = done[-1][0]
                outcome.fault_wall, outcome.fault_mono = time.time(), time.monotonic()
                fault(job, outcome)
                return
            if all(n.popen.poll() is not None for n in job.nodes if n.role == "worker"):
                return
            time.sleep(0.02)

    job.start()
    thread = None
    if fault is not None:
        thread = threading.Thread(target=inject, daemon=True)
        thread.start()
    try:
        outcome.code = job.supervise(timeout)
    finally:
        outcome.ended_mono = time.monotonic()
        if thread is not None:
            thread.join(timeout=60)
        job.out.close()
    return outcome


def kill(name: str, delay: float = 0.0):
    """kill -9 of node `name`, `delay` seconds after the step is reached (the fault time is the kill's)."""
    def fault(job: Job, outcome: Outcome) -> None:
        time.sleep(delay)
        node = next(n for n in job.nodes if n.name == name)
        outcome.notes["killed_pid"] = node.pid
        outcome.fault_wall, outcome.fault_mono = time.time(), time.monotonic()
        os.kill(node.pid, signal.SIGKILL)
    return fault


def kill_rank(rank: int, delay: float = 0.0):
    """kill -9 of the server that registered as ps-lite rank `rank` (ranks need not follow the start order)."""
    def fault(job: Job, outcome: Outcome) -> None:
        name = next(n.name for n in job.nodes if n.role == "server" and n.ps_rank == rank)
        kill(name, delay)(job, outcome)
    return fault


def final(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "final.npz") as data:
        return {k: data[k] for k in data.files}


def same_model(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and np.array_equal(a[k], b[k]) for k in a)


def update_counts(out: Path, num_servers: int = 2) -> dict[tuple[int, int], int]:
    """(server rank, key) -> updates applied, from the snapshots servers write at shutdown."""
    counts = {}
    for rank in range(num_servers):
        manifest = checkpoint.read_manifest(out / "snap", rank)
        for key, n in manifest["server"]["optimizer_counts"]["counts"].items():
            counts[(rank, int(key))] = int(n)
    return counts


def updates_lost(out: Path, steps: int = STEPS) -> int:
    """Rounds some (server, key) did not apply (negative: applied twice)."""
    counts = update_counts(out)
    assert counts, "no update counts in the final snapshots"
    return sum(steps - n for n in counts.values())


def processes_left(job: Job, namespaces=()) -> list[str]:
    """Every process the job started, by PID and process group, and anything inside `namespaces`."""
    left = []
    for node in job.history:
        if node.popen.poll() is None:
            left.append(f"{node.name} pid {node.pid}")
        try:
            os.killpg(node.pid, 0)
            left.append(f"process group {node.pid} of {node.name}")
        except ProcessLookupError:
            pass
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        if pids:
            left.append(f"netns {ns}: pids {' '.join(pids)}")
    return left


def record(results: dict, name: str, **values) -> None:
    results[name] = values


def table(results: dict) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f} s"
        return str(v)
    lines = ["| fault | outcome | time to detect | time to recover | updates lost | notes |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.get('outcome', '')} | {fmt(r.get('detect'))} | {fmt(r.get('recover'))} | "
                     f"{fmt(r.get('lost'))} | {r.get('notes', '')} |")
    return "\n".join(lines)


def write_report(results: dict, path: Path) -> None:
    path.write_text(table(results) + "\n\n" + json.dumps(results, indent=1, default=str) + "\n")
