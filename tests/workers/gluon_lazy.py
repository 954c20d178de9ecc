"""Gluon wide&deep-style training on a dist kvstore, written as a user writes it (no kvstore_lazy calls): a
categorical feature with few values and a multi-hot id feature, each through a SparseEmbedding (row_sparse weight)
of --input-dim rows, then Dense layers; Trainer(update_on_kvstore), save_parameters/save_states,
load_parameters/load_states. With the patched mxnet and KVSTORE_LAZY=1 the embeddings are lazy.

Trains steps [--start, --stop) of a fixed per-rank batch sequence (so a run split in two with a checkpoint between
can be compared with an uninterrupted one). Results go to <out>.rank<r>.npz: the rows each rank fed, the peak RSS,
and (rank 0, --save) what mx.nd.load reads back from the checkpoint.
"""
import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet.gluon.contrib.nn import SparseEmbedding

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

CATEGORIES = [3, 31337, 99998]   # the 3 values the categorical feature takes (all < the smallest input_dim used)

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--input-dim", type=int, default=100000)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--optimizer", default="sgd", help="sgd (momentum) | adam")
p.add_argument("--steps", type=int, default=8, help="length of the batch sequence")
p.add_argument("--start", type=int, default=0)
p.add_argument("--stop", type=int, default=None)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--load", help="checkpoint prefix to restore from (<prefix>.params, <prefix>.states)")
p.add_argument("--save", help="checkpoint prefix rank 0 writes at the end")
p.add_argument("--no-states", action="store_true", help="skip save_states (stock mxnet refuses it on dist)")
p.add_argument("--linger", action="store_true", help="after saving, wait to be killed (a crash, not an exit)")
p.add_argument("--constant-init", action="store_true",
               help="Constant(0.05) for both embeddings: no random draws for them, so a stock and a lazy run start "
                    "from the same weights (the Dense layers draw the same Xavier values)")
args = p.parse_args()
stop = args.steps if args.stop is None else args.stop

kv = mx.kv.create(args.mode)
rank, nw = kv.rank, kv.num_workers
mx.random.seed(42)
np.random.seed(42)
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


net = Net(prefix="net_")
net.initialize(mx.init.Xavier(magnitude=2.0))   # the ids embedding has no initializer of its own: Xavier too
if args.load:
    net.load_parameters(args.load + ".params")
params = net.collect_params()
opt_params = {"rescale_grad": 1.0 / (args.batch * nw)}
if args.optimizer == "sgd":
    opt_params.update(learning_rate=0.5, momentum=0.9, wd=1e-3)
else:
    opt_params.update(learning_rate=0.05, wd=1e-4)
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
    loaded = mx.nd.load(args.save + ".params")
    for name, value in loaded.items():
        results[f"ckpt_stype_{name}"] = np.array(value.stype)
        if value.stype == "row_sparse":
            results[f"ckpt_indices_{name}"] = value.indices.asnumpy()
            results[f"ckpt_data_{name}"] = value.data.asnumpy()
        else:
            results[f"ckpt_value_{name}"] = value.asnumpy()
    # what this process holds of each embedding: no full weight anywhere
    results["local_rows_cat"] = np.array(params["net_cat_weight"]._data[0].indices.shape[0])
kv._barrier()
with open("/proc/self/status") as fh:
    results["vmhwm_kb"] = np.array(next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")))
results["kvstore_lazy_imported"] = np.array("kvstore_lazy.integration" in sys.modules)
save(args.out, rank, results)
print("worker", rank, "done; VmHWM", int(results["vmhwm_kb"]), "kB", flush=True)
if args.linger:
    time.sleep(600)
