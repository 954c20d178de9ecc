"""Gluon wide&deep-style training on a dist kvstore, written as a user writes it (no kvstore_lazy calls): a
categorical feature with few values and a multi-hot id feature, each through a SparseEmbedding (row_sparse weight)
of --input-dim rows, then Dense layers; Trainer(update_on_kvstore), save_parameters/save_states,
load_parameters/load_states. With the patched mxnet and KVSTORE_LAZY=1 the embeddings are lazy.

Trains steps [--start, --stop) of a fixed per-rank batch sequence (so a run split in two with a checkpoint between
can be compared with an uninterrupted one). Results go to <out>.rank<r>.npz: the rows each rank fed, the peak RSS,
and (rank 0, --save) what mx.nd.load reads back from the checkpoint.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet.gluon.contrib.nn import SparseEmbedding

sys.path.insert(0, os.path.dirname(__file__))
from common_train import CATEGORIES, connect, finish_lazy, lazy_parser, optimizer_params, read_back  # noqa: E402

p = lazy_parser(batch=32)
p.add_argument("--steps", type=int, default=8, help="length of the batch sequence")
p.add_argument("--start", type=int, default=0)
p.add_argument("--stop", type=int, default=None)
p.add_argument("--load", help="checkpoint prefix to restore from (<prefix>.params, <prefix>.states)")
p.add_argument("--save", help="checkpoint prefix rank 0 writes at the end")
p.add_argument("--local-load", help="no job: load_parameters of this file into a fresh local net, save what it holds")
args = p.parse_args()
stop = args.steps if args.stop is None else args.stop
categories = [c % args.input_dim for c in CATEGORIES]


class Net(gluon.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            constant = mx.init.Constant(0.05) if args.constant_init else None
            self.cat = SparseEmbedding(args.input_dim, args.dim, weight_initializer=constant or mx.init.Uniform(0.1),
                                       prefix="cat_")
            self.ids = SparseEmbedding(args.input_dim, args.dim, weight_initializer=constant, prefix="ids_")
            self.fc1 = nn.Dense(16, in_units=2 * args.dim, activation="tanh", prefix="fc1_")
            self.fc2 = nn.Dense(1, in_units=16, prefix="fc2_")

    def forward(self, cat, ids):
        h = mx.nd.concat(self.cat(cat).reshape((0, -1)), self.ids(ids).mean(axis=1), dim=1)
        return self.fc2(self.fc1(h))


if args.local_load:
    local = Net(prefix="net_")
    local.load_parameters(args.local_load)
    held = {name: param._data[0] for name, param in local._collect_params_with_prefix().items()}
    np.savez(args.out, **{f"{kind}_{name}": getattr(value, kind).asnumpy() for name, value in held.items()
                          if value.stype == "row_sparse" for kind in ("indices", "data")})
    sys.exit(0)

kv, rank, nw = connect(args.mode)
net = Net(prefix="net_")
net.initialize(mx.init.Xavier(magnitude=2.0))   # the ids embedding has no initializer of its own: Xavier too
if args.load:
    net.load_parameters(args.load + ".params")
params = net.collect_params()
opt_params = optimizer_params(args.optimizer, args.batch, nw)
trainer = gluon.Trainer(params, args.optimizer, opt_params, kvstore=kv)
if args.load and os.path.exists(args.load + ".states"):
    trainer.load_states(args.load + ".states")   # every worker (it is collective, as kv.init is)

rng = np.random.RandomState(1000 + rank)
batches = []
for _ in range(args.steps):
    cat = rng.choice(categories, size=(args.batch, 1)).astype(np.float32)
    ids = np.minimum(rng.zipf(1.3, (args.batch, 3)) - 1, args.input_dim - 1).astype(np.float32)
    y = rng.randn(args.batch, 1).astype(np.float32)
    batches.append((cat, ids, y))
loss_fn = gluon.loss.L2Loss()
results = {"cat_rows": np.zeros(0, np.int64), "ids_rows": np.zeros(0, np.int64)}
for step in range(args.start, stop):
    cat, ids, y = batches[step]
    results["cat_rows"] = np.union1d(results["cat_rows"], cat.astype(np.int64).ravel())
    results["ids_rows"] = np.union1d(results["ids_rows"], ids.astype(np.int64).ravel())
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(cat), mx.nd.array(ids)), mx.nd.array(y))
    loss.backward()
    trainer.step(1)
    results[f"loss_{step}"] = loss.asnumpy()
mx.nd.waitall()
kv._barrier()   # every rank's last step is in before rank 0 saves

if args.save and rank == 0:
    net.save_parameters(args.save + ".params")
    if not args.no_states:
        trainer.save_states(args.save + ".states")
    read_back(args.save + ".params", results)
    # what this process holds of each embedding: no full weight anywhere
    results["local_rows_cat"] = np.array(params["net_cat_weight"]._data[0].indices.shape[0])
finish_lazy(kv, args.out, results, args.linger)
