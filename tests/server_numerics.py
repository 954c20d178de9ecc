"""The server's arithmetic on fixed inputs, for comparing one Python/numpy with another (tests/test_server_python.py).

``python tests/server_numerics.py CASES.json OUT.npz`` runs under the server's Python (no mxnet: the optimizers come
as the protocol-0 pickles a worker sends, made by the caller) and writes every result array to OUT.npz:

* optimizers: for each case, STEPS dense updates of the SHAPES weights, and STEPS lazy row_sparse updates of a
  (ROWS, COLS) table through both server paths (rows gathered and scattered; ``update_rows`` in place), each
  through the compiled kernels and through the numpy expressions (what other dtypes take);
* initializers: rows of every initializer for large and small row ids, in float16/32/64;
* 2-bit compression: dequantized pushes;
* dense-update semantics: a table under each optimizer stock runs on every row, rows brought when touched.

Inputs are drawn from ``np.random.RandomState`` (whose streams numpy keeps fixed across versions), by the functions
below, which the caller also uses to compute MXNet's results.
"""
from __future__ import annotations

import contextlib
import json
import sys
import zlib

import numpy as np

from kvstore_lazy.numerics import optimizers
from kvstore_lazy.numerics.catchup import History, rule_for, touched_update
from kvstore_lazy.numerics.compression import dequantize_2bit
from kvstore_lazy.numerics.initializers import parse_initializer

SHAPES = {0: (5, 7), 1: (13,)}
STEPS = 5
ROWS, COLS, SPARSE_KEY = 10, 4, 3
INITIALIZERS = [
    '["uniform", {"scale": 0.07}]', '["uniform", {"scale": 3.5}]', '["normal", {"sigma": 0.01}]',
    '["normal", {"sigma": 2.0}]', '["xavier", {"rnd_type": "uniform", "factor_type": "avg", "magnitude": 3}]',
    '["xavier", {"rnd_type": "gaussian", "factor_type": "in", "magnitude": 2.34}]',
    '["msraprelu", {"factor_type": "out", "slope": 0.1}]', '["constant", {"value": -2.5}]', '["zero", {}]',
    '["one", {}]',
]
INIT_SHAPE = (2 ** 40, 6)
INIT_ROW_IDS = np.array([0, 1, 2, 7, 1000, 123456789, 2 ** 33 + 5, 2 ** 40 - 1], np.uint64)


def dense_data(case: str):
    """(weights by key, [grads by key] per step), as tests/test_optimizers.py draws them."""
    rng = np.random.RandomState(zlib.crc32(case.encode()))
    weights = {k: rng.randn(*s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: (rng.randn(*s) * 2).astype(np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return weights, grads


def sparse_data():
    """(initial table, [(sorted row ids, grad rows)] per step); the last 2 rows never get gradients."""
    rng = np.random.RandomState(7)
    initial = rng.randn(ROWS, COLS).astype(np.float32)
    steps = []
    for _ in range(STEPS):
        idx = np.sort(rng.choice(ROWS - 2, size=4, replace=False))
        steps.append((idx, rng.randn(len(idx), COLS).astype(np.float32)))
    return initial, steps


def catchup_data():
    """(initial table, [(sorted row ids, grad rows)] per step) for the dense-semantics cases: 24 steps, every 7th
    without rows, the last 2 rows never touched."""
    rng = np.random.RandomState(13)
    initial = rng.randn(ROWS, COLS).astype(np.float32)
    steps = []
    for k in range(24):
        idx = np.sort(rng.choice(ROWS - 2, size=0 if k % 7 == 6 else 3, replace=False)).astype(np.int64)
        steps.append((idx, rng.randn(len(idx), COLS).astype(np.float32)))
    return initial, steps


def compression_data():
    rng = np.random.RandomState(11)
    return [(bytes(rng.randint(0, 256, 4 * -(-n // 16), dtype=np.uint8)), n, np.float32(t))
            for n, t in ((1, 0.5), (37, 0.25), (1000, 2.0))]


@contextlib.contextmanager
def numpy_path(active: bool):
    """With ``active``, SGD/Adam take their numpy expressions instead of the kernels (as for float16 arrays)."""
    accepts = optimizers.kernels.accepts
    if active:
        optimizers.kernels.accepts = lambda weight, tables, slots, grad: False
    try:
        yield
    finally:
        optimizers.kernels.accepts = accepts


def run_dense(body: bytes, case: str) -> dict[str, np.ndarray]:
    opt = optimizers.load_optimizer(body)
    weights, grads = dense_data(case)
    states = {k: opt.init_states(w) for k, w in weights.items()}
    for step in range(STEPS):
        for key in SHAPES:
            opt.update(key, weights[key], grads[step][key], states[key])
    out = {f"w{k}": w for k, w in weights.items()}
    out.update({f"s{k}.{i}": s for k, ss in states.items() for i, s in enumerate(ss)})
    return out


def run_sparse(body: bytes, in_place: bool) -> dict[str, np.ndarray]:
    opt = optimizers.load_optimizer(body)
    weight, steps = sparse_data()
    states = opt.init_states(weight)
    for idx, grad in steps:
        if in_place and opt.update_rows(SPARSE_KEY, weight, states, idx.astype(np.int64), grad):
            continue
        w_rows, s_rows = weight[idx], [s[idx] for s in states]
        opt.update(SPARSE_KEY, w_rows, grad, s_rows, row_sparse=True)
        weight[idx] = w_rows
        for s, rows in zip(states, s_rows):
            s[idx] = rows
    return {"w": weight, **{f"s{i}": s for i, s in enumerate(states)}}


def run_catchup(body: bytes) -> dict[str, np.ndarray]:
    """A table under an optimizer stock runs on every row, kept as the server keeps it: rows brought over the steps
    they missed when touched (``numerics.catchup.History``), every row brought at the end."""
    opt = optimizers.load_optimizer(body)
    rule = rule_for(opt)
    history = History(rule, opt.num_states())
    weight, steps = catchup_data()
    states, ticks = opt.init_states(weight), np.zeros(ROWS, np.int64)
    for idx, grad in steps:
        w, s = weight[idx], [x[idx] for x in states]
        history.bring(w, s, ticks[idx])
        touched_update(rule, opt, SPARSE_KEY, w, grad, s)
        history.record(opt.update_count(SPARSE_KEY), rule.scalars(opt, SPARSE_KEY))
        weight[idx] = w
        for x, rows in zip(states, s):
            x[idx] = rows
        ticks[idx] = history.tick
    history.bring(weight, states, ticks)
    return {"w": weight, **{f"s{i}": s for i, s in enumerate(states)}}


def run(cases: dict) -> dict[str, np.ndarray]:
    """Every result, named ``kind/case/path/array``."""
    results = {}
    for path in ("kernels", "numpy"):
        with numpy_path(path == "numpy"):
            for case, body in cases["dense"].items():
                for name, a in run_dense(body.encode("latin-1"), case).items():
                    results[f"dense/{case}/{path}/{name}"] = a
            for case, body in cases["sparse"].items():
                for how in ("gathered", "in_place"):
                    for name, a in run_sparse(body.encode("latin-1"), how == "in_place").items():
                        results[f"sparse/{case}/{how}-{path}/{name}"] = a
    for case, body in cases.get("catchup", {}).items():
        for name, a in run_catchup(body.encode("latin-1")).items():
            results[f"catchup/{case}/{name}"] = a
    for i, dumps in enumerate(INITIALIZERS):
        init = parse_initializer(dumps)
        for dtype in (np.float16, np.float32, np.float64):
            results[f"init/{i}/{np.dtype(dtype).name}"] = init.rows(42, 3, INIT_ROW_IDS, INIT_SHAPE, dtype)
    for i, (payload, n, threshold) in enumerate(compression_data()):
        results[f"2bit/{i}"] = dequantize_2bit(payload, n, threshold)
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    results = run(cases)
    np.savez(sys.argv[2], **results)
    print(f"numpy {np.__version__}, Python {sys.version.split()[0]}: {len(results)} arrays")
