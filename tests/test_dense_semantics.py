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

    def __init__(self, make, lazy: bool, seed: int):
        self.make, self.lazy = make, lazy
        self.rng = np.random.RandomState(seed)
        self.peer = Peer(KVServer(0, 1, 2))
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
