"""Gluon training on a dist kvstore, as a user writes it: a sparse embedding (row_sparse weight via
SparseEmbedding, or a dense weight with a row_sparse gradient via nn.Embedding(sparse_grad=True)) feeding Dense
layers, `Trainer(..., kvstore=kv)` (update_on_kvstore), a few steps on deterministic per-rank data.

In dist_async the workers take turns (rank 0 trains a step, waits for its pushes to be answered, barrier, rank 1
trains a step, ...), so the order in which the server applies updates is fixed and two runs can be compared.
Results (initial and final parameters, per-step losses and weights) go to <out>.rank<r>.npz.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet.gluon.contrib.nn import SparseEmbedding

sys.path.insert(0, os.path.dirname(__file__))
from common_train import connect, finish_train, optimizer_params, train_parser, train_steps  # noqa: E402

p = train_parser()
p.add_argument("--embedding", default="sparse", help="sparse (SparseEmbedding, row_sparse weight) | "
                                                     "sparse_grad (nn.Embedding(sparse_grad=True), dense weight)")
p.add_argument("--vocab", type=int, default=500)   # 500 x 16 = 8000 elements: partitioned when the bound is 1000
p.add_argument("--seq", type=int, default=4)
args = p.parse_args()

kv, rank, nw = connect(args.mode)
ctx = mx.cpu()


class Net(gluon.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            if args.embedding == "sparse":
                self.emb = SparseEmbedding(args.vocab, args.dim, weight_initializer=mx.init.Uniform(0.1))
            else:
                self.emb = nn.Embedding(args.vocab, args.dim, sparse_grad=True,
                                        weight_initializer=mx.init.Uniform(0.1))
            self.fc1 = nn.Dense(args.hidden, in_units=args.dim, activation="tanh")
            self.fc2 = nn.Dense(1, in_units=args.hidden)

    def forward(self, x):
        return self.fc2(self.fc1(self.emb(x).mean(axis=1)))


net = Net(prefix="net_")
net.initialize(mx.init.Xavier(magnitude=2.0), ctx=ctx)
params = net.collect_params()
names = sorted(params.keys())          # the Trainer's kv keys are the indices in this order
emb_name = "net_sparseembedding0_weight" if args.embedding == "sparse" else "net_embedding0_weight"
assert emb_name in names, names
sparse_weight = args.embedding == "sparse"

opt_params = optimizer_params(args.optimizer, args.batch, nw)
trainer = gluon.Trainer(params, args.optimizer, opt_params, kvstore=kv)
assert trainer._kvstore is None  # created lazily, below, on every rank at the same point

rng = np.random.RandomState(1000 + rank)
# ids skewed toward small rows, so both ranks touch some of the same rows in the same step
batches = [(np.minimum(rng.zipf(1.5, (args.batch, args.seq)) - 1, args.vocab - 1).astype(np.float32),
            rng.randn(args.batch, 1).astype(np.float32)) for _ in range(args.steps)]
all_rows = mx.nd.arange(0, args.vocab, dtype="int64")
touched = np.unique(np.concatenate([x.ravel() for x, _ in batches])).astype(np.int64)
loss_fn = gluon.loss.L2Loss()


def weights(prefix):
    """Every parameter as the servers hold it now (call after a barrier)."""
    res = {}
    for idx, name in enumerate(names):
        if name == emb_name and sparse_weight:
            out = mx.nd.sparse.zeros("row_sparse", params[name].shape)
            kv.row_sparse_pull(idx, out=out, row_ids=all_rows)
            res[prefix + name] = out.asnumpy()
        else:
            out = mx.nd.zeros(params[name].shape)
            kv.pull(idx, out=out)
            res[prefix + name] = out.asnumpy()
    return res


# Initialise the kvstore on every rank before the loop (set_optimizer, kv.init / broadcast with their barriers),
# so the turn-taking barriers below cannot pair up with kv.init's barrier.
if sparse_weight:
    params[emb_name].row_sparse_data(mx.nd.array([0], dtype="int64"))
else:
    trainer._init_kvstore()
    trainer._init_params()
assert trainer._kvstore is kv and trainer._update_on_kvstore
results = weights("init_")
results["touched"] = touched
kv._barrier()


def train_step(step):
    x, y = (mx.nd.array(a) for a in batches[step])
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(1)
    results[f"loss_{step}"] = loss.asnumpy()
    # the dense weight this rank got back from its pushpull
    results[f"fc1_local_{step}"] = params["net_dense0_weight"].data().asnumpy()


train_steps(kv, args.mode, args.steps, train_step, weights, results)
finish_train(kv, args.out, results)
