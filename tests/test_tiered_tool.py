"""scripts/bench_workers/tiered.py ``--index-times``: the disk index's calls it times on the request thread are the
real ones (the benchmark document's spread-arm figures come from it). A small in-process run (no sockets, ~3 s):
with hashed ids and a small memtable the RunIndex has runs, so its lookups read blocks and the report counts those
calls; nested calls are inside the calls around them; with a dense key no RunIndex call is made. Checks the counts
and the nesting, never a timing's size."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "scripts" / "bench_workers" / "tiered.py"
LABELS = ["lookup", "groups' probes", "filters and fences", "block reads, checks, searches", "remove", "set"]


def run_tool(*extra: str) -> str:
    run = subprocess.run([sys.executable, str(TOOL), "--rows", "300000", "--budget", "16MiB", "--steps", "6",
                          "--index-times", *extra], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


def index_times(out: str) -> dict[str, tuple[float, float]]:
    """label -> (wall ms a step, calls a step) from the report's lines."""
    times = {}
    for label in LABELS:
        match = re.search(rf"^\s+{re.escape(label)}\s+([0-9.]+) \(([0-9.]+)\)$", out, re.M)
        assert match, f"no line for {label!r} in:\n{out}"
        times[label] = float(match[1]), float(match[2])
    return times


def per_step(out: str, counter: str) -> int:
    match = re.search(rf"{counter} ([0-9,]+)", out.split("zipf phase, per step:")[1])
    assert match, out
    return int(match[1].replace(",", ""))


def test_index_times_count_the_runindex_calls_a_hashed_key_makes():
    out = run_tool("--hashed", "--memtable", "4096")
    assert per_step(out, "index_blocks_read") > 0              # the index has runs: lookups read blocks
    times = index_times(out)
    for label in LABELS:
        assert times[label][1] > 0, (label, out)                # each call made on the request thread, counted
    lookup, probes, filters, reads = (times[k][0] for k in LABELS[:4])
    assert lookup >= probes >= max(filters, reads)              # nested calls inside the calls around them
    assert probes >= filters + reads - 0.05                     # (both inside a group's probe; printed to 0.01 ms)


def test_index_times_see_no_runindex_call_with_a_dense_key():
    times = index_times(run_tool())
    assert all(calls == 0 for _, calls in times.values()), times
