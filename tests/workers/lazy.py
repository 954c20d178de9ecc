"""A row_sparse training loop on a stock worker: lazy (init_lazy) or explicit (kv.init with all rows) init,
row_sparse_pull + push over known row ids, several optimizers. Results go to <out>.rank<r>.npz."""
import argparse
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save, tcp_bytes_sent  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--rows", type=int, default=2000)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--key", type=int, default=3)
p.add_argument("--dtype", default="float32")
p.add_argument("--init", default="explicit", help="explicit | lazy")
p.add_argument("--initializer", default='["uniform", {"scale": 0.07}]')
p.add_argument("--seed", type=int, default=42)
p.add_argument("--optimizer", default="sgd", help="none | sgd | adam | adagrad | ftrl | test")
p.add_argument("--multi-precision", action="store_true")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--shuffle-pulls", action="store_true")
p.add_argument("--bad-row", action="store_true", help="pull a row id >= rows (must fail loudly)")
p.add_argument("--fetch", action="store_true", help="rank 0 fetches the existing rows and saves a checkpoint")
args = p.parse_args()

kv = mx.kv.create(args.mode)
rank, nw = kv.rank, kv.num_workers
dt = np.dtype(args.dtype)
opts = {
    "sgd": lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4, rescale_grad=0.5),
    "adam": lambda: mx.optimizer.Adam(learning_rate=0.01, rescale_grad=0.5),
    "adagrad": lambda: mx.optimizer.AdaGrad(learning_rate=0.1, rescale_grad=0.5),
    "ftrl": lambda: mx.optimizer.Ftrl(learning_rate=0.1, lamda1=0.01, rescale_grad=0.5),
    "test": lambda: mx.optimizer.create("test", rescale_grad=0.5),
}
if args.optimizer != "none":
    opt = opts[args.optimizer]()
    opt.multi_precision = args.multi_precision
    kv.set_optimizer(opt)

shape = (args.rows, args.dim)
results = {}


before = tcp_bytes_sent()
if args.init == "lazy":
    from kvstore_lazy.worker import init_lazy
    init_lazy(kv, args.key, shape, dtype=dt, init=args.initializer, seed=args.seed)
else:
    # rows given explicitly (also what a stock job does): a deterministic full weight
    full = ((np.arange(args.rows * args.dim).reshape(shape) % 23) / 50.0 - 0.2).astype(dt)
    kv.init(args.key, mx.nd.array(full, dtype=dt).tostype("row_sparse"))
results["init_bytes"] = tcp_bytes_sent() - before

rng = np.random.RandomState(1000 + rank)
touched = set()   # pulled or pushed
trained = set()   # pushed


def pull(ids):
    out = mx.nd.sparse.zeros("row_sparse", shape, dtype=dt)
    kv.row_sparse_pull(args.key, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    return out.indices.asnumpy(), out.data.asnumpy()


# the same probe ids on every worker, pulled before any update, in a worker-specific order
probe = np.unique(np.concatenate([np.arange(5), args.rows - 1 - np.arange(5),
                                  np.random.RandomState(7).randint(0, args.rows, 40)]))
order = np.random.RandomState(rank).permutation(len(probe)) if args.shuffle_pulls else np.arange(len(probe))
got = {}
for chunk in np.array_split(probe[order], 4):
    ids, vals = pull(chunk)
    got.update(zip(ids.tolist(), vals))
results["probe_ids"] = probe
results["probe_vals"] = np.stack([got[i] for i in probe.tolist()])
touched.update(probe.tolist())
kv._barrier()

if args.bad_row:
    pull(np.array([args.rows + 5]))
    print("UNEXPECTED: bad pull returned", flush=True)
    sys.exit(3)

for step in range(args.steps):
    ids = np.unique(np.minimum(rng.zipf(1.3, args.batch) - 1, args.rows - 1))
    touched.update(ids.tolist())
    trained.update(ids.tolist())
    idx, vals = pull(ids)
    grad_rows = ((idx[:, None] * 3 + np.arange(args.dim)[None, :] + step + rank) % 11 - 5).astype(dt) / 4
    grad = mx.nd.sparse.row_sparse_array((grad_rows, idx), shape=shape, dtype=dt)
    kv.push(args.key, grad)
kv._barrier()
all_touched = np.array(sorted(touched), dtype=np.int64)
ids, vals = pull(all_touched)
results["touched"] = all_touched
results["trained"] = np.array(sorted(trained), dtype=np.int64)
results["final_ids"] = ids
results["final_vals"] = vals
if args.fetch and rank == 0:
    from kvstore_lazy.worker import declared, fetch_rows, save_rows
    ids, vals, states = fetch_rows(kv, args.key, shape, dtype=dt, states=True)
    results["fetched_ids"], results["fetched_vals"] = ids, vals
    results["fetched_num_states"] = len(states)
    for j, st in enumerate(states):
        results[f"fetched_state{j}"] = st
    path = args.out + ".params"
    save_rows(path, {"embed_weight": (shape, ids, vals)}, specs={"embed_weight": declared(kv, args.key)})
    loaded = mx.nd.load(path)["arg:embed_weight"]
    results["loaded_stype"] = np.array(loaded.stype)
    results["loaded_indices"] = loaded.indices.asnumpy()
    results["loaded_data"] = loaded.data.asnumpy()
kv._barrier()
save(args.out, rank, results)
print("worker", rank, "done; init sent", results["init_bytes"], "bytes", flush=True)
