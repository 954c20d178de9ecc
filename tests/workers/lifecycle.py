"""Lazy keys with row lifecycle policies on stock workers: every step each worker pulls and pushes its ids of every
key (tests/workers/lifecycle_stream.py), waits for its pushes (dist_sync: the round is applied) and, in dist_async,
meets the other workers at a barrier, so that round s of every key is steps s's pushes on any server count. At the
end rank 0 lists the rows that exist (fetch_rows) into <out>.rank0.npz.

--keys '{"3": {"admit_min_count": 2}, "5": {}}': the keys and their init_lazy policy arguments ({}: server defaults).
"""
import argparse
import json
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402
from lifecycle_stream import grad_for, ids_for  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--keys", required=True)
p.add_argument("--rows", type=int, default=50_000)
p.add_argument("--dim", type=int, default=4)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--seed", type=int, default=42)
p.add_argument("--fetch-chunk", type=int, default=0, help="also fetch values and states, this many rows a pull")
args = p.parse_args()

import kvstore_lazy.worker  # noqa: E402
from kvstore_lazy.worker import fetch_rows, init_lazy  # noqa: E402

kv = mx.kv.create(args.mode)
rank = kv.rank
kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=0.5))
shape = (args.rows, args.dim)
keys = {int(k): v for k, v in json.loads(args.keys).items()}
for key, policy in sorted(keys.items()):
    init_lazy(kv, key, shape, init=mx.init.Uniform(0.07), seed=args.seed, **policy)

for step in range(1, args.steps + 1):
    for key in sorted(keys):
        ids = ids_for(key, rank, step, args.rows, args.batch)
        out = mx.nd.sparse.zeros("row_sparse", shape)
        kv.row_sparse_pull(key, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
        idx = out.indices.asnumpy().astype(np.int64)
        kv.push(key, mx.nd.sparse.row_sparse_array((grad_for(idx, args.dim, step, rank), idx), shape=shape))
    mx.nd.waitall()          # my pushes are applied (dist_sync: every worker's: the round is done)
    if args.mode == "dist_async":
        kv._barrier()        # ... and everyone's
kv._barrier()
results = {}
if rank == 0:
    for key in sorted(keys):
        if args.fetch_chunk:
            kvstore_lazy.worker.FETCH_BYTES = args.fetch_chunk * args.dim * 4     # pieces of fetch_chunk rows
            ids, values, states = fetch_rows(kv, key, shape, states=True)
            results[f"values{key}"], results[f"state{key}"] = values, states[0]
        else:
            ids, _ = fetch_rows(kv, key, shape)
        results[f"rows{key}"] = ids
kv._barrier()
save(args.out, rank, results)
print("worker", rank, "done", flush=True)
