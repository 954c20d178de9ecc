"""The disk-scale benchmark (issue 29; `python scripts/bench.py --scenarios disk-scale`), small: a real server with a
32 MiB budget and a disk tier, simulated stock workers (scripts/bench_workers/scale_job.py) through the stock
scheduler, 1M rows of a (2^40, 8) SGD-momentum key with hashed ids, every phase of the scenario (fill, snapshots,
Zipf steps, fetch_rows, a restart restoring the chain).

Checks the job's results, never its timings or RSS: every trained row kept (in memory or on disk) and listed by
fetch_rows exactly once (the listed ids hash to the trained ids), the sample rows fetched with the value one SGD
step gives (recomputed here from the initial values the server served), and the restored server holding the same
rows with the same values bit for bit; the data directory is gone afterwards.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
ROWS, DIM = 1_000_000, 8


def test_disk_scale_keeps_fetches_and_restores_every_row(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--scenarios", "disk-scale",
                          "--rows", str(ROWS), "--budget", "32MiB", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads((out / "results.json").read_text())["scenarios"]["disk-scale"]
    phases = {(p["role"], p["phase"]): p for p in data["phases"]}

    fill = phases[("train", "fill")]
    trained = fill["rows"]
    assert trained >= ROWS and trained % (2 * data["config"]["batch"]) == 0      # whole dist_sync steps
    after = fill["stats"]["key"]
    assert after["rows"] + after["disk_rows"] == trained         # every trained row kept, in one tier or the other
    assert after["disk_rows"] > trained // 2                     # the budget sent most of them to disk
    assert fill["stats"]["bad_requests"] == 0

    listing = phases[("train", "fetch_rows: listing")]
    assert listing["listed"] == trained
    assert listing["listed_hash"] == listing["trained_hash"]     # the same set of ids (the listing is sorted unique)
    fetched = phases[("train", "fetch_rows: rows")]
    assert fetched["all_finite"] and fetched["sample_fetched"] == fetched["sample"] == 4096

    sample = np.load(out / "runs" / "disk-scale-train-lazy" / "res.sample.npz")
    untouched = ~sample["zipf_touched"]
    assert untouched.sum() > 3000
    grads = ((sample["ids"] % 5) + 1).astype(np.float32) / np.float32(128)
    expected = sample["initial"] - (np.float32(0.25) * grads)[:, None]           # lr 0.25, wd 0, momentum from 0
    assert np.array_equal(sample["fetched"][untouched], expected[untouched].astype(np.float32))
    assert fetched["sample_untouched_equal_trained"] == untouched.sum()
    assert not np.array_equal(sample["fetched"], sample["initial"])    # (the values did move)

    restored = phases[("restore", "restored: count and sample")]
    assert restored["restored_rows"] == trained
    assert restored["sample_equal_fetched"] == restored["sample"] == 4096
    assert restored["stats"]["key"]["rows"] + restored["stats"]["key"]["disk_rows"] == trained
    assert ("restore", "stop (shutdown snapshot, full)") in phases
    assert all(check["ok"] for check in data["checks"]), data["checks"]
    assert not (out / "runs" / "disk-scale-data").exists()       # the disk tier and snapshots are deleted
