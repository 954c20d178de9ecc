"""protocol.kv.parse of row_sparse requests against a plain-Python model of MXNet's checks (DataHandleRowSparse):
any list of 64-bit row keys either parses to exactly the int64 row ids ``key - master`` or is refused naming the
first broken rule, whichever path (the fast check or the detailed one) parse takes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fakepeer import Requests
from kvstore_lazy.protocol import kv
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.kv import MAX_ROW_ID, BadRequest, KeyRange, parse, reply, rows_reply, value_reply
from kvstore_lazy.protocol.message import KVPairs, Message, identity_of

KEYS = KeyRange(0, 1)
MASTER = 5


def model(row_keys: list[int]) -> list[int] | str:
    """What the row keys mean: the row ids, or the reason they are refused (the first rule broken)."""
    if any(k < MASTER for k in row_keys):
        return "below its master key"
    ids = [k - MASTER for k in row_keys]
    if ids and max(ids) > MAX_ROW_ID:
        return "beyond the int64 row ids"
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return "not sorted and unique"
    return ids


def through_codec(msg: Message) -> Message:
    return Message.from_frames([identity_of(msg.sender)] + msg.to_frames())


row_key = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 64), st.integers(MAX_ROW_ID, MAX_ROW_ID + 16))


@settings(max_examples=400, deadline=None)
@given(st.lists(row_key, max_size=12), st.booleans())
@example([], False)
@example([5, 6, 7], False)
@example([MASTER + MAX_ROW_ID], False)
@example([MASTER + MAX_ROW_ID + 1], False)
@example([MASTER + 3, MASTER + 3], True)
@example([4, 6], False)
@example([2**64 - 1], False)
def test_row_sparse_parse_matches_the_model(row_keys, push):
    worker = Requests()
    rows = [k - MASTER for k in row_keys]   # rsp_keys adds the master back; negative ids give keys below it
    keys = [MASTER] + row_keys
    if push:
        values = np.arange(2 * len(rows), dtype=np.float32).reshape(len(rows), 2)
        msg = worker.kv(mx.command_code(mx.ROW_SPARSE, 0), keys, values.tobytes(), [0] + [8] * len(rows),
                        push=True)
    else:
        msg = worker.kv(mx.command_code(mx.ROW_SPARSE, 0), keys, b"", push=False, pull=True)
    expected = model(row_keys)
    if isinstance(expected, str):
        with pytest.raises(BadRequest, match=expected) as info:
            parse(through_codec(msg), KEYS)
        assert info.value.key == MASTER
        return
    request = parse(through_codec(msg), KEYS)
    assert request.key == MASTER and request.request_type == mx.ROW_SPARSE
    assert request.local_ids.dtype == np.int64 and request.local_ids.tolist() == expected
    assert request.keys.tolist() == keys
    if push:
        assert request.values.tolist() == (values.tolist() if rows else [])
    else:
        assert request.values is None


@pytest.mark.parametrize("head", [-1, mx.command_code(3, 0), mx.command_code(mx.DEFAULT, 7), 10**6])
def test_heads_that_are_no_data_command_are_refused(head):
    msg = Requests().kv(head, [3], b"", push=False, pull=True)
    with pytest.raises(BadRequest, match="data command"):
        parse(through_codec(msg), KEYS)


def test_every_valid_head_parses_to_its_type_and_dtype():
    for request_type in (mx.DEFAULT, mx.ROW_SPARSE):
        for flag, dtype in mx.MSHADOW_DTYPES.items():
            msg = Requests().kv(mx.command_code(request_type, flag), [3], b"", push=False, pull=True)
            request = parse(through_codec(msg), KEYS)
            assert (request.request_type, request.dtype) == (request_type, dtype)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), unique=True, max_size=20), st.integers(0, 64), st.integers(0, 2**31 - 1),
       st.booleans())
def test_pull_replies_are_the_kvpairs_layout(rows, row_size, timestamp, dense):
    """value_reply and rows_reply build their frames directly: byte for byte what reply() with KVPairs gives."""
    worker = Requests()
    worker.ts = timestamp
    if dense:
        msg = worker.pull(3)
        payload = bytes(range(row_size))
        lens = np.array([len(payload)], np.int32)
    else:
        msg = worker.rsp_pull(MASTER, sorted(rows))
        payload = bytes(4 * row_size * len(rows))
        lens = np.array([0] + [row_size] * len(rows), np.int32)
    request = parse(through_codec(msg), KEYS)
    got = value_reply(request, payload) if dense else rows_reply(request, payload, row_size)
    want = reply(request.sender, request.meta, KVPairs(request.keys, payload, lens))
    assert got[0] == want[0] == msg.sender
    assert [bytes(f) for f in got[1].to_frames()] == [bytes(f) for f in want[1].to_frames()]
    assert got[1].meta == want[1].meta



def _outcome(msg: Message):
    try:
        request = parse(through_codec(msg), KEYS)
    except BadRequest as exc:
        return ("refused", exc.key, exc.reason)
    return (request.key, request.dtype, request.request_type, request.keys.tobytes(), request.local_ids.tobytes(),
            request.local_ids.dtype, request.local_ids.flags.writeable, request.values.shape,
            request.values.dtype, request.values.tobytes())


@settings(max_examples=600, deadline=None)
@given(st.lists(row_key, max_size=6), st.lists(st.integers(-2, 40), max_size=8), st.integers(0, 80),
       st.sampled_from([0, 1, 2, 6]))
@example([6, 7], [0, 8, 8], 16, 0)
@example([6, 7], [0, 2, 2], 16, 0)
@example([6, 7], [0, 4, 4], 8, 2)
def test_a_row_sparse_push_parses_the_same_through_the_compiled_check(row_keys, lens, nvals, flag):
    """kv.parse takes a push a worker sends through _fast.c row_push; every push, well-formed or not, must give the
    same request or the same refusal as the checks of decode_kv/_row_sparse/_rows alone."""
    msg = Requests().kv(mx.command_code(mx.ROW_SPARSE, flag), [MASTER] + row_keys,
                        bytes(range(nvals)), lens, push=True)
    fast = _outcome(msg)
    saved = kv._row_push
    kv._row_push = lambda *args: None
    try:
        assert _outcome(msg) == fast
    finally:
        kv._row_push = saved


def test_the_compiled_check_takes_what_a_worker_sends():
    msg = through_codec(Requests().rsp_push(MASTER, [1, 4], np.ones((2, 3), np.float32)))
    got = kv._row_push(msg.data[0], msg.data[2], len(msg.data[1]), 4)
    assert got is not None and np.frombuffer(got[0], np.int64).tolist() == [1, 4] and got[1:] == (3, MASTER)
