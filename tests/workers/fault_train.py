"""A dist_sync training loop made for fault tests (a stock MXNet 1.9.1 worker).

Deterministic in everything: the rows each worker uses and its gradients are functions of (rank, step) and of the
values it pulled, so two runs that apply the same updates end bit for bit equal, and a run that lost or repeated an
update does not. A lazy row_sparse key (init_lazy) and a dense key, SGD with momentum and wd on the servers (so
optimizer states matter too).

- <out>/progress.rank<r>: "step unix-time" per finished step (its pushes answered: the round is applied).
- --checkpoint-every K: after step K, 2K, ... every worker waits for its pushes, a worker barrier, rank 0 asks the
  servers for a tagged snapshot {"step": s} (answered once written), a second barrier.
- --resume: start after the step the servers' tagged snapshots carry (read from --snapshot-dir).
- At the end rank 0 pulls every row any worker used and the dense key into <out>/final.npz.
"""
import argparse
import json
import os
import time

import mxnet as mx
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--rows", type=int, default=20000)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--dense", type=int, default=256)
p.add_argument("--sleep", type=float, default=0.05, help="seconds to sleep per step (time to inject faults)")
p.add_argument("--checkpoint-every", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--snapshot-dir", default="")
args = p.parse_args()

SPARSE_KEY, DENSE_KEY = 3, 4   # with 2 servers: dense key 4 lives on server rank 0 ((4 * 9973) % 2)
kv = mx.kv.create("dist_sync")
rank, nw = kv.rank, kv.num_workers
os.makedirs(args.out, exist_ok=True)
kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-4, rescale_grad=0.5))
shape = (args.rows, args.dim)

from kvstore_lazy.worker import init_lazy  # noqa: E402

init_lazy(kv, SPARSE_KEY, shape, init=mx.init.Uniform(0.07), seed=7)
kv.init(DENSE_KEY, mx.nd.array(np.linspace(-1, 1, args.dense, dtype=np.float32)))

start = 0
if args.resume:
    from kvstore_lazy.persist import checkpoint
    tag = checkpoint.common_tag(args.snapshot_dir, int(os.environ["DMLC_NUM_SERVER"]))
    start = int(tag["step"]) if tag else 0
    print(f"worker {rank}: resuming after step {start}", flush=True)


def ids_for(r: int, step: int) -> np.ndarray:
    rng = np.random.RandomState(1000 * step + r)
    return np.unique(np.minimum(rng.zipf(1.3, args.batch) - 1, args.rows - 1)).astype(np.int64)


def pull_rows(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull(SPARSE_KEY, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    return out.indices.asnumpy(), out.data.asnumpy()


progress = open(os.path.join(args.out, f"progress.rank{rank}"), "a", buffering=1)
dense = mx.nd.zeros(args.dense)
for step in range(start + 1, args.steps + 1):
    ids = ids_for(rank, step)
    idx, vals = pull_rows(ids)
    extra = ((idx[:, None] * 3 + np.arange(args.dim)[None, :] + step + rank) % 11 - 5).astype(np.float32) / 4
    grad = mx.nd.sparse.row_sparse_array((vals * 0.5 + extra, idx), shape=shape)
    kv.push(SPARSE_KEY, grad)
    kv.pull(DENSE_KEY, out=dense)
    dgrad = dense * 0.1 + mx.nd.array(np.cos(np.arange(args.dense) * (step + 1) + rank).astype(np.float32))
    kv.push(DENSE_KEY, dgrad)
    mx.nd.waitall()   # both pushes answered: this step's rounds are applied on the servers
    progress.write(f"{step} {time.time():.3f}\n")
    if args.checkpoint_every and step % args.checkpoint_every == 0:
        kv._barrier()
        if rank == 0:
            kv._send_command_to_servers(103, json.dumps({"step": step}))   # LAZY_SNAPSHOT with a tag
        kv._barrier()
    time.sleep(args.sleep)

mx.nd.waitall()
kv._barrier()
if rank == 0:
    used = np.unique(np.concatenate([ids_for(r, s) for r in range(nw) for s in range(1, args.steps + 1)]))
    idx, vals = pull_rows(used)
    kv.pull(DENSE_KEY, out=dense)
    np.savez(os.path.join(args.out, "final.npz"), ids=idx, vals=vals, dense=dense.asnumpy())
kv._barrier()
progress.close()
print(f"worker {rank} done after step {args.steps}", flush=True)
