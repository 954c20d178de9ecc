"""The honest stock worker of tests/test_trust_live.py: it trains while an attacker talks to the same server, and
checks every value it gets back.

Keys (MXNet's Test optimizer on the servers: weight += grad, so every value is an exact small integer):
- 3: dense (4,), init 0, each step pushes ones: after step t every element is t;
- 5: row_sparse (10, 2) initialised with all rows (value 100), each step pushes row t % 10 with ones;
- 7: lazy row_sparse (1000, 4) declared with Zero init (kvstore_lazy.worker.init_lazy), each step pushes row
  t % 1000 with ones; at the end fetch_rows (the checkpoint path) must list exactly the rows pushed.

Control files in --dir: it writes ``ready`` once initialised and ``progress`` (the step count); it stops at the
first step after ``stop`` appears (or after --max-steps); it writes ``result.json`` (steps, the slowest step in
seconds) and exits 0. Any wrong value raises, so the process exits non-zero and says which.
"""
import argparse
import json
import os
import time
from pathlib import Path

import mxnet as mx
import numpy as np

from kvstore_lazy.worker import fetch_rows, init_lazy

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--max-steps", type=int, default=3000)
p.add_argument("--pause", type=float, default=0.02, help="seconds between steps")
args = p.parse_args()
control = Path(args.dir)


def note(name: str, text: str) -> None:
    tmp = control / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, control / name)


kv = mx.kv.create(args.mode)
kv.set_optimizer(mx.optimizer.Test(rescale_grad=1.0))
rows = mx.nd.sparse.row_sparse_array((np.full((10, 2), 100, np.float32), np.arange(10)), shape=(10, 2))
kv.init([3, 5], [mx.nd.zeros(4), rows])
init_lazy(kv, 7, (1000, 4), init=mx.init.Zero(), seed=1)
all5 = mx.nd.arange(0, 10, dtype="int64")
note("ready", str(kv.rank))

dense = np.zeros(4, np.float32)
sparse5 = np.full((10, 2), 100, np.float32)
lazy7 = np.zeros((1000, 4), np.float32)
slowest, step = 0.0, 0
while step < args.max_steps and not (control / "stop").exists():
    started = time.monotonic()
    row5, row7 = step % 10, step % 1000
    kv.push(3, mx.nd.ones(4))
    kv.push(5, mx.nd.sparse.row_sparse_array((np.ones((1, 2), np.float32), [row5]), shape=(10, 2)))
    kv.push(7, mx.nd.sparse.row_sparse_array((np.ones((1, 4), np.float32), [row7]), shape=(1000, 4)))
    dense += 1
    sparse5[row5] += 1
    lazy7[row7] += 1
    out3 = mx.nd.zeros(4)
    kv.pull(3, out=out3)
    out5 = mx.nd.sparse.zeros("row_sparse", (10, 2))
    kv.row_sparse_pull(5, out=out5, row_ids=all5)
    out7 = mx.nd.sparse.zeros("row_sparse", (1000, 4))
    kv.row_sparse_pull(7, out=out7, row_ids=mx.nd.array([row7, 999], dtype="int64"))
    got3, got5, got7 = out3.asnumpy(), out5.asnumpy(), out7.asnumpy()
    if not (np.array_equal(got3, dense) and np.array_equal(got5, sparse5)
            and np.array_equal(got7[[row7, 999]], lazy7[[row7, 999]])):
        raise SystemExit(f"step {step}: wrong values: key 3 {got3} (want {dense}), key 5 {got5.ravel()} (want "
                         f"{sparse5.ravel()}), key 7 rows {row7}, 999: {got7[[row7, 999]].ravel()}")
    step += 1
    slowest = max(slowest, time.monotonic() - started)
    note("progress", str(step))
    time.sleep(args.pause)

ids, values = fetch_rows(kv, 7, (1000, 4))
touched = np.arange(min(step, 1000))   # the pushed rows: a pulled row (999) is not stored (materialize=push)
if not (np.array_equal(ids, touched) and np.array_equal(values, lazy7[touched])):
    raise SystemExit(f"fetch_rows: ids {ids[:10]}... ({len(ids)}), want {len(touched)} rows")
note("result.json", json.dumps({"steps": step, "slowest": slowest, "rank": kv.rank, "rows": len(ids)}))
print(f"victim done: {step} steps, slowest {slowest:.3f}s", flush=True)
