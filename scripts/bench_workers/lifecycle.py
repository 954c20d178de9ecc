"""A stock MXNet 1.9.1 worker for the lifecycle scenario of scripts/bench.py: streaming CTR training on one lazy
row_sparse key (input_dim, D) with row lifecycle policies (init_lazy keyword arguments from --policy, or the
servers' environment).

Each step: B examples of F ids (common.DriftingCTR: a Zipf law whose popular set drifts); a row_sparse_pull of
their distinct ids; logit = sum over the fields of the mean of the id's D weights; the log loss of the step's
clicks with the pulled weights (progressive validation: measured before the step trains); a push of the gradient
rows (Adam on the servers). Rank 0 reads the servers' RSS every --rss-every steps.

--delta-probe S (a job whose servers snapshot every second or so): after training, wait S seconds (a periodic
snapshot catches up), push one step that touches 1% of the rows that exist (all of them: the run keeps every row),
wait S seconds again (the next periodic snapshot holds only that step). scripts/bench.py reads the snapshot lines.

Records (JSON lines in <out>.rank<r>.jsonl): init, rss, loss (per step), probe, done.
"""
import argparse
import json
import os
import sys
import time

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import DriftingCTR, Results, server_pids, servers_rss  # noqa: E402
from kvstore_lazy.worker import init_lazy, stats  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--server", default="lazy", choices=["lazy"])
p.add_argument("--mode", default="dist_sync")
p.add_argument("--input-dim", type=int, required=True)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--fields", type=int, default=4)
p.add_argument("--batch", type=int, default=1024)
p.add_argument("--steps", type=int, default=80)
p.add_argument("--drift", type=float, default=2.0)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--key", type=int, default=3)
p.add_argument("--policy", default="{}", help="init_lazy keyword arguments (JSON)")
p.add_argument("--rss-every", type=int, default=5)
p.add_argument("--delta-probe", type=float, default=0.0)
args = p.parse_args()

kv = mx.kv.create(args.mode)
rank, workers = kv.rank, kv.num_workers
res = Results(args.out, rank)
pids = server_pids() if rank == 0 else []
kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.1))
shape = (args.input_dim, args.dim)
kv._barrier()
if rank == 0:
    res.add(kind="rss", what="idle", step=0, rss=servers_rss(pids))
init_lazy(kv, args.key, shape, init=mx.init.Uniform(0.01), seed=args.seed, **json.loads(args.policy))
mx.nd.waitall()
res.add(kind="init")
stream = DriftingCTR(args.input_dim, args.batch, args.fields, args.seed, rank, drift=args.drift)


def pull(ids: np.ndarray) -> np.ndarray:
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull(args.key, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    return out.data.asnumpy()


def push(ids: np.ndarray, grad: np.ndarray) -> None:
    kv.push(args.key, mx.nd.sparse.row_sparse_array((grad, ids), shape=shape))


started = time.perf_counter()
for step in range(1, args.steps + 1):
    ids, clicks = stream.examples(step)
    uniq, inverse = np.unique(ids, return_inverse=True)
    weights = pull(uniq)
    logits = weights.mean(axis=1)[inverse].reshape(ids.shape).sum(axis=1)
    prob = 1 / (1 + np.exp(-logits))
    loss = float(-np.mean(clicks * np.log(prob + 1e-7) + (1 - clicks) * np.log(1 - prob + 1e-7)))
    per_example = (prob - clicks) / len(clicks)                          # d loss / d logit
    per_id = np.bincount(inverse.ravel(), weights=np.repeat(per_example, ids.shape[1]), minlength=len(uniq))
    push(uniq, np.repeat((per_id / args.dim).astype(np.float32)[:, None], args.dim, axis=1))
    mx.nd.waitall()
    res.add(kind="loss", step=step, loss=loss, rows=int(len(uniq)))
    if rank == 0 and args.rss_every and step % args.rss_every == 0:
        res.add(kind="rss", what="step", step=step, rss=servers_rss(pids), seconds=time.perf_counter() - started)
kv._barrier()
if rank == 0:
    res.add(kind="rss", what="end", step=args.steps, rss=servers_rss(pids), seconds=time.perf_counter() - started)

if args.delta_probe:
    # every row any worker touched exists (the probe job keeps all rows): 1% of them, split between the workers
    seen = np.unique(np.concatenate([DriftingCTR(args.input_dim, args.batch, args.fields, args.seed, r,
                                                 drift=args.drift).examples(s)[0].ravel()
                                     for r in range(workers) for s in range(1, args.steps + 1)]))
    sample = np.sort(np.random.default_rng(5).choice(seen, max(1, len(seen) // 100), replace=False))
    mine = np.array_split(sample, workers)[rank]
    kv._barrier()
    time.sleep(args.delta_probe)
    pull(mine)
    push(mine, np.full((len(mine), args.dim), 1e-3, np.float32))
    mx.nd.waitall()
    kv._barrier()
    res.add(kind="probe", rows=int(len(sample)), seen=int(len(seen)), at=time.time())
    time.sleep(args.delta_probe)
kv._barrier()
if rank == 0:
    stats(kv)          # each server logs "stats: {json}": rows, pending, admitted, dropped, evicted, bytes
res.add(kind="done")
print(f"lifecycle worker {rank} done", flush=True)
