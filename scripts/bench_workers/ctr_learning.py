r"""A stock MXNet 1.9.1 worker for the "learning" scenario of scripts/bench.py (issue 32): what Adam's row_sparse
semantics do to a model's quality, on a synthetic CTR task whose generating model is known.

Data (:class:`ZipfLogistic`, importable without mxnet): F categorical fields; field f's ids are Zipf(a) ranks
folded into [0, n_f) and scrambled by the bijection rank -> rank * P mod n_f (so hot ids spread over the servers'
row ranges); every id has a true weight t_f[id] ~ Normal(0, sigma) and a click is Bernoulli(sigmoid(b0 + sum_f
t_f[id_f])). The true probabilities are known, so the held-out set's log loss and AUC under them are the floor no
model of the data can beat (the Bayes-optimal predictor). A training example of worker r at step s is a pure
function of (seed, r, s); the held-out set of (seed, "held out"), the same on every worker.

Model: per field f a wide weight (row_sparse key 200+f, (n_f, 1), Zero) and an embedding (row_sparse key 100+f,
(n_f, D), Uniform(0.05)); dense keys 0 (v, (F*D,): a Dense(1) layer over the concatenated embeddings) and 1 (the
bias, (1,)). logit = bias + sum_f wide_f[id_f] + sum_f <emb_f[id_f], v_f>: a logistic regression over the ids
(the wide part can represent the true model exactly) plus a small factorised part, as a wide & deep CTR model has.
Forward and backward are numpy on the pulled rows (the gradients are exact). Every step: row_sparse_pull of the
batch's distinct ids of every sparse key and a pull of the dense keys, then a push of every key's gradient,
waited to completion (the servers' dist_sync reply comes after the update). Adam on the servers
(`--lazy-update 1`: MXNet's default for row_sparse, only the rows in a batch move; `0`: the dense semantics,
every row moves every step), rescale_grad = 1 / (batch x workers), weight decay --wd.

--server lazy: keys declared with kvstore_lazy.worker.init_lazy; stock: rank 0 kv.inits every row with the same
values (the initializer's value for (seed, key, row)), so both servers start from identical weights.

Rank 0 evaluates on the held-out set --evals times (evenly spaced; the last after the last step): it pulls the
rows the held-out set needs and computes log loss and AUC (numpy). Both workers wait at a barrier around an
evaluation, and rank 0 reads the servers' CPU (/proc/<pid>/stat) after each barrier, so "server CPU per step"
counts the training steps only (the evaluations' pulls are recorded apart). The last evaluation's predicted
probabilities are saved to <out>.pred.npy, for scripts/bench.py to compare servers.

Records (JSON lines in <out>.rank<r>.jsonl): config (rank 0: sizes, the floor), eval (rank 0: held-out log loss and
AUC, and the server CPU and wall time of the steps since the previous evaluation), train (rank 0: steps, wall,
server CPU), done.

--replay lazy,dense,row-steps runs no job: the same training in one process, float64 numpy, with MXNet's Adam
formulas per arm (:func:`replay`), printing each arm's held-out log loss and AUC at the evaluation steps. It agrees
with the jobs to about 1e-4 in log loss, so it checks the servers' arms independently and shows in seconds how an
arm's result moves with --lr or --wd (the dense arm replays every row every step: minutes at the full sizes):

    python scripts/bench_workers/ctr_learning.py --replay lazy,row-steps --dims 500000,200000,100000,50000 \
        --batch 2048 --steps 600 --held-out 100000 --evals 3 --lr 0.005
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, scramble_factor, server_pids, servers_cpu  # noqa: E402

EMB_KEY, WIDE_KEY = 100, 200        # + field index
V_KEY, BIAS_KEY = 0, 1              # the dense keys
EMB_SCALE = 0.05                    # Uniform(0.05) for the embeddings
HELD_OUT = 1_000_003                # the held-out set's stream, apart from every worker's


class ZipfLogistic:
    """The synthetic CTR task: ids Zipf(a) per field, clicks from a known logistic model."""

    def __init__(self, dims: list[int], a: float = 1.2, sigma: float = 0.8, bias: float = -1.5, seed: int = 0):
        self.dims, self.a, self.sigma, self.bias, self.seed = [int(n) for n in dims], a, sigma, bias, seed
        self.factors = [np.int64(scramble_factor(n)) for n in self.dims]
        self.truth = [np.random.default_rng([seed, 77, f]).normal(0.0, sigma, n) for f, n in enumerate(self.dims)]

    def ids(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """(count, F) int64 ids."""
        out = np.empty((count, len(self.dims)), np.int64)
        for f, n in enumerate(self.dims):
            ranks = (rng.zipf(self.a, count) - 1) % n
            out[:, f] = ranks * self.factors[f] % n
        return out

    def true_logit(self, ids: np.ndarray) -> np.ndarray:
        return self.bias + sum(self.truth[f][ids[:, f]] for f in range(len(self.dims)))

    def sample(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids (count, F), clicks (count,) float32, true probabilities (count,) float64)."""
        ids = self.ids(rng, count)
        prob = sigmoid(self.true_logit(ids))
        clicks = (rng.random(count) < prob).astype(np.float32)
        return ids, clicks, prob

    def batch(self, rank: int, step: int, count: int):
        return self.sample(np.random.default_rng([self.seed, rank, step]), count)

    def held_out(self, count: int):
        return self.sample(np.random.default_rng([self.seed, HELD_OUT]), count)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))   # no overflow for large |x|


def log_loss(clicks: np.ndarray, prob: np.ndarray) -> float:
    p = np.clip(np.asarray(prob, np.float64), 1e-12, 1 - 1e-12)
    y = np.asarray(clicks, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc(clicks: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    y = np.asarray(clicks) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = np.asarray(score)[order]
    ranks = np.empty(len(s), np.float64)
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    for_each = (starts + ends + 1) / 2.0            # the average 1-based rank of each run of ties
    ranks[order] = np.repeat(for_each, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def eval_steps(steps: int, evals: int) -> list[int]:
    """The steps after which the held-out set is evaluated: evenly spaced, the last one after the last step."""
    return sorted({max(1, round(steps * (k + 1) / evals)) for k in range(evals)})


def replay(task: ZipfLogistic, args, arm: str, workers: int = 2) -> list[tuple[int, float, float]]:
    """The job's training in one process, float64 numpy, no servers: the workers' batches merged as a dist_sync
    server merges them, then MXNet's Adam per arm ("lazy": the rows in the batch, bias correction by the key's step
    t; "dense": every row, rows without gradient with g = wd x w; "row-steps": lazy, bias correction by each row's
    own update count). Not bit-identical to a job (float32 there), but within ~1e-4 of its held-out log loss: an
    independent check of the servers' arms, and a cheap way to see how an arm's result moves with lr or wd.
    Returns [(step, held-out log loss, AUC)] at the evaluation steps."""
    F, D = len(task.dims), args.emb_dim
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-8, args.lr, args.wd
    rescale = 1.0 / (args.batch * workers)
    from kvstore_lazy.numerics.initializers import parse_initializer   # (seed, key, row) -> the servers' values
    weights = [np.zeros((n, 1)) for n in task.dims]
    if D:
        uniform = parse_initializer(json.dumps(["uniform", {"scale": EMB_SCALE}]))
        weights += [uniform.rows(args.seed, EMB_KEY + f, np.arange(n, dtype=np.uint64), (n, D), np.float32)
                    .astype(np.float64) for f, n in enumerate(task.dims)]
    mean = [np.zeros_like(w) for w in weights]
    var = [np.zeros_like(w) for w in weights]
    count = [np.zeros((len(w), 1)) for w in weights]
    dense = {BIAS_KEY: np.zeros(1)}
    if D:
        dense[V_KEY] = np.random.default_rng([args.seed, 5]).normal(0, 0.1, F * D).astype(np.float32).astype(float)
    dense_mean = {k: np.zeros_like(v) for k, v in dense.items()}
    dense_var = {k: np.zeros_like(v) for k, v in dense.items()}
    ho_ids, ho_clicks, _ = task.held_out(args.held_out)

    def logits(ids: np.ndarray) -> np.ndarray:
        out = dense[BIAS_KEY][0] + sum(weights[f][ids[:, f], 0] for f in range(F))
        if D:
            out = out + sum(weights[F + f][ids[:, f]] @ dense[V_KEY][f * D:(f + 1) * D] for f in range(F))
        return out

    def adam(w, m, v, g, scale):
        g = g + wd * w
        m[:] = b1 * m + (1 - b1) * g
        v[:] = b2 * v + (1 - b2) * g * g
        return w - lr * scale * m / (np.sqrt(v) + eps)

    evals = eval_steps(args.steps, args.evals)
    out = []
    for step in range(1, args.steps + 1):
        batches = [task.batch(r, step, args.batch) for r in range(workers)]
        ids = np.concatenate([b[0] for b in batches])
        d = sigmoid(logits(ids)) - np.concatenate([b[1] for b in batches])
        scale = np.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        grads = {BIAS_KEY: np.array([d.sum()])}
        for f in range(F):
            uniq, inv = np.unique(ids[:, f], return_inverse=True)
            per_id = np.bincount(inv, weights=d, minlength=len(uniq))[:, None]
            parts = [(f, per_id)]
            if D:
                parts.append((F + f, per_id * dense[V_KEY][None, f * D:(f + 1) * D]))
                grads.setdefault(V_KEY, np.zeros(F * D))[f * D:(f + 1) * D] = per_id[:, 0] @ weights[F + f][uniq]
            for j, g in parts:
                if arm == "dense":
                    full = np.zeros_like(weights[j])
                    full[uniq] = rescale * g
                    weights[j] = adam(weights[j], mean[j], var[j], full, scale)
                    continue
                m, v = mean[j][uniq], var[j][uniq]
                if arm == "row-steps":
                    count[j][uniq] += 1
                    t = count[j][uniq]
                    row_scale = np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                else:
                    row_scale = scale
                weights[j][uniq] = adam(weights[j][uniq], m, v, rescale * g, row_scale)
                mean[j][uniq], var[j][uniq] = m, v
        for key, g in grads.items():
            dense[key] = adam(dense[key], dense_mean[key], dense_var[key], rescale * g, scale)
        if step in evals:
            lg = logits(ho_ids)
            out.append((step, log_loss(ho_clicks, sigmoid(lg)), auc(ho_clicks, lg)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="results prefix (a job's worker)")
    p.add_argument("--server", choices=["lazy", "stock"], help="the servers' kind (a job's worker)")
    p.add_argument("--replay", default="", help="run no job: replay the arms given (lazy,dense,row-steps) in numpy "
                                                "and print their held-out log loss and AUC at the evaluation steps")
    p.add_argument("--arm", default="", help="a label for the records (the server-side options are the bench's)")
    p.add_argument("--mode", default="dist_sync")
    p.add_argument("--dims", default="200000,100000,50000", help="ids per field")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--sigma", type=float, default=0.8, help="std of the true per-id weights")
    p.add_argument("--true-bias", type=float, default=-1.5)
    p.add_argument("--emb-dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=1024, help="examples per worker per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--held-out", type=int, default=50_000)
    p.add_argument("--evals", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--lazy-update", type=int, default=1, choices=[0, 1])
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    task = ZipfLogistic([int(n) for n in args.dims.split(",")], args.zipf, args.sigma, args.true_bias, args.seed)
    if args.replay:
        ho_ids, ho_clicks, ho_prob = task.held_out(args.held_out)
        print(f"floor: log loss {log_loss(ho_clicks, ho_prob):.4f}, AUC {auc(ho_clicks, ho_prob):.4f}; constant: "
              f"{log_loss(ho_clicks, np.full(len(ho_clicks), ho_clicks.mean())):.4f}", flush=True)
        for arm in args.replay.split(","):
            t = time.perf_counter()
            curve = replay(task, args, arm)
            print(f"{arm:9s} lr {args.lr:g} wd {args.wd:g}: " + ", ".join(f"{step}: {loss:.4f} / {a:.4f}"
                                                                         for step, loss, a in curve)
                  + f"  ({time.perf_counter() - t:.0f} s)", flush=True)
        return
    if not args.out or not args.server:
        p.error("--out and --server are required (or --replay)")

    import mxnet as mx

    from kvstore_lazy.numerics.initializers import parse_initializer

    F, D = len(task.dims), args.emb_dim
    kv = mx.kv.create(args.mode)
    rank, nw = kv.rank, kv.num_workers
    res = Results(args.out, rank)
    pids = server_pids() if rank == 0 else []
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=args.lr, wd=args.wd, lazy_update=bool(args.lazy_update),
                                       rescale_grad=1.0 / (args.batch * nw)))

    sparse = [(WIDE_KEY + f, (n, 1), mx.init.Zero(), f) for f, n in enumerate(task.dims)]
    if D:
        sparse += [(EMB_KEY + f, (n, D), mx.init.Uniform(EMB_SCALE), f) for f, n in enumerate(task.dims)]
    v0 = np.random.default_rng([args.seed, 5]).normal(0, 0.1, F * D).astype(np.float32)
    dense = [(V_KEY, v0), (BIAS_KEY, np.zeros(1, np.float32))] if D else [(BIAS_KEY, np.zeros(1, np.float32))]
    for key, value in dense:
        kv.init(key, mx.nd.array(value))
    if args.server == "lazy":
        from kvstore_lazy.worker import init_lazy
    for key, shape, init, _ in sparse:
        if args.server == "lazy":
            init_lazy(kv, key, shape, init=init, seed=args.seed)
        elif rank == 0:
            # every row (zeros too: a stock server needs them all), with the values a lazy server computes
            values = parse_initializer(init.dumps()).rows(args.seed, key, np.arange(shape[0], dtype=np.uint64),
                                                          shape, np.float32)
            kv.init(key, mx.nd.sparse.row_sparse_array((values, np.arange(shape[0], dtype=np.int64)), shape=shape))
            del values
        else:
            kv.init(key, mx.nd.sparse.zeros("row_sparse", shape))
    mx.nd.waitall()

    def pull_sparse(uniq: list[np.ndarray]) -> list[np.ndarray]:
        keys = [key for key, _, _, _ in sparse]
        outs = [mx.nd.sparse.zeros("row_sparse", shape) for _, shape, _, _ in sparse]
        row_ids = [mx.nd.array(uniq[f], dtype="int64") for _, _, _, f in sparse]
        kv.row_sparse_pull(keys, out=outs, row_ids=row_ids)
        return [o.data.asnumpy() for o in outs]

    def pull_dense() -> dict[int, np.ndarray]:
        outs = [mx.nd.zeros(value.shape) for _, value in dense]
        kv.pull([key for key, _ in dense], out=outs)
        return {key: o.asnumpy() for (key, _), o in zip(dense, outs)}

    def forward(ids: np.ndarray):
        """(logit, uniq per field, inverse per field, rows per sparse key, dense values)."""
        uniq, inv = [], []
        for f in range(F):
            u, i = np.unique(ids[:, f], return_inverse=True)
            uniq.append(u)
            inv.append(i)
        rows = pull_sparse(uniq)
        dv = pull_dense()
        logit = np.full(len(ids), float(dv[BIAS_KEY][0]))
        for j, (_, _, _, f) in enumerate(sparse):
            if j < F:
                logit += rows[j][inv[f], 0]
            else:
                logit += rows[j][inv[f]] @ dv[V_KEY][f * D:(f + 1) * D]
        return logit, uniq, inv, rows, dv

    # ---- the held-out set and its floor (rank 0)
    if rank == 0:
        ho_ids, ho_clicks, ho_prob = task.held_out(args.held_out)
        base = float(ho_clicks.mean())
        res.add(kind="config", arm=args.arm, server=args.server, dims=task.dims, zipf=args.zipf, sigma=args.sigma,
                true_bias=args.true_bias, emb_dim=D, batch=args.batch, steps=args.steps, workers=nw,
                lr=args.lr, wd=args.wd, lazy_update=args.lazy_update, held_out=args.held_out,
                held_out_ctr=base, floor_logloss=log_loss(ho_clicks, ho_prob), floor_auc=auc(ho_clicks, ho_prob),
                constant_logloss=log_loss(ho_clicks, np.full(len(ho_clicks), base)),
                held_out_distinct=[int(len(np.unique(ho_ids[:, f]))) for f in range(F)])

    evals = eval_steps(args.steps, args.evals)
    train_cpu = [0.0] * len(pids)
    eval_cpu = [0.0] * len(pids)
    train_wall = 0.0
    window: list[float] = []
    segment_start = 0

    def add_cpu(total: list[float], before: list, after: list) -> None:
        for i, (a, b) in enumerate(zip(before, after)):
            total[i] = None if a is None or b is None or total[i] is None else total[i] + (b - a)

    kv._barrier()
    cpu = servers_cpu(pids)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, clicks, _ = task.batch(rank, step, args.batch)
        logit, uniq, inv, rows, dv = forward(ids)
        prob = sigmoid(logit)
        window.append(log_loss(clicks, prob))
        d = prob - clicks                                         # d loss / d logit, per example (rescaled on
        per_id = [np.bincount(inv[f], weights=d, minlength=len(uniq[f])) for f in range(F)]   # the servers)
        keys, grads = [], []
        for j, (key, shape, _, f) in enumerate(sparse):
            if j < F:
                g = per_id[f][:, None]
            else:
                g = per_id[f][:, None] * dv[V_KEY][None, f * D:(f + 1) * D]
            keys.append(key)
            grads.append(mx.nd.sparse.row_sparse_array((g.astype(np.float32), uniq[f]), shape=shape))
        for key, value in dense:
            if key == BIAS_KEY:
                g = np.array([d.sum()], np.float32)
            else:
                g = np.concatenate([per_id[f] @ rows[F + f] for f in range(F)]).astype(np.float32)
            keys.append(key)
            grads.append(mx.nd.array(g))
        kv.push(keys, grads)
        mx.nd.waitall()
        if step in evals:
            wall = time.perf_counter() - started
            train_wall += wall
            kv._barrier()
            after = servers_cpu(pids)
            add_cpu(train_cpu, cpu, after)
            segment = [0.0] * len(pids)
            add_cpu(segment, cpu, after)
            if rank == 0:
                t = time.perf_counter()
                logit = forward(ho_ids)[0]
                pred = sigmoid(logit)
                # segment_*: the training steps since the previous evaluation (how the cost per step moves)
                res.add(kind="eval", step=step, logloss=log_loss(ho_clicks, pred), auc=auc(ho_clicks, logit),
                        train_logloss=float(np.mean(window)), seconds=time.perf_counter() - t,
                        segment_steps=step - segment_start, segment_wall=wall, segment_server_cpu=segment)
                if step == evals[-1]:
                    np.save(f"{args.out}.pred.npy", pred.astype(np.float32))
            window = []
            segment_start = step
            kv._barrier()
            cpu = servers_cpu(pids)
            add_cpu(eval_cpu, after, cpu)
            started = time.perf_counter()
    if rank == 0:
        res.add(kind="train", steps=args.steps, wall=train_wall, server_cpu=train_cpu, eval_server_cpu=eval_cpu,
                evals=evals)
    kv._barrier()
    res.add(kind="done")
    print(f"ctr_learning worker {rank} done", flush=True)


if __name__ == "__main__":
    main()
