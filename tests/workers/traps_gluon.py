"""The Gluon job of tests/test_traps.py, written as a user of MXNet's sparse Gluon tutorial writes it (no
kvstore_lazy call): a SparseEmbedding of 2000 rows (row_sparse weight, Uniform(0.1)) trained a few SGD steps on
dist_sync, rows pulled with ``row_sparse_data`` before each forward.

The batch-size trap of that path (issue 28, trap 10) is avoided as the manual shows: ``row_sparse_data`` before the
first step sets the kvstore up with the optimizer's ``rescale_grad`` (1.0 by default), so a later
``trainer.step(batch_size)`` raises "Possible change in the batch_size"; giving ``rescale_grad=1/batch_size`` to
the optimizer and calling ``trainer.step(1)`` scales the same way and never trips it.

Writes <out>/rank<r>.json: the rows each rank fed, their values when first pulled, the losses, whether kvstore_lazy's
hooks ran in this process. Rank 0 saves the parameters to --save after the last step.
"""
import argparse
import json
import os
import sys

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--save", default="")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--step-by-batch", action="store_true", help="the tutorial's trainer.step(batch_size) (MXNet raises)")
args = p.parse_args()

BATCH = 3
kv = mx.kv.create("dist_sync")
net = gluon.contrib.nn.SparseEmbedding(2000, 4, weight_initializer=mx.init.Uniform(0.1), prefix="emb_")
net.initialize()
optimizer = {"learning_rate": 0.5} if args.step_by_batch else {"learning_rate": 0.5, "rescale_grad": 1.0 / BATCH}
trainer = gluon.Trainer(net.collect_params(), "sgd", optimizer, kvstore=kv)
ids = mx.nd.array([[3, 17, 1999], [17, 400, 3]][kv.rank])
first = net.weight.row_sparse_data(ids)
result = {"rows": first.indices.asnumpy().tolist(), "init": first.data.asnumpy().tolist(), "losses": []}
for step in range(args.steps):
    net.weight.row_sparse_data(ids)
    with autograd.record():
        loss = (net(ids) ** 2).sum()
    loss.backward()
    trainer.step(BATCH if args.step_by_batch else 1)
    result["losses"].append(float(loss.asscalar()))
mx.nd.waitall()
kv._barrier()
if args.save and kv.rank == 0:
    net.save_parameters(args.save)
result["hooks"] = "kvstore_lazy.worker.integration" in sys.modules
with open(os.path.join(args.out, f"rank{kv.rank}.json"), "w") as fh:
    json.dump(result, fh)
