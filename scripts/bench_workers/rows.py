"""A stock MXNet 1.9.1 worker for the memory, throughput and scale scenarios of scripts/bench.py.

One row_sparse key (input_dim, D): init (lazy with kvstore_lazy.worker.init_lazy, or as a stock user does: the
full initial weight, built by rank 0; other ranks pass an empty array of the same shape, which a stock kv.init
accepts since only rank 0 pushes), then phases of steps "B:steps:ids" (ids zipf or uniform), each step a
row_sparse_pull of B unique rows then a push of their gradients, each timed to completion (mx.nd.waitall, so the
push's server reply is included). Rank 0 reads the servers' RSS every --rss-every steps and after each phase.
Then dense latency: for each "RxC:iterations", push then pull (each waited), timed.

Records (JSON lines in <out>.rank<r>.jsonl): init, rss, phase, dense, done.
"""
import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import (Results, row_stream, server_pids, servers_cpu, servers_rss,  # noqa: E402
                    stock_initial_weight, tcp_bytes_sent)
from kvstore_lazy.worker import init_lazy, stats  # noqa: E402  (common puts the repo on sys.path)

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--server", required=True, choices=["lazy", "stock"])
p.add_argument("--mode", default="dist_sync")
p.add_argument("--input-dim", type=int, required=True)
p.add_argument("--dim", type=int, default=32)
p.add_argument("--key", type=int, default=3)
p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
p.add_argument("--seed", type=int, default=1)
p.add_argument("--phases", default="", help="B:steps:zipf|uniform|fresh[,...] (see common.row_stream)")
p.add_argument("--rss-every", type=int, default=0, help="rank 0 reads server RSS every N steps (0: per phase)")
p.add_argument("--dense", default="", help="RxC:iterations[,...]")
args = p.parse_args()

kv = mx.kv.create(args.mode)
rank = kv.rank
res = Results(args.out, rank)
pids = server_pids() if rank == 0 else []
if args.optimizer == "sgd":
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-5))
else:
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.001))
shape = (args.input_dim, args.dim)
kv._barrier()
if rank == 0:
    res.add(kind="rss", what="idle", step=0, rss=servers_rss(pids))

# ---- init
init = mx.init.Uniform(0.07)
value, build = (None, 0.0) if args.server == "lazy" else stock_initial_weight(rank, shape)
kv._barrier()
sent = tcp_bytes_sent()
t = time.perf_counter()
if value is None:
    init_lazy(kv, args.key, shape, init=init, seed=args.seed)
else:
    kv.init(args.key, value)
mx.nd.waitall()
seconds = time.perf_counter() - t
sent = tcp_bytes_sent() - sent
del value
res.add(kind="init", seconds=seconds, bytes_sent=sent, build_seconds=build,
        rss=servers_rss(pids) if rank == 0 else None)

# ---- row phases
step = 0
for index, phase in enumerate(filter(None, args.phases.split(","))):
    batch, steps, ids_kind = phase.split(":")
    batch, steps = int(batch), int(steps)
    stream = row_stream(ids_kind, args.input_dim, batch, args.seed + 1000 * index, rank, kv.num_workers)
    grad_vals = mx.nd.array(np.random.default_rng(rank).normal(0, 0.01, (batch, args.dim)).astype(np.float32))
    pull_ms, push_ms = [], []
    kv._barrier()
    cpu = servers_cpu(pids)
    started = time.perf_counter()
    for s in range(steps):
        ids = stream.next()
        row_ids = mx.nd.array(ids, dtype="int64")
        out = mx.nd.sparse.zeros("row_sparse", shape)
        grad = mx.nd.sparse.row_sparse_array((grad_vals, row_ids), shape=shape)
        mx.nd.waitall()
        t0 = time.perf_counter()
        kv.row_sparse_pull(args.key, out=out, row_ids=row_ids)
        out.wait_to_read()
        t1 = time.perf_counter()
        kv.push(args.key, grad)
        mx.nd.waitall()
        t2 = time.perf_counter()
        pull_ms.append((t1 - t0) * 1e3)
        push_ms.append((t2 - t1) * 1e3)
        if s == 0 and out.indices.shape[0] != len(ids):
            raise SystemExit(f"pulled {out.indices.shape[0]} rows for {len(ids)} ids")
        step += 1
        if rank == 0 and args.rss_every and step % args.rss_every == 0:
            res.add(kind="rss", what="step", step=step, rss=servers_rss(pids))
    wall = time.perf_counter() - started
    kv._barrier()
    cpu = [None if a is None or b is None else b - a for a, b in zip(cpu, servers_cpu(pids))]
    res.add(kind="phase", index=index, batch=batch, steps=steps, ids=ids_kind, pull_ms=pull_ms, push_ms=push_ms,
            wall=wall, end_step=step, server_cpu=cpu)
    if rank == 0:
        res.add(kind="rss", what="phase", step=step, phase=index, rss=servers_rss(pids))
        if args.server == "lazy":
            stats(kv)   # each server logs "stats: {json}" (rows per key): the i-th such line is after phase i

# ---- dense latency
for index, item in enumerate(filter(None, args.dense.split(","))):
    size, iterations = item.split(":")
    dshape = tuple(int(d) for d in size.split("x"))
    key = 1000 + index
    kv.init(key, mx.nd.ones(dshape) * 0.1)
    grad = mx.nd.ones(dshape) * 0.01
    out = mx.nd.zeros(dshape)
    push_ms, pull_ms = [], []
    kv._barrier()
    cpu = servers_cpu(pids)
    for _ in range(int(iterations)):
        mx.nd.waitall()
        t0 = time.perf_counter()
        kv.push(key, grad)
        mx.nd.waitall()
        t1 = time.perf_counter()
        kv.pull(key, out=out)
        out.wait_to_read()
        t2 = time.perf_counter()
        push_ms.append((t1 - t0) * 1e3)
        pull_ms.append((t2 - t1) * 1e3)
    kv._barrier()
    cpu = [None if a is None or b is None else b - a for a, b in zip(cpu, servers_cpu(pids))]
    res.add(kind="dense", shape=list(dshape), push_ms=push_ms, pull_ms=pull_ms, server_cpu=cpu)

kv._barrier()
if rank == 0:
    res.add(kind="rss", what="end", step=step, rss=servers_rss(pids))
    if args.server == "lazy":
        stats(kv)
res.add(kind="done")
print(f"bench worker {rank} done", flush=True)
