"""mx.mod.Module training on a dist kvstore: `sparse.dot(csr data, row_sparse weight)` plus a bias and two dense
FullyConnected layers, `init_optimizer(kvstore=kv)` (update_on_kvstore), `prepare(batch, sparse_row_id_fn=...)`
(row_sparse_pull of the rows the batch uses), forward/backward/update for a few batches of deterministic per-rank
csr data.

In dist_async the workers take turns (rank 0 trains a batch, waits for its pushes to be answered, barrier, rank 1
trains a batch, ...), so the order in which the server applies updates is fixed and two runs can be compared.
Results (initial and final parameters, get_params(), per-step losses) go to <out>.rank<r>.npz.
"""
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common_train import connect, finish_train, optimizer_params, train_parser, train_steps  # noqa: E402

p = train_parser()
p.add_argument("--features", type=int, default=400)   # 400 x 16 = 6400 elements: partitioned when the bound is 1000
p.add_argument("--nnz", type=int, default=6, help="non-zeros per csr row")
args = p.parse_args()

kv, rank, nw = connect(args.mode)

data = mx.sym.Variable("data", stype="csr")
label = mx.sym.Variable("label")
w = mx.sym.Variable("emb_weight", stype="row_sparse", shape=(args.features, args.dim))
b = mx.sym.Variable("emb_bias", shape=(args.dim,))
h = mx.sym.tanh(mx.sym.broadcast_add(mx.sym.sparse.dot(data, w), b))
h = mx.sym.FullyConnected(h, num_hidden=args.hidden, name="fc1")
h = mx.sym.Activation(h, act_type="tanh")
out = mx.sym.FullyConnected(h, num_hidden=1, name="fc2")
net = mx.sym.LinearRegressionOutput(out, label, name="out")

rng = np.random.RandomState(1000 + rank)


def make_batch():
    # column ids skewed toward small features, so both ranks touch some of the same rows of emb_weight in the same step
    indptr, indices, values = [0], [], []
    for _ in range(args.batch):
        cols = np.unique(np.minimum(rng.zipf(1.4, args.nnz) - 1, args.features - 1))
        indices.extend(cols.tolist())
        values.extend(rng.uniform(-1, 1, len(cols)).tolist())
        indptr.append(len(indices))
    x = mx.nd.sparse.csr_matrix((np.array(values, np.float32), np.array(indices, np.int64),
                                 np.array(indptr, np.int64)), shape=(args.batch, args.features))
    y = mx.nd.array(rng.randn(args.batch, 1))
    return mx.io.DataBatch(data=[x], label=[y])


batches = [make_batch() for _ in range(args.steps)]

mod = mx.mod.Module(net, data_names=["data"], label_names=["label"], context=mx.cpu())
mod.bind(data_shapes=[("data", (args.batch, args.features))], label_shapes=[("label", (args.batch, 1))])
mod.init_params(initializer=mx.init.Xavier(magnitude=2.0))
opt_params = optimizer_params(args.optimizer, args.batch, nw)
# every rank: set_optimizer, then kv.init (row_sparse emb_weight) / kv.broadcast (dense), with their barriers
mod.init_optimizer(kvstore=kv, optimizer=args.optimizer, optimizer_params=opt_params)
assert mod._update_on_kvstore and mod._kvstore is kv
shapes = {name: arr.shape for name, arr in mod.get_params()[0].items()}
arg_names = sorted(shapes)


def row_ids(batch):
    return {"emb_weight": batch.data[0].indices}


def weights(prefix):
    """Every parameter as the servers hold it now (call after a barrier); Module's kv keys are the names."""
    res = {}
    for name in arg_names:
        shape = shapes[name]
        if name == "emb_weight":
            o = mx.nd.sparse.zeros("row_sparse", shape)
            kv.row_sparse_pull(name, out=o, row_ids=mx.nd.arange(0, shape[0], dtype="int64"))
        else:
            o = mx.nd.zeros(shape)
            kv.pull(name, out=o)
        res[prefix + name] = o.asnumpy()
    return res


results = weights("init_")
results["touched"] = np.unique(np.concatenate([bt.data[0].indices.asnumpy() for bt in batches])).astype(np.int64)
kv._barrier()


def train_step(step):
    batch = batches[step]
    mod.prepare(batch, sparse_row_id_fn=row_ids)
    mod.forward(batch, is_train=True)
    pred = mod.get_outputs()[0].asnumpy()
    mod.backward()
    mod.update()
    results[f"loss_{step}"] = ((pred - batch.label[0].asnumpy()) ** 2).mean(axis=1)
    results[f"pred_{step}"] = pred


train_steps(kv, args.mode, args.steps, train_step, weights, results)
# Module's own view: dense params as this rank's last pushpull returned them, emb_weight pulled with all its rows
arg_params, _ = mod.get_params()
for name in arg_names:
    results["getparams_" + name] = arg_params[name].asnumpy()
finish_train(kv, args.out, results)
