"""A stock MXNet 1.9.1 worker for the "step" scenario of scripts/bench.py: the kvstore traffic of one CTR training
step, as a Gluon Trainer with update_on_kvstore issues it.

Model (only its parameters; no forward/backward: the step is the kvstore part, the same for both servers): per
categorical feature f of --features, an embedding (row_sparse key 100+f, (input_dim, --emb-dim)) and a wide weight
(row_sparse key 200+f, (input_dim, 1)); an MLP over the concatenated embeddings (--hidden), whose weights and biases
are the dense keys 0..M-1 in Gluon's parameter order. A step, like Trainer.step then the next forward: push every
key's gradient (dense, then row_sparse rows of this step's ids; priority -i, as Trainer._allreduce_grads), then
pull every dense key and row_sparse_pull the next step's rows of every sparse key (the feature's --rows distinct
Zipf ids, shared by its embedding and wide weight), all queued at once on the engine; the step ends when
mx.nd.waitall() returns. Ids and gradient arrays are built before the step's clock starts.

Init (as make demo's model: embeddings Uniform(0.07), wide weights Zero): lazy servers get
kvstore_lazy.worker.init_lazy; stock servers what a stock user sends (rank 0 the full weight, every row). Rank 0
reads the servers' CPU (/proc/<pid>/stat) after a barrier before and after the measured steps (the --warmup steps
before them create most of the rows and are left out).

Records (JSON lines in <out>.rank<r>.jsonl): config, step (per-step latencies, wall, server CPU), done.
"""
import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, ZipfRows, server_pids, servers_cpu, stock_initial_weight  # noqa: E402
from kvstore_lazy.worker import init_lazy  # noqa: E402  (common puts the repo on sys.path)

EMB_KEY, WIDE_KEY = 100, 200

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--server", required=True, choices=["lazy", "stock"])
p.add_argument("--mode", default="dist_sync")
p.add_argument("--features", default="2000000,1000000,500000,100000", help="input_dim of each feature")
p.add_argument("--emb-dim", type=int, default=16)
p.add_argument("--hidden", default="256,128", help="MLP hidden layer sizes")
p.add_argument("--rows", type=int, default=256, help="distinct Zipf ids per feature per worker per step")
p.add_argument("--steps", type=int, default=100, help="measured steps")
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
p.add_argument("--seed", type=int, default=5)
args = p.parse_args()

dims = [int(d) for d in args.features.split(",")]
hidden = [int(h) for h in args.hidden.split(",") if h]
dense_shapes = []
fan_in = len(dims) * args.emb_dim
for width in hidden + [1]:
    dense_shapes += [(width, fan_in), (width,)]   # Dense layer: weight (units, in_units), bias (units,)
    fan_in = width
sparse = [(EMB_KEY + f, (n, args.emb_dim), f) for f, n in enumerate(dims)] + \
         [(WIDE_KEY + f, (n, 1), f) for f, n in enumerate(dims)]

kv = mx.kv.create(args.mode)
rank = kv.rank
res = Results(args.out, rank)
pids = server_pids() if rank == 0 else []
if args.optimizer == "adam":
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.001))
else:
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.05, momentum=0.9))

for key, shape in enumerate(dense_shapes):
    kv.init(key, mx.nd.ones(shape) * 0.01)
for key, shape, _ in sparse:
    wide = key >= WIDE_KEY
    if args.server == "lazy":
        init_lazy(kv, key, shape, init=mx.init.Zero() if wide else mx.init.Uniform(0.07), seed=args.seed)
    elif wide:
        # kv.init of a zero row_sparse array ships no rows, and a stock server then has none to pull: every row
        # of it, zero, as a stock user's full initial weight
        value = mx.nd.sparse.row_sparse_array((np.zeros(shape, np.float32), np.arange(shape[0])), shape=shape) \
            if rank == 0 else mx.nd.sparse.zeros("row_sparse", shape)
        kv.init(key, value)
        del value
    else:
        value, _ = stock_initial_weight(rank, shape)
        kv.init(key, value)
        del value
mx.nd.waitall()

streams = [ZipfRows(n, args.rows, args.seed + 100 * f, rank) for f, n in enumerate(dims)]
rng = np.random.default_rng(rank)
dense_grads = [mx.nd.array(rng.normal(0, 0.01, s).astype(np.float32)) for s in dense_shapes]
dense_outs = [mx.nd.zeros(s) for s in dense_shapes]
sparse_vals = [mx.nd.array(rng.normal(0, 0.01, (args.rows, shape[1])).astype(np.float32)) for _, shape, _ in sparse]


def next_ids() -> list:
    return [mx.nd.array(s.next(), dtype="int64") for s in streams]


ids = next_ids()
outs = [mx.nd.sparse.zeros("row_sparse", shape) for _, shape, _ in sparse]
for (key, _, f), out in zip(sparse, outs):
    kv.row_sparse_pull(key, out=out, row_ids=ids[f])
mx.nd.waitall()

latency_ms = []
cpu = None
started = None
for step in range(args.warmup + args.steps):
    if step == args.warmup:
        kv._barrier()
        cpu = servers_cpu(pids)
        started = time.perf_counter()
    grads = [mx.nd.sparse.row_sparse_array((vals, ids[f]), shape=shape)
             for (_, shape, f), vals in zip(sparse, sparse_vals)]
    ids = next_ids()
    outs = [mx.nd.sparse.zeros("row_sparse", shape) for _, shape, _ in sparse]
    mx.nd.waitall()
    t0 = time.perf_counter()
    priority = 0
    for key, grad in enumerate(dense_grads):
        kv.push(key, grad, priority=-priority)
        priority += 1
    for (key, _, _), grad in zip(sparse, grads):
        kv.push(key, grad, priority=-priority)
        priority += 1
    priority = 0
    for key, out in enumerate(dense_outs):
        kv.pull(key, out=out, priority=-priority)
        priority += 1
    for (key, _, f), out in zip(sparse, outs):
        kv.row_sparse_pull(key, out=out, row_ids=ids[f], priority=-priority)
        priority += 1
    mx.nd.waitall()
    if step >= args.warmup:
        latency_ms.append((time.perf_counter() - t0) * 1e3)
    if step == 0 and outs[0].indices.shape[0] != args.rows:
        raise SystemExit(f"pulled {outs[0].indices.shape[0]} rows for {args.rows} ids")
wall = time.perf_counter() - started
kv._barrier()
cpu = [None if a is None or b is None else b - a for a, b in zip(cpu, servers_cpu(pids))]
res.add(kind="step", steps=args.steps, warmup=args.warmup, latency_ms=latency_ms, wall=wall, server_cpu=cpu,
        sparse_keys=len(sparse), dense_keys=len(dense_shapes), rows=args.rows,
        dense_elements=int(sum(np.prod(s) for s in dense_shapes)))
kv._barrier()
res.add(kind="done")
print(f"bench worker {rank} done", flush=True)
