"""A stock worker for tests/test_metrics_integration.py: a lazy row_sparse key and a small dense key trained in
dist_sync, one bad command, a tagged snapshot, then LAZY_STATS at a quiescent moment; rank 0 then waits (up to
--hold seconds) for the test to create <out>.go while the servers are scraped, and the job ends.

Results (<out>.rank<r>.npz): steps, pulls of each kind and the row ids this worker trained."""
import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402
from kvstore_lazy.protocol import mxnet as proto  # noqa: E402
from kvstore_lazy.worker import init_lazy, snapshot, stats  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--rows", type=int, default=100_000)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--hold", type=float, default=120.0)
args = p.parse_args()

SPARSE, DENSE = 3, 5
kv = mx.kv.create("dist_sync")
rank = kv.rank
kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=0.5))
shape = (args.rows, args.dim)
init_lazy(kv, SPARSE, shape, init=mx.init.Uniform(0.07), seed=7)
kv.init(DENSE, mx.nd.ones((4, 4)))

rng = np.random.RandomState(100 + rank)
trained = set()
dense_out = mx.nd.zeros((4, 4))
for step in range(args.steps):
    ids = np.unique(rng.randint(0, args.rows, 50))
    trained.update(ids.tolist())
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull(SPARSE, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    # the gradient uses the pulled rows, as training does: each step waits for its pull (pushing a fresh array while
    # the previous step's pull and push of the key are in flight made a stock worker send row lens that disagree
    # with its values, once in 25 runs; the server refused the push)
    weights = out.data.asnumpy()
    grad = mx.nd.sparse.row_sparse_array(((0.5 + rank + 0.01 * weights).astype(np.float32), out.indices.asnumpy()),
                                         shape=shape)
    kv.push(SPARSE, grad)
    kv.push(DENSE, mx.nd.ones((4, 4)) * (step + 1))
    kv.pull(DENSE, out=dense_out)
    dense_out.wait_to_read()
mx.nd.waitall()          # every push answered: the servers applied every round
kv._barrier()
if rank == 0:
    kv._send_command_to_servers(proto.LAZY_DECLARE, "not json")   # a bad command: each server counts one
    snapshot(kv, {"step": args.steps})   # LAZY_SNAPSHOT: each server writes tagged/rank<r>
    stats(kv)            # each server logs "stats: {json}", its LAZY_STATS reply
    open(args.out + ".ready", "w").close()
    deadline = time.monotonic() + args.hold
    while not os.path.exists(args.out + ".go"):
        if time.monotonic() > deadline:
            sys.exit("no go file from the test")
        time.sleep(0.05)
kv._barrier()
save(args.out, rank, {"steps": args.steps, "trained": np.array(sorted(trained), np.int64)})
print("worker", rank, "done", flush=True)
