"""mx.mod.Module wide&deep-style training on a dist kvstore, written as a user writes it (no kvstore_lazy calls):
a one-hot categorical feature with few values and a multi-hot id feature (csr), each `sparse.dot` with a row_sparse
weight of --input-dim rows, then FullyConnected layers; `fit(..., sparse_row_id_fn=...)` with
`mx.callback.do_checkpoint` (rank 0), `save_checkpoint(save_optimizer_states=True)` at the end, and
`Module.load(..., load_optimizer_states=True)` + `fit(begin_epoch=...)` to resume. With the patched mxnet and
KVSTORE_LAZY=1 the weights are lazy.

Epochs [--begin, --end) of the same per-rank batches. Results go to <out>.rank<r>.npz: the rows each rank fed, the
peak RSS, and (rank 0) what mx.nd.load reads back from the last checkpoint.
"""
import logging
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common_train import CATEGORIES, connect, finish_lazy, lazy_parser, optimizer_params, read_back  # noqa: E402

p = lazy_parser(batch=16)
p.add_argument("--batches", type=int, default=3, help="batches per epoch")
p.add_argument("--begin", type=int, default=0)
p.add_argument("--end", type=int, default=3)
p.add_argument("--prefix", required=True, help="checkpoint prefix (rank 0 writes <prefix>-<epoch>.params ...)")
p.add_argument("--resume", help="checkpoint prefix to Module.load(resume, begin, load_optimizer_states=True) from")
args = p.parse_args()
logging.basicConfig(level=logging.INFO)

kv, rank, nw = connect(args.mode)
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

opt_params = optimizer_params(args.optimizer, args.batch, nw)


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
    read_back("%s-%04d.params" % (args.prefix, args.end), results)
finish_lazy(kv, args.out, results, args.linger)
