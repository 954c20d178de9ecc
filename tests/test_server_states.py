"""KVServer (sans-IO): what kvstore_lazy.worker.integration uses for worker checkpoints -- string-key aliases of the
virtual
keys (LAZY_ALIAS), optimizer states read and written through the flat-state keys, update counts (LAZY_SET_COUNTS);
the header row (protocol.kv.RowsHeader) read both ways by older and newer peers; a row_sparse key that was not
declared lazy and is split over servers, listed and restored by each server's local ids, made global by the worker
(kvstore_lazy.worker's _id_offsets/_global_ids, pure arithmetic over the headers).
End to end with stock workers: test_gluon_lazy.py, test_module_lazy.py, test_lazy_integration.py."""
import dataclasses
import json
import logging
import pickle

import mxnet
import numpy as np
import pytest

from fakepeer import F32, F64, WORKER0, Requests, check_reply, reply_kv
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.kv import KIND_ROW_SPARSE, RowsHeader
from kvstore_lazy.protocol.message import Message, identity_of
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.worker import _global_ids, _id_offsets, lazy_spec_body, restore_states

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
    # rows, states, row size, kind, count, num_update, local rows, ids local (0: a declared key lists global ids)
    np.testing.assert_array_equal(header[0, :8], [3, 2, DIM, 1, 2, 2, ROWS, 0])
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


# ----------------------------------------------------------------------------------------------------------------
# the header row between peers of different versions; a key not declared lazy, split over servers

def test_header_fields_added_at_the_end_are_read_both_ways():
    new = RowsHeader(3, 2, 4, KIND_ROW_SPARSE, 7, 9, local_rows=5, ids_local=1)
    row = new.row()
    assert row.shape == (1, W) and not row[0, len(RowsHeader.FIELDS):].any()
    assert RowsHeader.from_row(row) == new
    # an older worker reads the six fields it knows, unchanged
    np.testing.assert_array_equal(row[0, :6], [3, 2, 4, KIND_ROW_SPARSE, 7, 9])
    # an older server's row: zero padding after six fields; its ids read as global, as they always were
    old = np.zeros((1, W))
    old[0, :6] = [3, 2, 4, KIND_ROW_SPARSE, 7, 9]
    assert RowsHeader.from_row(old) == RowsHeader(3, 2, 4, KIND_ROW_SPARSE, 7, 9, local_rows=0, ids_local=0)


TOTAL, DECLARED = 10, 6     # 10 x DIM keys split over 2 servers (MXNET_KVSTORE_BIGARRAY_BOUND=1): rows 0-4, 5-9


def split_servers(monkeypatch):
    """Servers 0 and 1 of 2, Adam: KEY kv.init'ed with every row (as MXNet's worker sends it: each server its part,
    by local id) and DECLARED declared lazy, each trained on local rows 1 and 3 of both servers."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "1")
    servers, peers = [], []
    for rank in range(2):
        w = Requests(WORKER0, rank=rank, num_servers=2)
        server = KVServer(rank, 2, 1)
        _, rows = proto.row_partition(TOTAL, 2, rank)
        call(server, w.command(proto.CONTROLLER, pickle.dumps(mxnet.optimizer.create("adam", learning_rate=0.1), 0)))
        call(server, w.rsp_push(KEY, range(rows), np.full((rows, DIM), 0.5)))
        call(server, w.command(proto.LAZY_DECLARE, lazy_spec_body(DECLARED, (TOTAL, DIM), "float32", '["zero", {}]')))
        call(server, w.rsp_push(DECLARED, [], np.zeros((0, DIM))))
        for key in (KEY, DECLARED):
            call(server, w.rsp_push(key, [1, 3], np.arange(2 * DIM).reshape(2, DIM) + rank))
        assert server.bad_requests == 0
        servers.append(server)
        peers.append(w)
    return servers, peers


def listing(server, w, key) -> tuple[RowsHeader, np.ndarray]:
    """LAZY_ROWS then the header row and the listed ids of one server, as kvstore_lazy.worker._query reads them."""
    call(server, w.command(proto.LAZY_ROWS, json.dumps({"key": key})))
    rows = rows_of(call(server, w.rsp_pull(proto.ROWS_HEADER_KEY, [0, 1], F64)), np.float64)
    header = RowsHeader.from_row(rows[0])
    return header, rows[1, :header.count].astype(np.int64)


def test_a_key_not_declared_lazy_is_listed_by_local_id_and_the_worker_makes_the_ids_global(monkeypatch):
    """Server 1's init push of KEY carried local ids 0-4 for global rows 5-9, all it ever learns of them: it lists
    them so and says so (ids_local, local_rows), and the worker adds the start of its part. A declared key's
    servers know their part (the declaration) and list global ids."""
    servers, peers = split_servers(monkeypatch)
    shape = (TOTAL, DIM)
    got = [listing(server, w, KEY) for server, w in zip(servers, peers)]
    for rank, (header, ids) in enumerate(got):
        assert (header.ids_local, header.local_rows, header.count) == (1, 5, 5)
        np.testing.assert_array_equal(ids, np.arange(5))
    headers, per_server = [h for h, _ in got], [ids for _, ids in got]
    assert _id_offsets(None, KEY, shape, headers) == [0, 5]
    np.testing.assert_array_equal(_global_ids(None, KEY, shape, headers, per_server), np.arange(TOTAL))
    # (what the worker read before: [0..4, 0..4]; and from servers older than the header's fields)
    older = [dataclasses.replace(h, local_rows=0, ids_local=0) for h in headers]
    with pytest.raises(RuntimeError, match="the servers listed overlapping or unsorted rows"):
        _global_ids(None, KEY, shape, older, per_server)
    # a shape (or MXNET_KVSTORE_BIGARRAY_BOUND) the key was not split with is named, not guessed around
    with pytest.raises(RuntimeError, match="server 0 holds 5 rows of it, but this worker splits shape"):
        _global_ids(None, KEY, (TOTAL + 2, DIM), headers, per_server)

    got = [listing(server, w, DECLARED) for server, w in zip(servers, peers)]
    for rank, (header, ids) in enumerate(got):
        assert (header.ids_local, header.local_rows) == (0, 5)
        np.testing.assert_array_equal(ids, [5 * rank + 1, 5 * rank + 3])
    assert _id_offsets(None, DECLARED, shape, [h for h, _ in got]) == [0, 0]
    np.testing.assert_array_equal(_global_ids(None, DECLARED, shape, [h for h, _ in got], [i for _, i in got]),
                                  [1, 3, 6, 8])


@pytest.mark.parametrize("servers,bound,offsets", [(3, 1, [0, 333, 667]), (2, 10 ** 9, [0, 0])],
                         ids=["3servers-split", "2servers-unsplit"])
def test_the_worker_offsets_are_mxnet_parts(monkeypatch, servers, bound, offsets):
    """Any number of servers: each server's part as EncodeRowSparseKey cuts it (llround of T/S*i); an unsplit key
    lives whole on its home server, whose local ids are global."""
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(bound))
    shape = (1000, 4)
    if bound == 1:
        parts = [proto.row_partition(1000, servers, s)[1] for s in range(servers)]
    else:
        parts = [1000 if s == proto.dense_home_server(KEY, servers) else 0 for s in range(servers)]
    headers = [RowsHeader(rows, 0, 4, KIND_ROW_SPARSE, local_rows=rows, ids_local=1) if rows else RowsHeader()
               for rows in parts]
    assert _id_offsets(None, KEY, shape, headers) == offsets
    ids = _global_ids(None, KEY, shape, headers, [np.arange(rows) for rows in parts])
    np.testing.assert_array_equal(ids, np.arange(1000))


def test_a_restore_names_the_rows_of_a_key_not_declared_lazy_by_local_id(monkeypatch):
    """What restore_states pushes to server 1 for global rows 6 and 8 of KEY: local ids 1 and 3, whose states it
    writes. The global ids (what the worker pushed before) are beyond its rows: refused, and so are the state pushes
    after it, which went into the rows of the LAZY_ROWS listing (every row, in order) before."""
    servers, peers = split_servers(monkeypatch)
    states = table_rows(servers[1], KEY, [1, 3])[1]
    target, w = KVServer(1, 2, 1), Requests(WORKER0, rank=1, num_servers=2)
    call(target, w.command(proto.CONTROLLER, pickle.dumps(mxnet.optimizer.create("adam", learning_rate=0.1), 0)))
    call(target, w.rsp_push(KEY, range(5), np.full((5, DIM), 0.5)))
    call(target, w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    for ids in ([6, 8], [1, 3]):
        pushed = np.concatenate([[2], np.zeros(W - 1), ids, -np.ones(W - 2)]).reshape(2, W)
        call(target, w.rsp_push(proto.ROWS_HEADER_KEY, [0, 1], pushed, F64))
        for j, state in enumerate(states):
            flat = np.zeros(W, np.float32)
            flat[:2 * DIM] = state.reshape(-1)
            call(target, w.rsp_push(proto.flat_state_key(j), [0], flat[None], F32))
        if ids == [6, 8]:
            assert target.bad_requests == 1 + len(states)
            assert not any(s.any() for s in table_rows(target, KEY, range(5))[1])
            call(target, w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    assert target.bad_requests == 1 + len(states)
    for want, have in zip(states, table_rows(target, KEY, [1, 3])[1]):
        np.testing.assert_array_equal(have, want)
    assert not any(s[[0, 2, 4]].any() for s in table_rows(target, KEY, range(5))[1])


def test_restore_states_refuses_row_ids_outside_the_key():
    saved = {"kind": "row_sparse", "row_ids": np.array([1, 12]), "states": [np.zeros((2, DIM))]}
    with pytest.raises(ValueError, match="saved row ids must be within the key's 10 rows"):
        restore_states(None, KEY, (10, DIM), saved)     # before it sends anything


def test_any_piece_of_a_listing_or_of_a_flat_state_is_the_same_rows_of_the_whole():
    """A checkpoint reads a large key's listing and states piece by piece; the server builds only the rows asked
    for, so every piece (contiguous or not, with or without the header) must be those rows of the whole."""
    w = Requests(WORKER0)
    server = KVServer(0, 1, 1)
    call(server, w.command(proto.CONTROLLER, pickle.dumps(mxnet.optimizer.create("adam", learning_rate=0.1), 0)))
    call(server, w.command(proto.LAZY_DECLARE, lazy_spec_body(KEY, (1000, DIM), "float32", '["uniform", {}]', 3)))
    call(server, w.rsp_push(KEY, [], np.zeros((0, DIM))))
    ids = np.arange(3, 1000, 5)                      # 200 rows: 4 listing rows (the last padded), 10 state rows
    call(server, w.rsp_push(KEY, ids, np.ones((len(ids), DIM))))
    call(server, w.command(proto.LAZY_ROWS, json.dumps({"key": KEY})))
    whole = rows_of(call(server, w.rsp_pull(proto.ROWS_HEADER_KEY, range(5), F64)), np.float64)
    np.testing.assert_array_equal(whole[1:].reshape(-1)[:len(ids)], ids)
    assert (whole[1:].reshape(-1)[len(ids):] == -1).all()
    for piece in ([0], [4], [1, 2], [0, 2, 4], [3], [2, 3, 4]):
        got = rows_of(call(server, w.rsp_pull(proto.ROWS_HEADER_KEY, piece, F64)), np.float64)
        np.testing.assert_array_equal(got, whole[piece])
    states = rows_of(call(server, w.rsp_pull(proto.flat_state_key(0), range(10), F32)), np.float32)
    for piece in ([0], [9], [2, 3, 4], [1, 5, 9], [0, 9]):
        got = rows_of(call(server, w.rsp_pull(proto.flat_state_key(0), piece, F32)), np.float32)
        np.testing.assert_array_equal(got, states[piece])
    assert server.bad_requests == 0
    call(server, w.rsp_pull(proto.ROWS_HEADER_KEY, [4, 5], F64))      # beyond the listing: refused
    assert server.bad_requests == 1
