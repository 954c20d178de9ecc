"""KVServer request semantics, sans-IO: hand-built worker requests in, replies out, no sockets.

Like h11's two in-memory peers: each test plays one or two stock workers (node 9 = rank 0, node 11 = rank 1) with
their own customer timestamps (tests/fakepeer.Requests), feeds the requests to ``KVServer.handle`` and sends every
reply through the wire codec (Message -> frames -> Message) before looking at it.

Covered: dense init/push/pull in dist_sync (round of NUM_WORKER requests answered together, mid-round pull gets the
old value at once) and dist_async, pushpull replies, row_sparse init/merge/no-optimizer writes, lazy declaration and
initial values, materialize='push', partitioned lazy keys (server rank 1 of 2), multi-precision fp16 dense and
row_sparse, 2-bit compression.

Bad input: every rejected request gets exactly one ERROR line naming the sender and the key, exactly one reply to
its sender with its timestamp and customer id (a rejected pull gets its keys back with no values, so the worker's
size check fails loudly), leaves every stored value and pending round untouched, and the server answers the next
good request. A worker whose push was rejected gets an error reply on its next pull of that key.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mxnet
from fakepeer import F16, F32, F64, WORKER0, WORKER1, Requests, check_reply, quantize_2bit
from kvstore_lazy.numerics.initializers import parse_initializer
from kvstore_lazy.protocol import ProtocolError
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.message import Message, decode_kv, identity_of
from kvstore_lazy.protocol.pbmeta import EMPTY
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.modes import MATERIALIZE_ON_PUSH, MATERIALIZE_ON_TOUCH
from kvstore_lazy.worker import lazy_spec_body

SERVER_ID = 8
UNIFORM = '["uniform", {"scale": 0.07}]'
NAME = {WORKER0: "worker 0 (node 9)", WORKER1: "worker 1 (node 11)"}


def optimizer_body(name: str = "test", **kwargs) -> bytes:
    """What KVStore.set_optimizer sends: the protocol-0 pickle of a real mxnet optimizer."""
    return pickle.dumps(mxnet.optimizer.create(name, **kwargs), 0)


def f32(*values) -> np.ndarray:
    return np.array(values, np.float32)


class Peer:
    """Drive a KVServer; every outgoing message goes through the codec as the van would send it."""

    def __init__(self, server: KVServer) -> None:
        self.server = server

    def send(self, msg: Message) -> list[tuple[int, Message]]:
        # the request itself must survive the codec too (what a ROUTER would hand the runtime)
        msg = Message.from_frames([identity_of(msg.sender) if msg.sender != EMPTY else b"\0abcd"] + msg.to_frames())
        out = []
        for node, reply in self.server.handle(msg):
            out.append((node, Message.from_frames([identity_of(SERVER_ID)] + reply.to_frames())))
        return out

    def call(self, msg: Message, *, good: bool = True) -> Message:
        """A request answered at once by exactly one reply to its sender (and, if `good`, not refused)."""
        bad = self.server.bad_requests
        out = self.send(msg)
        if good:
            assert self.server.bad_requests == bad, "a good request was refused (see the log)"
        assert len(out) == 1, out
        node, reply = out[0]
        assert node == msg.sender
        check_reply(reply, msg)
        return reply

    def ok(self, msg: Message) -> Message:
        reply = self.call(msg)
        if msg.meta.push and not msg.meta.pull and not msg.meta.simple_app:
            assert reply.data == [], "a push reply carries no data"
        return reply

    def values(self, msg: Message, dtype=np.float32) -> np.ndarray:
        """Pull (dense or row_sparse): the values of a good reply, with the layout checks a KVWorker makes."""
        reply = self.call(msg)
        kv = decode_kv(reply.data)
        req = decode_kv(msg.data)
        assert kv.keys.tolist() == req.keys.tolist()
        assert len(kv.lens) == len(kv.keys)
        return np.frombuffer(kv.vals, dtype).copy()


def stored(server: KVServer) -> dict:
    """Everything a rejected request must leave alone: values, master copies, states, rows, pending rounds,
    declarations and settings (the server's public inspection of itself)."""
    return server.inspect()


def row_ids(server: KVServer, key: int) -> list[int]:
    """The rows of `key` that exist, ascending (the server's public snapshot)."""
    return server.snapshot()[1][key]["row_ids"].tolist()


def error_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture(autouse=True)
def _log_level(caplog):
    caplog.set_level(logging.INFO, logger="kvstore_lazy")


# ---------------------------------------------------------------------------------------------------------------
# dense

def test_dense_sync_round_answers_together_and_mid_round_pull_gets_old_value():
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.SYNC_MODE))
    init = f32(1, 2, 3, 4)
    peer.ok(w0.push(3, init))                                    # the first push is the init: answered at once
    assert peer.values(w1.pull(3)).tolist() == init.tolist()

    push0 = w0.push(3, f32(0.5, 0.5, 0.5, 0.5))
    assert peer.send(push0) == []                                # buffered until NUM_WORKER requests
    assert peer.values(w1.pull(3)).tolist() == init.tolist()     # mid-round pull: old value, at once
    assert peer.values(w0.pull(3)).tolist() == init.tolist()
    push1 = w1.push(3, f32(1, 2, 0, -1))
    out = peer.send(push1)
    assert [node for node, _ in out] == [WORKER0, WORKER1]       # the whole round, in arrival order
    for (_, reply), req in zip(out, [push0, push1]):
        check_reply(reply, req)
        assert reply.data == []
    # no optimizer: stored = the round's sum
    assert peer.values(w0.pull(3)).tolist() == [1.5, 2.5, 0.5, -0.5]

    # with an optimizer the round's sum goes through it once
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("sgd", learning_rate=0.5)))
    peer.ok(w1.command(proto.CONTROLLER, optimizer_body("sgd", learning_rate=0.5)))   # every worker sends it
    assert peer.send(w0.push(3, f32(1, 1, 1, 1))) == []
    assert len(peer.send(w1.push(3, f32(1, 1, 1, 1)))) == 2
    np.testing.assert_allclose(peer.values(w1.pull(3)), f32(0.5, 1.5, -0.5, -1.5), rtol=1e-6)


def test_dense_sync_pushpull_replies_carry_the_new_value():
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0)))
    peer.ok(w0.push(4, f32(10, 20)))
    pp0, pp1 = w0.pushpull(4, f32(1, 2)), w1.pushpull(4, f32(3, 4))
    assert peer.send(pp0) == []
    out = peer.send(pp1)
    assert [n for n, _ in out] == [WORKER0, WORKER1]
    for (_, reply), req in zip(out, [pp0, pp1]):
        check_reply(reply, req)
        kv = decode_kv(reply.data)
        assert kv.keys.tolist() == [4] and kv.lens.tolist() == [8]
        assert np.frombuffer(kv.vals, np.float32).tolist() == [14, 26]     # Test optimizer: w += sum of grads


def test_dense_async_applies_each_push_at_once():
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=2.0)))
    peer.ok(w0.push(1, f32(1, 1, 1)))
    peer.ok(w0.push(1, f32(1, 2, 3)))                            # answered at once, no round
    assert peer.values(w1.pull(1)).tolist() == [3, 5, 7]
    reply = peer.call(w1.pushpull(1, f32(0.5, 0.5, 0.5)))
    assert np.frombuffer(decode_kv(reply.data).vals, np.float32).tolist() == [4, 6, 8]
    assert peer.values(w0.pull(1)).tolist() == [4, 6, 8]


def test_dense_float64_and_int_keys_keep_their_dtype():
    peer = Peer(KVServer(0, 1, 1))
    w0 = Requests(WORKER0)
    peer.ok(w0.push(2, np.array([1.25, 2.5], np.float64), F64))
    assert peer.values(w0.pull(2, F64), np.float64).tolist() == [1.25, 2.5]
    peer.ok(w0.push(6, np.array([7, -8], np.int32), 4))
    assert peer.values(w0.pull(6, 4), np.int32).tolist() == [7, -8]


# ---------------------------------------------------------------------------------------------------------------
# row_sparse

def rsp_server(num_workers=2, sync=True, optimizer=None, **kwargs):
    peer = Peer(KVServer(0, 1, num_workers, **kwargs))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    if sync:
        peer.ok(w0.command(proto.SYNC_MODE))
    if optimizer:
        peer.ok(w0.command(proto.CONTROLLER, optimizer))
    return peer, w0, w1


def test_row_sparse_init_pull_and_sync_merge_sums_overlapping_rows():
    peer, w0, w1 = rsp_server(optimizer=optimizer_body("test", rescale_grad=1.0))
    init = np.arange(12, dtype=np.float32).reshape(6, 2)
    peer.ok(w0.rsp_push(5, range(6), init))
    assert peer.values(w1.rsp_pull(5, [1, 4]), np.float32).reshape(-1, 2).tolist() == init[[1, 4]].tolist()
    reply = peer.call(w1.rsp_pull(5, [0, 5]))
    assert decode_kv(reply.data).lens.tolist() == [0, 2, 2]      # lens in elements, master key first

    g0 = np.ones((2, 2), np.float32)
    g1 = np.full((2, 2), 10, np.float32)
    push0, push1 = w0.rsp_push(5, [0, 2], g0), w1.rsp_push(5, [2, 3], g1)
    assert peer.send(push0) == []
    assert peer.values(w1.rsp_pull(5, [0, 2])).reshape(-1, 2).tolist() == init[[0, 2]].tolist()   # mid-round
    out = peer.send(push1)
    assert [n for n, _ in out] == [WORKER0, WORKER1]
    for (_, reply), req in zip(out, [push0, push1]):
        check_reply(reply, req)
        assert reply.data == []
    expected = init.copy()
    expected[0] += 1
    expected[2] += 11                                            # row 2 pushed by both: summed
    expected[3] += 10
    got = peer.values(w0.rsp_pull(5, range(6))).reshape(6, 2)
    assert got.tolist() == expected.tolist()


def test_row_sparse_zero_row_push_counts_in_the_round():
    peer, w0, w1 = rsp_server(optimizer=optimizer_body("test", rescale_grad=1.0))
    peer.ok(w0.rsp_push(5, range(3), np.zeros((3, 2))))
    assert peer.send(w0.rsp_push(5, [], np.zeros((0, 2)))) == []
    assert len(peer.send(w1.rsp_push(5, [1], f32(1, 2)))) == 2
    assert peer.values(w0.rsp_pull(5, range(3))).reshape(3, 2).tolist() == [[0, 0], [1, 2], [0, 0]]
    # a zero-row pull: keys back, lens all 0, no values, still 3 frames
    reply = peer.call(w0.rsp_pull(5, []))
    assert len(reply.data) == 3 and decode_kv(reply.data).lens.tolist() == [0] and reply.data[1] == b""


def test_row_sparse_push_without_optimizer_writes_rows_at_their_ids():
    peer, w0, w1 = rsp_server()
    init = np.arange(10, dtype=np.float32).reshape(5, 2)
    peer.ok(w0.rsp_push(5, range(5), init))
    assert peer.send(w0.rsp_push(5, [3], f32(-1, -1))) == []
    assert len(peer.send(w1.rsp_push(5, [1, 3], f32(7, 7, 1, 1)))) == 2
    expected = init.copy()
    expected[1] = 7
    expected[3] = 0                  # merged: -1 + 1; stored at row 3 (the stock server would write rows 0, 1)
    assert peer.values(w0.rsp_pull(5, range(5))).reshape(5, 2).tolist() == expected.tolist()


def test_row_sparse_async_update_per_push():
    peer, w0, w1 = rsp_server(sync=False, optimizer=optimizer_body("test", rescale_grad=1.0))
    peer.ok(w0.rsp_push(5, range(4), np.zeros((4, 3))))
    peer.ok(w0.rsp_push(5, [2], f32(1, 2, 3)))
    peer.ok(w1.rsp_push(5, [2, 3], f32(1, 1, 1, 5, 5, 5)))
    assert peer.values(w0.rsp_pull(5, [2, 3])).reshape(2, 3).tolist() == [[2, 3, 4], [5, 5, 5]]


# ---------------------------------------------------------------------------------------------------------------
# lazy keys

def declare(peer, req, key, rows, row_shape, init=UNIFORM, seed=42, dtype="float32", bound=None, monkeypatch=None):
    if bound is not None:
        monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(bound))
    body = lazy_spec_body(key, (rows,) + tuple(row_shape), dtype, init, seed)
    peer.ok(req.command(proto.LAZY_DECLARE, body))


def initial(ids, rows, dim, key=7, seed=42, init=UNIFORM, dtype=np.float32):
    return parse_initializer(init).rows(seed, key, np.asarray(ids, np.uint64), (rows, dim), dtype)


def test_lazy_declare_empty_init_then_pull_gives_initializer_values(monkeypatch):
    monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)
    peer, w0, w1 = rsp_server(optimizer=optimizer_body("test", rescale_grad=1.0), materialize=MATERIALIZE_ON_TOUCH)
    declare(peer, w0, 7, 1000, (4,))
    declare(peer, w1, 7, 1000, (4,))                            # every worker may declare: identical is fine
    reply = peer.ok(w0.rsp_push(7, [], np.zeros((0, 4))))       # kv.init of an empty rsp: master key only
    assert reply.data == []
    got = peer.values(w1.rsp_pull(7, [3, 500, 999])).reshape(3, 4)
    np.testing.assert_array_equal(got, initial([3, 500, 999], 1000, 4))   # the worker sends sorted unique ids
    assert row_ids(peer.server, 7) == [3, 500, 999]                      # materialize='touch': pulls store
    # a push updates from the initial values
    assert peer.send(w0.rsp_push(7, [3], f32(1, 1, 1, 1))) == []
    assert len(peer.send(w1.rsp_push(7, [], np.zeros((0, 4))))) == 2
    np.testing.assert_array_equal(peer.values(w0.rsp_pull(7, [3])), initial([3], 1000, 4)[0] + 1)


def test_lazy_materialize_push_pull_stores_nothing(monkeypatch):
    """The default policy (issue 12): rows exist only once trained."""
    monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)
    peer, w0, _ = rsp_server(num_workers=1, optimizer=optimizer_body("test", rescale_grad=1.0))
    assert peer.server.materialize == MATERIALIZE_ON_PUSH
    declare(peer, w0, 7, 50, (2, 3))                            # row shape (2, 3): 6 elements a row
    peer.ok(w0.rsp_push(7, [], np.zeros((0, 6))))
    got = peer.values(w0.rsp_pull(7, [0, 10, 49])).reshape(3, 6)
    np.testing.assert_array_equal(got, initial([0, 10, 49], 50, 6).reshape(3, 6))
    assert row_ids(peer.server, 7) == []                         # pulls computed the rows, stored none
    peer.ok(w0.rsp_push(7, [10], np.ones((1, 6))))
    assert row_ids(peer.server, 7) == [10]
    got = peer.values(w0.rsp_pull(7, [9, 10])).reshape(2, 6)
    np.testing.assert_array_equal(got[0], initial([9], 50, 6)[0])
    np.testing.assert_array_equal(got[1], initial([10], 50, 6)[0] + 1)
    assert row_ids(peer.server, 7) == [10]


def test_lazy_partitioned_key_uses_global_row_ids_on_server_rank_1(monkeypatch, caplog):
    rows, dim = 11, 3
    start, part = proto.row_partition(rows, 2, 1)
    assert (start, part) == (6, 5)
    peer = Peer(KVServer(1, 2, 1))
    w0 = Requests(WORKER0, rank=1, num_servers=2)               # keys offset by server 1's range begin
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0)))
    declare(peer, w0, 7, rows, (dim,), bound=10, monkeypatch=monkeypatch)   # 33 elements >= bound: partitioned
    peer.ok(w0.rsp_push(7, [], np.zeros((0, dim))))
    got = peer.values(w0.rsp_pull(7, [0, 4])).reshape(2, dim)   # local rows 0 and 4 = global rows 6 and 10
    np.testing.assert_array_equal(got, initial([6, 10], rows, dim))
    peer.ok(w0.rsp_push(7, [2], f32(1, 1, 1)))
    np.testing.assert_array_equal(peer.values(w0.rsp_pull(7, [2])), initial([8], rows, dim)[0] + 1)
    assert row_ids(peer.server, 7) == [8]   # global ids; pulls store nothing (push policy)
    caplog.clear()
    reply = peer.call(w0.rsp_pull(7, [5]), good=False)         # local row 5 = global row 11: out of range
    assert decode_kv(reply.data).vals == b""
    (line,) = error_lines(caplog)
    assert "row 11 is out of range" in line and "[6, 11)" in line


# ---------------------------------------------------------------------------------------------------------------
# multi-precision

def test_multi_precision_fp16_dense_keeps_float32_master():
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.push(1, np.ones(3, np.float16), F16))            # initialized before kSetMultiPrecision: converted
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0, multi_precision=True)))
    peer.ok(w0.command(proto.SET_MULTI_PRECISION))
    peer.ok(w0.push(2, np.ones(3, np.float16), F16))            # initialized after
    g = np.full(3, 1e-4, np.float16)
    master = np.ones(3, np.float32)
    for _ in range(5):
        for key in (1, 2):
            assert peer.send(w0.push(key, g, F16)) == []
            assert len(peer.send(w1.push(key, g, F16))) == 2
        master = master + (g.astype(np.float32) + g.astype(np.float32)) * np.float32(1.0)
    for key in (1, 2):
        got = peer.values(w0.pull(key, F16), np.float16)
        np.testing.assert_array_equal(got, master.astype(np.float16))
        assert (got > 1).all()                                   # fp16 arithmetic alone would have stayed at 1
        np.testing.assert_array_equal(peer.server.snapshot()[1][key]["weights"].reshape(-1), master)


def test_multi_precision_fp16_row_sparse():
    peer = Peer(KVServer(0, 1, 1))
    w0 = Requests(WORKER0)
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0, multi_precision=True)))
    peer.ok(w0.command(proto.SET_MULTI_PRECISION))
    peer.ok(w0.rsp_push(5, range(3), np.ones((3, 2), np.float16), F16))
    for _ in range(4):
        peer.ok(w0.rsp_push(5, [1], np.full((1, 2), 2e-4, np.float16), F16))
    master = np.float32(1)
    for _ in range(4):
        master = master + np.float32(np.float16(2e-4))
    got = peer.values(w0.rsp_pull(5, [0, 1], F16), np.float16).reshape(2, 2)
    assert got[0].tolist() == [1, 1]
    np.testing.assert_array_equal(got[1], np.full(2, master, np.float32).astype(np.float16))
    assert got[1][0] > 1
    assert peer.server.snapshot()[1][5]["weights"].dtype == np.float32


# ---------------------------------------------------------------------------------------------------------------
# gradient compression

def test_2bit_quantize_reference_layout():
    # element j: word j>>4, byte (j&15)>>2, bit pair j&3 from the top
    assert quantize_2bit([1, -1, 0, 1]) == bytes([0b11100011, 0, 0, 0])
    assert quantize_2bit([0] * 16 + [-1]) == bytes(4) + bytes([0b10000000, 0, 0, 0])


def test_compressed_sync_push_dequantized_and_merged():
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.command(proto.SET_GRADIENT_COMPRESSION, "1,0.500000"))
    peer.ok(w0.push(4, np.zeros(20, np.float32)))               # the init push uses the default command
    s0 = [1, -1, 0] * 6 + [1, 1]
    s1 = [0, -1, 1] * 6 + [-1, 0]
    p0, p1 = w0.compressed_push(4, s0), w1.compressed_push(4, s1)
    assert peer.send(p0) == []
    out = peer.send(p1)
    assert [n for n, _ in out] == [WORKER0, WORKER1]
    for (_, reply), req in zip(out, [p0, p1]):
        check_reply(reply, req)
    expected = 0.5 * np.array(s0, np.float32) + 0.5 * np.array(s1, np.float32)
    assert peer.values(w0.compressed_pull(4)).tolist() == expected.tolist()
    assert peer.values(w1.pull(4)).tolist() == expected.tolist()


# ---------------------------------------------------------------------------------------------------------------
# bad input

@pytest.fixture
def loaded(monkeypatch):
    """Server rank 0 of 2, one worker, dist_sync, Test optimizer; dense key 3 (4 floats), row_sparse key 5 (6 rows of
    2), lazy key 7 (100 rows of 2), compression off."""
    monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)
    peer = Peer(KVServer(0, 2, 1))
    w0 = Requests(WORKER0, customer_id=1, num_servers=2)   # a second KVStore in the worker: replies must copy it
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0)))
    peer.ok(w0.push(3, f32(1, 2, 3, 4)))
    peer.ok(w0.rsp_push(5, range(6), np.arange(12, dtype=np.float32).reshape(6, 2)))
    declare(peer, w0, 7, 100, (2,))
    peer.ok(w0.rsp_push(7, [], np.zeros((0, 2))))
    peer.values(w0.rsp_pull(7, [1, 2]))
    declare(peer, w0, 12, 10, (2,))                             # declared, never initialized
    return peer, w0


def check_good(peer: Peer, req: Requests) -> None:
    """The values `loaded` stored, answered correctly."""
    assert peer.values(req.pull(3)).tolist() == [1, 2, 3, 4]
    assert peer.values(req.rsp_pull(5, [0, 5])).tolist() == [0, 1, 10, 11]
    np.testing.assert_array_equal(peer.values(req.rsp_pull(7, [1, 2])).reshape(2, 2), initial([1, 2], 100, 2))


def decodable(msg: Message) -> bool:
    try:
        decode_kv(msg.data)
    except ProtocolError:
        return False
    return True


def reject(peer: Peer, caplog, msg: Message, key) -> str:
    """Send a request the server must refuse; check the log line, the reply and that nothing changed."""
    before, count = stored(peer.server), peer.server.bad_requests
    caplog.clear()
    out = peer.send(msg)
    lines = error_lines(caplog)
    assert len(lines) == 1, lines
    assert NAME[msg.sender] in lines[0], lines[0]
    if key is None:
        assert "key ?" in lines[0], lines[0]
    else:
        assert re.search(rf"\bkey {key}\b", lines[0]), lines[0]
    assert len(out) == 1, out
    node, reply = out[0]
    assert node == msg.sender
    check_reply(reply, msg)
    if reply.data:
        assert msg.meta.pull, "only a rejected pull gets data back"
        kv = decode_kv(reply.data)
        assert kv.keys.tolist() == decode_kv(msg.data).keys.tolist()  # keys echoed ...
        assert kv.vals == b"" and kv.lens.tolist() == [0] * len(kv.keys)   # ... with no values
    else:
        assert not (msg.meta.pull and decodable(msg) and len(decode_kv(msg.data).keys)), \
            "a rejected pull must get its keys back so the worker's size check fails"
    assert stored(peer.server) == before, "a rejected request changed stored state"
    assert peer.server.bad_requests == count + 1
    return lines[0]


DEF, RSP, CMP = (proto.command_code(t, F32) for t in (proto.DEFAULT, proto.ROW_SPARSE, proto.COMPRESSED))
F4 = f32(1, 1, 1, 1).tobytes()
B1 = proto.server_key_begin(1, 2)

# name -> (request builder, key named in the log)
BAD = {
    # dense layout
    "dense-lens-disagree-with-vals": (lambda r: r.kv(DEF, [3], F4, [20], push=True), 3),
    "dense-vals-size-mismatch": (lambda r: r.push(3, f32(1, 2, 3, 4, 5)), 3),
    "dense-vals-not-whole-floats": (lambda r: r.kv(DEF, [3], F4[:15], [15], push=True), 3),
    "dense-pushpull-vals-size-mismatch": (lambda r: r.pushpull(3, f32(1, 2)), 3),
    # frames a KVServer::Process would refuse
    "lens-count-mismatch": (lambda r: r.frames(DEF, [np.uint64(3).tobytes(), F4,
                                                     np.array([16, 16], np.int32).tobytes()]), 3),
    "one-data-frame": (lambda r: r.frames(DEF, [np.uint64(3).tobytes()]), 3),
    "four-data-frames": (lambda r: r.frames(DEF, [np.uint64(3).tobytes(), F4, np.int32(16).tobytes(), b""]), 3),
    "keys-not-whole-uint64": (lambda r: r.frames(DEF, [np.uint64(3).tobytes() + b"\0\0\0\0", F4,
                                                       np.int32(16).tobytes()]), 3),
    "pull-keys-not-whole-uint64": (lambda r: r.frames(DEF, [np.uint64(3).tobytes() + b"\0", b""], push=False,
                                                      pull=True), 3),
    "lens-not-whole-int32": (lambda r: r.frames(DEF, [np.uint64(3).tobytes(), F4, b"\x10\0\0"]), 3),
    # heads
    "unknown-request-type-push": (lambda r: r.kv(proto.command_code(3, F32), [3], F4, [16], push=True), 3),
    "unknown-request-type-pull": (lambda r: r.kv(proto.command_code(3, F32), [3], b"", push=False, pull=True), 3),
    "unknown-dtype-bool-push": (lambda r: r.kv(proto.command_code(proto.DEFAULT, 7), [3], F4, [16], push=True), 3),
    "unknown-dtype-bf16-pull": (lambda r: r.kv(proto.command_code(proto.DEFAULT, 12), [3], b"", push=False,
                                               pull=True), 3),
    "negative-head": (lambda r: r.kv(-5, [3], b"", push=False, pull=True), 3),
    # never initialized / declared
    "pull-never-initialized": (lambda r: r.pull(9), 9),
    "rsp-pull-never-initialized": (lambda r: r.rsp_pull(9, [0, 1]), 9),
    "rsp-pull-before-declare-zero-rows": (lambda r: r.rsp_pull(8, []), 8),
    "rsp-pull-declared-not-initialized": (lambda r: r.rsp_pull(12, [0]), 12),
    "rsp-empty-init-not-declared": (lambda r: r.rsp_push(8, [], np.zeros((0, 2))), 8),
    # rows
    "row-id-beyond-input-dim-pull": (lambda r: r.rsp_pull(5, [2, 6]), 5),
    "row-id-beyond-input-dim-push": (lambda r: r.rsp_push(5, [6], f32(1, 1)), 5),
    "lazy-row-id-beyond-input-dim-pull": (lambda r: r.rsp_pull(7, [99, 100]), 7),
    "lazy-row-id-beyond-input-dim-push": (lambda r: r.rsp_push(7, [100], f32(1, 1)), 7),
    "duplicate-row-ids-pull": (lambda r: r.rsp_pull(5, [1, 1]), 5),
    "duplicate-row-ids-push": (lambda r: r.rsp_push(5, [1, 1], f32(1, 1, 1, 1)), 5),
    "unsorted-row-ids-pull": (lambda r: r.rsp_pull(5, [3, 1]), 5),
    "unsorted-row-ids-push": (lambda r: r.rsp_push(5, [3, 1], f32(1, 1, 1, 1)), 5),
    "row-key-below-master": (lambda r: r.kv(RSP, [5, 4], b"", push=False, pull=True), 5),
    # row ids past int64 (a 64-bit row key decoded to a negative int64 would pass a range check)
    "row-id-2^63-pull": (lambda r: r.kv(RSP, [5, 5 + 2 ** 63], b"", push=False, pull=True), 5),
    "row-id-near-2^64-pull": (lambda r: r.kv(RSP, [5, 2 ** 64 - 1], b"", push=False, pull=True), 5),
    "lazy-row-id-2^63-push": (lambda r: r.kv(RSP, [7, 7 + 2 ** 63 + 7], f32(1, 1).tobytes(), [0, 8], push=True), 7),
    "rsp-lens0-not-zero": (lambda r: r.kv(RSP, [5, 6], f32(1, 1).tobytes(), [8, 8], push=True), 5),
    "rsp-row-lens-differ": (lambda r: r.kv(RSP, [5, 6, 7], f32(1, 1, 1).tobytes(), [0, 8, 4], push=True), 5),
    "rsp-vals-size-mismatch": (lambda r: r.kv(RSP, [5, 6, 7], f32(1, 1).tobytes(), [0, 8, 8], push=True), 5),
    "rsp-row-size-mismatch": (lambda r: r.rsp_push(5, [1], f32(1, 1, 1)), 5),
    "rsp-push-without-lens": (lambda r: r.kv(RSP, [5, 6], f32(1, 1).tobytes(), None, push=True), 5),
    # dtypes and kinds
    "wrong-dtype-push-dense": (lambda r: r.push(3, np.ones(4), F64), 3),
    "wrong-dtype-push-dense-same-size": (lambda r: r.push(3, np.ones(4, np.int32), 4), 3),
    "wrong-dtype-pull-dense": (lambda r: r.pull(3, F16), 3),
    "wrong-dtype-pull-dense-same-size": (lambda r: r.pull(3, 4), 3),
    "wrong-dtype-push-rsp": (lambda r: r.rsp_push(5, [1], np.ones((1, 2), np.float16), F16), 5),
    "wrong-dtype-pull-rsp": (lambda r: r.rsp_pull(5, [1], F64), 5),
    "wrong-dtype-pull-lazy": (lambda r: r.rsp_pull(7, [1], F16), 7),
    "dense-push-to-rsp-key": (lambda r: r.push(5, f32(1, 2)), 5),
    "rsp-push-to-dense-key": (lambda r: r.rsp_push(3, [0], f32(1, 1)), 3),
    # key ranges (this server is rank 0 of 2)
    "key-of-server-1-push": (lambda r: r.kv(DEF, [B1 + 3], F4, [16], push=True), B1 + 3),
    "key-of-server-1-pull": (lambda r: r.kv(DEF, [B1 + 3], b"", push=False, pull=True), B1 + 3),
    "key-of-server-1-rsp-pull": (lambda r: r.kv(RSP, [B1 + 5, B1 + 6], b"", push=False, pull=True), B1 + 5),
    "max-key": (lambda r: r.kv(DEF, [2 ** 64 - 1], b"", push=False, pull=True), 2 ** 64 - 1),
    # compression
    "compressed-push-without-compression": (lambda r: r.compressed_push(3, [1, -1, 0, 1]), 3),
    "compressed-push-fp16": (lambda r: r.kv(proto.command_code(proto.COMPRESSED, F16), [4, 3], b"\0" * 4, [0, 4],
                                            push=True), None),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_logged_answered_and_changes_nothing(loaded, caplog, case):
    peer, w0 = loaded
    build, key = BAD[case]
    reject(peer, caplog, build(w0), key)
    # the server carries on: another worker gets the right values, and so does this one once any poison is spent
    check_good(peer, Requests(WORKER1, num_servers=2))
    peer.send(w0.pull(3))
    peer.send(w0.rsp_pull(5, [0]))
    peer.send(w0.rsp_pull(7, [1]))
    caplog.clear()
    check_good(peer, w0)
    assert error_lines(caplog) == []


def test_bad_request_mid_round_leaves_the_round_alone(caplog):
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.SYNC_MODE))
    peer.ok(w0.push(3, f32(1, 2)))
    peer.ok(w0.rsp_push(5, range(3), np.zeros((3, 2))))
    assert peer.send(w0.push(3, f32(1, 1))) == []
    assert peer.send(w0.rsp_push(5, [1], f32(1, 1))) == []
    reject(peer, caplog, w1.push(3, f32(1, 1, 1)), 3)           # does not count as the round's second request
    reject(peer, caplog, w1.rsp_push(5, [3], f32(1, 1)), 5)
    assert len(peer.send(w1.push(3, f32(2, 2)))) == 2
    assert len(peer.send(w1.rsp_push(5, [2], f32(2, 2)))) == 2
    assert peer.values(Requests(13).pull(3)).tolist() == [3, 3]
    assert peer.values(Requests(13).rsp_pull(5, range(3))).tolist() == [0, 0, 1, 1, 2, 2]


def test_rejected_push_makes_that_workers_next_pull_fail(loaded, caplog):
    peer, w0 = loaded
    w1 = Requests(WORKER1, num_servers=2)
    for push, pull, key in [(w0.push(3, np.ones(4), F64), lambda: w0.pull(3), 3),
                            (w0.rsp_push(5, [9], f32(1, 1)), lambda: w0.rsp_pull(5, [0, 1]), 5),
                            (w0.rsp_push(7, [3, 3], f32(1, 1, 1, 1)), lambda: w0.rsp_pull(7, [1]), 7),
                            (w0.kv(proto.command_code(3, F32), [3], F4, [16], push=True), lambda: w0.pull(3), 3)]:
        reject(peer, caplog, push, key)
        check_good(peer, w1)                                      # other workers are not affected
        line = reject(peer, caplog, pull(), key)                  # keys back, no values: the worker fails loudly
        assert "earlier push" in line
        caplog.clear()
        check_good(peer, w0)                                      # once only
        assert error_lines(caplog) == []


def test_dist_async_push_without_optimizer_is_refused(caplog):
    peer = Peer(KVServer(0, 1, 1))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.push(3, f32(1, 2)))                                # the init needs no optimizer
    peer.ok(w0.rsp_push(5, range(2), f32(1, 2, 3, 4)))
    assert "no optimizer" in reject(peer, caplog, w0.push(3, f32(5, 5)), 3)
    assert "no optimizer" in reject(peer, caplog, w0.rsp_push(5, [1], f32(5, 5)), 5)
    assert "no optimizer" in reject(peer, caplog, w0.pushpull(3, f32(5, 5)), 3)
    assert peer.values(w1.pull(3)).tolist() == [1, 2]
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0)))
    peer.ok(w1.push(3, f32(5, 5)))
    assert peer.values(w1.pull(3)).tolist() == [6, 7]


def test_compressed_push_with_wrong_payload_size(caplog):
    peer = Peer(KVServer(0, 1, 1))
    w0 = Requests(WORKER0)
    peer.ok(w0.command(proto.SET_GRADIENT_COMPRESSION, "1,0.5"))
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0)))
    peer.ok(w0.push(3, np.zeros(20, np.float32)))
    msg = w0.kv(CMP, [20, 3], b"\0" * 4, [0, 4], push=True)       # 20 values need 2 words
    assert "compressed bytes" in reject(peer, caplog, msg, 3)
    msg = w0.kv(CMP, [16, 3], b"\0" * 4, [0, 4], push=True)       # 16 values to a key of 20
    reject(peer, caplog, msg, 3)
    peer.ok(w0.compressed_push(3, [1] * 20))
    assert peer.values(Requests(WORKER1).pull(3)).tolist() == [0.5] * 20


def test_unidentified_sender_is_dropped(loaded, caplog):
    peer, w0 = loaded
    msg = w0.pull(3)
    msg.sender = EMPTY
    caplog.clear()
    assert peer.send(msg) == []                                  # nobody to answer
    (line,) = error_lines(caplog)
    assert "unidentified" in line
    check_good(peer, w0)


def test_a_reply_arriving_as_a_request_is_dropped(loaded, caplog):
    """A message with request=0 is a reply (ours, echoed back by a peer posing as us, or forged): never served, or
    a server could answer its own replies forever."""
    peer, w0 = loaded
    for msg in (w0.pull(3), w0.push(3, f32(9, 9, 9, 9)), w0.command(proto.STOP_SERVER)):
        msg.meta.request = False
        before = stored(peer.server)
        caplog.clear()
        assert peer.send(msg) == []
        (line,) = error_lines(caplog)
        assert "dropping a reply" in line and NAME[WORKER0] in line
        assert stored(peer.server) == before and not peer.server.stopped
    check_good(peer, w0)


# ---------------------------------------------------------------------------------------------------------------
# bad commands

def reject_command(peer: Peer, caplog, msg: Message, *, key=None) -> str:
    before = stored(peer.server)
    caplog.clear()
    reply = peer.call(msg, good=False)                          # SimpleApp reply: head, timestamp, customer id
    assert reply.meta.simple_app and reply.meta.body == b""
    lines = error_lines(caplog)
    assert len(lines) == 1, lines
    assert NAME[msg.sender] in lines[0] and f"command {msg.meta.head}" in lines[0]
    if key is not None:
        assert re.search(rf"\bkey {key}\b", lines[0]), lines[0]
    assert stored(peer.server) == before
    return lines[0]


def test_second_declaration_with_another_shape_is_refused(loaded, caplog):
    peer, w0 = loaded
    w1 = Requests(WORKER1, num_servers=2)
    for shape, dtype in [((100, 3), "float32"), ((101, 2), "float32"), ((100, 2, 1), "float32"),
                         ((100, 2), "float16")]:
        body = lazy_spec_body(7, shape, dtype, UNIFORM, 42)
        line = reject_command(peer, caplog, w1.command(proto.LAZY_DECLARE, body), key=7)
        assert "already declared" in line
    check_good(peer, w0)
    caplog.clear()
    peer.ok(w1.command(proto.LAZY_DECLARE, lazy_spec_body(7, (100, 2), "float32", UNIFORM, 42)))   # same: fine
    peer.ok(w1.command(proto.LAZY_DECLARE, lazy_spec_body(7, (100, 2), "float32", '["zero", {}]', 1)))
    assert error_lines(caplog) == []
    assert any("keeping the first" in r.getMessage() for r in caplog.records)
    check_good(peer, w0)


class _RunsShell:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Eval:
    def __reduce__(self):
        return (eval, ("__import__('os').getpid()",))


def test_malicious_optimizer_pickle_is_not_run(loaded, caplog, tmp_path):
    peer, w0 = loaded
    # the payload works: a plain unpickler in a child process creates the file
    proof = tmp_path / "proof"
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=pickle.dumps(_RunsShell(proof), 0), check=True, timeout=60)
    assert proof.exists()

    marker = tmp_path / "pwned"
    for body in [pickle.dumps(_RunsShell(marker), 0), pickle.dumps(_RunsShell(marker), 2), pickle.dumps(_Eval(), 0),
                 # a dict of optimizers, a plain dict, an optimizer class with a hostile state
                 pickle.dumps({"x": 1}, 0), pickle.dumps(_RunsShell, 0)]:
        line = reject_command(peer, caplog, w0.command(proto.CONTROLLER, body))
        assert "pickle" in line or "optimizer" in line, line
    assert not marker.exists()
    assert peer.server.optimizer_body == optimizer_body("test", rescale_grad=1.0)   # the previous one stays
    check_good(peer, w0)


@pytest.mark.parametrize("body", [b"", b"garbage", b"\x80\x04\x95garbage", b"(lp0\nI1\na.",
                                  b"ccopy_reg\n_reconstructor\n(cposix\nsystem\nc__builtin__\nobject\nNtR.",
                                  b"cmxnet.optimizer.optimizer\nAdaDelta\n)R.", b"\0" * 64],
                         ids=["empty", "text", "truncated-proto4", "list", "reconstruct-posix", "unsupported",
                              "zeros"])
def test_garbage_controller_body(loaded, caplog, body):
    peer, w0 = loaded
    reject_command(peer, caplog, w0.command(proto.CONTROLLER, body))
    check_good(peer, w0)


def test_optimizer_with_unusable_hyper_parameters_is_refused(loaded, caplog):
    """A pickle of a real optimizer class whose state cannot run (a string learning rate): refused when it arrives,
    not when the first push makes it fail."""
    peer, w0 = loaded
    for attr, value in [("lr", "abc"), ("momentum", "x"), ("wd", [1])]:
        opt = mxnet.optimizer.SGD(learning_rate=0.1)
        setattr(opt, attr, value)
        reject_command(peer, caplog, w0.command(proto.CONTROLLER, pickle.dumps(opt, 0)))
    check_good(peer, w0)
    peer.ok(w0.push(3, f32(1, 1, 1, 1)))                        # the Test optimizer is still the one in use
    assert peer.values(w0.pull(3)).tolist() == [2, 3, 4, 5]


BAD_COMMANDS = {
    "compression-not-numbers": (proto.SET_GRADIENT_COMPRESSION, b"x,y"),
    "compression-unknown-type": (proto.SET_GRADIENT_COMPRESSION, b"7,0.5"),
    "compression-threshold-beyond-float32": (proto.SET_GRADIENT_COMPRESSION, b"1,1e39"),
    "compression-not-ascii": (proto.SET_GRADIENT_COMPRESSION, b"\xff\xfe"),
    "declare-not-json": (proto.LAZY_DECLARE, b"not json"),
    "declare-not-utf8": (proto.LAZY_DECLARE, b"\xff\xfe"),
    "declare-a-list": (proto.LAZY_DECLARE, b"[1, 2]"),
    "declare-empty-object": (proto.LAZY_DECLARE, b"{}"),
    "declare-nested-100000-deep": (proto.LAZY_DECLARE, b"[" * 100000),
    "declare-init-nested-100000-deep": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [2], "init": "[" * 100000}).encode()),
    "declare-rows-infinity": (proto.LAZY_DECLARE,
                              b'{"key": 11, "rows": Infinity, "row_shape": [2], "init": "[\\"zero\\", {}]"}'),
    "declare-key-1e400": (proto.LAZY_DECLARE,
                          b'{"key": 1e400, "rows": 10, "row_shape": [2], "init": "[\\"zero\\", {}]"}'),
    "declare-row-size-beyond-int64": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [10 ** 30], "init": '["zero", {}]'}).encode()),
    "declare-negative-dims": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [-2, -2], "init": '["zero", {}]'}).encode()),
    "declare-int32": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [2], "dtype": "int32", "init": '["zero", {}]'}).encode()),
    "declare-constant-does-not-broadcast": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [2], "init": '["constant", {"value": [[1, 2, 3], [4, 5, 6]]}]'}).encode()),
    "declare-unsupported-initializer": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [2], "init": '["orthogonal", {}]'}).encode()),
    "declare-zero-rows": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 0, "row_shape": [2], "init": '["zero", {}]'}).encode()),
    "declare-rows-1e300": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 1e300, "row_shape": [2], "init": '["zero", {}]'}).encode()),
    "declare-rows-1.5": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 1.5, "row_shape": [2], "init": '["zero", {}]'}).encode()),
    "declare-row-shape-empty": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [], "init": '["zero", {}]'}).encode()),
    "declare-row-shape-string": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": "8", "init": '["zero", {}]'}).encode()),
    "declare-row-shape-float": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [8.5], "init": '["zero", {}]'}).encode()),
    "declare-row-size-2^20": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [1 << 20], "init": '["zero", {}]'}).encode()),
    "declare-dtype-null": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [2], "dtype": None, "init": '["zero", {}]'}).encode()),
    "declare-bound-0": (proto.LAZY_DECLARE, json.dumps(
        {"key": 11, "rows": 10, "row_shape": [2], "bound": 0, "init": '["zero", {}]'}).encode()),
    "declare-key-minus-1": (proto.LAZY_DECLARE, json.dumps(
        {"key": -1, "rows": 10, "row_shape": [2], "init": '["zero", {}]'}).encode()),
    "declare-key-2^64": (proto.LAZY_DECLARE, json.dumps(
        {"key": 2 ** 64, "rows": 10, "row_shape": [2], "init": '["zero", {}]'}).encode()),
    "declare-a-virtual-key": (proto.LAZY_DECLARE, json.dumps(
        {"key": proto.ROWS_HEADER_KEY, "rows": 10, "row_shape": [64], "init": '["zero", {}]'}).encode()),
    "declare-over-a-dense-key": (proto.LAZY_DECLARE, json.dumps(
        {"key": 3, "rows": 10, "row_shape": [2], "init": '["zero", {}]'}).encode()),
    "rows-query-empty-object": (proto.LAZY_ROWS, b"{}"),
    "rows-query-a-list": (proto.LAZY_ROWS, b"[5]"),
    "rows-query-key-not-a-number": (proto.LAZY_ROWS, b'{"key": "five"}'),
}


@pytest.mark.parametrize("case", sorted(BAD_COMMANDS))
def test_bad_command_body(loaded, caplog, case):
    peer, w0 = loaded
    head, body = BAD_COMMANDS[case]
    reject_command(peer, caplog, w0.command(head, body))
    check_good(peer, w0)
    # a refused declaration declares nothing: an empty init of key 11 is still refused
    if head == proto.LAZY_DECLARE:
        reject(peer, caplog, w0.rsp_push(11, [], np.zeros((0, 2))), 11)


def test_unknown_and_profiler_commands_are_answered_and_ignored(loaded, caplog):
    peer, w0 = loaded
    caplog.clear()
    for head, body in [(5, b"profile_all:1,0"), (99, b"whatever"), (EMPTY, b""), (-1, b"\xff")]:
        peer.ok(w0.command(head, body))
    assert error_lines(caplog) == []
    check_good(peer, w0)


# ---------------------------------------------------------------------------------------------------------------
# any bytes: handle() never raises and answers every identified request at most once

_frame = st.binary(max_size=40)
_keys = st.lists(st.sampled_from([0, 1, 3, 4, 5, 6, 7, 8, 105, B1 + 3, 2 ** 64 - 1,
                                  # the virtual row-listing / optimizer-state keys
                                  proto.ROWS_HEADER_KEY, proto.ROWS_HEADER_KEY + 1, proto.ROWS_HEADER_KEY + 8,
                                  proto.ROWS_HEADER_KEY + 40, proto.ROWS_HEADER_KEY + 57]), max_size=5)


@st.composite
def requests(draw):
    r = Requests(draw(st.sampled_from([WORKER0, WORKER1])), num_servers=2)
    r.ts = draw(st.integers(0, 1000))
    head = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 9, 35, 90]), st.integers(-3, 300)))
    kind = draw(st.sampled_from(["kv", "frames", "command"]))
    if kind == "command":
        body = draw(st.one_of(st.binary(max_size=60), st.sampled_from(
            [b"{}", b"[]", b'{"key": 5}', b'{"key": 3}', b'{"key": "x"}', b'{"alias": 1, "key": 1073741824}'])))
        return r.command(draw(st.sampled_from([0, 1, 3, 4, 5, 100, 101, 102, 110, 111, 200])), body)
    push, pull = draw(st.booleans()), draw(st.booleans())
    if kind == "frames":
        return r.frames(head, draw(st.lists(_frame, max_size=4)), push=push, pull=pull)
    keys = draw(_keys)
    lens = draw(st.one_of(st.none(), st.lists(st.sampled_from([0, 4, 8, 16, -1, 2 ** 31 - 1]),
                                              min_size=len(keys), max_size=len(keys))))
    return r.kv(head, keys, draw(st.binary(max_size=48)), lens, push=push, pull=pull)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(requests(), min_size=1, max_size=8), sync=st.booleans(), compression=st.booleans())
def test_handle_never_raises(msgs, sync, compression, monkeypatch):
    monkeypatch.delenv("MXNET_KVSTORE_BIGARRAY_BOUND", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # random bytes as floats overflow; that is fine
        logging.disable(logging.CRITICAL)
        try:
            peer = Peer(KVServer(0, 2, 2))
            w = Requests(WORKER0, num_servers=2)
            if sync:
                peer.send(w.command(proto.SYNC_MODE))
            if compression:
                peer.send(w.command(proto.SET_GRADIENT_COMPRESSION, "1,0.5"))
            peer.send(w.command(proto.CONTROLLER, optimizer_body("test", rescale_grad=1.0)))
            peer.send(w.push(3, f32(1, 2, 3, 4)))
            peer.send(w.rsp_push(5, range(6), np.zeros((6, 2))))
            peer.send(w.command(proto.LAZY_DECLARE, lazy_spec_body(7, (100, 2), "float32", UNIFORM, 1)))
            peer.send(w.rsp_push(7, [], np.zeros((0, 2))))
            for msg in msgs:
                out = peer.send(msg)
                assert len(out) <= (2 if sync else 1)
                mine = [reply for node, reply in out if reply.meta.timestamp == msg.meta.timestamp
                        and node == msg.sender]
                if not (sync and msg.meta.push and not msg.meta.simple_app):
                    assert len(mine) == 1                          # only a buffered sync push may wait
        finally:
            logging.disable(logging.NOTSET)


# ---------------------------------------------------------------------------------------------------------------
# issue 11: full 64-bit row ids (defect 3), what one peer can make the server hold (defect 5), strict declarations
# (defect 8), restored update counts (defect 4) and a push whose lens are element counts (defect 9)

@pytest.mark.parametrize("rows", [[2 ** 63], [2 ** 63, 2 ** 63 + 7], [2 ** 64 - 16], [1, 2 ** 63 + 1]])
def test_row_ids_beyond_2_63_are_refused(loaded, caplog, rows):
    """They used to wrap to negative int64 ids, pass the range check and be stored (issue 11, defect 3)."""
    peer, w0 = loaded
    begin = proto.server_key_begin(0, 2)
    for key in (5, 7):
        keys = [begin + key] + [(begin + key + r) % 2 ** 64 for r in rows]
        assert "beyond the int64 row ids" in reject(peer, caplog, w0.kv(RSP, keys, b"", push=False, pull=True), key)
    keys = [begin + 5] + [(begin + 5 + r) % 2 ** 64 for r in rows]
    vals = np.zeros((len(rows), 2), np.float32).tobytes()
    push = w0.kv(RSP, keys, vals, [0] + [8] * len(rows), push=True)
    assert "beyond the int64 row ids" in reject(peer, caplog, push, 5)
    assert all(r < 100 for r in row_ids(peer.server, 7))


def test_rejected_pushes_to_many_keys_hold_bounded_memory(loaded, caplog):
    """100k rejected pushes to distinct keys grew the flagged set by 13.7 MiB: a refused push now flags only a key
    this server holds or has declared, so the set is bounded by (workers of the job) x (keys), and a refused push to
    a key that does not exist (nothing a later pull could read) flags nothing."""
    peer, w0 = loaded
    w1 = Requests(WORKER1, num_servers=2)
    with caplog.at_level(logging.CRITICAL, logger="kvstore_lazy"):
        begin = proto.server_key_begin(0, 2)
        for key in range(1000, 7000):   # lens that disagree with the values: refused
            peer.send(w1.kv(DEF, [begin + key], F4, [12], push=True))
        peer.send(w1.kv(DEF, [begin + 3], F4, [12], push=True))   # a key it holds: flagged
    assert peer.server.poisoned == {(WORKER1, 3)}
    assert "earlier push" in reject(peer, caplog, w1.pull(3), 3)   # it still fails loudly
    check_good(peer, w0)                                           # the other worker is not affected


BAD_DECLARATIONS = {
    "rows-1e300": {"rows": 1e300}, "rows-1.5": {"rows": 1.5}, "rows-true": {"rows": True},
    "rows-2^63": {"rows": 2 ** 63}, "row-shape-empty": {"row_shape": []}, "row-shape-string": {"row_shape": "8"},
    "row-shape-float": {"row_shape": [8.5]},
    "row-shape-zero": {"row_shape": [4, 0]}, "dtype-null": {"dtype": None}, "dtype-number": {"dtype": 0},
    "bound-0": {"bound": 0}, "bound-negative": {"bound": -5}, "key-negative": {"key": -1}, "key-2^64": {"key": 2 ** 64},
    "key-virtual": {"key": proto.ROWS_HEADER_KEY}, "key-string": {"key": "11"}, "seed-float": {"seed": 0.5},
    "init-not-a-string": {"init": ["zero", {}]},
    "row-of-2^20-elements": {"row_shape": [1 << 20]}, "row-over-the-limit": {"row_shape": [257, 256]},
}


@pytest.mark.parametrize("case", sorted(BAD_DECLARATIONS))
def test_loose_declarations_are_refused(loaded, caplog, case):
    """Issue 11, defect 8 (and the row-size cap of defect 5): each used to be accepted, truncated or defaulted."""
    peer, w0 = loaded
    body = {"key": 11, "rows": 10, "row_shape": [2], "dtype": "float32", "init": '["zero", {}]', "seed": 1,
            "bound": 1000000}
    body.update(BAD_DECLARATIONS[case])
    reject_command(peer, caplog, w0.command(proto.LAZY_DECLARE, json.dumps(body).encode()))
    assert 11 not in peer.server.specs
    check_good(peer, w0)


def test_a_lazy_declaration_over_a_dense_key_is_refused(loaded, caplog):
    peer, w0 = loaded
    line = reject_command(peer, caplog, w0.command(proto.LAZY_DECLARE, lazy_spec_body(3, (10, 4), "float32",
                                                                                      '["zero", {}]', 1)))
    assert "dense" in line
    check_good(peer, w0)


def test_declared_keys_are_capped(monkeypatch, caplog):
    from kvstore_lazy.server import core

    monkeypatch.setattr(core, "MAX_DECLARED_KEYS", 50)
    peer = Peer(KVServer(0, 1, 1))
    w0 = Requests(WORKER0)
    for key in range(50):
        peer.ok(w0.command(proto.LAZY_DECLARE, lazy_spec_body(key, (10, 2), "float32", '["zero", {}]', 1)))
    line = reject_command(peer, caplog, w0.command(proto.LAZY_DECLARE, lazy_spec_body(
        50, (10, 2), "float32", '["zero", {}]', 1)))
    assert "limit" in line and len(peer.server.specs) == 50
    peer.ok(w0.command(proto.LAZY_DECLARE, lazy_spec_body(7, (10, 2), "float32", '["zero", {}]', 1)))  # known: fine


@pytest.mark.timeout(60)
def test_restored_update_counts_cannot_make_the_scheduler_loop(loaded, caplog):
    """LAZY_SET_COUNTS sets num_update; 10^12 updates past a FactorScheduler(step=1)'s count used to make the next
    push loop for hours. Now the command is refused and the next push is answered at once."""
    peer, w0 = loaded
    opt = mxnet.optimizer.SGD(learning_rate=0.5, lr_scheduler=mxnet.lr_scheduler.FactorScheduler(step=1, factor=0.5))
    peer.ok(w0.command(proto.CONTROLLER, pickle.dumps(opt, 0)))
    line = reject_command(peer, caplog, w0.command(proto.LAZY_SET_COUNTS, json.dumps(
        {"key": 3, "counts": [10 ** 12], "num_update": [10 ** 12]}).encode()))
    assert "FactorScheduler" in line
    peer.ok(w0.command(proto.LAZY_SET_COUNTS, json.dumps({"key": 3, "counts": [4], "num_update": [4]}).encode()))
    assert peer.server.optimizer.num_update == 4
    peer.ok(w0.push(3, f32(1, 1, 1, 1)))


def test_a_push_whose_lens_are_element_counts_is_applied(loaded, caplog):
    """What a stock worker really sent (issue 11, defect 9, captured): a row_sparse push of 2 rows of 2 floats whose
    lens a concurrent row_sparse pull's reply overwrote with element counts. The values are intact; they apply as
    the same push with byte lens would."""
    peer, w0 = loaded
    begin = proto.server_key_begin(0, 2)
    grad = f32(1, 2, 3, 4).tobytes()
    for lens in ([0, 2, 2], [0, 8, 2]):                           # elements, and a half-overwritten buffer
        peer.ok(w0.kv(RSP, [begin + 5, begin + 5 + 1, begin + 5 + 4], grad, lens, push=True))
    # the Test optimizer adds the gradient: rows 1 and 4 got it twice
    assert peer.values(w0.rsp_pull(5, [1, 4])).tolist() == [2 + 2, 3 + 4, 8 + 6, 9 + 8]
    for lens, why in [([0, 2, 2], "whole float32"), ([0, 3, 3], "bytes (8) or elements (2)")]:
        vals = grad[:6] if why == "whole float32" else grad
        assert why in reject(peer, caplog, w0.kv(RSP, [begin + 5, begin + 6, begin + 9], vals, lens, push=True), 5)


def test_the_optimizer_is_logged_once_however_many_workers_send_it(caplog):
    """Every worker of a stock job sends its set_optimizer: the server logs the optimizer once, and again only when
    another one arrives (issue 28, trap 10's 'optimizer set: sgd' twice)."""
    peer = Peer(KVServer(0, 1, 2))
    w0, w1 = Requests(WORKER0), Requests(WORKER1)
    peer.ok(w0.command(proto.CONTROLLER, optimizer_body("sgd", learning_rate=0.5)))
    peer.ok(w1.command(proto.CONTROLLER, optimizer_body("sgd", learning_rate=0.5)))
    peer.ok(w1.command(proto.CONTROLLER, optimizer_body("sgd", learning_rate=0.25)))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer set")
            and r.levelno >= logging.INFO]
    assert said == ["optimizer set: sgd", "optimizer set: sgd"]


@pytest.mark.parametrize("lazy_job, declared, rows, warned", [
    (True, False, 5000, True),      # a lazy job whose mxnet is not patched ships the whole weight
    (True, True, 5000, False),      # declared: a lazy key (its init would carry no rows anyway)
    (True, False, 100, False),      # a small undeclared key is an ordinary choice
    (False, False, 5000, False),    # not a lazy job: a stock job's full init is what it always was
])
def test_an_undeclared_full_row_sparse_init_in_a_lazy_job_is_warned_of(caplog, lazy_job, declared, rows, warned):
    server = KVServer(0, 1, 1, lazy_job=lazy_job)
    peer, w0 = Peer(server), Requests(WORKER0)
    if declared:
        declare(peer, w0, 7, 10_000, (4,))
    peer.ok(w0.rsp_push(7, list(range(rows)), np.ones(rows * 4, np.float32)))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "not declared lazy" in
             r.getMessage()]
    assert (lines == [f"key 7: an init of {rows} rows of a row_sparse key that was not declared lazy, in a job with "
                      "KVSTORE_LAZY=1: every row is stored. Is the workers' mxnet patched? (run `kvstore-lazy patch` "
                      "in their Python) Or declare the key with kvstore_lazy.worker.init_lazy"]) == warned
    assert len(row_ids(server, 7)) == rows or declared
