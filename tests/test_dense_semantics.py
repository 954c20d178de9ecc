"""The server under optimizers stock runs densely on a row_sparse weight (SGD / Adam with lazy_update=False, NAG with
momentum, Signum, RMSProp), sans-IO: every row a worker pulls, every optimizer state and every checkpoint read equal
what mxnet's own updater holds when it moves every row every step (the stock server's semantics), bit for bit.

Each case plays two stock workers (tests/fakepeer.Requests) against one KVServer: rounds of row_sparse pushes
(random rows, some rounds with no rows at all, which stock still counts), pulls of random rows between rounds (rows
never stored among them), and, beside it, mxnet's Updater on a row_sparse weight holding every row, fed the round's
merged gradient (what the stock server's updater sees). Declared (lazy) keys and keys initialised with every row;
a snapshot restored into a new server half-way; a new optimizer half-way (stock starts a new updater: states at
zero, counts from the pickle). Rows the server holds must stay few: the rows pushed, nothing else.
"""
from __future__ import annotations

import logging
import os
import pickle
import zlib

import numpy as np
import pytest
from test_catchup import CASES, KEY, LAZY, _states
from test_server import UNIFORM, Peer, declare, initial

import mxnet as mx
from fakepeer import WORKER0, WORKER1, Requests
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.server.core import KVServer

ROWS, DIM = 40, 3
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _quiet(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="kvstore_lazy")
    monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)


def _rsp(values, rows):
    return mx.nd.sparse.row_sparse_array((values, np.asarray(rows, np.int64)), shape=(ROWS, DIM))


class Job:
    """One server, two workers, and the stock reference: mxnet's updater over a weight of every row."""

    def __init__(self, make, lazy: bool, seed: int, lifecycle=None):
        self.make, self.lazy = make, lazy
        self.tolerance = 0.0
        self.rng = np.random.RandomState(seed)
        self.peer = Peer(KVServer(0, 1, 2, lifecycle=lifecycle))
        self.w0, self.w1 = Requests(WORKER0), Requests(WORKER1)
        self.peer.ok(self.w0.command(proto.SYNC_MODE))
        self.set_optimizer()
        if lazy:
            for w in (self.w0, self.w1):
                declare(self.peer, w, KEY, ROWS, (DIM,), init=UNIFORM, seed=42)
            self.peer.ok(self.w0.rsp_push(KEY, [], np.zeros((0, DIM))))
            start = initial(np.arange(ROWS), ROWS, DIM, key=KEY)
        else:
            start = self.rng.randn(ROWS, DIM).astype(np.float32)
            self.peer.ok(self.w0.rsp_push(KEY, range(ROWS), start))
        self.stock = _rsp(start, np.arange(ROWS))
        self.pushed: set[int] = set()

    def set_optimizer(self):
        opt = self.make()
        self.peer.ok(self.w0.command(proto.CONTROLLER, pickle.dumps(opt, 0)))
        self.updater = mx.optimizer.get_updater(self.make())

    def round(self, empty: bool = False):
        grads = []
        for w in (self.w0, self.w1):
            n = 0 if empty else int(self.rng.randint(0, 4))
            ids = np.sort(self.rng.choice(ROWS - 5, size=n, replace=False)).astype(np.int64)   # 5 rows never pushed
            g = self.rng.randn(n, DIM).astype(np.float32)
            grads.append((ids, g))
            self.pushed.update(ids.tolist())
        assert self.peer.send(self.w0.rsp_push(KEY, grads[0][0], grads[0][1])) == []
        assert len(self.peer.send(self.w1.rsp_push(KEY, grads[1][0], grads[1][1]))) == 2
        merged = np.zeros((ROWS, DIM), np.float32)
        for ids, g in grads:
            merged[ids] += g
        ids = np.unique(np.concatenate([grads[0][0], grads[1][0]]))
        self.updater(KEY, _rsp(merged[ids], ids), self.stock)

    def pull(self, ids):
        return self.peer.values(self.w0.rsp_pull(KEY, ids)).reshape(len(ids), DIM)

    def check_pull(self, ids):
        got, expect = self.pull(ids), self.stock.asnumpy()[ids]
        if self.tolerance:      # relative to the row's largest element
            scale = np.maximum(np.abs(expect).max(axis=1, keepdims=True), 1e-30)
            assert (np.abs(got - expect) / scale).max() <= self.tolerance, f"rows {list(ids)}"
        else:
            assert np.array_equal(got, expect), f"rows {list(ids)}: max diff {np.abs(got - expect).max()}"

    def check_all(self):
        self.check_pull(np.arange(ROWS))
        entry = self.peer.server.keys[KEY]
        ids = np.asarray(entry.row_ids(), np.uint64)
        expect = _states(self.updater.states[KEY])
        assert entry.num_states == len(expect)
        for j, theirs in enumerate(expect):
            ours = entry.state_rows(ids, j)
            assert np.array_equal(ours, theirs[ids.astype(np.int64)]), f"state {j}"
        if self.lazy:       # rows exist only once pushed
            assert set(ids.tolist()) == self.pushed


def _drive(job: Job, rounds: int, snapshot_at: int | None = None, new_optimizer_at: int | None = None):
    for k in range(1, rounds + 1):
        job.round(empty=k % 7 == 0)
        if k % 3 == 0:
            job.check_pull(np.sort(job.rng.choice(ROWS, size=4, replace=False)))
        if k == snapshot_at:
            meta, tables = job.peer.server.snapshot()
            fresh = KVServer(0, 1, 2)
            fresh.restore(meta, tables)
            job.peer = Peer(fresh)
        if k == new_optimizer_at:
            job.set_optimizer()


@pytest.mark.parametrize("lazy", [True, False], ids=["declared", "all-rows"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pulls_states_and_checkpoint_reads_equal_stock(case, lazy):
    job = Job(CASES[case], lazy, zlib.crc32(case.encode()))
    _drive(job, 30)
    job.check_all()
    stats = job.peer.server.stats()["sparse"][str(KEY)]
    assert stats["history_steps"] == 30 and 1 <= stats["history_runs"] <= 30


@pytest.mark.parametrize("case", ["sgd-mom-wd", "signum-wd", "adam-wd"])
def test_rows_on_the_disk_tier_are_brought_as_in_memory(case, tmp_path):
    """A memory budget of a few rows and a disk tier: rows demoted, read where they are by pulls and checkpoint
    reads (brought on the copy), promoted by pushes: still stock's values and states."""
    from kvstore_lazy.server.policy import Settings
    job = Job(CASES[case], True, 21, Settings(memory_budget=400, disk_dir=str(tmp_path / "disk")))
    _drive(job, 30, new_optimizer_at=12)       # (the rows on disk finish the first optimizer's steps too)
    stats = job.peer.server.stats()["sparse"][str(KEY)]
    assert stats["disk_rows"] > 0 and stats["promoted"] > 0, stats
    job.check_all()


@pytest.mark.parametrize("case", ["sgd-wd", "sgd-mom-wd", "nag-mom-wd", "signsgd-wd", "sgd-mom-clip-cosine-mults"])
def test_closed_forms_stay_within_their_tolerance(case):
    """KVSTORE_LAZY_CATCHUP=closed: the linear rules' rows by closed forms (float64, one rounding), within 1e-6 of
    the row's largest element of stock's float32 iteration after 60 steps (the bounds after 10k steps are pinned in
    tests/test_catchup.py and stated in the docs)."""
    from kvstore_lazy.server.policy import Settings
    job = Job(CASES[case], True, 8, Settings(catchup="closed"))
    job.tolerance = 1e-6
    _drive(job, 60)
    job.check_pull(np.arange(ROWS))
    assert job.peer.server.keys[KEY].history.closed


@pytest.mark.parametrize("case", ["sgd-mom-wd", "nag-mom-wd", "signum-wd", "rmsprop-centered-wd", "adam-wd",
                                  "sgd-wd-clip-rescale-factor"])
def test_a_snapshot_restored_half_way_goes_on_as_stock(case):
    job = Job(CASES[case], True, 5)
    _drive(job, 24, snapshot_at=11)
    job.check_all()


@pytest.mark.parametrize("case", ["sgd-mom-wd", "adam-wd", "rmsprop-wd-clipw-clipg"])
def test_a_new_optimizer_half_way_restarts_states_as_stock(case):
    """kController mid-job: stored rows finish the old steps, then states start at zero; rows never stored carry
    the first optimizer's steps into the second's."""
    job = Job(CASES[case], True, 9)
    _drive(job, 20, new_optimizer_at=8)
    job.check_all()


@pytest.mark.parametrize("case", ["sgd-lazy", "adam-lazy", "nag-nomom"])
def test_lazy_optimizers_count_rounds_without_rows_as_stock(case):
    """Stock's updater runs on a round whose merged gradient has no rows (the update is counted: Adam's t, lr
    schedules); the lazy optimizers' rows stay bit-identical to stock's. (AdaGrad and Ftrl: mxnet's updater
    refuses a row_sparse weight with wd in-process, so they have no reference here.)"""
    job = Job(LAZY[case], True, 3)
    for k in range(1, 16):
        job.round(empty=k % 3 == 0)
    job.check_all()
    assert job.peer.server.keys[KEY].history is None          # a lazy optimizer: no history, no tick column


# ---------------------------------------------------------------------------------------------------------------
# beyond stock: Adam's bias correction per row (KVSTORE_LAZY_ADAM_ROW_STEPS / init_lazy(adam_row_steps=True))

def _row_steps_job(monkeypatch, declared: bool | None, env: str | None):
    if env is not None:
        monkeypatch.setenv("KVSTORE_LAZY_ADAM_ROW_STEPS", env)
    from kvstore_lazy.server.policy import Settings
    from kvstore_lazy.worker import lazy_spec_body
    make = lambda: mx.optimizer.Adam(learning_rate=0.01, wd=1e-3)   # noqa: E731 (lazy_update=True: stock's default)
    peer = Peer(KVServer(0, 1, 1, lifecycle=Settings.from_env(dict(os.environ))))
    w0 = Requests(WORKER0)
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.command(proto.CONTROLLER, pickle.dumps(make(), 0)))
    body = lazy_spec_body(KEY, (ROWS, DIM), "float32", mx.init.Uniform(0.07), 42, adam_row_steps=declared)
    peer.ok(w0.command(proto.LAZY_DECLARE, body))
    peer.ok(w0.rsp_push(KEY, [], np.zeros((0, DIM))))
    return peer, w0, make


@pytest.mark.parametrize("declared,env", [(True, None), (None, "on")], ids=["declared", "environment"])
def test_adam_row_steps_corrects_each_row_by_its_own_updates(monkeypatch, declared, env):
    """Each row's update is lazy Adam's with the row's own count as t: bit for bit what mxnet's lazy Adam computes
    for a row that has an updater of its own (fed only that row's gradients)."""
    peer, w0, make = _row_steps_job(monkeypatch, declared, env)
    rng = np.random.RandomState(4)
    start = initial(np.arange(ROWS), ROWS, DIM, key=KEY)
    own = {r: (mx.optimizer.get_updater(make()), _rsp(start, np.arange(ROWS))) for r in range(ROWS)}
    for k in range(12):
        ids = np.sort(rng.choice(ROWS, size=3 + k % 4, replace=False))
        g = rng.randn(len(ids), DIM).astype(np.float32)
        peer.ok(w0.rsp_push(KEY, ids, g))
        for i, r in enumerate(ids):
            updater, weight = own[int(r)]
            updater(KEY, _rsp(g[i:i + 1], [r]), weight)
    got = peer.values(w0.rsp_pull(KEY, np.arange(ROWS))).reshape(ROWS, DIM)
    expect = np.stack([own[r][1].asnumpy()[r] for r in range(ROWS)])
    assert np.array_equal(got, expect)
    assert peer.server.optimizer.update_count(KEY) == 12               # the key's count goes on (schedulers)
    table = peer.server.snapshot()[1][KEY]                             # each row's count is kept (a column)
    counts = [own[int(r)][0].optimizer._index_update_count[KEY] for r in table["row_ids"]]
    assert table["arrays"]["col_steps"].tolist() == counts and len(set(counts)) > 2


def test_adam_row_steps_off_is_stock_lazy_adam(monkeypatch):
    peer, w0, make = _row_steps_job(monkeypatch, False, "on")      # the declaration wins over the environment
    peer.ok(w0.rsp_push(KEY, [1, 2], np.ones((2, DIM), np.float32)))
    assert "col_steps" not in peer.server.snapshot()[1][KEY]["arrays"]
    with pytest.raises(ValueError, match="adam_row_steps must be true or false"):
        from kvstore_lazy.server.declaration import LazySpec
        LazySpec.from_json({"key": 1, "rows": 4, "row_shape": [2], "init": '["zero", {}]', "adam_row_steps": 1})


def test_a_rounds_new_rows_are_brought_once(monkeypatch):
    """Both workers pull rows never stored, then push them: the rows are brought over the history once (kept for
    the tick: server/keys/row_catchup.FreshRows), and the values are still stock's."""
    from kvstore_lazy.numerics.catchup import History
    job = Job(CASES["adam-wd"], True, 2)
    _drive(job, 6)
    job.round()                                   # (the tick moves on: nothing is kept from _drive's pulls)
    brought = []
    initial = History.initial
    monkeypatch.setattr(History, "initial", lambda self, w, s: (brought.append(len(w)), initial(self, w, s))[1])
    new = np.array([k for k in range(ROWS) if k not in job.pushed][:3])
    for w in (job.w0, job.w1):
        job.peer.values(w.rsp_pull(KEY, new))
    g = job.rng.randn(len(new), DIM).astype(np.float32)
    assert job.peer.send(job.w0.rsp_push(KEY, new, g)) == []
    assert len(job.peer.send(job.w1.rsp_push(KEY, [], np.zeros((0, DIM))))) == 2
    job.updater(KEY, _rsp(g, new), job.stock)
    job.pushed.update(new.tolist())
    assert brought == [len(new)]                  # the first pull's; the second pull and the push took them
    job.check_all()
