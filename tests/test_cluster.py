"""Multi-host tests on network-namespace "hosts" (scripts/netns_cluster.sh): a lazy wide&deep job across them, the
ssh launcher across them, and the fault scenarios, each with a deadline and a check that no process is left:

- kill -9 a server mid-training: detected, restarted, it rejoins from its snapshot and journal, the job finishes
  with the same model as an undisturbed run (no update lost); without --restart-servers the job ends naming it;
- kill -9 a worker: the job ends with an error naming it;
- a worker's link down for 20 s: the job stalls, resumes and finishes with the same model;
- the whole job killed, then restarted from its last tagged checkpoint: same model.

Needs root and iproute2 (skipped otherwise). Run: ``pytest -m cluster tests/test_cluster.py``. A results table
(fault, time to detect, time to recover, updates lost) is printed at the end and written to
$KVSTORE_LAZY_FAULT_REPORT (default: cluster-faults.md in the test's temporary directory).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import faultjob
from cluster import netns_unavailable
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.launch import Job, NetnsPlacer, parse_netns_map

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns_cluster.sh"
# the tests' own namespaces, apart from a cluster made by hand (prefix kvl) and from other test runs
PREFIX = os.environ.get("KVL_TEST_NETNS_PREFIX") or f"kvlt{os.getpid() % 100000}"
HOSTS = ["sched", "server0", "server1", "worker0", "worker1"]


pytestmark = [pytest.mark.cluster, pytest.mark.integration,
              pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))]


def sh(*args: str, check: bool = True) -> str:
    env = dict(os.environ, KVL_NETNS_PREFIX=PREFIX)
    out = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"netns_cluster.sh {' '.join(args)}: {out.stdout}{out.stderr}")
    return out.stdout


def namespaces() -> list[str]:
    return [f"{PREFIX}-{h}" for h in HOSTS]


def link_bytes() -> dict[str, dict[str, int]]:
    """host -> {rx, tx, lo} bytes of its veth and loopback."""
    out = {}
    for line in sh("counters").splitlines()[1:]:
        host, _, rx, tx, lo = line.split()
        out[host] = {"rx": int(rx), "tx": int(tx), "lo": int(lo)}
    return out


@pytest.fixture(scope="module")
def cluster():
    sh("down")
    sh("up")
    sh("up")   # idempotent
    try:
        yield parse_netns_map(sh("map").strip())
    finally:
        sh("down")
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(line.split()[0].startswith(PREFIX + "-") for line in left.splitlines() if line.split())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    table: dict = {}
    yield table
    if table:
        path = Path(os.environ.get("KVSTORE_LAZY_FAULT_REPORT")
                    or tmp_path_factory.mktemp("report") / "cluster-faults.md")
        faultjob.write_report(table, path)
        sys.__stdout__.write(f"\n\nfault scenarios on network-namespace hosts (also in {path}):\n"
                             f"{faultjob.table(table)}\n")
        sys.__stdout__.flush()


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """fault_train.py undisturbed on the namespace hosts: what every fault scenario must end with."""
    out = tmp_path_factory.mktemp("reference")
    outcome = faultjob.run(faultjob.make_job(out, placer=NetnsPlacer(cluster)), out)
    assert outcome.code == 0, outcome.log[-6000:]
    assert faultjob.updates_lost(out) == 0
    assert faultjob.processes_left(outcome.job, namespaces()) == []
    return faultjob.final(out)


def placer(cluster) -> NetnsPlacer:
    return NetnsPlacer(cluster)


# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_wide_deep_lazy_job_across_hosts(cluster, tmp_path):
    """The demo's lazy wide&deep job with scheduler, 2 servers and 2 workers each on its own host: it finishes, the
    veth counters show the traffic crossed the hosts, and the rows the servers stored equal the rows the workers
    used."""
    before = link_bytes()
    snap, run = tmp_path / "snap", tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "wide_deep.py"), "--server", "lazy", "--out", str(run),
               "--dims", "200000,100000,50000,10000", "--emb-dim", "8", "--steps", "40", "--batch", "256"]
    job = Job(command, 2, 2, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
              server_env={"KVSTORE_LAZY_SNAPSHOT_DIR": str(snap)}, out=faultjob.Log(tmp_path / "job.log"),
              placer=placer(cluster))
    job.start()
    code = job.supervise(300)
    log = job.out.text()
    job.out.close()
    assert code == 0, log[-6000:]
    assert faultjob.processes_left(job, namespaces()) == []
    after = link_bytes()
    delta = {h: {k: after[h][k] - before[h][k] for k in ("rx", "tx", "lo")} for h in HOSTS}
    for host in ("server0", "server1", "worker0", "worker1"):
        assert delta[host]["tx"] > 1_000_000 and delta[host]["rx"] > 1_000_000, (host, delta)
        assert delta[host]["lo"] < 100_000, (host, delta)   # ZeroMQ's connection of a node to itself only
    assert delta["sched"]["rx"] > 5_000
    # every node really was on its own host
    hosts = {n.name: n.placement.host for n in job.history}
    assert len(set(hosts.values())) == 5, hosts
    # rows stored (the servers' snapshots at shutdown) == rows seen (the union of the ids the workers used)
    result = json.loads((run / "result.json").read_text())
    assert result["ckpt_problems"] == []
    dims = result["dims"]
    seen = [np.unique(np.concatenate([np.load(run / f"seen.rank{r}.npz")[f"f{f}"] for r in range(2)]))
            for f in range(len(dims))]
    stored: dict[int, int] = {}
    for rank in range(2):
        for key, info in checkpoint.read_manifest(snap, rank)["keys"].items():
            if info["kind"] == "row_sparse":
                stored[int(key)] = stored.get(int(key), 0) + info["rows"]
    for f in range(len(dims)):
        assert stored[100 + f] == len(seen[f]), (f, stored, len(seen[f]))   # embedding rows
        assert stored[200 + f] == len(seen[f]), (f, stored, len(seen[f]))   # wide rows
    print(f"wide&deep across hosts: link bytes {delta}; rows stored {stored}")


@pytest.mark.timeout(300)
def test_ssh_launcher_across_hosts(cluster, reference, tmp_path):
    """--launcher ssh -H hostfile with the hosts' addresses (a stand-in ssh enters the host's namespace): the same
    model as the netns launcher gives."""
    addresses = {h: sh("addr", h).strip() for h in HOSTS}
    hostfile = tmp_path / "hosts"
    hostfile.write_text("\n".join(addresses[h] for h in ("server0", "server1", "worker0", "worker1")) + "\n")
    out = tmp_path / "run"
    out.mkdir()
    fake_ssh = shlex.join([sys.executable, str(ROOT / "tests" / "fake_ssh.py")])
    env = dict(os.environ, **faultjob.FAULT_ENV, FAKE_SSH_LOG=str(tmp_path / "ssh.log"))
    proc = subprocess.run([sys.executable, "-m", "kvstore_lazy.launch", "--launcher", "ssh", "-H", str(hostfile),
                           "--ssh-command", fake_ssh, "--scheduler-host", addresses["sched"], "-n", "2", "-s", "2",
                           "--env", "PYTHONPATH", "--env", "OMP_NUM_THREADS", "--timeout", "200",
                           sys.executable, str(ROOT / "tests" / "workers" / "fault_train.py"), "--out", str(out),
                           "--steps", str(faultjob.STEPS), "--sleep", "0.1"],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    calls = [json.loads(line) for line in (tmp_path / "ssh.log").read_text().splitlines()]
    assert sorted(c["netns"] for c in calls) == sorted(f"{PREFIX}-{h}" for h in HOSTS)
    assert faultjob.same_model(faultjob.final(out), reference)
    for ns in namespaces():
        assert subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split() == []


def check_server_restarted(outcome, server: str, out, reference, results, row: str, when: str) -> None:
    """What both server-restart scenarios must show, and their row of the faults table: the job finished, the server
    rejoined from its snapshot and journal, the model is bit-identical to the uninterrupted run with no update lost,
    the death was noticed within 1 s and recovery took under 30 s, and no process is left."""
    log = outcome.log
    assert outcome.code == 0, log[-6000:]
    assert "recovered rank" in log
    same = faultjob.same_model(faultjob.final(out), reference)
    lost = faultjob.updates_lost(out)
    detect = outcome.event("exited", server) - outcome.fault_mono
    recover = outcome.recovered_after(outcome.fault_wall)
    replay = next(line for line in log.splitlines() if "recovered rank" in line)
    results[row] = dict(
        outcome=f"restarted, rejoined, job finished (exit {outcome.code}); model bit-identical: {same}",
        detect=detect, recover=recover, lost=lost, notes=when + replay.split("INFO ")[-1].split(": ", 1)[-1])
    assert same and lost == 0
    assert detect < 1.0 and recover < 30
    assert faultjob.processes_left(outcome.job, namespaces()) == []


@pytest.mark.timeout(300)
def test_server_killed_is_restarted_and_nothing_is_lost(cluster, reference, results, tmp_path):
    out = tmp_path / "run"
    outcome = faultjob.run(faultjob.make_job(out, placer=placer(cluster)), out, fault=faultjob.kill("server 0"),
                           at_step=20, timeout=200)
    check_server_restarted(outcome, "server 0", out, reference, results, "kill -9 server (--restart-servers)",
                           f"killed between steps (after step {outcome.fault_step}); ")
    assert "server 0 (pid" in outcome.log
    # the launcher names the node by start order and, once known, by its ps-lite rank
    assert re.search(rf"in netns {PREFIX}-server0(, rank \d+)?\) was killed by SIGKILL; restarting it", outcome.log)


@pytest.mark.timeout(300)
def test_server_killed_under_traffic_is_restarted_and_nothing_is_lost(cluster, reference, results, tmp_path):
    """As above, but with no pause between steps and the kill 30 ms after a step: requests die in the server's
    socket buffers and rounds are half-done; the workers re-send (PS_RESEND) what the journal did not get."""
    out = tmp_path / "run"
    outcome = faultjob.run(faultjob.make_job(out, placer=placer(cluster), sleep=0.0), out,
                           fault=faultjob.kill("server 1", delay=0.03), at_step=30, timeout=200)
    check_server_restarted(outcome, "server 1", out, reference, results,
                           "kill -9 server under traffic (--restart-servers)",
                           f"killed 30 ms after step {outcome.fault_step}, no pause between steps; recovery waits for "
                           f"the workers' PS_RESEND (3 s timeout); ")


@pytest.mark.timeout(300)
def test_server_killed_without_restart_ends_the_job(cluster, results, tmp_path):
    out = tmp_path / "run"
    outcome = faultjob.run(faultjob.make_job(out, placer=placer(cluster), restart=0), out,
                           fault=faultjob.kill("server 1"), at_step=20, timeout=200)
    assert outcome.code == 128 + 9, outcome.log[-4000:]
    assert "ERROR: server 1 (pid" in outcome.log and "was killed by SIGKILL; stopping the job" in outcome.log
    detect = outcome.event("failed", "server 1") - outcome.fault_mono
    ended = outcome.ended_mono - outcome.fault_mono
    results["kill -9 server (no restart)"] = dict(
        outcome=f"job ended, exit {outcome.code}, error names server 1", detect=detect, recover=None, lost=None,
        notes=f"every process stopped {ended:.2f} s after the kill")
    assert detect < 1.0 and ended < 10
    assert faultjob.processes_left(outcome.job, namespaces()) == []


@pytest.mark.timeout(300)
def test_worker_killed_ends_the_job_naming_it(cluster, results, tmp_path):
    out = tmp_path / "run"
    outcome = faultjob.run(faultjob.make_job(out, placer=placer(cluster)), out, fault=faultjob.kill("worker 1"),
                           at_step=20, timeout=200)
    assert outcome.code == 128 + 9, outcome.log[-4000:]
    line = next(line for line in outcome.log.splitlines() if "ERROR:" in line)
    assert "worker 1 (pid" in line and f"{PREFIX}-worker1" in line and "killed by SIGKILL" in line
    detect = outcome.event("failed", "worker 1") - outcome.fault_mono
    ended = outcome.ended_mono - outcome.fault_mono
    results["kill -9 worker"] = dict(outcome=f"job ended, exit {outcome.code}: '{line.split('] ', 1)[1]}'",
                                     detect=detect, recover=None, lost=None,
                                     notes=f"every process stopped {ended:.2f} s after the kill")
    assert detect < 1.0 and ended < 10
    assert faultjob.processes_left(outcome.job, namespaces()) == []


@pytest.mark.timeout(300)
def test_link_down_20s_then_the_job_resumes(cluster, reference, results, tmp_path):
    out = tmp_path / "run"
    times = {}

    def link_down(job, outcome):
        sh("link", "worker1", "down")
        times["down"] = time.time()
        time.sleep(20)
        sh("link", "worker1", "up")
        times["up"] = time.time()

    try:
        outcome = faultjob.run(faultjob.make_job(out, placer=placer(cluster)), out, fault=link_down, at_step=20,
                               timeout=200)
    finally:
        sh("link", "worker1", "up")
    assert outcome.code == 0, outcome.log[-6000:]
    same = faultjob.same_model(faultjob.final(out), reference)
    lost = faultjob.updates_lost(out)
    steps = faultjob.progress(out)
    stalled = [(s, t) for s, t in steps if times["down"] < t < times["up"]]
    resumed = outcome.first_step_after(times["up"])
    results["link of worker 1 down 20 s"] = dict(
        outcome=f"stalled, resumed, job finished (exit {outcome.code}); model bit-identical: {same}",
        detect=None, recover=resumed, lost=lost,
        notes=f"steps finished while down: {len(stalled)}; time to recover counted from the link coming back")
    assert same and lost == 0
    assert len(stalled) <= 1   # at most the step already in flight
    assert resumed is not None and resumed < 15
    assert faultjob.processes_left(outcome.job, namespaces()) == []


@pytest.mark.timeout(400)
def test_whole_job_restarts_from_its_last_checkpoint(cluster, reference, results, tmp_path):
    out = tmp_path / "run"
    first = faultjob.run(faultjob.make_job(out, placer=placer(cluster), restart=0, checkpoint_every=10), out,
                         fault=faultjob.kill("worker 0"), at_step=25, timeout=200)
    assert first.code == 128 + 9, first.log[-4000:]
    assert faultjob.processes_left(first.job, namespaces()) == []
    tag = checkpoint.common_tag(out / "snap", 2)
    assert tag["step"] <= first.fault_step
    restart = time.time()
    second = faultjob.run(faultjob.make_job(out, placer=placer(cluster), restart=0, checkpoint_every=10,
                                            resume=True, log_name="job2.log"), out, timeout=200)
    assert second.code == 0, second.log[-6000:]
    same = faultjob.same_model(faultjob.final(out), reference)
    lost = faultjob.updates_lost(out)
    first_step = next(t for s, t in faultjob.progress(out) if t > restart) - restart
    results["whole job killed, restarted from its last checkpoint"] = dict(
        outcome=f"resumed after step {tag['step']}, finished (exit {second.code}); model bit-identical: {same}",
        detect=None, recover=first_step, lost=lost,
        notes=f"killed after step {first.fault_step}; {first.fault_step - tag['step']} steps redone; time to recover "
              f"= from the restart to its first step (processes start, snapshots load)")
    assert same and lost == 0
    assert "kv.init push from worker 0 is dropped" in second.log and "keeping its states and counts" in second.log
    assert faultjob.processes_left(second.job, namespaces()) == []
