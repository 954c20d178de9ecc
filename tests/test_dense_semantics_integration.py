"""Issue 32, "every optimizer as stock computes it": for SGD and Adam with ``lazy_update=False``, NAG with momentum,
Signum and RMSProp, MXNet 1.9.1's server updates EVERY row of a row_sparse weight each round (rows without gradient
take a zero-gradient step: weight decay, momentum, moving averages), so kvstore_lazy must give every row, stored or
not, exactly the value and optimizer state stock gives it.

The job (tests/workers/dense_semantics_train.py): dist_sync, 2 stock workers, 2 servers, two row_sparse tables (key 3
declared lazy on our servers, so most of its rows never exist there; key 5 initialised with every row and not
declared, most of its rows never pushed) and a dense layer (key 8), all three partitioned over both servers;
Zipf-skewed ids, so most rows go untouched for many steps; two steps whose rows all fall in one server's range (the
other server has a round with zero rows of that key: stock still runs its updater, so update counts, lr schedules and
Adam's t move on). The same job runs against stock servers and against ours; then

1. the mxnet reference: the job's merged gradients (per step, the sum of both ranks' pushes, as a row_sparse array)
   replayed in this process through mxnet's own updater on a row_sparse weight holding every row (what each stock
   server does with its part) must give the stock servers' final rows bit for bit: this checks the harness;
2. every row of every key (pulled from both servers by both workers), every gradient and every loss, bit-identical
   (float32 bytes) between stock and ours;
3. for the rows that exist on our servers, the weights and every optimizer state equal the reference's bit for bit;
   the rows that exist are exactly the pushed ones (key 3: reading a row never stores it) and every row (key 5);
   and each server counted every round of each key, the zero-row rounds too (as stock does).

Stock's quirks are part of what is compared: NAG on a row_sparse key reads the weight from before the step in its
momentum term, Adam with lazy_update=False computes (1 - beta2) * (g * g). No bound is needed anywhere: the
comparisons are exact.

Before the server caught rows up (commit 645f640 and earlier) every dense-semantics case failed: every row no batch
touched differed from stock (the zero-gradient steps never applied to them), and from the second step on the losses,
the gradients and so the pushed rows followed.
Two more cases guard the rest of the comparison: ``adam-lazy-wd-multifactor`` (stock is lazy too) failed there only
because a server did not count a round with zero rows of a key (Adam's t behind from then on); the control
``control-sgd-lazy-momentum-wd`` (lazy, no zero-row rounds) passed then and must pass now.
"""
import json

import numpy as np
import pytest

from common import load
from dense_semantics_train import DENSE, EMB, EXPLICIT, ROW_SPARSE, SKEW_STEPS, initial_weights, make_optimizer

pytestmark = pytest.mark.integration

BOUND = 1000   # MXNET_KVSTORE_BIGARRAY_BOUND: all three keys (16000, 8000, 1024 elements) split over both servers
STEPS = 24
RESCALE = 1.5       # not a power of two: the rescaled gradient is rounded
WD = 1e-2

CASES = {
    "sgd-momentum-wd": {"name": "sgd", "params": {
        "learning_rate": 0.1, "momentum": 0.9, "wd": WD, "lazy_update": False, "rescale_grad": RESCALE}},
    "sgd-wd-factor-clip-rescale": {"name": "sgd", "params": {
        "learning_rate": 0.2, "wd": WD, "lazy_update": False, "rescale_grad": 4.0, "clip_gradient": 2e-3},
        "scheduler": ["factor", {"step": 5, "factor": 0.7}]},
    "nag-momentum-wd": {"name": "nag", "params": {
        "learning_rate": 0.1, "momentum": 0.9, "wd": WD, "rescale_grad": RESCALE}},
    "signum-momentum-wd-wdlh": {"name": "signum", "params": {
        "learning_rate": 0.01, "momentum": 0.9, "wd": WD, "wd_lh": 0.05, "rescale_grad": RESCALE}},
    "signsgd-wd": {"name": "signum", "params": {
        "learning_rate": 0.01, "momentum": 0.0, "wd": WD, "rescale_grad": RESCALE}},
    "rmsprop-wd": {"name": "rmsprop", "params": {
        "learning_rate": 0.01, "wd": WD, "rescale_grad": RESCALE}},
    "rmsprop-centered-wd": {"name": "rmsprop", "params": {
        "learning_rate": 0.01, "centered": True, "gamma1": 0.95, "gamma2": 0.9, "wd": WD, "rescale_grad": RESCALE}},
    "adam-wd": {"name": "adam", "params": {
        "learning_rate": 0.01, "wd": WD, "lazy_update": False, "rescale_grad": RESCALE}},
    # stock is lazy here (only the rows of a round's gradient change), but the zero-row rounds still count: Adam's t
    "adam-lazy-wd-multifactor": {"name": "adam", "params": {
        "learning_rate": 0.01, "wd": WD, "lazy_update": True, "rescale_grad": RESCALE},
        "scheduler": ["multifactor", {"step": [5, 14], "factor": 0.5}]},
    # control: lazy on stock too and no zero-row rounds: what the lazy server always did (passes before issue 32)
    "control-sgd-lazy-momentum-wd": {"name": "sgd", "skew": False, "params": {
        "learning_rate": 0.1, "momentum": 0.9, "wd": WD, "lazy_update": True, "rescale_grad": RESCALE}},
}


def skew_steps(case: str) -> tuple:
    return SKEW_STEPS if CASES[case].get("skew", True) else ()


def run(job_factory, server: str, case: str) -> list[dict]:
    job = job_factory(server, num_workers=2, num_servers=2, server=server,
                      mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": str(BOUND), "MXNET_STORAGE_FALLBACK_LOG_VERBOSE": "0"})
    job.start()
    out = str(job.tmp / "res")
    spec = {k: v for k, v in CASES[case].items() if k != "skew"}
    args = ["--out", out, "--optimizer", json.dumps(spec), "--steps", str(STEPS),
            "--skew-steps", ",".join(map(str, skew_steps(case)))]
    if server == "lazy":
        args += ["--declare", "--fetch"]
    job.run_workers("dense_semantics_train.py", args, timeout=90)
    return [load(out, r) for r in range(2)]


def merged_gradients(res: list[dict], key: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, rows) of the round's merged gradient: both ranks' pushes summed (a + b in float32, as a server
    sums two pushes; a row one rank pushed is its gradient as pushed)."""
    rows = ROW_SPARSE[key]
    merged = np.zeros((rows, res[0][f"grad{key}_{step}"].shape[1]), np.float32)
    present = np.zeros(rows, bool)
    for r in res:
        ids = r[f"ids{key}_{step}"]
        merged[ids] += r[f"grad{key}_{step}"]
        present[ids] = True
    ids = np.flatnonzero(present)
    return ids, merged[ids]


def replay(res: list[dict], case: str):
    """mxnet's own updater on every step's merged gradients: ({key: all rows}, {key: [state arrays, all rows]})."""
    import mxnet as mx

    updater = mx.optimizer.get_updater(make_optimizer(CASES[case]))
    init = initial_weights()
    weights = {key: mx.nd.array(init[key]).tostype("row_sparse") for key in ROW_SPARSE}
    for step in range(STEPS):
        for key in ROW_SPARSE:
            ids, grad = merged_gradients(res, key, step)
            updater(key, mx.nd.sparse.row_sparse_array((grad, ids), shape=init[key].shape), weights[key])
    states = {}
    for key in ROW_SPARSE:
        state = updater.states[key]
        flat = list(state) if isinstance(state, (tuple, list)) else ([] if state is None else [state])
        states[key] = [s.asnumpy() for s in flat]
    return {key: w.asnumpy() for key, w in weights.items()}, states


def pushed_rows(res: list[dict], key: int) -> np.ndarray:
    """Every row some worker pushed a gradient for, in any step."""
    return np.unique(np.concatenate([r[f"ids{key}_{s}"] for r in res for s in range(STEPS)]))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def row_diff(ours: np.ndarray, theirs: np.ndarray, pushed: np.ndarray, row_ids=None) -> str:
    """Which rows (ids `row_ids`, default 0..n-1) differ: how many of them some worker pushed, how many no batch
    ever touched."""
    if ours.shape != theirs.shape:
        return f"shapes {ours.shape} != {theirs.shape}"
    row_ids = np.arange(len(ours)) if row_ids is None else row_ids
    differ = row_ids[np.any(ours.view(np.uint32) != theirs.view(np.uint32), axis=1)]
    untouched = np.setdiff1d(differ, pushed)
    n_pushed = len(np.intersect1d(row_ids, pushed))
    return (f"{len(differ)} of {len(ours)} rows differ: {len(differ) - len(untouched)} of the {n_pushed} pushed "
            f"rows, {len(untouched)} of the {len(ours) - n_pushed} rows no batch touched (e.g. rows "
            f"{untouched[:5].tolist()}); max |diff| {np.abs(ours - theirs).max():.3g}")


def check_job(res: list[dict], case: str) -> None:
    """The job is what the test needs: many rows untouched, zero-row rounds where the case has them, rows moved,
    the clip and the schedule active where set, and both ranks pulled the same values."""
    for key, rows in ROW_SPARSE.items():
        pushed = pushed_rows(res, key)
        assert len(pushed) < rows // 2 and pushed.min() < rows // 2 <= pushed.max(), (key, len(pushed))
        for step in skew_steps(case):
            ids = np.concatenate([r[f"ids{key}_{step}"] for r in res])
            assert (ids < rows // 2).all() if key == EMB else (ids >= rows // 2).all(), (key, step)
        assert not np.array_equal(res[0][f"final_{key}"], res[0][f"init_{key}"])
        # rows pushed only in the first quarter of the run: they wait most of it
        late = np.unique(np.concatenate([r[f"ids{key}_{s}"] for r in res for s in range(STEPS // 4, STEPS)]))
        assert len(np.setdiff1d(pushed, late)) >= 20, key
    for r in range(2):
        for key in (EMB, EXPLICIT, DENSE):
            assert same_bits(res[r][f"final_{key}"], res[0][f"final_{key}"]), f"ranks pulled different values, {key}"
    params = CASES[case]["params"]
    if "clip_gradient" in params:
        scaled = np.concatenate([np.abs(merged_gradients(res, key, s)[1]).ravel() * params["rescale_grad"]
                                 for key in ROW_SPARSE for s in range(STEPS)])
        assert 0.01 < np.mean(scaled > params["clip_gradient"]) < 0.99, "the clip must cut some values, not all"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_every_row_matches_stock(job_factory, case):
    stock = run(job_factory, "stock", case)
    lazy = run(job_factory, "lazy", case)
    check_job(stock, case)
    ref_weights, ref_states = replay(stock, case)

    # 1. the reference replay reproduces the stock servers (else the harness, not the server, is wrong)
    for key in ROW_SPARSE:
        assert same_bits(ref_weights[key], stock[0][f"final_{key}"]), \
            f"harness: mxnet replay != stock, key {key}: " + row_diff(ref_weights[key], stock[0][f"final_{key}"],
                                                                      pushed_rows(stock, key))

    # 2. ours == stock: the initial rows, every row of every key at the end, both ranks, and everything in between
    problems = []
    for r in range(2):
        for key in (EMB, EXPLICIT, DENSE):
            assert same_bits(lazy[r][f"init_{key}"], stock[r][f"init_{key}"]), f"rank {r} key {key}: initial rows"
    for r in range(2):
        for key in ROW_SPARSE:
            ours, theirs = lazy[r][f"final_{key}"], stock[r][f"final_{key}"]
            if not same_bits(ours, theirs):
                problems.append(f"rank {r} key {key}, final rows: " + row_diff(ours, theirs, pushed_rows(stock, key)))
            if r == 0 and not same_bits(ours, ref_weights[key]):
                problems.append(f"key {key}, final rows vs mxnet's replay: " + row_diff(ours, ref_weights[key],
                                                                                       pushed_rows(stock, key)))
        if not same_bits(lazy[r][f"final_{DENSE}"], stock[r][f"final_{DENSE}"]):
            problems.append(f"rank {r}: the dense layer differs")
        differ = [s for s in range(STEPS) if not same_bits(lazy[r][f"loss_{s}"], stock[r][f"loss_{s}"])
                  or any(not same_bits(lazy[r][f"{name}{key}_{s}"], stock[r][f"{name}{key}_{s}"])
                         for key in ROW_SPARSE for name in ("ids", "grad"))]
        if differ:
            problems.append(f"rank {r}: the loss or gradients differ from step {differ[0]} on ({len(differ)} steps)")

    # 3. the rows that exist on our servers, and their optimizer states, are the reference's; the update counts
    got = lazy[0]
    assert "fetch_error" not in got, str(got.get("fetch_error"))
    for key, rows in ROW_SPARSE.items():
        ids, pushed = got[f"fetched_ids{key}"], pushed_rows(lazy, key)
        if key == EMB and not np.array_equal(ids, pushed):
            # a declared key stores the rows pushed; reading the others (the final pulls of every row) computes
            # them from their initial values and leaves them unstored
            problems.append(f"key {key}: {len(ids)} rows exist, {len(pushed)} were pushed, "
                            f"{len(np.setdiff1d(pushed, ids))} of them missing")
        if key == EXPLICIT and not np.array_equal(ids, np.arange(rows)):
            problems.append(f"key {key}: {len(ids)} rows exist, not every row given at init")
        if not same_bits(got[f"fetched{key}"], ref_weights[key][ids]):
            problems.append(f"key {key}, rows that exist: " + row_diff(got[f"fetched{key}"], ref_weights[key][ids],
                                                                       pushed, ids))
        if int(got[f"fetched_num_states{key}"]) != len(ref_states[key]):
            problems.append(f"key {key}: {int(got[f'fetched_num_states{key}'])} states, mxnet has "
                            f"{len(ref_states[key])}")
            continue
        for j, state in enumerate(ref_states[key]):
            ours = got[f"fetched{key}_state{j}"]
            if not same_bits(ours, state[ids]):
                problems.append(f"key {key} state {j}, rows that exist: " + row_diff(ours, state[ids], pushed, ids))
    for key in (EMB, EXPLICIT, DENSE):   # [update count, num_update] per server: every round, zero-row ones too
        counts = got[f"counts{key}"].tolist()
        if counts != [[STEPS, STEPS]] * 2:
            problems.append(f"key {key}: [update count, num_update] per server {counts}, stock counts {STEPS}")
    assert not problems, f"{case}: kvstore_lazy is not stock:\n  " + "\n  ".join(problems)
