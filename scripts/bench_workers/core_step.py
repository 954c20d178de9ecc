"""CPU per training step of the server core alone, no sockets: ``python scripts/bench_workers/core_step.py``.

Plays two stock workers against one in-process :class:`KVServer` with the frames a stock worker sends (through the
wire codec both ways): each step, both workers pull B Zipf-distributed distinct rows of a lazy (input_dim x D) key
and push gradients for them (dist_sync, so the second push triggers the merge and the optimizer update). Prints the
CPU time per step (pull + push of both workers) after a warm-up, which is repeatable on a shared machine where the
end-to-end figures of ``make bench`` are not. Then the same for dense keys (both push, then both pull). For tuning
the hot path; ``make bench`` holds the side-by-side tables.

``--workers N``: N stock workers instead of two (a dist_sync round of N pushes, each of B rows; N=8 is the
saturation scenario's); the row_sparse rows also split a step's CPU into its pulls, the round's first N-1 pushes
and its last (the one that completes the round: the round's merge, the update, the N replies).

``--step``: the traffic of bench.py's "step" scenario (scripts/bench_workers/step.py, its quick preset: 4 features,
embeddings D=16 Uniform and wide weights Zero, an MLP 64-256-128-1, Adam, 256 Zipf ids per feature and worker,
dist_sync, one server) through the server core alone, with the CPU per step split by request kind: what of the
step job's server CPU is the core's, the rest being the runtime loop, ZeroMQ and the kernel.
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import numpy as np

# Appended, not prepended: PYTHONPATH=<another checkout> measures that checkout's server with this script (its
# kvstore_lazy is printed first); without it, this checkout's.
sys.path.append(str(Path(__file__).resolve().parents[2]))

import kvstore_lazy  # noqa: E402

from kvstore_lazy.protocol import mxnet as mx  # noqa: E402
from kvstore_lazy.protocol.message import KVPairs, Message, identity_of  # noqa: E402
from kvstore_lazy.protocol.pbmeta import Meta  # noqa: E402
from kvstore_lazy.server.core import KVServer  # noqa: E402
from kvstore_lazy.server.lifecycle import Settings, parse_bytes  # noqa: E402
from kvstore_lazy.worker import lazy_spec_body  # noqa: E402

KEY = 3
WORKERS = (9, 11)
ROW_SPARSE_F32 = mx.command_code(mx.ROW_SPARSE, 0)
DEFAULT_F32 = mx.command_code(mx.DEFAULT, 0)


class Worker:
    def __init__(self, node_id: int) -> None:
        self.node_id, self.ts = node_id, 0

    def _message(self, head: int, *, push=False, pull=False, simple_app=False, body=b"", kv=None) -> Message:
        meta = Meta(head=head, body=body, request=True, push=push, pull=pull, simple_app=simple_app, app_id=0,
                    timestamp=self.ts, customer_id=0)
        self.ts += 1
        data = []
        if kv is not None:
            data, meta.data_type = kv.frames()
        # through the codec, as the van would hand it to the server
        return Message.from_frames([identity_of(self.node_id)] + Message(meta, data, sender=self.node_id).to_frames())

    def command(self, head: int, body: bytes) -> Message:
        return self._message(head, simple_app=True, body=body)

    def rows(self, ids: np.ndarray, values: np.ndarray | None) -> Message:
        keys = np.concatenate([[KEY], KEY + ids.astype(np.uint64)]).astype(np.uint64)
        if values is None:
            return self._message(ROW_SPARSE_F32, pull=True, kv=KVPairs(keys, b"", np.zeros(0, np.int32)))
        lens = np.full(len(keys), values.shape[1] * 4, np.int32)
        lens[0] = 0
        return self._message(ROW_SPARSE_F32, push=True, kv=KVPairs(keys, values.tobytes(), lens))


    def dense(self, key: int, values: np.ndarray | None) -> Message:
        keys = np.array([key], np.uint64)
        if values is None:
            return self._message(DEFAULT_F32, pull=True, kv=KVPairs(keys, b"", np.zeros(0, np.int32)))
        payload = values.tobytes()
        return self._message(DEFAULT_F32, push=True, kv=KVPairs(keys, payload, np.array([len(payload)], np.int32)))


def zipf_rows(rng, input_dim: int, batch: int) -> np.ndarray:
    ids: set[int] = set()
    while len(ids) < batch:
        ids.update((rng.zipf(1.2, batch) * 0x9E3779B1 % input_dim).tolist())
    return np.sort(np.fromiter(ids, np.int64)[:batch])


def start(optimizer: str, materialize: str = "push", lifecycle: Settings | None = None, num_workers: int = 2):
    import mxnet  # only for the optimizer pickle a stock worker sends
    server = KVServer(0, 1, num_workers, materialize=materialize, lifecycle=lifecycle)
    workers = [Worker(n) for n in WORKERS] + [Worker(9 + 2 * rank) for rank in range(len(WORKERS), num_workers)]
    workers = workers[:num_workers]   # (stock workers' node ids: 9, 11, 13, ...)

    def handle(msg: Message) -> None:
        for _, reply in server.handle(msg):
            reply.to_frames()
        assert server.bad_requests == 0, "a request was refused"

    opt = mxnet.optimizer.create(optimizer, learning_rate=0.01, **({"momentum": 0.9} if optimizer == "sgd" else {}))
    handle(workers[0].command(mx.SYNC_MODE, b""))
    handle(workers[0].command(mx.CONTROLLER, pickle.dumps(opt, 0)))
    return server, workers, handle


def run_dense(optimizer: str, shape: tuple[int, ...], steps: int, warmup: int) -> dict:
    server, workers, handle = start(optimizer)
    rng = np.random.default_rng(0)
    handle(workers[0].dense(5, rng.standard_normal(shape).astype(np.float32)))
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in workers]
    cpu = []
    for step in range(warmup + steps):
        t = time.process_time()
        for w, grad in zip(workers, grads):
            handle(w.dense(5, grad))
        for w in workers:
            handle(w.dense(5, None))
        if step >= warmup:
            cpu.append(time.process_time() - t)
    return {"cpu_ms_per_step": 1e3 * float(np.mean(cpu)), "cpu_ms_p50": 1e3 * float(np.median(cpu))}


def lifecycle_of(text: str) -> tuple[Settings | None, dict]:
    """--lifecycle NAME[=VALUE]: none, budget=8MiB (the server's memory budget), or an init_lazy policy argument
    (admit_min_count=2, admit_prob=0.5, ttl_rounds=20)."""
    name, _, value = text.partition("=")
    if name == "none":
        return None, {}
    if name == "budget":
        return Settings(memory_budget=parse_bytes(value)), {}
    return None, {name: float(value) if name in ("admit_prob", "ttl_seconds") else int(value)}


def run(optimizer: str, input_dim: int, dim: int, batch: int, steps: int, warmup: int,
        materialize: str = "push", lifecycle: str = "none", num_workers: int = 2) -> dict:
    settings, policy = lifecycle_of(lifecycle)
    server, workers, handle = start(optimizer, materialize, settings, num_workers)
    handle(workers[0].command(mx.LAZY_DECLARE, lazy_spec_body(KEY, (input_dim, dim), "float32",
                                                               '["uniform", {"scale": 0.07}]', 1, **policy)))
    handle(workers[0].rows(np.zeros(0, np.int64), np.zeros((0, dim), np.float32)))
    rng = np.random.default_rng(0)
    batches = [[zipf_rows(rng, input_dim, batch) for _ in workers] for _ in range(warmup + steps)]
    grads = [rng.standard_normal((batch, dim)).astype(np.float32) for _ in workers]
    cpu, parts = [], np.zeros(3)    # parts: the pulls, the first N-1 pushes, the last push (the round's end)
    for step, ids in enumerate(batches):
        t = time.process_time()
        for w, rows in zip(workers, ids):
            handle(w.rows(rows, None))
        t1 = time.process_time()
        for w, rows, grad in zip(workers[:-1], ids, grads):
            handle(w.rows(rows, grad))
        t2 = time.process_time()
        handle(workers[-1].rows(ids[-1], grads[-1]))
        t3 = time.process_time()
        if step >= warmup:
            cpu.append(t3 - t)
            parts += (t1 - t, t2 - t1, t3 - t2)
    pulls, pushes, last = 1e3 * parts / steps
    return {"optimizer": optimizer, "batch": batch, "rows": server.stats()["sparse"][str(KEY)]["rows"],
            "cpu_ms_per_step": 1e3 * float(np.mean(cpu)), "cpu_ms_p50": 1e3 * float(np.median(cpu)),
            "pulls_ms": pulls, "pushes_ms": pushes, "last_push_ms": last}


def run_small(optimizer: str, repeat: int) -> dict:
    """Server CPU per small request (us): what a CTR step is made of (issue "faster on a real training step")."""
    server, workers, handle = start(optimizer)
    rng = np.random.default_rng(1)
    handle(workers[0].dense(5, rng.standard_normal((2, 3)).astype(np.float32)))
    handle(workers[0].command(mx.LAZY_DECLARE, lazy_spec_body(KEY, (1 << 40, 16), "float32",
                                                               '["uniform", {"scale": 0.07}]', 1)))
    handle(workers[0].rows(np.zeros(0, np.int64), np.zeros((0, 16), np.float32)))
    grad = rng.standard_normal((2, 3)).astype(np.float32)
    fresh = [np.sort(rng.choice(1 << 40, 256, replace=False)) for _ in range(repeat)]
    known = [np.sort(rng.choice(1 << 40, 256, replace=False)) for _ in range(8)]
    for ids in known:   # stored under either policy: pushed once (a round of both workers)
        for w in workers:
            handle(w.rows(ids, np.zeros((256, 16), np.float32)))
    msgs = {
        "dense 2x3 push (sync round of 2)": [w.dense(5, grad) for _ in range(repeat) for w in workers],
        "dense 2x3 pull": [workers[0].dense(5, None) for _ in range(repeat)],
        "row_sparse pull, 256 new rows": [workers[0].rows(ids, None) for ids in fresh],
        "row_sparse pull, 256 stored rows": [workers[1].rows(known[i % 8], None) for i in range(repeat)],
        "row_sparse push, 256 stored rows (round of 2)": [w.rows(known[i % 8], rng.standard_normal((256, 16)).astype(
            np.float32)) for i in range(repeat // 2) for w in workers],
    }
    out = {}
    for name, batch in msgs.items():
        frames = [[identity_of(m.sender)] + m.to_frames() for m in batch]
        t = time.process_time()
        for f in frames:   # decoded here, as the runtime decodes what the socket gives it
            handle(Message.from_frames(f))
        out[name] = 1e6 * (time.process_time() - t) / len(batch)
    return out


STEP_FEATURES = (200_000, 100_000, 50_000, 10_000)
EMB_KEY, WIDE_KEY = 100, 200


def step_messages(w: Worker, kind: str, key: int, ids: np.ndarray | None = None,
                  values: np.ndarray | None = None) -> tuple[str, Message]:
    if kind.startswith("dense"):
        return kind, w.dense(key, values)
    keys = np.concatenate([[key], key + ids.astype(np.uint64)]).astype(np.uint64)
    if values is None:
        return kind, w._message(ROW_SPARSE_F32, pull=True, kv=KVPairs(keys, b"", np.zeros(0, np.int32)))
    lens = np.full(len(keys), values.shape[1] * 4, np.int32)
    lens[0] = 0
    return kind, w._message(ROW_SPARSE_F32, push=True, kv=KVPairs(keys, values.tobytes(), lens))


def run_step(steps: int, warmup: int, rows: int = 256) -> dict:
    """Server core CPU per step of the step scenario, by request kind (ms)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from common import ZipfRows
    server, workers, handle = start("adam")
    dense_shapes, fan_in = [], len(STEP_FEATURES) * 16
    for width in (256, 128, 1):
        dense_shapes += [(width, fan_in), (width,)]
        fan_in = width
    sparse = [(EMB_KEY + f, 16, f, '["uniform", {"scale": 0.07}]') for f in range(len(STEP_FEATURES))] + \
             [(WIDE_KEY + f, 1, f, '["zero", {}]') for f in range(len(STEP_FEATURES))]
    for key, shape in enumerate(dense_shapes):
        handle(workers[0].dense(key, np.full(shape, 0.01, np.float32)))
    for key, dim, f, init in sparse:
        handle(workers[0].command(mx.LAZY_DECLARE, lazy_spec_body(key, (STEP_FEATURES[f], dim), "float32", init, 5)))
        handle(step_messages(workers[0], "", key, np.zeros(0, np.int64), np.zeros((0, dim), np.float32))[1])
    streams = [[ZipfRows(n, rows, 5 + 100 * f, rank) for f, n in enumerate(STEP_FEATURES)]
               for rank in range(len(workers))]
    rng = np.random.default_rng(0)
    dense_grads = [rng.normal(0, 0.01, s).astype(np.float32) for s in dense_shapes]
    sparse_grads = {dim: rng.normal(0, 0.01, (rows, dim)).astype(np.float32) for dim in (1, 16)}
    ids = [[s.next() for s in per_worker] for per_worker in streams]
    totals: dict[str, float] = {}
    cpu = []
    for step in range(warmup + steps):
        batch = []
        for w, mine in zip(workers, ids):
            batch += [step_messages(w, "dense push", key, values=g) for key, g in enumerate(dense_grads)]
            batch += [step_messages(w, "row_sparse push", key, mine[f], sparse_grads[dim])
                      for key, dim, f, _ in sparse]
        ids = [[s.next() for s in per_worker] for per_worker in streams]
        for w, mine in zip(workers, ids):
            batch += [step_messages(w, "dense pull", key) for key in range(len(dense_shapes))]
            batch += [step_messages(w, "row_sparse pull", key, mine[f]) for key, _, f, _ in sparse]
        frames = [(kind, [identity_of(m.sender)] + m.to_frames()) for kind, m in batch]
        started = time.process_time()
        for kind, f in frames:
            t = time.process_time()
            handle(Message.from_frames(f))
            if step >= warmup:
                totals[kind] = totals.get(kind, 0.0) + time.process_time() - t
        if step >= warmup:
            cpu.append(time.process_time() - started)
    out = {kind: 1e3 * total / steps for kind, total in totals.items()}
    out["whole step"] = 1e3 * float(np.mean(cpu))
    fast = getattr(server, "fast", None)   # (a checkout from before server/fastpath.py has none)
    if fast is not None:
        out["pulls answered by the fast path"] = fast.answered
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-dim", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--optimizer", nargs="+", default=["sgd", "adam"])
    parser.add_argument("--dense", nargs="*", default=["2x3", "1000x1000"], help="dense shapes (push+pull rounds)")
    parser.add_argument("--workers", type=int, default=len(WORKERS), help="stock workers (a dist_sync round's pushes)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--small", type=int, default=2000, help="requests per small-request row (0: skip)")
    parser.add_argument("--only-small", action="store_true")
    parser.add_argument("--step", action="store_true", help="only the step scenario's traffic (see above)")
    parser.add_argument("--materialize", nargs="+", default=["push"], choices=["push", "touch"],
                        help="row policies to run the row_sparse steps with (push: the server's default)")
    parser.add_argument("--lifecycle", nargs="+", default=["none"],
                        help="row lifecycle policies to run the row_sparse steps with: none, budget=8MiB, "
                             "admit_min_count=2, admit_prob=0.5, ttl_rounds=20")
    args = parser.parse_args()
    print(f"kvstore_lazy from {Path(kvstore_lazy.__file__).resolve().parent}")
    if args.step:
        r = run_step(args.steps * 5, args.warmup * 2)
        print(f"{'step scenario (1 server, dist_sync, adam)':<44} {'server core CPU ms/step':>24}")
        for name, value in r.items():
            print(f"{name:<44} {value:>24.2f}" if isinstance(value, float) else f"{name:<44} {value:>24}")
        return
    if args.small:
        print(f"{'optimizer':<10} {'small request':<48} {'server CPU us/request':>22}")
        for optimizer in args.optimizer:
            for name, us in run_small(optimizer, args.small).items():
                print(f"{optimizer:<10} {name:<48} {us:>22.1f}")
        print()
    if args.only_small:
        return
    print(f"{'optimizer':<10} {'policy':>7} {'lifecycle':>18} {'B':>6} {'rows stored':>12} {'CPU ms/step':>12} "
          f"{'p50':>8} {'pulls':>8} {'pushes':>8} {'last':>8}   ({args.workers} workers; pushes: the round's first "
          f"{args.workers - 1}, last: the one that ends it)")
    for optimizer in args.optimizer:
        for batch in args.batch:
            for policy in args.materialize:
                for lifecycle in args.lifecycle:
                    r = run(optimizer, args.input_dim, args.dim, batch, args.steps, args.warmup, policy, lifecycle,
                            args.workers)
                    print(f"{optimizer:<10} {policy:>7} {lifecycle:>18} {batch:>6} {r['rows']:>12,} "
                          f"{r['cpu_ms_per_step']:>12.2f} {r['cpu_ms_p50']:>8.2f} {r['pulls_ms']:>8.2f} "
                          f"{r['pushes_ms']:>8.2f} {r['last_push_ms']:>8.2f}")
    print(f"\n{'optimizer':<10} {'dense':>10} {'CPU ms/round':>13} {'p50':>8}   (2 pushes + 2 pulls)")
    for optimizer in args.optimizer:
        for text in args.dense:
            r = run_dense(optimizer, tuple(int(d) for d in text.split("x")), args.steps, args.warmup)
            print(f"{optimizer:<10} {text:>10} {r['cpu_ms_per_step']:>13.2f} {r['cpu_ms_p50']:>8.2f}")


if __name__ == "__main__":
    main()
