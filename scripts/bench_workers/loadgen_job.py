"""The saturation scenario's one worker process: N simulated workers (``loadgen.SimWorkers``) in a real job with the
stock scheduler and one server, ours or stock, run through a plan of timed phases.

Owns: the job's life as stock workers would live it (register, BARRIER(7), rank 0's kSyncMode for dist_sync,
every worker's kController with SGD momentum, the key's init, the phases, rank 0's kStopServer, the final
BARRIER(7)), the phase plan, and its records (JSON lines in <out>.rank0.jsonl, see common.Results).
Does not own: the sockets and the pacing (``loadgen``), request bytes (``loadgen_wire``), the tables
(``saturation_report``).

bench.py starts it as the job's only worker command with DMLC_NUM_WORKER=N for every node: the scheduler and the
server then wait for N workers, and this process is all N of them.

    DMLC_* (from the launcher) python scripts/bench_workers/loadgen_job.py --out OUT --server lazy|stock
        [--input-dim 1000000] [--dim 32] [--batches 512,8192] [--closed-seconds 2] [--open-seconds 1.5]
        [--levels 0.1,0.5,0.8,1.0] [--min-steps 40] [--dense-seconds 1]

The row_sparse key (input_dim, D): our server gets what kvstore_lazy.worker.init_lazy sends (LAZY_DECLARE from every
worker, then rank 0's init push with no rows); the stock server the full Uniform(0.07) weight, as a stock user's
kv.init sends it. Per batch B: a closed-loop warm-up, a closed-loop phase (the saturation point at this N), then
open-loop phases at the given fractions of that closed-loop rate. Then the dense 2x3 key: push then pull per step,
open-loop at a light rate. Records: "setup", "phase" (see loadgen.run_steps; plus "level"), "dense", "done".
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import loadgen_wire as wire  # noqa: E402
from common import Results, ZipfRows, server_pids  # noqa: E402
from loadgen import Plan, SimWorkers, run_steps  # noqa: E402

from kvstore_lazy.protocol import mxnet as proto  # noqa: E402

ROW_KEY, DENSE_KEY = 3, 5
STEP_POOL = 16          # distinct (pull, push) pairs per worker and batch, cycled


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--server", required=True, choices=["lazy", "stock"])
    p.add_argument("--mode", default="dist_sync", choices=["dist_sync", "dist_async"])
    p.add_argument("--input-dim", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batches", default="512,8192")
    p.add_argument("--warmup-seconds", type=float, default=0.5)
    p.add_argument("--closed-seconds", type=float, default=2.0)
    p.add_argument("--open-seconds", type=float, default=1.5)
    p.add_argument("--levels", default="0.1,0.3,0.5,0.7,0.8,0.9,1.0,1.2",
                   help="open-loop rates as fractions of the closed-loop rate at this N and B")
    p.add_argument("--min-steps", type=int, default=40,
                   help="an open-loop phase lasts until this many steps were due (at most 3x --open-seconds), so "
                        "that a light level has enough samples for a p99")
    p.add_argument("--dense-seconds", type=float, default=1.0)
    p.add_argument("--dense-rate", type=float, default=100.0, help="dense steps per second, all workers")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of each setup request and drain")
    return p.parse_args(argv)


def setup(workers: SimWorkers, args: argparse.Namespace, begin: int) -> float:
    """Everything before the phases, in a stock worker's order; returns the init's seconds."""
    body = wire.optimizer_body()     # imports mxnet (~2 s) while the scheduler and the server start
    workers.register()
    workers.barrier(wire.ALL_GROUP)
    if args.mode == "dist_sync":
        workers.call(0, wire.command(proto.SYNC_MODE))       # rank 0, in mx.kv.create
    workers.call_all({i: wire.command(proto.CONTROLLER, body) for i in range(workers.n)})
    started = time.perf_counter()
    if args.server == "lazy":
        spec = wire.lazy_declare_body(ROW_KEY, args.input_dim, args.dim, args.seed)
        workers.call_all({i: wire.command(proto.LAZY_DECLARE, spec) for i in range(workers.n)})
        workers.call(0, wire.rsp_init(begin, ROW_KEY, None, args.dim))
    else:
        weight = np.random.default_rng(args.seed).uniform(-0.07, 0.07, (args.input_dim, args.dim))
        workers.call(0, wire.rsp_init(begin, ROW_KEY, weight.astype(np.float32), args.dim))
        del weight
    seconds = time.perf_counter() - started
    workers.call(0, wire.dense_push(begin, DENSE_KEY, np.full(6, 0.1, np.float32).tobytes()))
    workers.barrier(wire.WORKER_GROUP)                        # kv.init's worker barrier
    return seconds


def row_steps(workers: SimWorkers, args: argparse.Namespace, begin: int, batch: int) -> list[list]:
    steps = []
    for rank in range(workers.n):
        stream = ZipfRows(args.input_dim, batch, args.seed + batch, rank)
        grads = np.random.default_rng([rank, batch]).normal(0, 0.01, (batch, args.dim)).astype(np.float32)
        pairs = []
        for _ in range(STEP_POOL):
            ids = stream.next()
            pairs.append((wire.rsp_pull(begin, ROW_KEY, ids, args.dim),
                          wire.rsp_push(begin, ROW_KEY, ids, grads.tobytes(), args.dim)))
        steps.append(pairs)
    return steps


def batch_phases(workers: SimWorkers, args: argparse.Namespace, res: Results, begin: int, batch: int,
                 pid: int | None) -> None:
    steps = row_steps(workers, args, begin, batch)
    sync = args.mode == "dist_sync"
    run_steps(workers, Plan(steps, args.warmup_seconds, drain_timeout=args.timeout), pid)
    closed = run_steps(workers, Plan(steps, args.closed_seconds, drain_timeout=args.timeout), pid)
    res.add(kind="phase", level=None, **closed)
    print(f"  B={batch} closed-loop: {closed['rows_per_s']:.0f} rows/s, p50 {closed['p50_ms']:.2f} ms, "
          f"server {closed['server_cores'] or 0:.2f} cores", flush=True)
    steps_per_s = closed["steps"] / closed["seconds"]
    for level in (float(x) for x in args.levels.split(",") if x):
        rate = max(level * steps_per_s, 1.0)
        seconds = min(max(args.open_seconds, args.min_steps / rate), 3 * args.open_seconds)
        phase = run_steps(workers, Plan(steps, seconds, rate=rate, synchronous=sync,
                                        drain_timeout=args.timeout), pid)
        res.add(kind="phase", level=level, **phase)


def dense_phase(workers: SimWorkers, args: argparse.Namespace, res: Results, begin: int, pid: int | None) -> None:
    """The dense 2x3 key: push (kv.push) then pull (kv.pull) per step, open-loop at a light rate."""
    grad = np.full(6, 0.01, np.float32).tobytes()
    pair = (wire.dense_push(begin, DENSE_KEY, grad), wire.dense_pull(begin, DENSE_KEY, 24))
    # Plan's steps are (first, second) pairs; for the dense key the push goes first and the pull after its reply
    steps = [[pair] for _ in range(workers.n)]
    phase = run_steps(workers, Plan(steps, args.dense_seconds, rate=args.dense_rate,
                                    synchronous=args.mode == "dist_sync", drain_timeout=args.timeout), pid)
    res.add(kind="dense", shape=[2, 3], **phase)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    n = int(os.environ["DMLC_NUM_WORKER"])
    if int(os.environ.get("DMLC_NUM_SERVER", "1")) != 1:
        raise SystemExit("loadgen_job.py measures one server: DMLC_NUM_SERVER=1")
    res = Results(args.out, 0)
    workers = SimWorkers(n, os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"]),
                         os.environ.get("DMLC_NODE_HOST", "127.0.0.1"), timeout=args.timeout)
    begin = proto.server_key_begin(0, 1)
    try:
        init_seconds = setup(workers, args, begin)
        pids = server_pids()
        pid = pids[0] if pids else None
        res.add(kind="setup", workers=n, ids=workers.ids, init_seconds=init_seconds, server_pid=pid)
        print(f"loadgen: {n} simulated workers (ids {workers.ids}), {args.mode}, {args.server} server", flush=True)
        for batch in (int(b) for b in args.batches.split(",") if b):
            batch_phases(workers, args, res, begin, batch, pid)
        dense_phase(workers, args, res, begin, pid)
        workers.call(0, wire.command(proto.STOP_SERVER))
        workers.barrier(wire.ALL_GROUP)
    finally:
        workers.close()
    res.add(kind="done")
    print("loadgen done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
