"""kvstore_lazy.node.placement: bind vs advertise, the status file and ``--ready`` probe, the rejoin-or-register
decision,
whose snapshot a server may load, and the ADD_NODE a rejoined server sends its workers. The last test runs real
stock scheduler and workers on 127.0.0.1: two servers with a snapshot volume each, restarted with their ports
swapped, so the scheduler's sort gives each the other's rank; both refuse, naming why."""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from cluster import PYTHON, ROOT, free_port
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.node import membership
from kvstore_lazy.node import placement as lifecycle
from kvstore_lazy.node.placement import LifecycleError
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.protocol.pbmeta import ADD_NODE, SERVER
from kvstore_lazy.node.runtime import Config, StartupError, membership_path

BASE = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "kvl-scheduler", "DMLC_PS_ROOT_PORT": "9091",
        "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "2"}


def test_bind_address_is_the_advertised_ip_or_kvstore_lazy_bind():
    assert lifecycle.bind_address({}, "10.0.0.5") == "10.0.0.5"        # as a stock ps-lite server
    for value in ("", "*", "0.0.0.0", " 0.0.0.0 "):
        assert lifecycle.bind_address({"KVSTORE_LAZY_BIND": value}, "kvl-server-0.kvl-server") == "0.0.0.0"
    assert lifecycle.bind_address({"KVSTORE_LAZY_BIND": "10.0.0.7"}, "name") == "10.0.0.7"
    assert lifecycle.bind_address({"KVSTORE_LAZY_BIND": "lo"}, "name") == "lo"      # an interface of this host
    with pytest.raises(LifecycleError, match="DMLC_NODE_HOST='kvl-server-0.kvl-server' is a DNS name"):
        lifecycle.bind_address({}, "kvl-server-0.kvl-server")
    with pytest.raises(LifecycleError, match="KVSTORE_LAZY_BIND='nonsense.example'"):
        lifecycle.bind_address({"KVSTORE_LAZY_BIND": "nonsense.example"}, "x")


def test_config_binds_one_address_and_advertises_another():
    named = dict(BASE, DMLC_NODE_HOST="kvl-server-1.kvl-server", PORT="9100")
    with pytest.raises(StartupError, match="is a DNS name, which ZeroMQ cannot bind"):
        Config.from_env(named)
    cfg = Config.from_env(dict(named, KVSTORE_LAZY_BIND="0.0.0.0"))
    assert (cfg.host, cfg.bind, cfg.port) == ("kvl-server-1.kvl-server", "0.0.0.0", 9100)
    assert Config.from_env(dict(BASE, DMLC_NODE_HOST="10.1.2.3")).bind == ""    # unset: bind what is advertised
    with pytest.raises(StartupError, match="KVSTORE_LAZY_BIND='bogus'"):
        Config.from_env(dict(named, KVSTORE_LAZY_BIND="bogus"))
    # recovery "auto": needs PS_RESEND (like --restart-servers) and the journal; its window is 10 resend timeouts
    auto = dict(named, KVSTORE_LAZY_BIND="0.0.0.0", KVSTORE_LAZY_RECOVERY="auto", KVSTORE_LAZY_JOURNAL="1",
                KVSTORE_LAZY_SNAPSHOT_DIR="/s")
    with pytest.raises(StartupError, match="auto needs PS_RESEND=1"):
        Config.from_env(auto)
    cfg = Config.from_env(dict(auto, PS_RESEND="1", PS_RESEND_TIMEOUT="10000"))
    assert cfg.recovery == "auto" and cfg.rejoin_window == 100.0
    assert Config.from_env(dict(auto, PS_RESEND="1", KVSTORE_LAZY_REJOIN_WINDOW="45")).rejoin_window == 45.0
    with pytest.raises(StartupError, match="KVSTORE_LAZY_REJOIN_WINDOW='soon'"):
        Config.from_env(dict(auto, PS_RESEND="1", KVSTORE_LAZY_REJOIN_WINDOW="soon"))
    with pytest.raises(StartupError, match="needs KVSTORE_LAZY_JOURNAL"):
        Config.from_env(dict(auto, PS_RESEND="1", KVSTORE_LAZY_JOURNAL="0"))


def probe(path) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "kvstore_lazy.server", "--ready", str(path)], capture_output=True,
                          text=True, timeout=30, cwd=str(ROOT))


def test_status_file_and_ready_probe(tmp_path):
    path = tmp_path / "status.json"
    assert lifecycle.check_ready(None)[0] is False
    assert "does not exist yet" in lifecycle.check_ready(str(path))[1]
    status = lifecycle.StatusFile(str(path))
    status.write("starting", host="h", port=1)
    assert lifecycle.check_ready(str(path)) == (False, f"server process {os.getpid()} is starting, not serving yet")
    status.write("serving", rank=1, node_id=10, host="kvl-server-0.kvl-server", port=9100)
    ready, why = lifecycle.check_ready(str(path))
    assert ready and why.startswith("server rank 1 (node 10) serving as kvl-server-0.kvl-server:9100")
    lifecycle.StatusFile(None).write("serving")          # no file configured: nothing written, no error
    # the same pid with another start time is another process (a restarted container counts pids from 1 again)
    record = path.read_text().replace(f'"start_time": {status.started}', f'"start_time": {status.started + 1}')
    path.write_text(record)
    assert "no longer running" in lifecycle.check_ready(str(path))[1]
    # the probe command, against a live and then a dead process
    writer = subprocess.Popen([PYTHON, "-c", "import sys, time; from kvstore_lazy.node import placement as lifecycle; "
                               "lifecycle.StatusFile(sys.argv[1]).write('serving', rank=0); print('ok', flush=True); "
                               "time.sleep(60)", str(path)], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        assert writer.stdout.readline().strip() == "ok"
        out = probe(path)
        assert out.returncode == 0 and out.stdout.startswith("ready: server rank 0"), out
    finally:
        writer.kill()
        writer.wait(timeout=10)
        writer.stdout.close()
    out = probe(path)
    assert out.returncode == 1 and "no longer running" in out.stdout
    out = subprocess.run([PYTHON, "-m", "kvstore_lazy.server", "--ready"], capture_output=True, text=True,
                         timeout=30, cwd=str(ROOT), env={k: v for k, v in os.environ.items()
                                                         if k != lifecycle.STATUS_ENV})
    assert out.returncode == 1 and "KVSTORE_LAZY_STATUS_FILE is not set" in out.stdout


def test_rejoin_decision(tmp_path):
    path = tmp_path / "node.rank1.json"
    path.write_text("{}")
    assert lifecycle.rejoin_decision(None, None, 30)[0] is False
    assert lifecycle.rejoin_decision({"rank": 1, "state": "finished"}, path, 30) == \
        (False, f"{path}: the previous server passed its job's final barrier; a new job, registering")
    rejoin, why = lifecycle.rejoin_decision({"rank": 1, "state": "running"}, path, 30)
    assert rejoin and "within the 30s rejoin window" in why
    os.utime(path, (time.time() - 100, time.time() - 100))
    rejoin, why = lifecycle.rejoin_decision({"rank": 1, "state": "running"}, path, 30)
    assert not rejoin and "last alive 100s ago, past the 30s" in why
    assert lifecycle.rejoin_decision({"rank": 1}, tmp_path / "gone.json", 30)[0] is False
    lifecycle.touch(path)
    assert lifecycle.rejoin_decision({"rank": 1, "state": "running"}, path, 30)[0] is True


def snapshot(directory, rank, num_servers, host, port, rows=3):
    table = {"row_ids": np.arange(rows, dtype=np.uint64), "weights": np.ones((rows, 2), np.float32),
             "states": [], "meta": {"kind": "row_sparse"}}
    writer = None if host is None else lifecycle.writer_of(host, port)
    checkpoint.write_snapshot(directory, rank, num_servers, {3: table}, {}, writer=writer)


def test_a_server_refuses_a_snapshot_that_is_not_its_own(tmp_path):
    a, b = ("kvl-server-0.kvl-server", 9100), ("kvl-server-1.kvl-server", 9100)
    check = lifecycle.check_snapshot_owner
    assert lifecycle.snapshot_scope({}) == "job" and lifecycle.snapshot_scope({lifecycle.SCOPE_ENV: "server"}) == \
        "server"
    with pytest.raises(LifecycleError, match="KVSTORE_LAZY_SNAPSHOT_SCOPE='pod'"):
        lifecycle.snapshot_scope({lifecycle.SCOPE_ENV: "pod"})
    # its own volume, its own rank: loads
    own = tmp_path / "own"
    snapshot(own, 1, 2, *a)
    check(own, 1, *a, "server")
    assert checkpoint.read_manifest(own, 1)["writer"] == {"host": a[0], "port": 9100}
    # its volume holds another rank (the sort gave it a new one): refused, not started empty
    with pytest.raises(LifecycleError, match=r"made kvl-server-0.kvl-server:9100 server rank 0, but its own volume "
                                             r".* holds the snapshot of rank 1 \(written by "
                                             r"kvl-server-0.kvl-server:9100\) and none of rank 0"):
        check(own, 0, *a, "server")
    # a volume another server wrote (a PVC that moved, a changed name or port): refused
    with pytest.raises(LifecycleError, match="was written by kvl-server-0.kvl-server:9100, not by this server "
                                             r"\(kvl-server-1.kvl-server:9100, now rank 1\)"):
        check(own, 1, *b, "server")
    with pytest.raises(LifecycleError, match="sorting host and port"):
        check(own, 1, a[0], 9200, "server")
    # one directory shared by every server (the default scope): a rank may move between hosts, and a fresh job's
    # first server may write its rank before the others look
    check(own, 0, *b, "job")
    check(own, 1, *b, "job")
    # snapshots from before writers were recorded, an empty volume: no objection
    old = tmp_path / "old"
    snapshot(old, 1, 2, None, 0)
    check(old, 1, *b, "server")
    check(tmp_path / "empty", 0, *a, "server")


def test_address_update_is_an_add_node_of_this_server():
    msg = membership.address_update(10, "10.213.58.40", 9100, 77)
    back = Message.from_frames([identity_of(10)] + msg.to_frames())
    assert back.meta.control.cmd == ADD_NODE and back.meta.timestamp == 77
    [node] = back.meta.control.nodes
    assert (node.role, node.id, node.hostname, node.port, node.is_recovery) == (SERVER, 10, "10.213.58.40", 9100,
                                                                               False)


# ----------------------------------------------------------------------------------------------------------------


def run_pair(job_factory, name, ports, dirs, finish: bool):
    """Scheduler, two lazy servers (PORT and snapshot dir each), one dense.py worker on 127.0.0.1."""
    job = job_factory(name, num_workers=1, num_servers=2)
    job.port = free_port()
    job._spawn("scheduler", [PYTHON, "-c", "import mxnet"], job.env("scheduler"))
    for i, (port, directory) in enumerate(zip(ports, dirs)):
        job._spawn(f"server{i}", [PYTHON, "-m", "kvstore_lazy.server"],
                   job.env("server", {"PORT": str(port), "KVSTORE_LAZY_SNAPSHOT_DIR": str(directory),
                                      "KVSTORE_LAZY_SNAPSHOT_SCOPE": "server"}))
    job.spawn_workers("dense.py", ["--out", str(job.tmp / "res"), "--steps", "1", "--optimizer", "sgd"])
    if finish:
        job.wait(120)
        return job
    codes = job.wait_for(["server0", "server1"], 120)
    job.kill()
    return job, codes


@pytest.mark.integration
def test_ranks_follow_host_and_port_so_swapped_ports_are_refused(job_factory, tmp_path):
    low, high = sorted([free_port(), free_port()])
    dirs = [tmp_path / "volume-a", tmp_path / "volume-b"]     # one volume per server, as volumeClaimTemplates give
    run_pair(job_factory, "first", [low, high], dirs, finish=True)
    # the scheduler sorted by port on one host: the lower port got rank 0
    assert checkpoint.read_manifest(dirs[0], 0)["writer"] == {"host": "127.0.0.1", "port": low}
    assert checkpoint.read_manifest(dirs[1], 1)["writer"] == {"host": "127.0.0.1", "port": high}
    assert not membership_path(dirs[0], 1).exists()
    job, codes = run_pair(job_factory, "swapped", [high, low], dirs, finish=False)
    assert codes == {"server0": 2, "server1": 2}, job.report()
    assert (f"the scheduler made 127.0.0.1:{high} server rank 1, but its own volume {dirs[0]} holds the snapshot "
            f"of rank 0 (written by 127.0.0.1:{low})") in job.log("server0")
    assert (f"the scheduler made 127.0.0.1:{low} server rank 0, but its own volume {dirs[1]} holds the snapshot "
            f"of rank 1") in job.log("server1")
    assert "Traceback" not in job.log("server0")
