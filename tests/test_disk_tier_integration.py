"""The disk tier with real stock MXNet 1.9.1 workers and scheduler.

- A job whose rows went to disk and back (KVSTORE_LAZY_DISK_DIR under a small KVSTORE_LAZY_MEMORY_BUDGET) ends bit
  for bit where the same job with no budget ends: every row's weights and momentum on every server (their shutdown
  snapshots), and the rows a worker checkpoint lists (fetch_rows); 1 and 2 servers, dist_sync.
- kill -9 of a server mid-run with the tier active, recovered from its snapshots and journal: the job ends bit for
  bit where an undisturbed job with everything in memory ends.
- A disk that fills up (the tier's directory on a small tmpfs mounted in a private mount namespace made for the
  job): the server logs an ERROR naming the directory and exits with status 4, the job stops with that status, no
  process is left, and the snapshots written before load cleanly.
- A server restarted on a damaged segment of its snapshot's disk tier refuses it, naming the file, with status 4.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import faultjob
from common import load
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.store.segments import SegmentStore

pytestmark = pytest.mark.integration

ROWS, DIM, STEPS, BATCH, SEED, KEY = 200_000, 4, 20, 4096, 42, 3
# a row: 4 + 4 floats, 8 B of columns, 8 B of id (41 B; +1 change flag with snapshots); a few thousand fit
TIER_ENV = {"KVSTORE_LAZY_MEMORY_BUDGET": "256KiB"}
STATS = re.compile(r"stats \(at shutdown\): key (\d+) rows (\d+) bytes \d+ .*disk_rows (\d+) disk_bytes \d+ "
                   r"disk_index_bytes \d+ promoted (\d+) demoted (\d+) hit_rate ([\d.]+)")


def run_job(job_factory, name, servers, server_env):
    job = job_factory(name, num_workers=2, num_servers=servers, server="lazy",
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"})       # partitioned over the servers
    job.start(server_env=dict({"KVSTORE_LAZY_SNAPSHOT_DIR": str(job.tmp / "snap")}, **server_env))
    out = str(job.tmp / "res")
    job.run_workers("lifecycle.py", ["--out", out, "--mode", "dist_sync", "--keys", json.dumps({KEY: {}}),
                                     "--rows", str(ROWS), "--dim", str(DIM), "--steps", str(STEPS),
                                     "--batch", str(BATCH), "--seed", str(SEED), "--fetch-chunk", "3000"],
                    timeout=240)
    return load(out, 0), job


def tables(snap, servers) -> dict:
    """Each server's rows at shutdown: ids, weights, optimizer states; both tiers (the rows of the snapshot's disk
    store, read independently of the server's code through the record layout, merged with the memory rows)."""
    out = {}
    for rank in range(servers):
        for key, table in checkpoint.load_snapshot(snap, rank).tables.items():
            ids, weights, states = table["row_ids"], table["weights"], list(table["states"])
            if table.get("disk") is not None:
                store = SegmentStore.open(table["disk"])
                disk_ids = store.row_ids()
                payload = store.get(disk_ids)
                ids = np.concatenate([ids, disk_ids])
                order = np.argsort(ids)
                ids, weights = ids[order], np.concatenate([weights, payload["w"]])[order]
                states = [np.concatenate([st, payload[f"s{i}"]])[order] for i, st in enumerate(states)]
            out[(rank, key)] = [np.asarray(ids).tobytes(), np.asarray(weights).tobytes()] + \
                [st.tobytes() for st in states]
    return out


@pytest.mark.parametrize("servers", [1, 2])
def test_rows_through_disk_and_back_match_the_in_memory_job(job_factory, tmp_path, servers):
    ref, ref_job = run_job(job_factory, f"memory-{servers}", servers, {})
    res, job = run_job(job_factory, f"tier-{servers}", servers,
                       dict(TIER_ENV, KVSTORE_LAZY_DISK_DIR=str(tmp_path / "disk")))
    assert res["rows3"].tolist() == ref["rows3"].tolist()           # the worker's listing: both tiers
    assert len(ref["rows3"]) > 10_000
    # a worker checkpoint's values and momentum (fetch_rows(states=True), 3000 rows a pull): both tiers, exact
    assert res["values3"].tobytes() == ref["values3"].tobytes() and res["state3"].tobytes() == ref["state3"].tobytes()
    assert tables(job.tmp / "snap", servers) == tables(ref_job.tmp / "snap", servers)
    demoted = promoted = on_disk = 0
    for rank in range(servers):
        m = STATS.search(job.log(f"server{rank}"))
        assert m, job.log(f"server{rank}")[-3000:]
        on_disk, promoted, demoted = on_disk + int(m.group(3)), promoted + int(m.group(4)), demoted + int(m.group(5))
        assert 0 < float(m.group(6)) <= 1
    assert on_disk > len(ref["rows3"]) // 2 and promoted > 1000 and demoted > on_disk


# fault_train.py: a (20000, 8) lazy key over 2 servers, SGD momentum; its Zipf ids fall mostly on rank 0
KILL_ENV = {"KVSTORE_LAZY_MEMORY_BUDGET": str(40 * 1024), "KVSTORE_LAZY_SNAPSHOT_DELTAS": "4"}


def test_killed_server_with_the_tier_recovers_bit_identical_to_memory(tmp_path):
    ref = tmp_path / "memory"
    outcome = faultjob.run(faultjob.make_job(ref), ref)
    assert outcome.code == 0, outcome.log[-5000:]
    out = tmp_path / "run"
    env = dict(KILL_ENV, KVSTORE_LAZY_DISK_DIR=str(tmp_path / "disk"))
    outcome = faultjob.run(faultjob.make_job(out, sleep=0.0, server_env=env), out,
                           fault=faultjob.kill_rank(0, delay=0.03), at_step=25)
    log = outcome.log
    assert outcome.code == 0, log[-6000:]
    assert "was killed by SIGKILL; restarting it" in log and "journaled requests replayed" in log
    assert "(delta)" in log, "periodic snapshots must be deltas (each with the disk tier's store)"
    assert faultjob.same_model(faultjob.final(out), faultjob.final(ref)), "the model differs from the memory run"
    assert faultjob.updates_lost(out) == 0
    assert tables(out / "snap", 2) == tables(ref / "snap", 2), "the servers' rows differ from the memory run"
    demoted = [int(m.group(1)) for m in re.finditer(r"demoted (\d+)", log)]
    assert demoted and max(demoted) > 100, "rows must go to disk on the killed server"
    assert faultjob.processes_left(outcome.job) == []


FULL_JOB = """
import json, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import faultjob
disk, out = Path(sys.argv[2]), Path(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + sys.argv[4], "tmpfs", str(disk)], check=True)
env = json.loads(sys.argv[5])
outcome = faultjob.run(faultjob.make_job(out, restart=0, server_env=env), out, timeout=120)
print(json.dumps({"code": outcome.code, "left": faultjob.processes_left(outcome.job)}))
"""


def private_mounts_work(where: Path) -> str | None:
    """None if this process may mount a tmpfs in a private mount namespace, else why not."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=64k",
                            "tmpfs", str(where)], capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"the kernel refuses a tmpfs in a private mount namespace: " \
                                               f"{probe.stderr.strip()}"


def test_a_full_disk_stops_the_job_with_an_error_naming_the_directory(tmp_path):
    disk, out = tmp_path / "tier", tmp_path / "run"
    disk.mkdir()
    why = private_mounts_work(disk)
    if why:
        pytest.skip(why)
    # segments of 256 records of 84 B (21 KiB) on a 64 KiB tmpfs: the third segment does not fit
    env = dict(KILL_ENV, KVSTORE_LAZY_DISK_DIR=str(disk), KVSTORE_LAZY_DISK_SEGMENT_ROWS="256")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", FULL_JOB,
                           str(Path(__file__).parent), str(disk), str(out), "64k", json.dumps(env)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    log = (out / "job.log").read_text()
    assert result["code"] == 4, log[-4000:]
    m = re.search(r"ERROR .*disk tier failed \(KVSTORE_LAZY_DISK_DIR=(\S+)\): .*(No space left on device|"
                  r"cannot create a segment).*stopping this server", log)
    assert m and m.group(1) == str(disk), log[-4000:]
    assert result["left"] == []
    assert not os.path.ismount(disk), "the tmpfs lived only in the job's mount namespace"
    for rank in range(2):            # what was written before is a good snapshot (nothing half-written)
        loaded = checkpoint.load_snapshot(out / "snap", rank)
        assert loaded is not None and loaded.tables


def test_a_server_restarted_on_a_damaged_segment_refuses_it(tmp_path):
    """The recovered server of a kill -9 finds its snapshot's disk tier damaged: it stops, naming the segment."""
    out = tmp_path / "run"
    env = dict(KILL_ENV, KVSTORE_LAZY_DISK_DIR=str(tmp_path / "disk"), KVSTORE_LAZY_DISK_SEGMENT_ROWS="256")

    def damage_then_kill(job, outcome):
        snap = out / "snap" / "rank0"
        deadline = time.monotonic() + 60          # a slow machine: the first snapshot with segments comes later
        while True:                               # committed snapshots only (no component starting with ".")
            segs = sorted(p for p in snap.rglob("seg-*.dat")
                          if not any(part.startswith(".") for part in p.relative_to(snap).parts))
            if segs or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert segs, "the snapshots hold no disk tier segment 60 s after step 40"
        for seg in segs:             # break the links: the snapshot's copies are damaged (a byte of every record)
            size = json.loads((seg.parent / "store.json").read_text())["record_bytes"]
            data = np.frombuffer(seg.read_bytes(), np.uint8).copy().reshape(-1, size)
            data[:, 20] ^= 0xFF
            seg.unlink()
            seg.write_bytes(data.tobytes())
        faultjob.kill_rank(0)(job, outcome)

    outcome = faultjob.run(faultjob.make_job(out, steps=2000, sleep=0.02, server_env=env), out,
                           fault=damage_then_kill,
                           at_step=40)
    log = outcome.log
    assert outcome.code == 4, log[-5000:]
    assert re.search(r"ERROR .*seg-\d+\.dat is damaged: record \d+ .*stopping this server", log), log[-5000:]
    assert faultjob.processes_left(outcome.job) == []
