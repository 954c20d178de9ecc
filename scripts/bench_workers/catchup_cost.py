"""What dense-update semantics cost the server: ``python scripts/bench_workers/catchup_cost.py [--steps 1000]``.

Plays two stock workers against one in-process :class:`KVServer` (the frames a stock worker sends, through the wire
codec), as ``core_step.py`` does: each step both workers pull B Zipf(1.2) ids of a lazy (1M x 16) key and push
gradients for them (dist_sync). For optimizers stock runs lazily, and for the same optimizers with
``lazy_update=False`` (every row moves every step on stock: here rows are brought over the steps they missed when
touched, ``numerics/catchup``), exactly (``KVSTORE_LAZY_CATCHUP=exact``) and by closed forms (``closed``), with and
without weight decay, and for lazy Adam with its bias correction per row (``KVSTORE_LAZY_ADAM_ROW_STEPS``). Prints,
per configuration, the server-core CPU per step over the first and the last fifth of the run (the catch-up's cost
grows with the gaps rows wait, so with the job's length where weight decay keeps every missed step moving) and the
row-steps replayed per step, as a markdown table. CPU time of this process, so a busy machine slows it less than
wall time; compare rows of one run.
"""
from __future__ import annotations

import argparse
import pickle
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))

from core_step import KEY, WORKERS, Worker, zipf_rows  # noqa: E402

from kvstore_lazy.protocol import mxnet as mx  # noqa: E402
from kvstore_lazy.server.core import KVServer  # noqa: E402
from kvstore_lazy.server.policy import Settings  # noqa: E402
from kvstore_lazy.store import kernels  # noqa: E402
from kvstore_lazy.worker import lazy_spec_body  # noqa: E402

INPUT_DIM, DIM = 1_000_000, 16


def configurations():
    import mxnet
    opt = mxnet.optimizer
    sgd = dict(learning_rate=0.01, momentum=0.9)
    return [
        ("SGD momentum, wd 1e-4 (lazy: stock's default)", opt.SGD(wd=1e-4, **sgd), "exact", False),
        ("SGD momentum, wd 1e-4, lazy_update=False, exact", opt.SGD(wd=1e-4, lazy_update=False, **sgd), "exact", False),
        ("SGD momentum, wd 1e-4, lazy_update=False, closed", opt.SGD(wd=1e-4, lazy_update=False, **sgd), "closed",
         False),
        ("SGD momentum, no wd, lazy_update=False, exact", opt.SGD(lazy_update=False, **sgd), "exact", False),
        ("Adam, wd 1e-4 (lazy: stock's default)", opt.Adam(learning_rate=0.01, wd=1e-4), "exact", False),
        ("Adam, wd 1e-4, lazy, per-row bias correction", opt.Adam(learning_rate=0.01, wd=1e-4), "exact", True),
        ("Adam, wd 1e-4, lazy_update=False, exact", opt.Adam(learning_rate=0.01, wd=1e-4, lazy_update=False), "exact",
         False),
        ("Adam, no wd, lazy_update=False, exact", opt.Adam(learning_rate=0.01, lazy_update=False), "exact", False),
    ]


def run(optimizer, catchup: str, row_steps: bool, steps: int, batch: int) -> dict:
    server = KVServer(0, 1, len(WORKERS), lifecycle=Settings(catchup=catchup, adam_row_steps=row_steps))
    workers = [Worker(n) for n in WORKERS]

    def handle(msg) -> None:
        for _, reply in server.handle(msg):
            reply.to_frames()
        assert server.bad_requests == 0, "a request was refused"

    handle(workers[0].command(mx.SYNC_MODE, b""))
    handle(workers[0].command(mx.CONTROLLER, pickle.dumps(optimizer, 0)))
    handle(workers[0].command(mx.LAZY_DECLARE, lazy_spec_body(KEY, (INPUT_DIM, DIM), "float32",
                                                               '["uniform", {"scale": 0.07}]', 1)))
    handle(workers[0].rows(np.zeros(0, np.int64), np.zeros((0, DIM), np.float32)))
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((batch, DIM)).astype(np.float32) for _ in workers]
    cpu, replayed = [], [0]
    compiled = kernels.catchup_rows

    def counting(*args):      # row-steps the exact replay (the compiled kernel) applies
        done = compiled(*args)
        replayed[0] += done or 0
        return done

    kernels.catchup_rows = counting
    try:
        for _ in range(steps):
            ids = [zipf_rows(rng, INPUT_DIM, batch) for _ in workers]
            t = time.process_time()
            for w, rows in zip(workers, ids):
                handle(w.rows(rows, None))
            for w, rows, grad in zip(workers, ids, grads):
                handle(w.rows(rows, grad))
            cpu.append(time.process_time() - t)
    finally:
        kernels.catchup_rows = compiled
    fifth = max(steps // 5, 1)
    return {"first": 1e3 * float(np.mean(cpu[:fifth])), "last": 1e3 * float(np.mean(cpu[-fifth:])),
            "replayed": replayed[0] / steps, "rows": server.stats()["sparse"][str(KEY)]["rows"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=1024)
    args = p.parse_args()
    print(f"`python scripts/bench_workers/catchup_cost.py --steps {args.steps} --batch {args.batch}`, "
          f"{platform.machine()} {platform.node()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: "
          f"2 workers x B={args.batch} Zipf(1.2) ids of a ({INPUT_DIM:,} x {DIM}) key, pull + push a step.\n")
    print(f"| optimizer | server-core CPU ms/step, steps 1-{args.steps // 5} | last {args.steps // 5} steps | "
          f"row-steps replayed per step | rows stored |")
    print("|---|---|---|---|---|")
    for name, optimizer, catchup, row_steps in configurations():
        got = run(optimizer, catchup, row_steps, args.steps, args.batch)
        print(f"| {name} | {got['first']:.2f} | {got['last']:.2f} | {got['replayed']:,.0f} | {got['rows']:,} |",
              flush=True)


if __name__ == "__main__":
    main()
