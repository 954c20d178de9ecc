"""server/fastpath.py: the pulls it answers get the general path's bytes, and everything else goes to the general path.

Two servers get the same requests (through the wire codec, as the van hands them over): one as shipped, one whose
fast path hands every message back (the reference: KVServer's general path alone). Every reply must be the same
frames byte for byte and the stored state the same; ``FastPath.answered`` says which requests the fast path took,
so a test fails if it stops taking a pull it should answer, or answers one the general path refuses.
"""
from __future__ import annotations

import pickle

import mxnet
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakepeer import F16, F64, WORKER0, WORKER1, Requests
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.modes import MATERIALIZE_ON_TOUCH
from kvstore_lazy.server.fastpath import FastPath
from kvstore_lazy.server.keys import RowSparseKey
from kvstore_lazy.worker import lazy_spec_body

UNIFORM = '["uniform", {"scale": 0.07}]'


class GeneralPathOnly(FastPath):
    def answer(self, msg):
        return None


class Pair:
    """A server with its fast path and a reference without it, fed the same requests."""

    def __init__(self, rank: int = 0, num_servers: int = 1, **kwargs) -> None:
        self.fast = KVServer(rank, num_servers, 2, **kwargs)
        self.reference = KVServer(rank, num_servers, 2, **kwargs)
        self.reference.fast = GeneralPathOnly(self.reference)

    def send(self, msg: Message, *, fast: bool | None = None, partial: bool = False,
             pushed: bool | None = None) -> list[tuple[int, list]]:
        """Replies (recipient, frames), the same from both servers; `fast`: whether the fast path must answer,
        `partial`: with rows that keys.py made, `pushed`: whether the fast path must take the (dense) push."""
        frames = [identity_of(msg.sender)] + msg.to_frames()
        before, before_partial, pushes = self.fast.fast.answered, self.fast.fast.partial, self.fast.fast.pushes
        out = [[(node, reply.to_frames()) for node, reply in server.handle(Message.from_frames(frames))]
               for server in (self.fast, self.reference)]
        assert out[0] == out[1]
        assert self.fast.bad_requests == self.reference.bad_requests
        if fast is not None:
            assert self.fast.fast.answered - before == int(fast)
            assert self.fast.fast.partial - before_partial == int(partial)
        if pushed is not None:
            assert self.fast.fast.pushes - pushes == int(pushed)
        return out[0]

    def check_same_state(self) -> None:
        assert self.fast.inspect() == self.reference.inspect()


def optimizer(name: str = "sgd", **kwargs) -> bytes:
    return pickle.dumps(mxnet.optimizer.create(name, learning_rate=0.1, **kwargs), 0)


def rows(n: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, cols)).astype(np.float32)


def setup_keys(pair: Pair, w0: Requests, w1: Requests, total_rows: int = 1000) -> None:
    """Dense key 3 (6 floats), lazy row_sparse key 7 (total_rows x 4, uniform), sync mode, SGD; rows 1, 5, 9 of key
    7 pushed in one round."""
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer(momentum=0.9)))
    pair.send(w0.push(3, np.arange(6, dtype=np.float32)))
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (total_rows, 4), "float32", UNIFORM, 42)))
    pair.send(w0.rsp_push(7, [], np.zeros((0, 4), np.float32)))
    for w in (w0, w1):
        pair.send(w.rsp_push(7, [1, 5, 9], rows(3, 4)))


def test_pulls_of_stored_values_take_the_fast_path_with_the_same_bytes():
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1)
    pair.send(w1.pull(3), fast=True)
    pair.send(w0.rsp_pull(7, [1, 5, 9]), fast=True)
    pair.send(w1.rsp_pull(7, [5]), fast=True)
    # rows not stored (2, 3, 999): their initial values come from keys.py, in their places
    pair.send(w0.rsp_pull(7, [1, 2, 3, 5, 999]), fast=True, partial=True)
    pair.send(w0.rsp_pull(7, [0, 4]), fast=True, partial=True)
    # a pull with a lens frame (one int32 per key) is the same request
    pair.send(w0.kv(proto.command_code(proto.ROW_SPARSE, 0), w0.rsp_keys(7, [1, 9]), b"", [0, 0, 0], push=False,
                    pull=True), fast=True)
    # mid-round: a pull gets the value before the round, at once
    pair.send(w0.push(3, np.ones(6, np.float32)))
    pair.send(w0.rsp_push(7, [5], rows(1, 4, 3)))
    pair.send(w1.pull(3), fast=True)
    pair.send(w1.rsp_pull(7, [5, 9]), fast=True)
    pair.send(w1.push(3, np.ones(6, np.float32)))
    pair.send(w1.rsp_push(7, [5], rows(1, 4, 4)))
    pair.send(w0.pull(3), fast=True)
    pair.send(w0.rsp_pull(7, [1, 5, 9]), fast=True)
    pair.check_same_state()


@pytest.mark.parametrize("init", ['["zero", {}]', '["constant", {"value": 0.25}]', '["constant", {"value": -0.0}]',
                                  '["normal", {"sigma": 0.1}]'])
def test_rows_not_stored_of_other_initializers(init):
    """Absent rows filled by the compiled pull (zero, constant) or asked of keys.py (-0.0, normal): the same bytes."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer()))
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(8, (100, 3), "float32", init, 5)))
    pair.send(w0.rsp_push(8, [], np.zeros((0, 3), np.float32)))
    for w in (w0, w1):
        pair.send(w.rsp_push(8, [4], rows(1, 3)))
    pair.send(w0.rsp_pull(8, [1, 4, 60]), fast=True, partial=True)
    pair.send(w1.rsp_pull(8, [2, 3]), fast=True, partial=True)
    pair.check_same_state()


def test_what_the_fast_path_leaves_to_the_general_path():
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1)
    rsp_f32 = proto.command_code(proto.ROW_SPARSE, 0)
    general = [
        w0.rsp_pull(7, [9, 5]),                       # unsorted: refused
        w0.rsp_pull(7, [5, 5]),                       # duplicate: refused
        w0.rsp_pull(7, [5, 1000]),                    # out of range: refused
        w0.rsp_pull(7, []),                           # no rows
        w0.kv(rsp_f32, [7, 6], b"", push=False, pull=True),        # a row key below its master key
        w0.kv(rsp_f32, w0.rsp_keys(7, [1, 5]), b"", [0, 0], push=False, pull=True),   # lens do not match keys
        w0.rsp_pull(7, [1, 5], F64),                  # another dtype than the key's: refused
        w0.rsp_pull(3, [1]),                          # row_sparse pull of a dense key: refused
        w0.pull(7),                                   # dense pull of a row_sparse key: refused
        w0.pull(3, F64),                              # dense pull as another dtype: refused
        w0.pull(4),                                   # a key never initialized: refused
        w0.kv(proto.command_code(proto.DEFAULT, 0), [3, 3], b"", push=False, pull=True),   # two keys: refused
        w0.kv(proto.command_code(proto.DEFAULT, 0), [1 << 62], b"", push=False, pull=True),  # outside the range
        w0.push(3, np.ones(6, np.float32), pull=True),   # pushpull: a push
        w0.frames(rsp_f32, [np.array([7, 8], np.uint64).tobytes(), b"", b"", b""], push=False, pull=True),
    ]
    for msg in general:
        pair.send(msg, fast=False)
    pair.check_same_state()
    assert pair.fast.bad_requests >= 12


def test_a_poisoned_pull_is_refused_by_the_general_path():
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1)
    pair.send(w0.rsp_push(7, [5, 1], rows(2, 4)), fast=False)     # unsorted rows: refused, the key poisoned for w0
    pair.send(w0.rsp_pull(7, [1, 5]), fast=False)                 # refused: fails loudly in the worker
    pair.send(w0.rsp_pull(7, [1, 5]), fast=True)                  # the poison is spent
    pair.check_same_state()


def test_partitioned_key_on_the_second_server(monkeypatch):
    """Server rank 1 of 2 holds rows [500, 1000) of key 7 (row ids relative to its first row on the wire)."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "100")   # key 7 (1000 x 4) is split over the servers
    pair = Pair(rank=1, num_servers=2)
    w0, w1 = Requests(WORKER0, rank=1, num_servers=2), Requests(WORKER1, rank=1, num_servers=2)
    setup_keys(pair, w0, w1)
    assert pair.fast.keys[7].global_range() == (500, 1000)
    pair.send(w0.rsp_pull(7, [1, 5, 9]), fast=True)
    pair.send(w0.rsp_pull(7, [5, 499]), fast=True, partial=True)    # 499 is not stored
    pair.send(w0.rsp_pull(7, [5, 500]), fast=False)    # 500 is beyond this server's rows: refused
    pair.check_same_state()


def test_a_key_with_a_row_policy_gets_its_rows_from_keys_py():
    """Admission (a row is stored at its 2nd push): a pull of pending rows computes them, stores nothing."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer()))
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (1000, 4), "float32", UNIFORM, 3,
                                                            admit_min_count=2)))
    pair.send(w0.rsp_push(7, [], np.zeros((0, 4), np.float32)))
    for round_ in range(2):
        for w in (w0, w1):
            pair.send(w.rsp_push(7, [3, 8] if round_ else [3], rows(2 if round_ else 1, 4, round_)))
        pair.send(w0.rsp_pull(7, [3, 8, 20]), fast=True, partial=True)
    pair.check_same_state()


def test_multi_precision_and_touch_policy():
    pair, w0, w1 = Pair(materialize=MATERIALIZE_ON_TOUCH), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer(multi_precision=True)))
    pair.send(w0.command(proto.SET_MULTI_PRECISION))
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (100, 3), "float16", UNIFORM, 1)))
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(8, (100, 3), "float32", UNIFORM, 1)))
    pair.send(w0.rsp_push(7, [], np.zeros((0, 3), np.float16), F16))
    pair.send(w0.rsp_push(8, [], np.zeros((0, 3), np.float32)))
    pair.send(w0.rsp_pull(7, [2, 4], F16), fast=False)   # float16 rows of a float32 master table: cast by keys.py
    pair.send(w0.rsp_pull(7, [2, 4], F16), fast=False)
    pair.send(w0.rsp_pull(8, [2, 4]), fast=True, partial=True)   # keys.py creates them at the first touch...
    pair.send(w1.rsp_pull(8, [2, 4, 6]), fast=True, partial=True)
    pair.send(w1.rsp_pull(8, [2, 4, 6]), fast=True)              # ...and then they are in memory
    pair.check_same_state()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored=st.sets(st.integers(0, 5000), min_size=1, max_size=300),
       pulls=st.lists(st.sets(st.integers(0, 5000), min_size=1, max_size=40), min_size=1, max_size=8))
def test_any_pull_gets_the_general_path_bytes(stored, pulls):
    """Many rows (the index grows and rehashes), pulls of stored and unstored rows mixed."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1, total_rows=5001)
    ids = sorted(stored)
    for w in (w0, w1):
        pair.send(w.rsp_push(7, ids, rows(len(ids), 4, 1)))
    present = set(ids) | {1, 5, 9}
    for want in pulls:
        pair.send(w0.rsp_pull(7, sorted(want)), fast=True, partial=not want <= present)
    pair.check_same_state()


@pytest.mark.parametrize("frame", [b"", b"\x07" * 7, b"\x07" * 9])
def test_odd_key_frames_go_to_the_general_path(frame):
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1)
    pair.send(w0.frames(proto.command_code(proto.ROW_SPARSE, 0), [frame, b""], push=False, pull=True), fast=False)
    pair.send(w0.frames(proto.command_code(proto.DEFAULT, 0), [frame, b""], push=False, pull=True), fast=False)


def test_an_error_making_missing_rows_is_answered_as_the_general_path_answers_it(monkeypatch, caplog):
    """A failure inside keys.py while the fast path asks it for rows is refused (logged, answered), never raised."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1)

    def broken(self, request, store, known_absent=False):
        raise RuntimeError("no rows today")

    monkeypatch.setattr(RowSparseKey, "pull", broken)
    monkeypatch.setattr(RowSparseKey, "absent_fill", lambda self: None)   # absent rows asked of keys.py
    before = pair.fast.bad_requests
    (node, frames), = pair.send(w0.rsp_pull(7, [1, 2]))   # row 2 is not stored: keys.py is asked for it
    assert node == WORKER0 and pair.fast.bad_requests == before + 1
    assert "no rows today" in caplog.text
    # rows all in memory: keys.py's pull is not needed (the reference, which calls it for every pull, refuses)
    msg = w0.rsp_pull(7, [1, 5])
    (node, reply), = pair.fast.handle(Message.from_frames([identity_of(WORKER0)] + msg.to_frames()))
    assert node == WORKER0 and len(reply.data[1]) == 2 * 4 * 4 and pair.fast.bad_requests == before + 1


@pytest.mark.parametrize("name, kwargs", [("sgd", {"momentum": 0.9}), ("sgd", {}), ("sgd", {"wd": 0.01}),
                                          ("adam", {}), ("adam", {"clip_gradient": 0.5, "wd": 0.01})])
def test_dense_pushes_take_the_fast_path_with_the_same_replies_and_state(name, kwargs):
    """Sync rounds of two and three pushes (the merge buffer), the pulls between them, then async: the same reply
    bytes and the same values, optimizer states and pending round after every request."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer(name, **kwargs)))
    pair.send(w0.push(3, np.arange(6, dtype=np.float32)), pushed=False)    # the init: the general path
    pair.send(w0.push(4, np.arange(4, dtype=np.float64), F64), pushed=False)
    rng = np.random.default_rng(5)
    for step in range(4):
        for w in (w0, w1):
            # w1 pushpulls, as Gluon's Trainer does for a dense parameter: its answer carries the new value
            pair.send(w.push(3, rng.standard_normal(6).astype(np.float32), pull=w is w1), pushed=True)
            pair.check_same_state()
            pair.send(w.push(4, rng.standard_normal(4), F64, pull=step % 2 == 1), pushed=True)   # float64 too
        pair.send(w1.pull(3), fast=True)
        pair.check_same_state()
    pair.fast.num_workers = pair.reference.num_workers = 3   # a round of three: the merge sums in place
    for w in (w0, w1, w0):
        pair.send(w.push(3, rng.standard_normal(6).astype(np.float32)), pushed=True)
    pair.fast.sync_mode = pair.reference.sync_mode = False   # async: every push updates at once
    for w in (w0, w1):
        pair.send(w.push(3, rng.standard_normal(6).astype(np.float32), pull=w is w0), pushed=True)
        pair.check_same_state()


def test_dense_pushes_the_fast_path_leaves_to_the_general_path():
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer()))
    pair.send(w0.push(3, np.arange(6, dtype=np.float32)))
    f32 = proto.command_code(proto.DEFAULT, 0)
    general = [
        w0.push(3, np.ones(5, np.float32)),                   # wrong size: refused
        w0.push(3, np.ones(6), F64),                          # another dtype than the key's: refused
        w0.push(5, np.ones(6, np.float32)),                   # a new key: the init
        w0.kv(f32, [3], np.ones(6, np.float32).tobytes(), [20], push=True),      # lens do not match the values
        w0.kv(f32, [3, 3], np.ones(6, np.float32).tobytes(), [24, 0], push=True),   # two keys: refused
        w0.kv(f32, [3], np.ones(6, np.float32).tobytes()[:23], [23], push=True),   # not whole values
        w0.frames(f32, [np.array([3], np.uint64).tobytes(), np.ones(6, np.float32).tobytes()], push=True),  # no lens
    ]
    pair.send(w0.push(3, np.ones(6, np.float32), pull=True), pushed=True)   # a pushpull opens the round
    for msg in general:
        pair.send(msg, pushed=False)
        pair.check_same_state()
    assert pair.fast.bad_requests == 6
    assert pair.fast.poisoned                 # the refused pushes poisoned w0's next pull of key 3...
    pair.send(w1.push(3, np.ones(6, np.float32)), pushed=False)   # ...and while a poison waits: the general path
    pair.send(w0.pull(3), fast=False)         # refused, which spends it
    assert not pair.fast.poisoned
    pair.send(w0.push(3, np.ones(6, np.float32)), pushed=True)    # the round's second push
    pair.check_same_state()
    async_pair = Pair()                                           # async with no optimizer: refused
    async_pair.send(w0.push(3, np.arange(6, dtype=np.float32)))
    async_pair.send(w0.push(3, np.ones(6, np.float32)), pushed=False)
    async_pair.check_same_state()


@pytest.mark.parametrize("name, kwargs", [("sgd", {"momentum": 0.9}), ("adam", {}),
                                          ("adam", {"clip_gradient": 0.5, "wd": 0.01})])
@pytest.mark.parametrize("policy", [{}, {"admit_min_count": 2}])
def test_row_sparse_pushes_take_the_fast_path_with_the_same_replies_and_state(name, kwargs, policy):
    """Sync rounds of two and three pushes (rows of one worker only, of both, new rows), pulls between them, then
    async: the same reply bytes, rows, optimizer states and pending round after every request."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.SYNC_MODE))
    pair.send(w0.command(proto.CONTROLLER, optimizer(name, **kwargs)))
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (1000, 4), "float32", UNIFORM, 42, **policy)))
    pair.send(w0.rsp_push(7, [], np.zeros((0, 4), np.float32)), pushed=False)   # the init: the general path
    rng = np.random.default_rng(3)
    for step in range(5):
        for w in (w0, w1):
            ids = sorted(rng.choice(40 + 10 * step, 6 + step, replace=False).tolist())
            pair.send(w.rsp_push(7, ids, rng.standard_normal((len(ids), 4)).astype(np.float32)), pushed=True)
            pair.check_same_state()
        pair.send(w1.rsp_pull(7, list(range(0, 60, 3))), fast=True, partial=True)
    pair.fast.num_workers = pair.reference.num_workers = 3   # a round of three
    for w in (w0, w1, w0):
        pair.send(w.rsp_push(7, [2, 999], rng.standard_normal((2, 4)).astype(np.float32)), pushed=True)
    pair.check_same_state()
    pair.fast.sync_mode = pair.reference.sync_mode = False   # async: every push updates at once
    for w in (w0, w1):
        pair.send(w.rsp_push(7, [2, 5], rng.standard_normal((2, 4)).astype(np.float32)), pushed=True)
        pair.check_same_state()


def test_row_sparse_pushes_the_fast_path_leaves_to_the_general_path():
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    setup_keys(pair, w0, w1)
    rsp_f32 = proto.command_code(proto.ROW_SPARSE, 0)
    one = np.ones((1, 4), np.float32)
    general = [
        w0.rsp_push(7, [1], np.ones((1, 3), np.float32)),        # another row size: refused
        w0.rsp_push(7, [1000], one),                              # beyond the key's rows: refused
        w0.rsp_push(7, [5, 1], np.ones((2, 4), np.float32)),      # unsorted: refused
        w0.rsp_push(7, [1], one.astype(np.float64), F64),         # another dtype: refused
        w0.rsp_push(3, [1], one),                                 # a dense key: refused
        w0.rsp_push(8, [1], one),                                 # a key never initialized: its init
        w0.rsp_push(7, [], np.zeros((0, 4), np.float32)),         # no rows
        w0.kv(rsp_f32, w0.rsp_keys(7, [1]), one.tobytes(), [0, 16], push=True, pull=True),   # a pushpull
        w0.kv(rsp_f32, w0.rsp_keys(7, [1]), one.tobytes(), [0], push=True),   # lens do not match the keys
    ]
    for msg in general:
        pair.send(msg, pushed=False)
        pair.check_same_state()
    assert pair.fast.bad_requests >= 6
    pair.send(w1.rsp_push(7, [1], one), pushed=False)           # a poison waits: the general path
    pair.check_same_state()
    async_pair = Pair()                                           # async with no optimizer: refused
    async_pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (1000, 4), "float32", UNIFORM, 42)))
    async_pair.send(w0.rsp_push(7, [], np.zeros((0, 4), np.float32)))
    async_pair.send(w0.rsp_push(7, [1], one), pushed=False)
    async_pair.check_same_state()


def test_pushes_take_their_rows_slots_from_the_pull_before_them():
    """A worker's push of the rows it just pulled updates them at the slots the pull found (rows made by another
    worker's push in between are looked up again; in dist_sync its round merges them); another set of rows, a
    removal in between or a key with a row policy: looked up as usual. The same replies and state as the general
    path throughout."""
    pair, w0, w1 = Pair(), Requests(WORKER0), Requests(WORKER1)
    pair.send(w0.command(proto.CONTROLLER, optimizer(momentum=0.9)))                       # dist_async
    pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (1000, 4), "float32", UNIFORM, 42)))
    pair.send(w0.rsp_push(7, [], np.zeros((0, 4), np.float32)))
    rng = np.random.default_rng(5)

    def grad(ids):
        return rng.standard_normal((len(ids), 4)).astype(np.float32)

    def step(w, pulled, pushed, reused: bool) -> None:
        before = pair.fast.fast.reused
        pair.send(w.rsp_pull(7, pulled))
        pair.send(w.rsp_push(7, pushed, grad(pushed)), pushed=True)
        assert pair.fast.fast.reused - before == int(reused)
        pair.check_same_state()

    step(w0, [1, 5, 9], [1, 5, 9], True)                  # rows not in the table at the pull: made by the push
    step(w0, [1, 5, 9], [1, 5, 9], True)
    pair.send(w0.rsp_pull(7, [1, 5, 12, 30]))
    step(w1, [5, 12, 40], [5, 12, 40], True)              # w1 makes row 12 between w0's pull and push
    before = pair.fast.fast.reused
    pair.send(w0.rsp_push(7, [1, 5, 12, 30], grad([1, 5, 12, 30])), pushed=True)
    assert pair.fast.fast.reused - before == 1
    pair.check_same_state()
    step(w0, [1, 5], [1, 5, 9], False)                    # other rows than the pull's
    pair.send(w1.rsp_pull(7, [1, 9, 40]))
    for server in (pair.fast, pair.reference):            # a removal (as an eviction's) moves the last rows
        table = server.keys[7]._table
        table.remove_slots(table.lookup(np.asarray([5], np.uint64)))
    before = pair.fast.fast.reused
    pair.send(w1.rsp_push(7, [1, 9, 40], grad([1, 9, 40])), pushed=True)
    assert pair.fast.fast.reused == before
    pair.check_same_state()
    step(w1, [1, 9, 40], [1, 9, 40], True)
    pair.fast.sync_mode = pair.reference.sync_mode = True     # dist_sync: rounds of two, the slots merged
    for pulls in ([[1, 5, 9], [5, 9, 60]], [[1, 5, 9], [2, 5]], [[3, 70], [3, 70, 71]]):
        for w, rows_ in zip((w0, w1), pulls):
            pair.send(w.rsp_pull(7, rows_))
        before = pair.fast.fast.reused
        for w, rows_ in zip((w0, w1), pulls):
            pair.send(w.rsp_push(7, rows_, grad(rows_)), pushed=True)
        assert pair.fast.fast.reused - before == 2
        pair.check_same_state()
        # new rows get their slots in the order the general path gives them (the round's ids, ascending)
        assert pair.fast.keys[7]._table.row_ids().tolist() == pair.reference.keys[7]._table.row_ids().tolist()
    pair.send(w0.rsp_pull(7, [1, 9, 40]))
    pair.send(w1.rsp_pull(7, [9, 40]))
    pair.send(w0.rsp_push(7, [1, 9, 40], grad([1, 9, 40])), pushed=True)
    for server in (pair.fast, pair.reference):            # a removal between a push and its round's end: the
        table = server.keys[7]._table                     # round's rows are looked up when it is applied
        table.remove_slots(table.lookup(np.asarray([1], np.uint64)))
    pair.send(w1.rsp_push(7, [9, 40], grad([9, 40])), pushed=True)
    pair.check_same_state()
    policy = Pair()
    policy.send(w0.command(proto.CONTROLLER, optimizer(momentum=0.9)))
    policy.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (1000, 4), "float32", UNIFORM, 42,
                                                              admit_min_count=2)))
    policy.send(w0.rsp_push(7, [], np.zeros((0, 4), np.float32)))
    for _ in range(3):
        policy.send(w0.rsp_pull(7, [2, 3]))
        policy.send(w0.rsp_push(7, [2, 3], grad([2, 3])), pushed=True)
        policy.check_same_state()
    assert policy.fast.fast.reused == 0 and not policy.fast.fast._pulled


def test_the_slots_pulls_keep_for_their_pushes_are_bounded(monkeypatch):
    """Pulls that no push follows (an evaluating worker, keys only pulled) keep their slots at most PULLED_BYTES
    together, the oldest dropped first; a push whose pull's entry was dropped is looked up as usual, with the same
    replies and state as the general path."""
    from kvstore_lazy.server import fastpath
    monkeypatch.setattr(fastpath, "PULLED_BYTES", 3 * (8 * 5 + 8 * 6))       # three pulls of 5 rows (keys + slots)
    pair, w0 = Pair(), Requests(WORKER0)
    pair.send(w0.command(proto.CONTROLLER, optimizer(momentum=0.9)))                       # dist_async
    for key in range(1, 9):
        pair.send(w0.command(proto.LAZY_DECLARE, lazy_spec_body(key, (1000, 4), "float32", UNIFORM, 42)))
        pair.send(w0.rsp_push(key, [], np.zeros((0, 4), np.float32)))
    rows = [3, 8, 20, 21, 400]
    for key in range(1, 9):
        pair.send(w0.rsp_pull(key, rows))
    fast = pair.fast.fast
    assert sorted(k for _, k in fast._pulled) == [6, 7, 8] and fast._pulled_bytes <= fastpath.PULLED_BYTES
    before = fast.reused
    pair.send(w0.rsp_push(2, rows, np.ones((5, 4), np.float32)), pushed=True)    # its pull's entry was dropped
    pair.send(w0.rsp_push(8, rows, np.ones((5, 4), np.float32)), pushed=True)    # kept: taken
    assert fast.reused - before == 1 and sorted(k for _, k in fast._pulled) == [6, 7]
    pair.check_same_state()
