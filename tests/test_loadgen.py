"""The saturation load generator (scripts/bench_workers/loadgen*.py): its requests are a stock worker's bytes, its
simulated workers register through the stock scheduler, and a real kvstore_lazy server answers them right.

No timed assertions: the phases run for a fixed time and only their correctness is checked (every reply to the
request it answers, with the bytes it must carry; every worker issuing the same number of steps in dist_sync;
values after a sync round equal to the stored value minus the sum of the workers' gradients).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench_workers"))

import loadgen_wire as wire  # noqa: E402
import saturation_report  # noqa: E402
from loadgen import LoadgenError, Plan, SimWorkers, bench_common, run_steps  # noqa: E402
from wire_fixtures import load_fixture  # noqa: E402

from kvstore_lazy.protocol import mxnet as proto  # noqa: E402
from kvstore_lazy.protocol.message import decode_kv  # noqa: E402
from kvstore_lazy.protocol.pbmeta import decode_meta, encode_meta  # noqa: E402

STOCK = load_fixture("worker_dense_rsp_session.hex")
ROW_KEY, DENSE_KEY, ROWS, DIM = 3, 5, 5000, 8


# ---------------------------------------------------------------------------------------------------------------
# the bytes: what a stock MXNet 1.9.1 worker sent (tests/fixtures/worker_dense_rsp_session.hex), frame 0 (the
# DEALER identity) aside

@pytest.mark.parametrize("name, frames", [
    ("add_node", lambda: wire.add_node("127.0.0.1", 37351, 0)),
    ("barrier_startup", lambda: wire.barrier(wire.ALL_GROUP, 1)),
    ("sync_mode", lambda: wire.command(proto.SYNC_MODE).frames(0)),
    ("dense_init_push", lambda: wire.dense_push(0, 0, np.arange(5, dtype=np.float32).tobytes()).frames(1)),
    ("dense_push", lambda: wire.dense_push(0, 0, np.ones(5, np.float32).tobytes()).frames(2)),
    ("dense_pull", lambda: wire.dense_pull(0, 0, 20).frames(4)),
    ("rsp_init_push", lambda: wire.rsp_init(0, 2, np.arange(40, dtype=np.float32).reshape(10, 4), 4).frames(7)),
    ("rsp_push", lambda: wire.rsp_push(0, 2, np.array([2, 5]), np.ones(8, np.float32).tobytes(), 4).frames(8)),
    ("rsp_pull", lambda: wire.rsp_pull(0, 2, np.array([2, 5]), 4).frames(9)),
    ("rsp_pull_zero_rows", lambda: wire.rsp_pull(0, 2, np.zeros(0, np.int64), 4).frames(10)),
    ("stop_server", lambda: wire.command(proto.STOP_SERVER).frames(11)),
    ("barrier_finalize", lambda: wire.barrier(wire.ALL_GROUP, 2)),
])
def test_requests_are_a_stock_workers_bytes(name, frames):
    assert frames() == STOCK[name][1:]


@pytest.mark.parametrize("ts", [0, 1, 127, 128, 300, 16383, 16384, 2**21 + 5, 2**31 - 2])
def test_stamped_timestamp_is_the_codecs(ts):
    request = wire.rsp_pull(proto.server_key_begin(1, 2), ROW_KEY, np.array([1, 7, 9]), DIM)
    meta = decode_meta(request.frames(ts)[0])
    assert meta.timestamp == ts and meta.pull and not meta.push and meta.head == wire.RSP_HEAD
    assert request.frames(ts)[0] == encode_meta(meta)


def test_reply_checks():
    pull = wire.rsp_pull(0, ROW_KEY, np.arange(4), DIM)
    keys = len(pull.data[0])
    assert wire.reply_error(pull, [keys, 4 * DIM * 4, 5 * 4]) is None
    assert "bytes of values" in wire.reply_error(pull, [keys, 3 * DIM * 4, 5 * 4])
    assert "keys" in wire.reply_error(pull, [keys - 8, 4 * DIM * 4, 5 * 4])
    assert "data frames" in wire.reply_error(pull, [keys, 4 * DIM * 4])
    push = wire.rsp_push(0, ROW_KEY, np.arange(4), bytes(4 * DIM * 4), DIM)
    assert wire.reply_error(push, []) is None
    assert wire.reply_error(push, [8]) is not None
    with pytest.raises(ValueError):
        wire.rsp_push(0, ROW_KEY, np.arange(4), bytes(3), DIM)


def test_knee_is_where_p99_doubles():
    points = [{"offered_rows_per_s": x, "p99_ms": y} for x, y in ((100, 2.0), (500, 3.9), (800, 4.0), (900, 9))]
    assert saturation_report.knee(points)["offered_rows_per_s"] == 800
    assert saturation_report.knee(points[:2]) is None
    assert saturation_report.knee([]) is None


def test_report_keeps_the_issues_shape():
    records = [{"kind": "phase", "level": None, "pacing": "closed", "batch": 512, "rows_per_s": 1000.0,
                "server_cores": 0.5, "p50_ms": 1.0, "p99_ms": 2.0, "loadgen_cores": 0.1, "errors": []},
               {"kind": "phase", "level": 0.1, "pacing": "open", "batch": 512, "offered_rows_per_s": 100.0,
                "rows_per_s": 100.0, "server_cores": 0.05, "p50_ms": 1.0, "p99_ms": 1.5, "loadgen_cores": 0.01,
                "held_starts": 0, "errors": []}]
    gather = {"rows_per_s": 1e7, "rows_per_cpu_s": 2e7, "batch": 8192}
    _, data, _ = saturation_report.build([{"server": "ours", "mode": "dist_sync", "workers": 2,
                                           "records": records}], gather, ["dist_sync"])
    assert data["gather_limit_rows_per_s"] == 2e7
    assert data["rows"] == [{"server": "ours", "mode": "dist_sync", "workers": 2, "batch": 512, "rows_per_s": 1000.0,
                             "server_cores": 0.5, "p50_ms": 1.0, "p99_ms": 2.0}]


# ---------------------------------------------------------------------------------------------------------------
# a real job: the stock scheduler, our server, 3 simulated workers

def _pull_rows(workers: SimWorkers, row_ids: np.ndarray) -> np.ndarray:
    reply = workers.call(0, wire.rsp_pull(0, ROW_KEY, row_ids, DIM))
    pairs = decode_kv([f.buffer for f in reply.frames[2:]])
    assert list(pairs.keys) == list(ROW_KEY + np.concatenate([[0], row_ids]))
    return np.frombuffer(pairs.vals, np.float32).reshape(len(row_ids), DIM).copy()


def _check_sync_round(workers: SimWorkers) -> None:
    """Each worker pushes its own gradient for the same rows (and the dense key); the round's pulls equal the old
    values minus the sum (SGD, learning rate 1, no momentum, no weight decay; sums of powers of two are exact)."""
    rows = np.array([3, 17, 4000], np.int64)
    before = _pull_rows(workers, rows)
    grads = [np.full((len(rows), DIM), 0.125 * (i + 1), np.float32) for i in range(workers.n)]
    workers.call_all({i: wire.rsp_push(0, ROW_KEY, rows, grads[i].tobytes(), DIM) for i in range(workers.n)})
    np.testing.assert_array_equal(_pull_rows(workers, rows), before - sum(grads))
    old = _pull_dense(workers)
    dense = [np.full(6, 0.25 * (i + 1), np.float32) for i in range(workers.n)]
    workers.call_all({i: wire.dense_push(0, DENSE_KEY, dense[i].tobytes()) for i in range(workers.n)})
    np.testing.assert_array_equal(_pull_dense(workers), old - sum(dense))


def _pull_dense(workers: SimWorkers) -> np.ndarray:
    reply = workers.call(workers.n - 1, wire.dense_pull(0, DENSE_KEY, 24))
    return np.frombuffer(decode_kv([f.buffer for f in reply.frames[2:]]).vals, np.float32).copy()


def _row_plan(n: int, batch: int) -> list[list]:
    ZipfRows = bench_common.ZipfRows   # the bench folder's common.py (tests/workers has one of that name too)
    steps = []
    for rank in range(n):
        stream = ZipfRows(ROWS, batch, 7, rank)
        grad = np.full((batch, DIM), 0.01, np.float32).tobytes()
        pairs = []
        for _ in range(4):
            ids = stream.next()
            pairs.append((wire.rsp_pull(0, ROW_KEY, ids, DIM), wire.rsp_push(0, ROW_KEY, ids, grad, DIM)))
        steps.append(pairs)
    return steps


def test_simulated_workers_against_our_server(job_factory):
    n = 3
    job = job_factory("loadgen", num_workers=n, server="lazy").start()
    workers = SimWorkers(n, "127.0.0.1", job.port, timeout=30)
    try:
        ids = workers.register()
        assert sorted(ids) == [9, 11, 13]
        workers.barrier(wire.ALL_GROUP)
        workers.call(0, wire.command(proto.SYNC_MODE))
        body = wire.optimizer_body(momentum=0.0, learning_rate=1.0, wd=0.0)
        workers.call_all({i: wire.command(proto.CONTROLLER, body) for i in range(n)})
        spec = wire.lazy_declare_body(ROW_KEY, ROWS, DIM)
        workers.call_all({i: wire.command(proto.LAZY_DECLARE, spec) for i in range(n)})
        workers.call(0, wire.rsp_init(0, ROW_KEY, None, DIM))
        workers.call(0, wire.dense_push(0, DENSE_KEY, np.full(6, 0.5, np.float32).tobytes()))
        workers.barrier(wire.WORKER_GROUP)
        workers.keep_frames = True
        _check_sync_round(workers)
        workers.keep_frames = False
        steps = _row_plan(n, 64)
        before = list(workers.customer_ts)
        closed = run_steps(workers, Plan(steps, 0.5, drain_timeout=30))
        assert closed["errors"] == [] and closed["steps"] > 0 and closed["pacing"] == "closed"
        sent = [b - a for a, b in zip(before, workers.customer_ts)]
        assert len(set(sent)) == 1 and sent[0] >= 2 * closed["steps"] / n   # dist_sync: whole rounds only
        before = list(workers.customer_ts)
        opened = run_steps(workers, Plan(steps, 0.5, rate=60.0, drain_timeout=30))
        assert opened["errors"] == [] and opened["steps"] > 0 and opened["offered_rows_per_s"] == 60.0 * 64
        sent = [b - a for a, b in zip(before, workers.customer_ts)]
        assert len(set(sent)) == 1
        workers.keep_frames = True
        _check_sync_round(workers)
        workers.call(0, wire.command(proto.STOP_SERVER))
        workers.barrier(wire.ALL_GROUP)
    finally:
        workers.close()
    assert job.wait_for(["scheduler", "server0"], 60) == {"scheduler": 0, "server0": 0}


def test_a_job_that_never_forms_is_a_deadline(job_factory):
    job = job_factory("short", num_workers=2, server="lazy").start()
    workers = SimWorkers(1, "127.0.0.1", job.port, timeout=2)   # one of the two workers the job waits for
    try:
        with pytest.raises(LoadgenError, match="1 workers answered|0 of 1"):
            workers.register()
    finally:
        workers.close()
