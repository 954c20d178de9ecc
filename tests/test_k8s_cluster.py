"""What Kubernetes does to a job, emulated on network-namespace hosts (scripts/netns_cluster.sh), as
docker/k8s/base deploys it:

- every node is reached by a DNS name that resolves through /etc/netns/<ns>/hosts (cluster DNS): the stock
  scheduler at ``kvl-scheduler`` with DMLC_USE_KUBERNETES=1 (so it binds 0.0.0.0), the lazy servers at their
  StatefulSet names ``kvl-server-<i>.kvl-server``, all on the same PORT, bound to 0.0.0.0 (KVSTORE_LAZY_BIND) and
  advertising the name; the stock workers advertise their own addresses, as pods of an Indexed Job do;
- each server "pod" has a snapshot volume of its own (a volumeClaimTemplates PVC: a directory named after the pod),
  the same environment at every start (KVSTORE_LAZY_RECOVERY=auto), and a readiness probe
  (``python -m kvstore_lazy.server --ready``, with KVSTORE_LAZY_STATUS_FILE);
- a server pod is killed and re-created by its "StatefulSet": its namespace is deleted, and after the first
  crash-loop back-off (10 s) the server starts again in a NEW namespace with a NEW address, the name re-pointed at
  it on every host. It rejoins, and the job ends bit-identical to an undisturbed run with no update lost;
- a server pod that does not come back: the stock workers give up after 10 x PS_RESEND_TIMEOUT (measured here; it
  is the rejoin window the docs state).

Needs root and iproute2 (skipped otherwise). Part of ``make test-cluster``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import faultjob
from cluster import netns_unavailable
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.node import placement as lifecycle
from kvstore_lazy.launch import Job, NetnsPlacement, NetnsPlacer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns_cluster.sh"
PREFIX = os.environ.get("KVL_K8S_NETNS_PREFIX") or f"kvlk{os.getpid() % 100000}"
SUBNET = os.environ.get("KVL_K8S_SUBNET", "10.213.58")
SCHEDULER = "kvl-scheduler"                                   # the scheduler's headless Service
SERVERS = ["kvl-server-0.kvl-server", "kvl-server-1.kvl-server"]   # <pod>.<governing headless Service>
SCHEDULER_PORT, SERVER_PORT = 9091, 9100
RESEND_MS = 3000
BACKOFF = 10.0          # s: the kubelet's first crash-loop back-off
# What docker/k8s/base/kustomization's ConfigMap and the server StatefulSet set (the numbers of the dev overlay's
# resend timeout aside: 3 s here, so that the window test takes 30 s)
K8S_ENV = {"DMLC_USE_KUBERNETES": "1", "PS_RESEND": "1", "PS_RESEND_TIMEOUT": str(RESEND_MS)}
SERVER_ENV = {"KVSTORE_LAZY_BIND": "0.0.0.0", "PORT": str(SERVER_PORT), "KVSTORE_LAZY_JOURNAL": "1",
              "KVSTORE_LAZY_RECOVERY": "auto", "KVSTORE_LAZY_SNAPSHOT_INTERVAL": "1",
              "KVSTORE_LAZY_SNAPSHOT_SCOPE": "server"}
# the pod's volumes: its PVC (snapshots) and its container's /tmp (the status file), keyed by the pod's name
POD_COMMAND = ["sh", "-c", 'exec env KVSTORE_LAZY_SNAPSHOT_DIR="$KVL_PODS/$DMLC_NODE_HOST/pvc" '
               'KVSTORE_LAZY_STATUS_FILE="$KVL_PODS/$DMLC_NODE_HOST/status.json" "$0" -m kvstore_lazy.server',
               sys.executable]


pytestmark = [pytest.mark.cluster, pytest.mark.integration,
              pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))]


def sh(*args: str) -> str:
    env = dict(os.environ, KVL_NETNS_PREFIX=PREFIX, KVL_SUBNET=SUBNET)
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"netns_cluster.sh {' '.join(args)}: {out.stdout}{out.stderr}")
    return out.stdout


def in_netns(host: str, *argv: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{host}", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cluster():
    sh("down")
    sh("up")
    sh("dns", SCHEDULER, "sched")
    for i, name in enumerate(SERVERS):
        sh("dns", name, f"server{i}")
    try:
        yield
    finally:
        sh("down")
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(line.split()[0].startswith(PREFIX + "-") for line in left.splitlines() if line.split())
        assert not any(p.name.startswith(PREFIX + "-") for p in Path("/etc/netns").glob("*"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    table: dict = {}
    yield table
    if table:
        path = tmp_path_factory.mktemp("report") / "k8s-faults.md"
        faultjob.write_report(table, path)
        sys.__stdout__.write(f"\n\nKubernetes-like scenarios on network-namespace hosts (also in {path}):\n"
                             f"{faultjob.table(table)}\n")
        sys.__stdout__.flush()


class PodJob(Job):
    """fault_train.py laid out as docker/k8s/base lays out a job. A server that dies is a deleted pod: its namespace
    goes; with `recreate_after` seconds its StatefulSet starts it again under the same name, in a new namespace
    with a new address (the DNS name re-pointed at it), with the same environment; with None it never comes back."""

    def __init__(self, out: Path, recreate_after: float | None = BACKOFF) -> None:
        pods = out / "pods"
        mapping = {"scheduler": f"{PREFIX}-sched@{SCHEDULER}", "worker0": f"{PREFIX}-worker0",
                   "worker1": f"{PREFIX}-worker1"}
        mapping.update({f"server{i}": f"{PREFIX}-server{i}@{name}" for i, name in enumerate(SERVERS)})
        command = [sys.executable, str(ROOT / "tests" / "workers" / "fault_train.py"), "--out", str(out),
                   "--steps", str(faultjob.STEPS), "--sleep", "0.1"]
        env = dict(faultjob.FAULT_ENV, **K8S_ENV, KVL_PODS=str(pods))
        super().__init__(command, 2, 2, env=env, server_env=dict(SERVER_ENV), out=faultjob.Log(out / "job.log"),
                         placer=NetnsPlacer(mapping, port=SCHEDULER_PORT), server_command=POD_COMMAND,
                         restart_servers=1)
        self._fixed_server_ports = False   # every server pod has the same PORT (SERVER_ENV), as in a StatefulSet
        self.pods = pods
        self.recreate_after = recreate_after
        self.recreated: dict[str, tuple[float, str]] = {}    # pod name -> (monotonic time, new namespace host)

    def restart(self, node):
        host = node.placement.namespace[len(PREFIX) + 1:]
        name = node.placement.host
        sh("del", host)
        self.say(f"pod {name} deleted (netns {node.placement.namespace} gone)")
        if self.recreate_after is None:
            return node
        time.sleep(self.recreate_after)
        new_host = f"{host}b"
        sh("add", new_host, str(40 + node.rank))
        sh("dns", name, new_host)
        placement = NetnsPlacement(name, namespace=f"{PREFIX}-{new_host}")
        fresh = self._spawn(node.role, node.rank, placement, node.argv, dict(node.env), node.incarnation + 1)
        fresh.restarts, fresh.ps_rank = node.restarts + 1, node.ps_rank   # same name and port, same rank
        self.nodes[self.nodes.index(node)] = fresh
        self.recreated[name] = (time.monotonic(), new_host)
        self._event("restarted", fresh, f"pid {fresh.pid}")
        self.say(f"pod {name} re-created in netns {placement.namespace} at {sh('addr', new_host).strip()}")
        return fresh

    def volume(self, name: str) -> Path:
        return self.pods / name / "pvc"

    def status_file(self, name: str) -> str:
        return str(self.pods / name / "status.json")


class Prober(threading.Thread):
    """The kubelet's readiness probe of every server pod, every 0.2 s: (monotonic time, pod, ready)."""

    def __init__(self, job: PodJob) -> None:
        super().__init__(daemon=True)
        self.job = job
        self.seen: list[tuple[float, str, bool]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            for name in SERVERS:
                self.seen.append((time.monotonic(), name, lifecycle.check_ready(self.job.status_file(name))[0]))

    def ready_after(self, name: str, t: float) -> float | None:
        return next((s for s, n, r in self.seen if n == name and r and s > t), None)

    def not_ready_between(self, name: str, a: float, b: float) -> bool:
        return any(n == name and not r and a < s < b for s, n, r in self.seen)


def put_server0_back() -> None:
    """The first server's original host and name, for the scenario after this one."""
    sh("add", "server0", "20")
    sh("dns", SERVERS[0], "server0")


def updates_lost(job: PodJob) -> int:
    """Rounds some (server, key) did not apply, from the final snapshots on each pod's own volume."""
    lost = 0
    for name in SERVERS:
        ranks = sorted(int(p.parent.name[4:]) for p in job.volume(name).glob("rank*/manifest.json"))
        assert len(ranks) == 1, (name, ranks)       # one pod, one rank
        manifest = checkpoint.read_manifest(job.volume(name), ranks[0])
        lost += sum(faultjob.STEPS - int(n) for n in manifest["server"]["optimizer_counts"]["counts"].values())
    return lost


def ranks_of(job: PodJob) -> dict[str, int]:
    return {name: json.loads(next(job.volume(name).glob("node.rank*.json")).read_text())["rank"]
            for name in SERVERS}


def listening(host: str) -> set[str]:
    return {line.split()[3] for line in in_netns(host, "ss", "-ltnH").stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The undisturbed job in the Kubernetes layout: names, 0.0.0.0 binds, per-pod volumes, readiness."""
    out = tmp_path_factory.mktemp("k8s-reference")
    job = PodJob(out)
    prober = Prober(job)
    prober.start()
    checks = {}

    def look(job_, outcome):
        checks["sched"] = listening("sched")
        checks["servers"] = [listening(f"server{i}") for i in range(2)]
        # the kubelet's tcpSocket probe of the scheduler, by its name, from a worker's host
        checks["tcp"] = in_netns("worker0", sys.executable, "-c",
                                 f"import socket; socket.create_connection(('{SCHEDULER}', {SCHEDULER_PORT}), 5)"
                                 f".close(); print('connected')").stdout.strip()
        probe_env = dict(os.environ, KVSTORE_LAZY_STATUS_FILE=job.status_file(SERVERS[0]))
        checks["probe"] = in_netns("server0", sys.executable, "-m", "kvstore_lazy.server", "--ready", env=probe_env)

    outcome = faultjob.run(job, out, fault=look, at_step=10, timeout=200)
    prober.done.set()
    assert outcome.code == 0, outcome.log[-6000:]
    assert f"0.0.0.0:{SCHEDULER_PORT}" in checks["sched"], checks      # DMLC_USE_KUBERNETES=1
    assert all(f"0.0.0.0:{SERVER_PORT}" in s for s in checks["servers"]), checks   # KVSTORE_LAZY_BIND
    assert checks["tcp"] == "connected"
    assert checks["probe"].returncode == 0 and checks["probe"].stdout.startswith("ready: server rank"), checks
    # the scheduler sorts hosts in descending order: the pod with the greater name is rank 0, not its ordinal
    assert ranks_of(job) == {SERVERS[0]: 1, SERVERS[1]: 0}
    assert updates_lost(job) == 0
    for name in SERVERS:
        assert prober.ready_after(name, 0) is not None, name
        assert not lifecycle.check_ready(job.status_file(name))[0]   # stopped at the end
        record = json.loads(next(job.volume(name).glob("node.rank*.json")).read_text())
        assert record["host"] == name and record["state"] == "finished"
    assert faultjob.processes_left(job, [f"{PREFIX}-{h}" for h in ("sched", "server0", "server1")]) == []
    return faultjob.final(out)


@pytest.mark.timeout(420)
def test_server_pod_recreated_with_a_new_ip_rejoins_by_name(cluster, reference, results, tmp_path):
    """Training resumes about a second after the new pod starts. The stock workers' exit then waits until their
    kernels give up the connect to the old address they were trying (tcp_syn_retries, ~130 s): ZeroMQ keeps the
    socket the rejoined server made them replace until its queued messages are out (node_lifecycle docstring)."""
    out = tmp_path / "run"
    out.mkdir()
    job = PodJob(out, recreate_after=BACKOFF)
    prober = Prober(job)
    prober.start()
    old_ip = sh("addr", "server0").strip()
    try:
        outcome = faultjob.run(job, out, fault=faultjob.kill("server 0"), at_step=20, timeout=330)
    finally:
        prober.done.set()
        put_server0_back()
    log = outcome.log
    assert outcome.code == 0, log[-6000:]
    name = SERVERS[0]
    recreated_at, new_host = job.recreated[name]
    new_ip = sh("addr", new_host).strip()
    assert new_ip != old_ip
    assert "KVSTORE_LAZY_RECOVERY=auto:" in log and "within the 30s rejoin window; rejoining its job" in log
    assert "recovered rank 1" in log
    assert f"told 2 workers this server is at {sh('addr', new_host).strip()}:{SERVER_PORT}" in log
    same = faultjob.same_model(faultjob.final(out), reference)
    lost = updates_lost(job)
    ready_again = prober.ready_after(name, recreated_at)
    assert prober.not_ready_between(name, outcome.fault_mono, recreated_at)
    assert ready_again is not None
    recover = outcome.recovered_after(outcome.fault_wall)
    resumed = outcome.first_step_after(time.time() - (time.monotonic() - recreated_at))
    exited = max(t for t, what, n, _ in job.events if what == "exited" and n.startswith("worker")) - outcome.fault_mono
    results["server pod deleted, re-created with a new IP after 10 s"] = dict(
        outcome=f"rejoined by name ({old_ip} -> {new_ip}), job finished (exit {outcome.code}); model "
                f"bit-identical: {same}", detect=None, recover=recover, lost=lost,
        notes=f"time to recover counted from the kill (10 s of it is the back-off); first step {resumed:.2f} s after "
              f"the new pod started, Ready {ready_again - recreated_at:.2f} s after; workers exited {exited:.0f} s "
              f"after the kill (their old sockets' connects time out)")
    assert same and lost == 0
    assert recover is not None and recover < 10 * RESEND_MS / 1000
    assert ranks_of(job) == {SERVERS[0]: 1, SERVERS[1]: 0}
    assert faultjob.processes_left(job, [f"{PREFIX}-{new_host}"]) == []


@pytest.mark.timeout(300)
def test_server_pod_that_stays_away_past_the_window_fails_the_job(cluster, results, tmp_path):
    """How long a stock worker with PS_RESEND waits for a dead server: ~10 x PS_RESEND_TIMEOUT, then SIGABRT."""
    out = tmp_path / "run"
    out.mkdir()
    job = PodJob(out, recreate_after=None)
    try:
        outcome = faultjob.run(job, out, fault=faultjob.kill("server 0"), at_step=20, timeout=120)
    finally:
        put_server0_back()
    assert outcome.code == 128 + 6, outcome.log[-6000:]
    aborted = min(t for t, what, name, detail in job.events
                  if what == "exited" and name.startswith("worker") and t > outcome.fault_mono)
    waited = aborted - outcome.fault_mono
    timeout = RESEND_MS / 1000
    results["server pod gone for good (PS_RESEND_TIMEOUT 3 s)"] = dict(
        outcome=f"stock workers abort (SIGABRT), job fails (exit {outcome.code})", detect=waited, recover=None,
        lost=None, notes=f"a worker aborted {waited:.1f} s after the kill = {waited / timeout:.1f} x "
                         f"PS_RESEND_TIMEOUT: the rejoin window")
    assert 9 * timeout <= waited <= 13 * timeout, waited
    assert "Timeout to get the ACK message" in outcome.log
