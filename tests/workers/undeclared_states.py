"""Worker checkpoints of row_sparse keys that were never declared lazy, on kvstore_lazy servers.

Keys (the test sets MXNET_KVSTORE_BIGARRAY_BOUND=1000): UNDECLARED (1000 x 4), an ordinary ``kv.init`` with every
row, split over every server, so each server knows its rows by local id only (the init push carries ids relative
to the server's part); DECLARED (1000 x 4, ``init_lazy``), split too; SMALL (60 x 4, ``kv.init`` with every row),
not split. Adam (2 states per row). Every step each worker pushes gradients on rows of every server's part.

After --steps steps rank 0 reads each key: ``fetch_rows(states=True)``, a row_sparse_pull of every row,
``fetch_states``, a tagged snapshot of the servers (what they held then), and ``integration._save_states`` (what
Gluon's ``Trainer.save_states`` and Module's ``save_optimizer_states`` write on a dist kvstore), read back. Then
--steps more steps change the states, every worker restores the file (``integration._restore_states``, what
``Trainer.load_states`` runs: rank 0 writes, all barrier) and rank 0 reads the states again. The servers' snapshots
at exit hold what the restore wrote. Results go to <out>.rank<r>.npz.
"""
import argparse
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

from kvstore_lazy import worker  # noqa: E402
from kvstore_lazy.worker import integration  # noqa: E402

UNDECLARED, DECLARED, SMALL = 3, 5, 7
SHAPES = {UNDECLARED: (1000, 4), DECLARED: (1000, 4), SMALL: (60, 4)}

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()

kv = mx.kv.create("dist_sync")
rank = kv.rank
kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.05, rescale_grad=0.5))
for key in (UNDECLARED, SMALL):
    rows, dim = SHAPES[key]
    full = ((np.arange(rows * dim).reshape(rows, dim) % 23) / 50.0 - 0.2).astype(np.float32)
    kv.init(key, mx.nd.array(full).tostype("row_sparse"))
worker.init_lazy(kv, DECLARED, SHAPES[DECLARED], init=mx.init.Uniform(0.07), seed=42)


def train(first: int) -> None:
    for step in range(first, first + args.steps):
        rng = np.random.RandomState(100 * step + rank)
        for key, (rows, dim) in SHAPES.items():
            ids = np.unique(rng.randint(0, rows, 40))
            grad = ((ids[:, None] + np.arange(dim) + step + rank) % 7 - 3).astype(np.float32) / 4
            kv.push(key, mx.nd.sparse.row_sparse_array((grad, ids), shape=(rows, dim)))
    mx.nd.waitall()
    kv._barrier()


def read(tag: str, res: dict) -> None:
    for key, shape in SHAPES.items():
        got = worker.fetch_states(kv, key, shape)
        assert got["kind"] == "row_sparse", got["kind"]
        res[f"{tag}_ids{key}"] = got["row_ids"]
        for j, state in enumerate(got["states"]):
            res[f"{tag}_state{j}_{key}"] = state


train(0)
res = {}
path = args.out + ".states"
if rank == 0:
    for key, shape in SHAPES.items():
        ids, values, states = worker.fetch_rows(kv, key, shape, states=True)
        res[f"fetched_ids{key}"], res[f"fetched{key}"] = ids, values
        res[f"fetched_num_states{key}"] = np.array(len(states))
        for j, state in enumerate(states):
            res[f"fetched_state{j}_{key}"] = state
        out = mx.nd.sparse.zeros("row_sparse", shape)
        kv.row_sparse_pull(key, out=out, row_ids=mx.nd.array(np.arange(shape[0]), dtype="int64"))
        res[f"pulled_ids{key}"], res[f"pulled{key}"] = out.indices.asnumpy(), out.data.asnumpy()
    read("states", res)
    worker.snapshot(kv, {"step": args.steps})   # each server writes tagged/rank<r>: what it holds now
    params = [(f"k{key}", key, shape, "float32") for key, shape in SHAPES.items()]
    integration._save_states(kv, path, params)
    for name, entry in integration._read_states(path).items():
        res[f"saved_ids{name[1:]}"] = entry["row_ids"]
        for j, state in enumerate(entry["states"]):
            res[f"saved_state{j}_{name[1:]}"] = state
kv._barrier()
train(args.steps)
if rank == 0:
    read("retrained", res)   # (the others wait in the restore's first kv.init)
integration._restore_states(kv, path, [(f"k{key}", key, shape) for key, shape in SHAPES.items()],
                            string_keys=False)
if rank == 0:
    read("restored", res)
kv._barrier()
save(args.out, rank, res)
print("worker", rank, "done", flush=True)
