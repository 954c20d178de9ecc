"""KVServer (sans-IO): what kvstore_lazy.worker.integration uses for worker checkpoints -- string-key aliases of the
virtual
keys (LAZY_ALIAS), optimizer states read and written through the flat-state keys, update counts (LAZY_SET_COUNTS).
End to end with stock workers: test_gluon_lazy.py, test_module_lazy.py."""
import json
import logging
import pickle

import mxnet
import numpy as np
import pytest

from fakepeer import F32, F64, WORKER0, Requests, check_reply, reply_kv
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.worker import lazy_spec_body

W = proto.ROWS_WIDTH
KEY, ROWS, DIM = 2, 100, 3


def call(server, msg):
    msg = Message.from_frames([identity_of(msg.sender)] + msg.to_frames())
    out = server.handle(msg)
    assert len(out) == 1 and out[0][0] == msg.sender, out
    check_reply(out[0][1], msg)
    return out[0][1]


def rows_of(reply, dtype):
    kv = reply_kv(reply)
    return np.frombuffer(kv.vals, dtype).reshape(-1, W)


def table_rows(server, key, ids):
    """(weights, [states]) of rows `ids` of `key`, read through the server's public snapshot."""
    table = server.snapshot()[1][key]
    pos = np.searchsorted(table["row_ids"], np.asarray(ids, np.uint64))
    assert table["row_ids"][pos].tolist() == list(ids), "a row does not exist"
    return table["weights"][pos], [s[pos] for s in table["states"]]


def dense_states(server, key):
    return [s.reshape(-1) for s in server.snapshot()[1][key]["states"]]


def trained_server(w):
    """1 server, Adam, lazy key KEY trained on rows 1, 5, 7 (twice) and a dense key 4 trained once."""
    server = KVServer(0, 1, 1)
    call(server, w.command(proto.CONTROLLER, pickle.dumps(mxnet.optimizer.create("adam", learning_rate=0.1), 0)))
    call(server, w.command(proto.LAZY_DECLARE, lazy_spec_body(KEY, (ROWS, DIM), "float32", '["uniform", {}]', 3)))
    call(server, w.rsp_push(KEY, [], np.zeros((0, DIM))))
    for grad in (1.0, -2.0):
        call(server, w.rsp_push(KEY, [1, 5, 7], np.full((3, DIM), grad)))
    call(server, w.push(4, np.arange(6, dtype=np.float32)))
    call(server, w.push(4, np.ones(6, np.float32)))
    return server


def test_states_read_through_aliases_equal_the_table():
    w = Requests(WORKER0)
    server = trained_server(w)
    # a string-key KVStore names the virtual keys by small ints
    call(server, w.command(proto.LAZY_ALIAS, json.dumps({"alias": 10, "key": proto.ROWS_HEADER_KEY})))
    call(server, w.command(proto.LAZY_ALIAS, json.dumps({"alias": 11, "key": proto.flat_state_key(1)})))
    assert server.bad_requests == 0
    call(server, w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    header = rows_of(call(server, w.rsp_pull(10, [0, 1], F64)), np.float64)
    # rows, states, row size, kind, count, num_update
    np.testing.assert_array_equal(header[0, :6], [3, 2, DIM, 1, 2, 2])
    np.testing.assert_array_equal(header[1, :4], [1, 5, 7, -1])
    flat = rows_of(call(server, w.rsp_pull(11, [0], F32)), np.float32)
    want = table_rows(server, KEY, [1, 5, 7])[1][1].reshape(-1)
    np.testing.assert_array_equal(flat[0, :9], want)
    assert np.all(flat[0, 9:] == 0) and np.any(want != 0)
    # a dense key: this server's part of its states, header kind 2
    call(server, w.command(proto.LAZY_ROWS, json.dumps({"key": 4})))
    header = rows_of(call(server, w.rsp_pull(10, [0], F64)), np.float64)
    np.testing.assert_array_equal(header[0, :6], [6, 2, 0, 2, 1, 2])
    flat = rows_of(call(server, w.rsp_pull(proto.flat_state_key(0), [0], F32)), np.float32)
    np.testing.assert_array_equal(flat[0, :6], dense_states(server, 4)[0])


def test_restore_writes_states_and_counts_into_a_fresh_server():
    w = Requests(WORKER0)
    source = trained_server(w)
    states = table_rows(source, KEY, [1, 5, 7])[1]

    target = KVServer(0, 1, 1)
    call(target, w.command(proto.CONTROLLER, pickle.dumps(mxnet.optimizer.create("adam", learning_rate=0.1), 0)))
    call(target, w.command(proto.LAZY_DECLARE, lazy_spec_body(KEY, (ROWS, DIM), "float32", '["uniform", {}]', 3)))
    call(target, w.rsp_push(KEY, [1, 5], np.full((2, DIM), 0.5)))   # the checkpoint's rows, as kv.init ships them
    call(target, w.push(4, np.zeros(6, np.float32)))
    call(target, w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    listing = np.concatenate([[3], np.zeros(W - 1), [1, 5, 7], -np.ones(W - 3)]).reshape(2, W)
    call(target, w.rsp_push(proto.ROWS_HEADER_KEY, [0, 1], listing, F64))
    for j, state in enumerate(states):
        flat = np.zeros(W, np.float32)
        flat[:9] = state.reshape(-1)
        call(target, w.rsp_push(proto.flat_state_key(j), [0], flat[None], F32))
    call(target, w.command(proto.LAZY_SET_COUNTS, json.dumps({"key": KEY, "counts": [2], "num_update": [2]})))
    assert target.bad_requests == 0
    # row 7 was not in the checkpoint's weights: created with its initial value
    weights, have_states = table_rows(target, KEY, [1, 5, 7])
    for want, have in zip(states, have_states):
        np.testing.assert_array_equal(have, want)
    np.testing.assert_array_equal(weights[:2], np.full((2, DIM), 0.5, np.float32))
    assert target.optimizer.update_count(KEY) == 2 and target.optimizer.num_update == 2
    # the dense key's states, one chunk
    call(target, w.command(proto.LAZY_ROWS, json.dumps({"key": 4})))
    call(target, w.rsp_push(proto.flat_state_key(1), [0], np.arange(W, dtype=np.float32)[None], F32))
    np.testing.assert_array_equal(dense_states(target, 4)[1], np.arange(6, dtype=np.float32))
    assert target.bad_requests == 0


@pytest.mark.parametrize("case", ["no query", "missing chunk", "ids out of order", "ids out of range",
                                  "too many states", "float64 states"])
def test_bad_restores_are_rejected_and_change_nothing(case, caplog):
    w = Requests(WORKER0)
    server = trained_server(w)
    before = table_rows(server, KEY, [1, 5, 7])[1]
    if case != "no query":
        call(server, w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    caplog.set_level(logging.ERROR)
    if case in ("ids out of order", "ids out of range"):
        ids = [5, 1, 7] if case == "ids out of order" else [1, 5, ROWS]
        listing = np.concatenate([[3], np.zeros(W - 1), ids, -np.ones(W - 3)]).reshape(2, W)
        call(server, w.rsp_push(proto.ROWS_HEADER_KEY, [0, 1], listing, F64))
    elif case == "missing chunk":
        call(server, w.rsp_push(proto.flat_state_key(0), [1], np.zeros((1, W)), F32))
    elif case == "too many states":
        call(server, w.rsp_push(proto.flat_state_key(2), [0], np.zeros((1, W)), F32))
    elif case == "float64 states":
        call(server, w.rsp_push(proto.flat_state_key(0), [0], np.zeros((1, W)), F64))
    else:
        call(server, w.rsp_push(proto.flat_state_key(0), [0], np.zeros((1, W)), F32))
    assert server.bad_requests == 1 and "bad request" in caplog.text
    for want, have in zip(before, table_rows(server, KEY, [1, 5, 7])[1]):
        np.testing.assert_array_equal(have, want)


def test_alias_conflicts_are_refused():
    w = Requests(WORKER0)
    server = trained_server(w)
    call(server, w.command(proto.LAZY_ALIAS, json.dumps({"alias": 10, "key": proto.ROWS_HEADER_KEY})))
    call(server, w.command(proto.LAZY_ALIAS, json.dumps({"alias": 10, "key": proto.ROWS_HEADER_KEY})))   # same: fine
    assert server.bad_requests == 0
    for body in ({"alias": 10, "key": proto.flat_state_key(0)},     # already another alias
                 {"alias": KEY, "key": proto.ROWS_HEADER_KEY},       # a key with values
                 {"alias": 12, "key": 5},                            # not a virtual key
                 {"alias": proto.ROWS_HEADER_KEY, "key": proto.ROWS_HEADER_KEY}):
        call(server, w.command(proto.LAZY_ALIAS, json.dumps(body)))
    assert server.bad_requests == 4
    assert server.snapshot()[0]["aliases"] == {"10": proto.ROWS_HEADER_KEY}
