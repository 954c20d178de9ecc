"""Stock Gluon ``Trainer.step`` on a small row_sparse Parameter (issue 11, defect 9): a (2, 10) weight with
``stype='row_sparse', grad_stype='row_sparse'``, SGD with learning rate 1.0 on the servers (update_on_kvstore), each
worker's gradient ``(rank + 1) * w`` over all rows (the gradient of ``(rank + 1) / 2 * sum(w * w)``).

rescale_grad is 1/8 (set up front: the kvstore has it before the first step), so with 3 workers one step is
``w - (1 + 2 + 3) * w / 8 = w / 4``: every value stays exact in float32 (a power-of-two scaling), whatever order the
server sums the pushes in. The pulled weights are checked against that, and the results go to <out>.rank<r>.npz.
"""
import argparse
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--keys", type=int, default=4, help="Parameters, each a (2, 10) row_sparse weight")
p.add_argument("--check-every", type=int, default=1, help="pull and check the weights after every N steps")
p.add_argument("--grad", default="autograd", help="autograd: backward of (rank + 1) / 2 * sum(w * w) over the pulled "
                                                  "rows; direct: write (rank + 1) * w into the gradient (w as "
                                                  "expected), so the push does not wait for the pull")
p.add_argument("--congest", type=int, default=0, help="also push a dense key of this many float32 before each step "
                                                      "(partitioned over the servers), which keeps the connections "
                                                      "busy: the row_sparse pushes wait behind it in ZeroMQ's queue")
args = p.parse_args()

kv = mx.kv.create("dist_sync")
rank, nw = kv.rank, kv.num_workers
INIT = 2.0 ** 100        # w / 4 per step: 2^100 -> 2^-100 in 100 steps, exact all along
params = [gluon.Parameter(f"w{k}", shape=(2, 10), stype="row_sparse", grad_stype="row_sparse",
                          init=mx.init.Constant(INIT)) for k in range(args.keys)]
for param in params:
    param.initialize(ctx=mx.cpu())
trainer = gluon.Trainer(params, "sgd", {"learning_rate": 1.0, "rescale_grad": 1.0 / 8}, kvstore=kv)
all_rows = mx.nd.arange(0, 2, dtype="int64")
factor = 1.0 - sum(r + 1 for r in range(nw)) / 8.0
BIG = 999   # the congesting dense key (the Trainer's keys are 0..keys-1)
if args.congest:
    kv.init(BIG, mx.nd.zeros(args.congest))
expected = np.float32(INIT)
seen = []
for step in range(args.steps):
    if args.grad == "autograd":
        with autograd.record():
            ws = [param.row_sparse_data(all_rows) for param in params]
            loss = sum((w * w).sum() for w in ws) * ((rank + 1) / 2.0)
        loss.backward()
        trainer.step(1)
    else:
        for param in params:
            param.row_sparse_data(all_rows)     # the forward's pull, not waited for
            param.list_grad()[0][:] = mx.nd.full((2, 10), (rank + 1) * expected)
        if args.congest:
            kv.push(BIG, mx.nd.ones(args.congest))
        trainer.step(1, ignore_stale_grad=True)
    expected = np.float32(expected * np.float32(factor))
    if (step + 1) % args.check_every and step + 1 < args.steps:
        continue
    pulled = [param.row_sparse_data(all_rows).asnumpy() for param in params]
    for k, value in enumerate(pulled):
        assert np.all(value == expected), f"rank {rank} step {step} key {k}: {value.ravel()[:4]} != {expected}"
    seen.append(pulled[0][0, 0])
save(args.out, rank, {"seen": np.array(seen, np.float32), "final": np.stack(pulled)})
print(f"rank {rank} done; {args.steps} steps", flush=True)
