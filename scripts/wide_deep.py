"""Wide & deep CTR training on a stock MXNet 1.9.1 worker (dist_sync), as `make demo` runs it (scripts/demo.py).

Model: per categorical feature f, an embedding (row_sparse kv key 100+f, shape (input_dim, emb_dim)) and a wide
weight (row_sparse kv key 200+f, shape (input_dim, 1)); the embeddings feed a dense Gluon MLP whose parameters are
the Trainer's kv keys 0..n-1; logit = MLP(concat(embeddings)) + sum of wide weights.

Sparse parts go through the kvstore directly: per batch ``kv.row_sparse_pull`` of the batch's unique ids, forward/
backward with mx.autograd on the gathered rows, and ``kv.push`` of the row gradients (summed per unique id by the
backward of ``take``). The server optimizer is the Trainer's (update_on_kvstore), set before any sparse key exists.

--server lazy: keys are declared with ``kvstore_lazy.worker.init_lazy`` (no rows shipped; servers store a row once a
  worker pushes it, starting from the initializer's value for (seed, key, row), which a pull of an absent row gets).
--server stock: rank 0 ``kv.init``s every key with its full weight (what a stock server needs), built from the same
  deterministic initializer, so both runs start from identical values and see identical data.

Data: CTR-like, generated per (seed, rank, step): feature ids follow a Zipf law folded into input_dim and scrambled
by a fixed bijection (so hot rows spread over the servers' row ranges), labels from a hidden logistic model over the
first features. Outputs in --out: seen.rank<r>.npz (ids each worker used, per feature), result.json (rank 0:
losses, timings, bytes shipped at init, checkpoint facts), checkpoint/wide_deep.params (rank 0: sparse + dense).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from kvstore_lazy.node import procstats as metrics
from kvstore_lazy.numerics.initializers import parse_initializer

EMB_KEY, WIDE_KEY = 100, 200          # + feature index; the Trainer owns keys 0..len(params)-1
ZIPF_A = 1.2
SCRAMBLE = 2654435761                 # a prime larger than any input_dim: id -> id * P mod n is a bijection
_MASK64 = (1 << 64) - 1

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--server", choices=["lazy", "stock"], required=True)
p.add_argument("--out", required=True, help="run directory (shared by the workers)")
p.add_argument("--dims", default="2000000,1000000,500000,100000", help="input_dim of each categorical feature")
p.add_argument("--emb-dim", type=int, default=16)
p.add_argument("--hidden", default="64,32", help="MLP hidden layer sizes")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--batch", type=int, default=512, help="samples per worker per step")
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "adagrad", "ftrl"])
p.add_argument("--seed", type=int, default=2024)
p.add_argument("--interval", type=int, default=0, help="steps between progress lines (default: steps/10)")
args = p.parse_args()

DIMS = [int(d) for d in args.dims.split(",")]
F, D = len(DIMS), args.emb_dim
EMB_INIT = mx.init.Uniform(0.05)
WIDE_INIT = mx.init.Zero()
interval = args.interval or max(1, args.steps // 10)
os.makedirs(args.out, exist_ok=True)

kv = mx.kv.create("dist_sync")
rank, nw = kv.rank, kv.num_workers


def say(*parts) -> None:
    if rank == 0:
        print("rank 0:", *parts, flush=True)


# --------------------------------------------------------------------------------------------------------------
# data


def _unit(f: int, ids: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random number in [-1, 1) per (feature, id): the hidden model's effect of that id."""
    z = ids.astype(np.uint64) + np.uint64(((f + 1) * 0x9E3779B97F4A7C15) & _MASK64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -52 - 1.0


HIDDEN_FEATURES = list(range(min(3, F)))
HIDDEN_SCALE = 2.0
HIDDEN_BIAS = -0.3


def make_batch(rng: np.random.RandomState, batch: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.empty((batch, F), np.int64)
    for f, n in enumerate(DIMS):
        r = (rng.zipf(ZIPF_A, batch) - 1) % n
        ids[:, f] = (r * SCRAMBLE + 7919 * f) % n
    logit = HIDDEN_BIAS + sum(HIDDEN_SCALE * _unit(f, ids[:, f]) for f in HIDDEN_FEATURES)
    labels = (rng.random_sample(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return ids, labels


# --------------------------------------------------------------------------------------------------------------
# model: dense MLP (Gluon, Trainer keys) + sparse tables (our keys)

mx.random.seed(args.seed)
net = gluon.nn.Sequential()
in_units = F * D
with net.name_scope():
    for width in [int(h) for h in args.hidden.split(",") if h]:
        net.add(gluon.nn.Dense(width, activation="relu", in_units=in_units))
        in_units = width
    net.add(gluon.nn.Dense(1, in_units=in_units))
net.initialize(mx.init.Xavier())
loss_fn = gluon.loss.SigmoidBinaryCrossEntropyLoss()

opt_params = {"learning_rate": args.lr, "rescale_grad": 1.0 / (args.batch * nw)}
trainer = gluon.Trainer(net.collect_params(), args.optimizer, opt_params, kvstore=kv)
# The Trainer sends its optimizer to the servers when it first needs the kvstore (its first step). Do it now, on
# every worker, so the optimizer exists before any sparse key (and is not replaced mid-training: a stock server
# builds a fresh updater, i.e. drops optimizer states, for every optimizer it receives).
trainer._init_kvstore()
assert trainer._update_on_kvstore, "the demo expects update_on_kvstore (dist_sync)"

SPARSE = []   # (name, kv key, shape, initializer)
for f, n in enumerate(DIMS):
    SPARSE.append((f"emb{f}_weight", EMB_KEY + f, (n, D), EMB_INIT))
for f, n in enumerate(DIMS):
    SPARSE.append((f"wide{f}_weight", WIDE_KEY + f, (n, 1), WIDE_INIT))


def full_weight(key: int, shape, init) -> mx.nd.sparse.RowSparseNDArray:
    """Every row of a sparse weight, with exactly the values a lazy server gives (seed, key, row)."""
    values = parse_initializer(init.dumps()).rows(args.seed, key, np.arange(shape[0], dtype=np.uint64), shape,
                                                  np.float32)
    # built from (data, indices): tostype('row_sparse') would drop all-zero rows, and the stock server needs
    # every row at init
    return mx.nd.sparse.row_sparse_array((values, np.arange(shape[0], dtype=np.int64)), shape=shape,
                                         dtype="float32")


results = {"server": args.server, "rank": rank, "num_workers": nw, "dims": DIMS, "emb_dim": D,
           "steps": args.steps, "batch": args.batch, "optimizer": args.optimizer, "lr": args.lr}
t_start = time.monotonic()
init_bytes, gen_seconds, measuring = {}, 0.0, 0.0


def tcp_sent() -> int:
    """This process's TCP bytes sent; the time `ss` takes is kept out of init_seconds."""
    global measuring
    t = time.monotonic()
    sent = metrics.tcp_bytes_sent()
    measuring += time.monotonic() - t
    return sent


if args.server == "lazy":
    from kvstore_lazy.worker import init_lazy
for name, key, shape, init in SPARSE:
    if args.server == "lazy":
        before = tcp_sent()
        init_lazy(kv, key, shape, init=init, seed=args.seed)
    else:
        t_gen = time.monotonic()
        if rank == 0:
            value = full_weight(key, shape, init)
            value.wait_to_read()
        else:
            # only rank 0's init value is sent (KVStoreDist::InitImpl); the others just declare the shape
            value = mx.nd.sparse.zeros("row_sparse", shape)
        gen_seconds += time.monotonic() - t_gen
        before = tcp_sent()
        kv.init(key, value)
        del value
    init_bytes[name] = tcp_sent() - before
results["init_bytes_per_key"] = init_bytes
results["init_bytes"] = sum(init_bytes.values())
results["weight_gen_seconds"] = gen_seconds
results["init_seconds"] = time.monotonic() - t_start - measuring
say(f"sparse init ({args.server} server): {len(SPARSE)} keys, rank 0 sent {results['init_bytes']:,} bytes in "
    f"{results['init_seconds']:.1f}s (of which {results['weight_gen_seconds']:.1f}s building full weights)")

# --------------------------------------------------------------------------------------------------------------
# training

rng = np.random.RandomState(args.seed * 1000 + rank)
seen = [np.zeros(n, bool) for n in DIMS]
losses, window = [], []
t_train = time.monotonic()
t_window = t_train
for step in range(1, args.steps + 1):
    ids, labels = make_batch(rng, args.batch)
    uniq, inv = [], []
    for f in range(F):
        u, i = np.unique(ids[:, f], return_inverse=True)
        uniq.append(u)
        inv.append(mx.nd.array(i, dtype="int64"))
        seen[f][u] = True
    keys = [key for _, key, _, _ in SPARSE]
    row_ids = [mx.nd.array(uniq[j % F], dtype="int64") for j in range(len(SPARSE))]
    outs = [mx.nd.sparse.zeros("row_sparse", shape) for _, _, shape, _ in SPARSE]
    kv.row_sparse_pull(keys, out=outs, row_ids=row_ids)
    rows = []
    for j, out in enumerate(outs):
        if step == 1:
            assert np.array_equal(out.indices.asnumpy(), uniq[j % F]), "pulled rows come back in another order"
        r = out.data.copy()
        r.attach_grad()
        rows.append(r)
    label = mx.nd.array(labels)
    with autograd.record():
        x = mx.nd.concat(*[mx.nd.take(rows[f], inv[f]) for f in range(F)], dim=1)
        wide = mx.nd.add_n(*[mx.nd.take(rows[F + f], inv[f]) for f in range(F)])
        logit = net(x) + wide
        loss = loss_fn(logit, label)
    loss.backward()
    grads = [mx.nd.sparse.row_sparse_array((rows[j].grad, row_ids[j]), shape=shape)
             for j, (_, _, shape, _) in enumerate(SPARSE)]
    kv.push(keys, grads)
    trainer.step(1)   # rescale_grad = 1 / (batch * workers) was given to the optimizer
    window.append(float(loss.mean().asscalar()))
    if step % interval == 0 or step == args.steps:
        now = time.monotonic()
        mean = float(np.mean(window))
        losses.append([step, mean])
        say(f"step {step:5d}/{args.steps}  loss {mean:.4f}  {len(window) / (now - t_window):6.1f} steps/s  "
            f"rows seen by rank 0: " + " ".join(f"f{f}={int(seen[f].sum()):,}" for f in range(F)))
        if args.server == "lazy" and rank == 0:
            from kvstore_lazy.worker import stats
            t_stats = time.monotonic()
            stats(kv)   # each server logs its rows per key (a round trip the stock run has no counterpart of:
            now = time.monotonic()
            t_train += now - t_stats   # it is kept out of train_seconds, as ss is out of init_seconds)
        window, t_window = [], now
mx.nd.waitall()
results["train_seconds"] = time.monotonic() - t_train
results["losses"] = losses
results["first_loss"] = losses[0][1]
results["final_loss"] = losses[-1][1]

seen_ids = [np.flatnonzero(s).astype(np.int64) for s in seen]
np.savez(os.path.join(args.out, f"seen.rank{rank}.npz"), **{f"f{f}": seen_ids[f] for f in range(F)})
kv._barrier()   # every worker's pushes are applied and its seen ids are on disk

# --------------------------------------------------------------------------------------------------------------
# checkpoint (rank 0): one file, sparse weights as RowSparseNDArrays "arg:NAME" (only the rows that exist), dense
# MLP parameters as NDArrays "arg:NAME"


def pull_rows(key: int, shape, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = mx.nd.sparse.zeros("row_sparse", shape)
    kv.row_sparse_pull(key, out=out, row_ids=mx.nd.array(ids, dtype="int64"))
    return out.indices.asnumpy(), out.data.asnumpy()


def save_atomic(path: str, arrays: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    mx.nd.save(tmp, arrays)
    os.replace(tmp, path)


def save_rows_local(path: str, tables: dict) -> None:
    """What kvstore_lazy.worker.save_rows promises: atomic mx.nd.save of RowSparseNDArrays named arg:NAME (and of
    NDArrays given as such)."""
    arrays = {}
    for name, value in tables.items():
        if isinstance(value, tuple):
            shape, ids, vals = value
            vals = np.asarray(vals).reshape((len(ids),) + tuple(shape[1:]))
            value = mx.nd.sparse.row_sparse_array((vals, np.asarray(ids, np.int64)), shape=shape)
        arrays[f"arg:{name}"] = value
    save_atomic(path, arrays)


if rank == 0:
    t_ckpt = time.monotonic()
    ckpt_path = os.path.join(args.out, "checkpoint", "wide_deep.params")
    os.makedirs(os.path.dirname(ckpt_path), exist_ok=True)
    dense = {name: param.data() for name, param in net.collect_params().items()}
    if args.server == "lazy":
        from kvstore_lazy import worker as lazy_worker
        fetch_rows = getattr(lazy_worker, "fetch_rows", None)
        save_rows = getattr(lazy_worker, "save_rows", None)
        tables = {}
        if fetch_rows is not None:
            method = "kvstore_lazy.worker.fetch_rows"
            for name, key, shape, _ in SPARSE:
                ids, vals = fetch_rows(kv, key, shape, dtype="float32")
                tables[name] = (shape, np.asarray(ids, np.int64), vals)
        else:
            # Not the real thing: the rows the workers reported using. With materialize-on-touch they are the rows
            # the servers hold, but only fetch_rows reads what the servers actually have.
            method = "FALLBACK: row_sparse_pull of the rows the workers used (no kvstore_lazy.worker.fetch_rows)"
            print("NOTE: kvstore_lazy.worker.fetch_rows is not in this checkout; checkpointing by row_sparse_pull "
                  "of the union of the rows the workers used instead", flush=True)
            union = [np.unique(np.concatenate([np.load(os.path.join(args.out, f"seen.rank{r}.npz"))[f"f{f}"]
                                               for r in range(nw)])) for f in range(F)]
            for j, (name, key, shape, _) in enumerate(SPARSE):
                ids, vals = pull_rows(key, shape, union[j % F])
                tables[name] = (shape, ids, vals)
        tables.update(dense)
        declared = getattr(lazy_worker, "declared", None)
        if save_rows is not None and declared is not None:
            # with the sidecar saying how each absent row is computed (python -m kvstore_lazy.persist.checkpoint
            # densify)
            save_rows(ckpt_path, tables, specs={name: declared(kv, key) for name, key, _, _ in SPARSE})
            method += " + kvstore_lazy.worker.save_rows (with its .lazy.json sidecar)"
        elif save_rows is not None:
            save_rows(ckpt_path, tables)
            method += " + kvstore_lazy.worker.save_rows"
        else:
            print("NOTE: kvstore_lazy.worker.save_rows is not in this checkout; saving the same format locally "
                  "(atomic mx.nd.save of RowSparseNDArrays arg:NAME)", flush=True)
            method += " + local save (no kvstore_lazy.worker.save_rows)"
            save_rows_local(ckpt_path, tables)
        del tables
    else:
        method = "row_sparse_pull of every row (as Module does) + mx.nd.save"
        arrays = {f"arg:{name}": value for name, value in dense.items()}
        for name, key, shape, _ in SPARSE:
            out = mx.nd.sparse.zeros("row_sparse", shape)
            kv.row_sparse_pull(key, out=out, row_ids=mx.nd.arange(shape[0], dtype="int64"))
            arrays[f"arg:{name}"] = out
        save_atomic(ckpt_path, arrays)
        del arrays
    results["ckpt_save_seconds"] = time.monotonic() - t_ckpt

    # Reload and check: every sparse weight comes back row_sparse with its shape, holds every row this worker used,
    # and agrees bit for bit with a fresh pull of some of them (used rows exist on either server: the pull creates
    # none); dense parameters equal the worker's.
    t_load = time.monotonic()
    loaded = mx.nd.load(ckpt_path)
    results["ckpt_load_seconds"] = time.monotonic() - t_load
    check_rng = np.random.RandomState(7)
    ckpt_rows, problems = {}, []
    # with a row lifecycle policy on the servers (admission, TTL, a memory budget) rows used need not exist: the
    # rows the checkpoint has are checked against the servers instead
    lifecycle = args.server == "lazy" and any(os.environ.get(f"KVSTORE_LAZY_{v}") for v in (
        "ADMIT_MIN_COUNT", "ADMIT_PROB", "TTL_ROUNDS", "TTL_SECONDS", "MEMORY_BUDGET"))
    for j, (name, key, shape, _) in enumerate(SPARSE):
        arr = loaded.get(f"arg:{name}")
        if arr is None or arr.stype != "row_sparse" or arr.shape != shape:
            problems.append(f"{name}: missing or not a row_sparse {shape}")
            continue
        idx = arr.indices.asnumpy()
        ckpt_rows[name] = int(len(idx))
        used = np.intersect1d(seen_ids[j % F], idx) if lifecycle else seen_ids[j % F]
        if lifecycle and len(used) == 0:
            continue
        pos = np.minimum(np.searchsorted(idx, used), max(len(idx) - 1, 0))
        if len(idx) == 0 or not np.array_equal(idx[pos], used):
            problems.append(f"{name}: rows used in training are missing from the checkpoint")
            continue
        probe = np.sort(check_rng.choice(used, size=min(256, len(used)), replace=False))
        _, got = pull_rows(key, shape, probe)
        if not np.array_equal(arr.data.asnumpy()[np.searchsorted(idx, probe)], got):
            problems.append(f"{name}: checkpoint rows differ from the servers' rows")
    for name, value in dense.items():
        got = loaded.get(f"arg:{name}")
        if got is None or not np.array_equal(got.asnumpy(), value.asnumpy()):
            problems.append(f"{name}: dense parameter missing or different in the checkpoint")
    results["ckpt_method"] = method
    results["ckpt_path"] = ckpt_path
    results["ckpt_rows"] = ckpt_rows
    results["ckpt_bytes"] = os.path.getsize(ckpt_path)
    results["ckpt_problems"] = problems
    say(f"checkpoint ({method}): {results['ckpt_bytes']:,} bytes in {results['ckpt_save_seconds']:.1f}s; "
        f"mx.nd.load in {results['ckpt_load_seconds']:.1f}s: "
        + ("OK (row_sparse, shapes, used rows present and equal to the servers')" if not problems
           else "PROBLEMS: " + "; ".join(problems)))
    if args.server == "lazy":
        from kvstore_lazy.worker import stats
        stats(kv)   # final row counts, after the checkpoint
    results["worker_seconds"] = time.monotonic() - t_start
    with open(os.path.join(args.out, "result.json.tmp"), "w") as fh:
        json.dump(results, fh, indent=1)
    os.replace(os.path.join(args.out, "result.json.tmp"), os.path.join(args.out, "result.json"))
    if problems:
        sys.exit(3)
print(f"worker rank {rank} done", flush=True)
