"""Prometheus metrics of live servers (KVSTORE_LAZY_METRICS_PORT) in a real job: stock scheduler, 2 stock workers
(tests/workers/metrics_job.py), 2 kvstore_lazy servers, dist_sync, a lazy row_sparse key and a dense key.

The servers are scraped while the job trains, then at a quiescent moment (every push answered, the workers waiting
on the test) the scrape is compared with each server's LAZY_STATS reply (the "stats: {json}" line it logs for
kvstore_lazy.worker.stats): rows and bytes per key, dense bytes and bad requests exactly equal; request counts,
optimizer updates and snapshots equal what the job did. A malformed frame sent to one server's ROUTER shows up as
a bad request of kind "malformed" there only. All traffic is on 127.0.0.1; every process has a deadline.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from cluster import JobHung
from common import load
from test_promexport import scrape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 6
SPARSE, DENSE = "3", "5"


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


def one(samples: dict, name: str) -> float | None:
    return samples.get((name, ()))


def wait_until(what: str, job, check, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        dead = [p.name for p in job.procs if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise JobHung(f"{what}: not before the deadline (ended: {dead})\n" + job.report())
        time.sleep(0.1)


def servers_of(job) -> dict[int, dict]:
    """rank -> {"metrics": port, "port": ps-lite port, "log": process name}, from the servers' own log lines."""
    found = {}
    for proc in job.procs:
        if not proc.name.startswith("server"):
            continue
        text = proc.output()
        metrics = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", text)
        listen = re.search(r"listening on 127\.0\.0\.1:(\d+)", text)
        rank = re.search(r"registered as server rank (\d+)", text)
        if not (metrics and listen and rank):
            return {}
        found[int(rank.group(1))] = {"metrics": int(metrics.group(1)), "port": int(listen.group(1)),
                                     "log": proc.name}
    return found


def stats_reply(job, name: str) -> dict | None:
    lines = re.findall(r" INFO stats: (\{.*\})$", job.log(name), re.M)
    return json.loads(lines[-1]) if lines else None


def fresh_scrape(port: int, after: float, job) -> dict:
    """A scrape whose numbers the server's loop published after wall time `after`."""
    def published():
        samples = scrape(port)
        stamp = one(samples, "kvstore_lazy_metrics_published_timestamp_seconds")
        return samples if stamp is not None and stamp > after else None
    return wait_until("a publish after the stats", job, published, 15)


def test_metrics_of_a_live_job_equal_the_stats_command(job_factory):
    job = job_factory("metrics", num_workers=2, num_servers=2, server="lazy",
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"})
    job.start(server_env={"KVSTORE_LAZY_METRICS_PORT": "0", "KVSTORE_LAZY_METRICS_BIND": "127.0.0.1",
                          "KVSTORE_LAZY_SNAPSHOT_DIR": str(job.tmp / "snap"),
                          "KVSTORE_LAZY_STATS_INTERVAL": "3600"})
    out = str(job.tmp / "res")
    job.spawn_workers("metrics_job.py", ["--out", out, "--steps", str(STEPS)])
    servers = wait_until("the servers' metrics and ranks in their logs", job, lambda: servers_of(job), 120)
    assert sorted(servers) == [0, 1]

    # during the job: served, and the process collector is there
    early = scrape(servers[0]["metrics"])
    assert one(early, "process_resident_memory_bytes") > 0

    wait_until("the workers at their quiescent point", job, lambda: Path(out + ".ready").exists(), 180)
    replies = {rank: wait_until(f"server rank {rank}'s stats reply", job,
                                lambda s=s: stats_reply(job, s["log"]), 30) for rank, s in servers.items()}
    asked = time.time()
    scraped = {rank: fresh_scrape(s["metrics"], asked, job) for rank, s in servers.items()}

    for rank, samples in scraped.items():
        stats = replies[rank]
        assert stats["rank"] == rank
        assert by_label(samples, "kvstore_lazy_server_info", "rank") == {str(rank): 1}
        # exactly the stats command's numbers at the quiescent moment
        assert by_label(samples, "kvstore_lazy_key_rows", "key") == {k: s["rows"] for k, s in stats["sparse"].items()}
        assert by_label(samples, "kvstore_lazy_key_bytes", "key") == {k: s["bytes"] for k, s in stats["sparse"].items()}
        assert stats["sparse"][SPARSE]["rows"] > 0 and stats["sparse"][SPARSE]["bytes"] > 0
        assert one(samples, "kvstore_lazy_dense_bytes") == stats["dense_bytes"]
        assert one(samples, "kvstore_lazy_dense_keys") == stats["dense_keys"]
        bad = by_label(samples, "kvstore_lazy_bad_requests_total", "kind")
        assert bad == {"command_lazy_declare": 1} and sum(bad.values()) == stats["bad_requests"]

        # what the job did. MXNet 1.9.1: every worker sends kController (set_optimizer) and the declaration
        # (init_lazy), rank 0 alone kSyncMode and the kv.init pushes; a row_sparse push or pull reaches every server
        # holding part of the key (in dist_sync each server's round waits for both workers' pushes)
        requests = by_label(samples, "kvstore_lazy_requests_total", "kind")
        expected = {"command_controller": 2, "command_sync_mode": 1, "command_lazy_declare": 2 + 1,   # + the bad one
                    "command_lazy_snapshot": 1, "command_lazy_stats": 1,
                    "push_row_sparse": 1 + 2 * STEPS, "pull_row_sparse": 2 * STEPS}
        if stats["dense_keys"]:
            expected.update(push_dense=1 + 2 * STEPS, pull_dense=2 * STEPS)
        assert requests == expected
        counts = by_label(samples, "kvstore_lazy_request_duration_seconds_count", "kind")
        assert counts == requests
        updates = by_label(samples, "kvstore_lazy_optimizer_updates_total", "key")
        assert updates[SPARSE] == STEPS
        assert one(samples, "kvstore_lazy_optimizer_num_update") == STEPS
        assert one(samples, "kvstore_lazy_received_bytes_total") > 0
        assert one(samples, "kvstore_lazy_sent_bytes_total") > 0
        # LAZY_SNAPSHOT (rank 0) writes tagged/rank<r> before it is answered, then rank<r> at the next timer
        assert by_label(samples, "kvstore_lazy_snapshot_duration_seconds_count", "kind") == {"latest": 1, "tagged": 1}
        ages = by_label(samples, "kvstore_lazy_snapshot_age_seconds", "kind")
        assert 0 <= ages["latest"] <= ages["tagged"] < 120

    # the dense key lives on one server (below the bigarray bound): its pushes, pulls and updates are there only
    dense_home = [r for r, s in scraped.items() if DENSE in by_label(s, "kvstore_lazy_optimizer_updates_total", "key")]
    assert len(dense_home) == 1
    assert by_label(scraped[dense_home[0]], "kvstore_lazy_optimizer_updates_total", "key")[DENSE] == STEPS
    assert replies[dense_home[0]]["dense_keys"] == 1

    # a malformed frame on server rank 1's ROUTER: counted there, as nothing else
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{servers[1]['port']}")
        sock.send_multipart([b"\xff\xfe not a PBMeta"])
        wait_until("the malformed frame in the log", job,
                   lambda: "dropping a malformed message" in job.log(servers[1]["log"]), 15)
        sent = time.time()
        after = fresh_scrape(servers[1]["metrics"], sent, job)
        assert by_label(after, "kvstore_lazy_bad_requests_total", "kind") == {"command_lazy_declare": 1, "malformed": 1}
    finally:
        sock.close()
        ctx.term()

    Path(out + ".go").touch()
    job.wait(120)
    trained = np.unique(np.concatenate([load(out, r)["trained"] for r in range(2)]))
    # push (the default): the rows stored over both servers are the rows the workers trained
    assert sum(replies[r]["sparse"][SPARSE]["rows"] for r in replies) == len(trained)
