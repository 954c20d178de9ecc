"""A small CTR-like model trained by hand on a dist_sync kvstore (issue 32: every optimizer as stock computes it).

Two row_sparse embedding tables and one dense layer, updated on the servers (update_on_kvstore, as Gluon and Module
do): each step a worker row_sparse_pulls the rows its batch uses and pulls the dense weight, runs forward and
backward with autograd, and pushes the row_sparse gradients of those rows and the dense gradient.

- key EMB (LAZY_ROWS x DIM): on kvstore_lazy servers with ``--declare`` it is declared lazy (``init_lazy``: rows
  exist once pushed, the others are computed from the initializer); otherwise ``kv.init`` with every row, the same
  values (``initial_weights``: the initializer's pure function of (seed, key, row)).
- key EXPLICIT (EXPLICIT_ROWS x DIM): ``kv.init`` with every row on every server kind (every row stored from the
  start, most of them never pushed).
- key DENSE (HIDDEN x DIM): ``kv.init`` with a dense value.

All three are partitioned over 2 servers when MXNET_KVSTORE_BIGARRAY_BOUND is at most 1024. Ids are Zipf-skewed
through a fixed permutation, so the hot rows sit in both servers' ranges and most rows go untouched for many steps.
In the ``SKEW_STEPS`` every id of EMB falls in server 0's rows and every id of EXPLICIT in server 1's: the other
server gets a round with zero rows of that key (stock still runs its updater: the update count, lr schedules and
Adam's t move on).

Results (<out>.rank<r>.npz): every row of every key before and after training (``init_*``, ``final_*``), per step the
loss and the row ids and gradient rows this rank pushed for each row_sparse key (``ids{key}_{step}``,
``grad{key}_{step}``: the test replays them through mxnet's own updater); with ``--fetch`` (kvstore_lazy servers),
rank 0 also saves the rows that exist with their optimizer states (``fetch_rows(states=True)``) and every server's
update counts of each key.

The test imports ``make_optimizer``, ``initial_weights`` and the key constants from here (mxnet only, no job).
"""
import argparse
import json
import os
import sys
import traceback

import mxnet as mx
import numpy as np

from kvstore_lazy.numerics.initializers import parse_initializer

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

EMB, EXPLICIT, DENSE = 3, 5, 8
LAZY_ROWS, EXPLICIT_ROWS, DIM, HIDDEN = 2000, 1000, 8, 128   # 16000 / 8000 / 1024 elements
INIT = '["uniform", {"scale": 0.07}]'
SEED = 42
BATCH, SEQ = 16, 4
SKEW_STEPS = (4, 13)
ROW_SPARSE = {EMB: LAZY_ROWS, EXPLICIT: EXPLICIT_ROWS}
SCHEDULERS = {"factor": mx.lr_scheduler.FactorScheduler, "multifactor": mx.lr_scheduler.MultiFactorScheduler}


def make_optimizer(spec: dict) -> mx.optimizer.Optimizer:
    """The optimizer of a case: {"name": ..., "params": {...}, "scheduler": [kind, {...}] (optional)}."""
    params = dict(spec["params"])
    if spec.get("scheduler"):
        kind, kwargs = spec["scheduler"]
        params["lr_scheduler"] = SCHEDULERS[kind](**kwargs)
    return mx.optimizer.create(spec["name"], **params)


def initial_weights() -> dict:
    """Every key's initial value (float32), the same in every run: EMB the declared initializer's rows."""
    emb = parse_initializer(INIT).rows(SEED, EMB, np.arange(LAZY_ROWS, dtype=np.uint64), (LAZY_ROWS, DIM),
                                       np.float32)
    grid = np.arange(EXPLICIT_ROWS * DIM, dtype=np.float64).reshape(EXPLICIT_ROWS, DIM)
    explicit = (np.sin(grid * 0.37) * 0.08).astype(np.float32)
    dense = (np.cos(np.arange(HIDDEN * DIM, dtype=np.float64) * 0.11).reshape(HIDDEN, DIM) * 0.3).astype(np.float32)
    return {EMB: np.asarray(emb, np.float32), EXPLICIT: explicit, DENSE: dense}


def batches(rank: int, steps: int, skew_steps=SKEW_STEPS) -> list:
    """Per step (EMB ids, EXPLICIT ids, targets), each id array (BATCH, SEQ)."""
    rng = np.random.RandomState(1000 + rank)
    perm = {key: np.random.RandomState(key).permutation(rows) for key, rows in ROW_SPARSE.items()}
    out = []
    for step in range(steps):
        ids = {key: perm[key][np.minimum(rng.zipf(1.3, (BATCH, SEQ)) - 1, rows - 1)]
               for key, rows in ROW_SPARSE.items()}
        if step in skew_steps:
            # rows [0, 1000) of EMB live on server 0, rows [500, 1000) of EXPLICIT on server 1
            ids[EMB] = ids[EMB] % (LAZY_ROWS // 2)
            ids[EXPLICIT] = EXPLICIT_ROWS // 2 + ids[EXPLICIT] % (EXPLICIT_ROWS - EXPLICIT_ROWS // 2)
        out.append((ids[EMB], ids[EXPLICIT], rng.randn(BATCH).astype(np.float32)))
    return out


def fetch(kv) -> dict:
    """What kvstore_lazy servers hold: the rows that exist of each row_sparse key with their optimizer states, and
    every server's update counts of every key.

    EMB is declared (``fetch_rows``). EXPLICIT is not: a server was never told where its part of the key starts, so
    it lists its rows by local id; they are read here server by server (the listing ``fetch_rows`` is built on)
    and made global with the row partition the worker used to split the key."""
    from kvstore_lazy.protocol import mxnet as proto
    from kvstore_lazy.worker import _listed_ids, _query, _read_flat, fetch_rows

    res = {}
    ids, values, states = fetch_rows(kv, EMB, (LAZY_ROWS, DIM), states=True)
    res[f"fetched_ids{EMB}"], res[f"fetched{EMB}"] = ids, values
    res[f"fetched_num_states{EMB}"] = np.array(len(states))
    for j, state in enumerate(states):
        res[f"fetched{EMB}_state{j}"] = state
    headers = _query(kv, EXPLICIT)
    per_server = _listed_ids(kv, headers)
    ids = np.concatenate([local + proto.row_partition(EXPLICIT_ROWS, len(headers), s)[0]
                          for s, local in enumerate(per_server)])
    counts = [len(local) * DIM for local in per_server]
    num_states = max(h.num_states for h in headers)
    res[f"fetched_ids{EXPLICIT}"] = ids
    res[f"fetched_num_states{EXPLICIT}"] = np.array(num_states)
    for j in range(num_states):
        res[f"fetched{EXPLICIT}_state{j}"] = _read_flat(kv, proto.flat_state_key(j), counts).reshape(-1, DIM)
    out = mx.nd.sparse.zeros("row_sparse", (EXPLICIT_ROWS, DIM))
    kv.row_sparse_pull(EXPLICIT, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    res[f"fetched{EXPLICIT}"] = out.data.asnumpy()
    for key in (EMB, EXPLICIT, DENSE):
        res[f"counts{key}"] = np.array([[h.update_count, h.num_update] for h in _query(kv, key)])
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--optimizer", required=True, help="JSON: see make_optimizer")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skew-steps", default=",".join(map(str, SKEW_STEPS)),
                   help="comma-separated steps whose rows all fall in one server's range (empty: none)")
    p.add_argument("--declare", action="store_true", help="declare EMB lazy (kvstore_lazy servers only)")
    p.add_argument("--fetch", action="store_true", help="rank 0 reads the rows that exist and their states")
    args = p.parse_args()

    kv = mx.kv.create("dist_sync")
    rank = kv.rank
    kv.set_optimizer(make_optimizer(json.loads(args.optimizer)))
    init = initial_weights()
    skew = [int(k) for k in args.skew_steps.split(",") if k]
    if args.declare:
        from kvstore_lazy.worker import init_lazy
        init_lazy(kv, EMB, (LAZY_ROWS, DIM), init=INIT, seed=SEED)
    else:
        kv.init(EMB, mx.nd.array(init[EMB]).tostype("row_sparse"))
    kv.init(EXPLICIT, mx.nd.array(init[EXPLICIT]).tostype("row_sparse"))
    kv.init(DENSE, mx.nd.array(init[DENSE]))

    def pull_rows(key, ids):
        out = mx.nd.sparse.zeros("row_sparse", (ROW_SPARSE[key], DIM))
        kv.row_sparse_pull(key, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
        got = out.indices.asnumpy()
        assert np.array_equal(got, ids), f"pulled rows {got[:8]} for {ids[:8]}"
        return out.data.asnumpy()

    def everything(prefix):
        res = {f"{prefix}{key}": pull_rows(key, np.arange(rows)) for key, rows in ROW_SPARSE.items()}
        dense = mx.nd.zeros((HIDDEN, DIM))
        kv.pull(DENSE, out=dense)
        res[f"{prefix}{DENSE}"] = dense.asnumpy()
        return res

    results = everything("init_")
    kv._barrier()
    for step, (ids_emb, ids_exp, target) in enumerate(batches(rank, args.steps, skew)):
        tables, inverse = {}, {}
        for key, ids in ((EMB, ids_emb), (EXPLICIT, ids_exp)):
            rows, inv = np.unique(ids, return_inverse=True)
            tables[key] = (rows, mx.nd.array(pull_rows(key, rows)))
            inverse[key] = mx.nd.array(inv.reshape(-1), dtype="int64")
        weight = mx.nd.zeros((HIDDEN, DIM))
        kv.pull(DENSE, out=weight)
        for _, values in tables.values():
            values.attach_grad()
        weight.attach_grad()
        with mx.autograd.record():
            emb = sum(mx.nd.take(values, inverse[key]).reshape((BATCH, SEQ, DIM)).mean(axis=1)
                      for key, (_, values) in tables.items())
            hidden = mx.nd.tanh(mx.nd.dot(emb, weight, transpose_b=True))
            loss = 0.5 * mx.nd.square(hidden.mean(axis=1) - mx.nd.array(target)).sum()
        loss.backward()
        for key, (rows, values) in tables.items():
            grad = values.grad.asnumpy()
            results[f"ids{key}_{step}"], results[f"grad{key}_{step}"] = rows, grad
            kv.push(key, mx.nd.sparse.row_sparse_array((grad, rows), shape=(ROW_SPARSE[key], DIM)))
        kv.push(DENSE, weight.grad)
        results[f"loss_{step}"] = loss.asnumpy()
    mx.nd.waitall()
    kv._barrier()
    results.update(everything("final_"))
    if args.fetch and rank == 0:
        try:
            results.update(fetch(kv))
        except Exception:       # recorded, not raised: the other rank would wait at the barrier until the deadline
            results["fetch_error"] = np.array(traceback.format_exc())
    kv._barrier()
    save(args.out, rank, results)
    print("worker", rank, "done", flush=True)


if __name__ == "__main__":
    main()
