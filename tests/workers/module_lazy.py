"""mx.mod.Module wide&deep-style training on a dist kvstore, written as a user writes it (no kvstore_lazy calls):
a one-hot categorical feature with few values and a multi-hot id feature (csr), each `sparse.dot` with a row_sparse
weight of --input-dim rows, then FullyConnected layers; `fit(..., sparse_row_id_fn=...)` with
`mx.callback.do_checkpoint` (rank 0), `save_checkpoint(save_optimizer_states=True)` at the end, and
`Module.load(..., load_optimizer_states=True)` + `fit(begin_epoch=...)` to resume. With the patched mxnet and
KVSTORE_LAZY=1 the weights are lazy.

Epochs [--begin, --end) of the same per-rank batches. Results go to <out>.rank<r>.npz: the rows each rank fed, the
peak RSS, and (rank 0) what mx.nd.load reads back from the last checkpoint.
"""
import argparse
import logging
import os
import sys
import time

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

CATEGORIES = [3, 31337, 99998]

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--input-dim", type=int, default=100000)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--optimizer", default="sgd", help="sgd (momentum) | adam")
p.add_argument("--batches", type=int, default=3, help="batches per epoch")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--begin", type=int, default=0)
p.add_argument("--end", type=int, default=3)
p.add_argument("--prefix", required=True, help="checkpoint prefix (rank 0 writes <prefix>-<epoch>.params ...)")
p.add_argument("--resume", help="checkpoint prefix to Module.load(resume, begin, load_optimizer_states=True) from")
p.add_argument("--linger", action="store_true", help="after saving, wait to be killed (a crash, not an exit)")
p.add_argument("--no-states", action="store_true", help="skip optimizer states (stock mxnet refuses them on dist)")
p.add_argument("--constant-init", action="store_true",
               help="Constant(0.05) for both sparse weights (their __init__ attribute): no random draws for them, so "
                    "a stock and a lazy run start from the same weights")
args = p.parse_args()
logging.basicConfig(level=logging.INFO)

kv = mx.kv.create(args.mode)
rank, nw = kv.rank, kv.num_workers
mx.random.seed(42)
np.random.seed(42)
categories = [c % args.input_dim for c in CATEGORIES]
n = args.batches * args.batch

rng = np.random.RandomState(1000 + rank)
cat_cols = rng.choice(categories, size=n)
indptr, indices, values = [0], [], []
for _ in range(n):
    cols = np.unique(np.minimum(rng.zipf(1.3, 4) - 1, args.input_dim - 1))
    indices += cols.tolist()
    values += rng.uniform(-1, 1, len(cols)).tolist()
    indptr.append(len(indices))
labels = rng.randn(n, 1).astype(np.float32)


def csr(rows_values, rows_cols):
    ptr = np.cumsum([0] + [len(c) for c in rows_cols]).astype(np.int64)
    return mx.nd.sparse.csr_matrix((np.concatenate(rows_values).astype(np.float32),
                                    np.concatenate(rows_cols).astype(np.int64), ptr), shape=(len(rows_cols),
                                                                                             args.input_dim))


batches = []
for b in range(args.batches):
    rows = range(b * args.batch, (b + 1) * args.batch)
    x_cat = csr([[1.0] for _ in rows], [[cat_cols[r]] for r in rows])
    x_ids = csr([values[indptr[r]:indptr[r + 1]] for r in rows], [indices[indptr[r]:indptr[r + 1]] for r in rows])
    batches.append(mx.io.DataBatch(data=[x_cat, x_ids], label=[mx.nd.array(labels[list(rows)])]))


class Batches(mx.io.DataIter):
    """The same csr batches every epoch (NDArrayIter would densify csr slices)."""

    def __init__(self):
        super().__init__(args.batch)
        self.provide_data = [mx.io.DataDesc("cat", (args.batch, args.input_dim)),
                             mx.io.DataDesc("ids", (args.batch, args.input_dim))]
        self.provide_label = [mx.io.DataDesc("label", (args.batch, 1))]
        self.at = 0

    def reset(self):
        self.at = 0

    def next(self):
        if self.at >= len(batches):
            raise StopIteration
        self.at += 1
        return batches[self.at - 1]


train = Batches()

if args.resume:
    mod = mx.mod.Module.load(args.resume, args.begin, load_optimizer_states=not args.no_states,
                             data_names=["cat", "ids"], label_names=["label"], context=mx.cpu())
else:
    x_cat = mx.sym.Variable("cat", stype="csr")
    x_ids = mx.sym.Variable("ids", stype="csr")
    init = {"init": mx.init.Constant(0.05)} if args.constant_init else {}
    w_cat = mx.sym.Variable("cat_weight", stype="row_sparse", shape=(args.input_dim, args.dim), **init)
    w_ids = mx.sym.Variable("ids_weight", stype="row_sparse", shape=(args.input_dim, args.dim), **init)
    h = mx.sym.concat(mx.sym.sparse.dot(x_cat, w_cat), mx.sym.sparse.dot(x_ids, w_ids), dim=1)
    h = mx.sym.FullyConnected(h, num_hidden=16, name="fc1")
    h = mx.sym.Activation(h, act_type="tanh")
    out = mx.sym.FullyConnected(h, num_hidden=1, name="fc2")
    net = mx.sym.LinearRegressionOutput(out, mx.sym.Variable("label"), name="out")
    mod = mx.mod.Module(net, data_names=["cat", "ids"], label_names=["label"], context=mx.cpu())

opt_params = {"rescale_grad": 1.0 / (args.batch * nw)}
if args.optimizer == "sgd":
    opt_params.update(learning_rate=0.5, momentum=0.9, wd=1e-3)
else:
    opt_params.update(learning_rate=0.05, wd=1e-4)


def row_ids(batch):
    return {"cat_weight": batch.data[0].indices, "ids_weight": batch.data[1].indices}


mod.fit(train, kvstore=kv, optimizer=args.optimizer, optimizer_params=opt_params, eval_metric="mse",
        initializer=mx.init.Xavier(magnitude=2.0), begin_epoch=args.begin, num_epoch=args.end,
        sparse_row_id_fn=row_ids,
        epoch_end_callback=mx.callback.do_checkpoint(args.prefix) if rank == 0 else None)
mx.nd.waitall()
kv._barrier()
results = {"cat_rows": np.unique(cat_cols).astype(np.int64), "ids_rows": np.unique(indices).astype(np.int64)}
if rank == 0:
    mod.save_checkpoint(args.prefix, args.end, save_optimizer_states=not args.no_states)
    for name, value in mx.nd.load("%s-%04d.params" % (args.prefix, args.end)).items():
        results[f"ckpt_stype_{name}"] = np.array(value.stype)
        if value.stype == "row_sparse":
            results[f"ckpt_indices_{name}"] = value.indices.asnumpy()
            results[f"ckpt_data_{name}"] = value.data.asnumpy()
        else:
            results[f"ckpt_value_{name}"] = value.asnumpy()
kv._barrier()
with open("/proc/self/status") as fh:
    results["vmhwm_kb"] = np.array(next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")))
results["kvstore_lazy_imported"] = np.array("kvstore_lazy.integration" in sys.modules)
save(args.out, rank, results)
print("worker", rank, "done; VmHWM", int(results["vmhwm_kb"]), "kB", flush=True)
if args.linger:
    time.sleep(600)
