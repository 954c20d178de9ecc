"""A dist_sync training loop on stock MXNet 1.9.1 workers for the grow/shrink tests (tests/test_reshard.py).

The same start-up code in every job (set_optimizer, init_lazy, kv.init of the dense keys), then steps
--start+1 .. --steps. Deterministic: each worker's rows and gradients are functions of (rank, step) and of the
values it pulled, so a job restored from another's snapshots ends bit for bit where one run straight through ends
only if every value, optimizer state and update count carried over. Keys: a lazy row_sparse key split by rows over
the servers (3), a small dense key on one server (4), a big dense key split by elements (5); SGD with momentum and
wd on the servers (``--optimizer sgd-dense``: lazy_update=False, every row moves every step). At the end rank 0
pulls every row any worker used and the dense keys into <out>/final.npz.
"""
import argparse
import os

import mxnet as mx
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--start", type=int, default=0)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--rows", type=int, default=20000)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--seed", type=int, default=7)
p.add_argument("--optimizer", default="sgd", choices=["sgd", "sgd-dense"],
               help="sgd-dense: lazy_update=False, which the stock server runs on every row of the row_sparse key")
args = p.parse_args()

SPARSE_KEY, DENSE_KEY, BIG_KEY = 3, 4, 5
SMALL, BIG = 256, 12000         # with MXNET_KVSTORE_BIGARRAY_BOUND=10000: key 5 is split, key 4 is not
kv = mx.kv.create("dist_sync")
rank, nw = kv.rank, kv.num_workers
os.makedirs(args.out, exist_ok=True)
kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-4 if args.optimizer == "sgd" else 1e-2,
                                  rescale_grad=0.5, lazy_update=args.optimizer == "sgd"))
shape = (args.rows, args.dim)

from kvstore_lazy.worker import init_lazy  # noqa: E402

init_lazy(kv, SPARSE_KEY, shape, init=mx.init.Uniform(0.07), seed=args.seed)
kv.init(DENSE_KEY, mx.nd.array(np.linspace(-1, 1, SMALL, dtype=np.float32)))
kv.init(BIG_KEY, mx.nd.array(np.linspace(2, -2, BIG, dtype=np.float32)))


def ids_for(r: int, step: int) -> np.ndarray:
    rng = np.random.RandomState(1000 * step + r)
    hot = np.minimum(rng.zipf(1.3, args.batch) - 1, args.rows - 1)
    return np.unique(np.concatenate([hot, rng.randint(0, args.rows, 16)])).astype(np.int64)


def pull_rows(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull(SPARSE_KEY, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    return out.indices.asnumpy(), out.data.asnumpy()


dense, big = mx.nd.zeros(SMALL), mx.nd.zeros(BIG)
for step in range(args.start + 1, args.steps + 1):
    idx, vals = pull_rows(ids_for(rank, step))
    extra = ((idx[:, None] * 3 + np.arange(args.dim)[None, :] + step + rank) % 11 - 5).astype(np.float32) / 4
    kv.push(SPARSE_KEY, mx.nd.sparse.row_sparse_array((vals * 0.5 + extra, idx), shape=shape))
    for key, out, n in ((DENSE_KEY, dense, SMALL), (BIG_KEY, big, BIG)):
        kv.pull(key, out=out)
        kv.push(key, out * 0.1 + mx.nd.array(np.cos(np.arange(n) * (step + 1) + rank).astype(np.float32)))
    mx.nd.waitall()

kv._barrier()
if rank == 0:
    used = np.unique(np.concatenate([ids_for(r, s) for r in range(nw) for s in range(1, args.steps + 1)]))
    idx, vals = pull_rows(used)
    kv.pull(DENSE_KEY, out=dense)
    kv.pull(BIG_KEY, out=big)
    np.savez(os.path.join(args.out, "final.npz"), ids=idx, vals=vals, dense=dense.asnumpy(), big=big.asnumpy())
kv._barrier()
print(f"worker {rank} done after step {args.steps}", flush=True)
