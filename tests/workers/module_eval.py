"""A Module job written the way MXNet's example/sparse/linear_classification and factorization_machine are: csr
data, row_sparse weights (`w`: a wide part, `v`: a factor part feeding a dense layer), `mod.prepare(batch,
sparse_row_id_fn)` before each step, and before scoring and saving each epoch `mod.prepare(None, all_rows)`: a
row_sparse_pull of every row (what those examples do so the model they score and save is complete). Then
`mod.score(test, 'nll_loss')` and (rank 0) `mod.save_checkpoint(prefix, epoch)`.

The test set uses rows the training data never does (training ids are drawn from the lower half of the rows, test
ids from all of them), so a checkpoint that held only trained rows and loaded the others as zeros would score
differently from the job.

Modes:
- a dist job (default). `--stock-init`: the row_sparse weights start from the values lazy servers compute, built
  with kvstore_lazy.numerics.initializers for (seed 0, key = position in the Module's parameter order, row), so a
  stock run
  on stock servers starts where a lazy one does (the dense layer draws the same values from mx.random in both).
  Results in <out>.rank<r>.npz: eval_<epoch>, the rows each rank trained, the rows the executor held when scoring.
- `--score PREFIX --epoch E`: no kvstore; a fresh local Module from `mx.model.load_checkpoint(PREFIX, E)` and
  `set_params`, scoring the same test set; the score goes to <out>.npz.
"""
import argparse
import logging
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--input-dim", type=int, default=100_000)
p.add_argument("--factors", type=int, default=4)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--batches", type=int, default=4, help="training batches per rank and epoch")
p.add_argument("--test-batches", type=int, default=4)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--optimizer", default="adam")
p.add_argument("--prefix", help="checkpoint prefix (rank 0 saves <prefix>-<epoch>.params each epoch)")
p.add_argument("--stock-init", action="store_true")
p.add_argument("--score", help="score the checkpoint <SCORE>-<epoch>.params locally instead of training")
p.add_argument("--epoch", type=int, default=0)
args = p.parse_args()
logging.basicConfig(level=logging.INFO)
D = args.input_dim
INIT = mx.init.Uniform(0.1)


def csr_batches(rng, count, high):
    """`count` batches of --batch rows, 1 to 6 feature ids per row in [0, high), values in (-1, 1), and labels from
    a fixed hidden rule (so the model has something to learn)."""
    out = []
    for _ in range(count):
        cols, vals, ptr, labels = [], [], [0], []
        for _ in range(args.batch):
            ids = np.unique((rng.zipf(1.2, rng.randint(1, 7)) * 7919) % high)
            x = rng.uniform(-1, 1, len(ids))
            cols += ids.tolist()
            vals += x.tolist()
            ptr.append(len(cols))
            labels.append(float(np.sum(x * np.where(ids % 3 == 0, 1.0, -1.0)) > 0))
        data = mx.nd.sparse.csr_matrix((np.array(vals, np.float32), np.array(cols, np.int64),
                                        np.array(ptr, np.int64)), shape=(args.batch, D))
        out.append(mx.io.DataBatch(data=[data], label=[mx.nd.array(labels)]))
    return out


class Batches(mx.io.DataIter):
    """A fixed list of csr batches (NDArrayIter would densify csr slices)."""

    def __init__(self, batches):
        super().__init__(args.batch)
        self.batches, self.at = batches, 0
        self.provide_data = [mx.io.DataDesc("data", (args.batch, D))]
        self.provide_label = [mx.io.DataDesc("softmax_label", (args.batch,))]

    def reset(self):
        self.at = 0

    def next(self):
        if self.at >= len(self.batches):
            raise StopIteration
        self.at += 1
        return self.batches[self.at - 1]


def network():
    data = mx.sym.Variable("data", stype="csr")
    w = mx.sym.Variable("w", stype="row_sparse", shape=(D, 2))
    v = mx.sym.Variable("v", stype="row_sparse", shape=(D, args.factors))
    wide = mx.sym.sparse.dot(data, w)
    deep = mx.sym.FullyConnected(mx.sym.tanh(mx.sym.sparse.dot(data, v)), num_hidden=2, name="fc")
    return mx.sym.SoftmaxOutput(wide + deep, mx.sym.Variable("softmax_label"), name="softmax")


test = Batches(csr_batches(np.random.RandomState(7), args.test_batches, D))

if args.score:
    symbol, arg_params, aux_params = mx.model.load_checkpoint(args.score, args.epoch)
    mod = mx.mod.Module(symbol, data_names=["data"], label_names=["softmax_label"], context=mx.cpu())
    mod.bind(data_shapes=test.provide_data, label_shapes=test.provide_label, for_training=False)
    mod.set_params(arg_params, aux_params)
    score = dict(mod.score(test, "nll_loss"))["nll-loss"]
    save(args.out, 0, {"score": np.float64(score), "w_rows": np.array(arg_params["w"].indices.shape[0])})
    print("scored", score, flush=True)
    sys.exit(0)

kv = mx.kv.create(args.mode)
rank, nw = kv.rank, kv.num_workers
mx.random.seed(42)
np.random.seed(42)
train = Batches(csr_batches(np.random.RandomState(1000 + rank), args.batches, D // 2))

mod = mx.mod.Module(network(), data_names=["data"], label_names=["softmax_label"], context=mx.cpu())
mod.bind(data_shapes=train.provide_data, label_shapes=train.provide_label)
results = {}
if args.stock_init:
    # numpy only: the function lazy servers compute rows with
    from kvstore_lazy.numerics.initializers import parse_initializer

    arg_params = {}
    for name, cols in (("w", 2), ("v", args.factors)):
        key = mod._param_names.index(name)
        values = parse_initializer(INIT.dumps()).rows(0, key, np.arange(D, dtype=np.uint64), (D, cols), np.float32)
        arg_params[name] = mx.nd.sparse.row_sparse_array((values, np.arange(D)), shape=(D, cols))
        results[f"key_{name}"] = np.array(key)
    mod.init_params(initializer=INIT, arg_params=arg_params, allow_missing=True)
else:
    mod.init_params(initializer=INIT)
mod.init_optimizer(kvstore=kv, optimizer=args.optimizer,
                   optimizer_params={"learning_rate": 0.05, "rescale_grad": 1.0 / (args.batch * nw)})


def batch_rows(batch):
    return {"w": batch.data[0].indices, "v": batch.data[0].indices}


all_rows = mx.nd.arange(0, D, dtype="int64")
trained = set()
for epoch in range(args.epochs):
    train.reset()
    for batch in train:
        trained.update(batch.data[0].indices.asnumpy().tolist())
        mod.prepare(batch, sparse_row_id_fn=batch_rows)
        mod.forward_backward(batch)
        mod.update()
    mod.prepare(None, sparse_row_id_fn=lambda _: {"w": all_rows, "v": all_rows})   # every row, as the examples
    held = mod._exec_group.param_arrays[mod._param_names.index("w")][0]
    results[f"held_rows_{epoch}"] = np.array(held.indices.shape[0])
    results[f"eval_{epoch}"] = np.float64(dict(mod.score(test, "nll_loss"))["nll-loss"])
    logging.info("epoch %d: eval nll-loss %r", epoch, float(results[f"eval_{epoch}"]))
    if rank == 0 and args.prefix:
        mod.save_checkpoint(args.prefix, epoch)
    kv._barrier()
results["trained"] = np.array(sorted(trained), np.int64)
kv._barrier()
save(args.out, rank, results)
print("worker", rank, "done", flush=True)
