"""The sans-IO ps-lite codec (kvstore_lazy.protocol) against real bytes, hand-built bytes, properties and fuzzing.

Fixtures (tests/fixtures/*.hex, each with a header saying how it was made):
- worker_compressed_session.hex, worker_dense_rsp_session.hex: every message a stock MXNet 1.9.1 dist_sync worker
  sent to a fake scheduler and a fake server (pyzmq ROUTERs on 127.0.0.1).
- scheduler_replies.hex: what the stock scheduler sent to a fake server and a fake worker (ADD_NODE and BARRIER
  replies).
- handmade.hex: byte-by-byte annotated messages for cases that are hard to capture.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore_lazy.protocol import ProtocolError
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol import pbmeta
from kvstore_lazy.protocol.message import KVPairs, Message, decode_kv, identity_of, parse_identity
from kvstore_lazy.protocol.pbmeta import (ACK, ADD_NODE, BARRIER, CMD_EMPTY, DT_INT32, DT_OTHER, DT_UINT64, EMPTY,
                                          HEARTBEAT, SCHEDULER, SERVER, TERMINATE, WORKER, Control, Meta, Node,
                                          decode_meta, encode_meta)

from wire_fixtures import load_fixture
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1

# Hypothesis: no example database on disk, no per-example deadline flakiness on a loaded CI box (hangs are still
# caught: every example of the fuzz tests has to finish for the test to finish, and the suite is timed).
settings.register_profile("protocol", database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile("protocol")


COMPRESSED = load_fixture("worker_compressed_session.hex")
DENSE_RSP = load_fixture("worker_dense_rsp_session.hex")
SCHED = load_fixture("scheduler_replies.hex")
HANDMADE = load_fixture("handmade.hex")
CAPTURED = {f"{file}:{name}": frames
            for file, fixture in (("compressed", COMPRESSED), ("dense_rsp", DENSE_RSP), ("scheduler", SCHED))
            for name, frames in fixture.items()}


def msg(frames: list[bytes]) -> Message:
    return Message.from_frames(frames)


def f32(*values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


# ---------------------------------------------------------------------------------------------------------------
# captured: what a stock worker sends


@pytest.mark.parametrize("fixture, port", [(COMPRESSED, 41457), (DENSE_RSP, 37351)])
def test_stock_worker_add_node(fixture, port):
    frames = fixture["add_node"]
    assert len(frames) == 2  # identity + meta, no data
    assert frames[0][0] == 0 and len(frames[0]) == 5  # ZMQ auto identity: the first socket has no ps<id> yet
    m = msg(frames)
    assert m.sender == EMPTY
    assert m.data == []
    meta = m.meta
    assert meta.head == EMPTY and meta.customer_id == EMPTY  # PackMeta writes kEmpty for control messages
    assert meta.app_id == EMPTY  # absent on the wire
    assert meta.timestamp == 0
    assert (meta.request, meta.push, meta.pull, meta.simple_app) == (False, False, False, False)
    assert meta.body == b"" and meta.data_type == [] and meta.priority == 0 and meta.data_size == 0
    assert meta.control.cmd == ADD_NODE == 2
    assert meta.control.nodes == [Node(role=WORKER, id=EMPTY, hostname="127.0.0.1", port=port, is_recovery=False,
                                       customer_id=0)]
    assert meta.control.barrier_group == 0 and meta.control.msg_sig == 0


@pytest.mark.parametrize("fixture", [COMPRESSED, DENSE_RSP])
@pytest.mark.parametrize("name, timestamp", [("barrier_startup", 1), ("barrier_finalize", 2)])
def test_stock_worker_barrier_request(fixture, name, timestamp):
    m = msg(fixture[name])
    assert m.sender == 9 and fixture[name][0] == b"ps9"
    assert m.data == []
    assert m.meta == Meta(head=EMPTY, request=True, app_id=0, customer_id=0, timestamp=timestamp,
                          control=Control(cmd=BARRIER, barrier_group=7))


@pytest.mark.parametrize("fixture, name, head, body, timestamp", [
    (COMPRESSED, "sync_mode", mx.SYNC_MODE, b"", 0),
    (COMPRESSED, "set_gradient_compression", mx.SET_GRADIENT_COMPRESSION, b"1,0.500000", 1),
    (COMPRESSED, "stop_server", mx.STOP_SERVER, b"", 6),
    (DENSE_RSP, "sync_mode", mx.SYNC_MODE, b"", 0),
    (DENSE_RSP, "stop_server", mx.STOP_SERVER, b"", 11),
])
def test_stock_worker_simple_app_commands(fixture, name, head, body, timestamp):
    m = msg(fixture[name])
    assert m.sender == 9 and m.data == []
    assert m.meta == Meta(head=head, body=body, request=True, simple_app=True, app_id=0, customer_id=0,
                          timestamp=timestamp)


def _kv_message(fixture, name):
    m = msg(fixture[name])
    assert m.sender == 9
    assert m.meta.request and not m.meta.simple_app and m.meta.control.cmd == CMD_EMPTY
    assert m.meta.app_id == 0 and m.meta.customer_id == 0
    assert m.meta.priority == 0  # the priorities given to push/pull in Python never reach the wire
    assert len(m.meta.data_type) == len(m.data)
    return m, decode_kv(m.data), mx.decode_command(m.meta.head)


def test_stock_compressed_session_data():
    n, words = 37, 3  # ceil(37 / 16) float32 words
    m, kv, cmd = _kv_message(COMPRESSED, "init_push")  # the init push uses the default command, even with 2-bit on
    assert (cmd.request_type, cmd.dtype_flag, m.meta.head) == (mx.DEFAULT, mx.FLOAT32, 0)
    assert (m.meta.push, m.meta.pull) == (True, False)
    assert m.meta.data_type == [DT_UINT64, DT_OTHER, DT_INT32] == [8, 11, 3]
    assert kv.keys.tolist() == [3] and kv.lens.tolist() == [n * 4] and bytes(kv.vals) == bytes(n * 4)

    for i, name in enumerate(["compressed_push_1", "compressed_push_2"]):
        m, kv, cmd = _kv_message(COMPRESSED, name)
        assert (cmd.request_type, cmd.dtype_flag, m.meta.head) == (mx.COMPRESSED, mx.FLOAT32, 3)
        assert m.meta.timestamp == 3 + i
        assert (m.meta.push, m.meta.pull) == (True, False)
        # [begin + original size (dummy, len 0), begin + key (len c*4)]; S=1 so begin = 0
        assert kv.keys.tolist() == [n, 3] and kv.lens.tolist() == [0, words * 4] and len(kv.vals) == words * 4

    m, kv, cmd = _kv_message(COMPRESSED, "compressed_pull")
    assert (cmd.request_type, m.meta.push, m.meta.pull) == (mx.COMPRESSED, False, True)
    assert m.meta.data_type == [DT_UINT64, DT_OTHER]
    assert kv.keys.tolist() == [3] and bytes(kv.vals) == b"" and len(kv.lens) == 0


def test_stock_dense_and_row_sparse_session_data():
    m, kv, cmd = _kv_message(DENSE_RSP, "dense_init_push")
    assert (cmd, m.meta.push, m.meta.pull) == (mx.DataCommand(mx.DEFAULT, mx.FLOAT32), True, False)
    assert kv.keys.tolist() == [0] and kv.lens.tolist() == [20] and bytes(kv.vals) == f32(0, 1, 2, 3, 4)
    m, kv, _ = _kv_message(DENSE_RSP, "dense_push")
    assert (m.meta.push, m.meta.pull) == (True, False) and bytes(kv.vals) == f32(1, 1, 1, 1, 1)
    m, kv, _ = _kv_message(DENSE_RSP, "dense_pushpull")
    assert (m.meta.push, m.meta.pull) == (True, True) and bytes(kv.vals) == f32(1, 1, 1, 1, 1)
    assert kv.lens.tolist() == [20]
    m, kv, _ = _kv_message(DENSE_RSP, "dense_pull")
    assert (m.meta.push, m.meta.pull) == (False, True)
    assert m.meta.data_type == [DT_UINT64, DT_OTHER] and len(m.data) == 2 and len(m.data[1]) == 0  # empty vals frame
    assert kv.keys.tolist() == [0] and len(kv.lens) == 0

    m, kv, cmd = _kv_message(DENSE_RSP, "fp16_init_push")
    assert m.meta.head == 5 and cmd == mx.DataCommand(mx.DEFAULT, 2) and cmd.dtype == np.float16
    assert np.frombuffer(kv.vals, cmd.dtype).tolist() == [1.0, 1.0, 1.0] and kv.lens.tolist() == [6]
    m, kv, cmd = _kv_message(DENSE_RSP, "fp16_pull")
    assert m.meta.head == 5 and m.meta.pull and kv.keys.tolist() == [1]

    m, kv, cmd = _kv_message(DENSE_RSP, "rsp_init_push")
    assert m.meta.head == 1 and cmd == mx.DataCommand(mx.ROW_SPARSE, mx.FLOAT32) and m.meta.push
    assert kv.keys.tolist() == [2] + [2 + row for row in range(10)]  # master key, then key + row for every row
    assert kv.lens.tolist() == [0] + [16] * 10  # lens in bytes: u * 4
    assert np.frombuffer(kv.vals, "<f4").tolist() == list(range(40))
    m, kv, _ = _kv_message(DENSE_RSP, "rsp_push")
    assert kv.keys.tolist() == [2, 4, 7] and kv.lens.tolist() == [0, 16, 16] and bytes(kv.vals) == f32(*[1] * 8)
    m, kv, _ = _kv_message(DENSE_RSP, "rsp_pull")  # row ids [5, 2, 5] arrive sorted and unique
    assert (m.meta.push, m.meta.pull, m.meta.head) == (False, True, 1)
    assert kv.keys.tolist() == [2, 4, 7] and bytes(kv.vals) == b"" and len(kv.lens) == 0
    m, kv, _ = _kv_message(DENSE_RSP, "rsp_pull_zero_rows")
    assert kv.keys.tolist() == [2] and bytes(kv.vals) == b"" and m.meta.data_type == [DT_UINT64, DT_OTHER]


def test_stock_worker_timestamps_count_per_customer():
    # the worker's van numbers its requests per destination app: server requests 0.., scheduler requests 0..
    to_server = [msg(f).meta.timestamp for name, f in DENSE_RSP.items()
                 if name not in ("add_node", "barrier_startup", "barrier_finalize")]
    assert to_server == list(range(len(to_server)))


# ---------------------------------------------------------------------------------------------------------------
# captured: what the stock scheduler sends


@pytest.mark.parametrize("name, timestamp", [("add_node_reply_to_server", 1), ("add_node_reply_to_worker", 0)])
def test_stock_scheduler_add_node_reply(name, timestamp):
    m = msg(SCHED[name])
    assert m.sender == 1 and SCHED[name][0] == b"ps1"  # the scheduler's DEALER carries identity ps1
    assert m.data == []
    meta = m.meta
    assert meta.head == EMPTY and meta.customer_id == EMPTY and meta.app_id == EMPTY
    assert meta.timestamp == timestamp and not meta.request
    assert meta.control.cmd == ADD_NODE
    assert meta.control.nodes == [
        Node(role=SERVER, id=8, hostname="127.0.0.1", port=35543, customer_id=0),
        Node(role=WORKER, id=9, hostname="127.0.0.1", port=42109, customer_id=0),
        # the scheduler's own entry: ROOT_URI:ROOT_PORT, and an uninitialised customer_id
        Node(role=SCHEDULER, id=1, hostname="127.0.0.1", port=35755, customer_id=388),
    ]


@pytest.mark.parametrize("name, timestamp", [
    ("barrier_reply_to_server", 4), ("barrier_reply_to_worker", 3),
    ("finalize_barrier_reply_to_server", 8), ("finalize_barrier_reply_to_worker", 7),
])
def test_stock_scheduler_barrier_reply(name, timestamp):
    m = msg(SCHED[name])
    assert m.sender == 1 and m.data == []
    assert m.meta == Meta(head=EMPTY, request=False, app_id=0, customer_id=0, timestamp=timestamp,
                          control=Control(cmd=BARRIER, barrier_group=1924123264))  # garbage group, not 7


# ---------------------------------------------------------------------------------------------------------------
# captured: re-encoding gives the stock bytes


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_reencoding_captured_meta_is_byte_identical(name):
    frames = CAPTURED[name]
    meta = decode_meta(frames[1])
    assert encode_meta(meta) == frames[1]
    m = Message.from_frames(frames)
    assert [bytes(f) for f in m.to_frames()] == frames[1:]
    assert identity_of(m.sender) == frames[0] or m.sender == EMPTY


def test_stock_never_writes_data_size():
    """Field 11 (data_size) appears in no stock message; our encoder leaves it out when it is 0."""
    for frames in CAPTURED.values():
        pos, meta_bytes, numbers = 0, frames[1], []
        while pos < len(meta_bytes):
            number, _, pos = _split_field(meta_bytes, pos)
            numbers.append(number)
        assert 11 not in numbers
        assert numbers == sorted(numbers)  # protobuf writes fields in field-number order
    assert b"\x58" not in encode_meta(Meta(head=0, customer_id=0))
    assert encode_meta(Meta(head=0, customer_id=0, data_size=12)).endswith(b"\x58\x0c\x60\x00\x68\x00")


def _split_field(buf: bytes, pos: int) -> tuple[int, bytes, int]:
    """An independent minimal protobuf field splitter (no groups): (number, raw field bytes, next pos)."""
    start = pos

    def varint():
        nonlocal pos
        shift = value = 0
        while True:
            b = buf[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value

    key = varint()
    wire = key & 7
    if wire == 0:
        varint()
    elif wire == 2:
        size = varint()  # (not `pos += varint()`: that would read pos before varint() advances it)
        pos += size
    elif wire == 1:
        pos += 8
    elif wire == 5:
        pos += 4
    else:
        raise AssertionError(wire)
    return key >> 3, buf[start:pos], pos


@settings(PROFILE, max_examples=60)
@given(st.sampled_from(sorted(CAPTURED)), st.randoms(use_true_random=False))
def test_captured_meta_decodes_in_any_field_order(name, rnd):
    """Protobuf parsers accept fields in any order; shuffling a message's top-level fields changes nothing."""
    raw = CAPTURED[name][1]
    fields, pos = [], 0
    while pos < len(raw):
        _, chunk, pos = _split_field(raw, pos)
        fields.append(chunk)
    rnd.shuffle(fields)
    assert decode_meta(b"".join(fields)) == decode_meta(raw)


# ---------------------------------------------------------------------------------------------------------------
# hand-built


def test_handmade_negative_priority():
    frames = HANDMADE["negative_priority"]
    assert frames[1].endswith(bytes.fromhex("68feffffffffffffffff01"))  # 10-byte varint
    m = msg(frames)
    assert m.sender == 9
    assert m.meta == Meta(head=1, request=True, app_id=0, customer_id=0, timestamp=9, pull=True, priority=-2,
                          data_type=[DT_UINT64, DT_OTHER])
    kv = decode_kv(m.data)
    assert kv.keys.tolist() == [2, 4, 7] and bytes(kv.vals) == b"" and len(kv.lens) == 0
    assert encode_meta(m.meta) == frames[1]  # canonical: re-encodes to the same bytes


def test_handmade_barrier_reply_with_negative_group():
    frames = HANDMADE["barrier_reply_negative_group"]
    m = msg(frames)
    assert m.sender == 1
    assert m.meta == Meta(head=EMPTY, app_id=0, customer_id=0, timestamp=3,
                          control=Control(cmd=BARRIER, barrier_group=-1668298112))
    assert encode_meta(m.meta) == frames[1]


@pytest.mark.parametrize("name", ["unpacked_data_type", "mixed_data_type"])
def test_handmade_unpacked_data_type(name):
    frames = HANDMADE[name]
    m = msg(frames)
    assert m.meta.data_type == [DT_UINT64, DT_OTHER, DT_INT32]
    assert (m.meta.head, m.meta.push, m.meta.request, m.meta.timestamp) == (0, True, True, 2)
    # we always write data_type packed, so the bytes differ; the values survive a round trip
    encoded = encode_meta(m.meta)
    assert b"\x4a\x03\x08\x0b\x03" in encoded and encoded != frames[1]
    assert decode_meta(encoded) == m.meta
    if name == "unpacked_data_type":
        kv = decode_kv(m.data)
        assert kv.keys.tolist() == [3] and bytes(kv.vals) == f32(1, 2) and kv.lens.tolist() == [8]


def test_handmade_unknown_fields_are_skipped():
    m = msg(HANDMADE["unknown_fields"])
    assert m.sender == EMPTY  # 0x00 + 4 bytes: a ZMQ auto identity
    assert m.meta == Meta(head=EMPTY, customer_id=EMPTY, timestamp=0,
                          control=Control(cmd=ADD_NODE, nodes=[Node(role=SERVER, id=EMPTY, hostname="127.0.0.1",
                                                                     port=12345, customer_id=0)]))
    # dropping the unknown fields gives exactly what ps-lite's PackMeta would have written
    assert decode_meta(encode_meta(m.meta)) == m.meta


def test_handmade_wrong_wire_type_is_skipped():
    meta = msg(HANDMADE["wrong_wire_type"]).meta
    assert (meta.head, meta.priority, meta.data_type) == (4, 0, [])
    assert (meta.request, meta.simple_app, meta.app_id, meta.timestamp, meta.customer_id) == (True, True, 0, 5, 0)


def test_handmade_int32_truncation_and_non_minimal_varints():
    meta = msg(HANDMADE["int32_truncation"]).meta
    assert (meta.head, meta.timestamp, meta.customer_id) == (5, 5, -1)


def test_handmade_repeated_control_is_merged():
    meta = msg(HANDMADE["merged_control"]).meta
    assert meta.control == Control(cmd=ADD_NODE, nodes=[Node(role=WORKER, id=9, hostname="a", port=1),
                                                         Node(role=SCHEDULER, id=1, hostname="b", port=2)])
    assert meta.timestamp == 1 and meta.head == EMPTY


def test_non_utf8_hostname_survives():
    """proto2 strings are not UTF-8 checked by ps-lite; such a hostname decodes and re-encodes unchanged."""
    node = bytes.fromhex("0801") + b"\x1a\x03ab\xff" + bytes.fromhex("2001")
    meta_bytes = bytes.fromhex("08ffffffff07") + b"\x1a" + bytes([len(node) + 4]) + bytes.fromhex("0802") + \
        b"\x12" + bytes([len(node)]) + node
    meta = decode_meta(meta_bytes)
    assert meta.control.nodes[0].hostname.encode("utf-8", "surrogateescape") == b"ab\xff"
    assert decode_meta(encode_meta(meta)) == meta


@pytest.mark.parametrize("hex_bytes, reason", [
    ("08", "truncated varint"),
    ("08ffffffffffffffffffff01", "11-byte varint"),
    ("1205616263", "length past the end"),
    ("0d010203", "truncated fixed32"),
    ("09010203040506", "truncated fixed64"),
    ("00", "field number 0"),
    ("0e", "wire type 6"),
    ("0f", "wire type 7"),
    ("0c", "end group without start"),
    ("0b0801", "unterminated group"),
    ("0b0801140c", "mismatched end group"),
    ("0b" * 101 + "0c" * 101, "groups nested too deeply"),
    ("1a00", "control without its required cmd"),
    ("1a03080212", "node tag without its length"),
    ("1a0408021200", "node without its required role"),
    ("1a0508021201ff", "garbage inside a node"),
    ("4a0180", "truncated varint inside packed data_type"),
])
def test_malformed_meta_raises_protocol_error(hex_bytes, reason):
    with pytest.raises(ProtocolError):
        decode_meta(bytes.fromhex(hex_bytes))


def test_empty_meta_is_all_defaults():
    # UnpackMeta: app_id and timestamp are kEmpty when absent, everything else the proto default
    assert decode_meta(b"") == Meta(head=0, customer_id=0, app_id=EMPTY, timestamp=EMPTY)


# ---------------------------------------------------------------------------------------------------------------
# frames and identities


@pytest.mark.parametrize("identity, sender", [
    (b"ps1", 1), (b"ps9", 9), (b"ps10", 10), (b"ps0", 0), (b"ps2147483646", 2147483646), (b"ps2147483647", EMPTY),
    # issue 11: only the canonical decimal (ps-lite's GetNodeID reads ps01 as the scheduler, ps09 as worker 0)
    (b"ps007", EMPTY), (b"ps01", EMPTY), (b"ps09", EMPTY), (b"ps00", EMPTY), (b"ps+9", EMPTY),
    (b"ps4294967297", EMPTY), (b"ps99999999999", EMPTY), (b"ps9\x00", EMPTY), (b"ps\xef\xbc\x99", EMPTY),
    (b"ps", EMPTY), (b"p", EMPTY), (b"", EMPTY), (b"ps9a", EMPTY), (b"ps-9", EMPTY), (b"ps 9", EMPTY),
    (b"PS9", EMPTY), (b"xs9", EMPTY), (b"\x00k\x8bEg", EMPTY), (b"ps\xd9\xa3", EMPTY),
])
def test_parse_identity(identity, sender):
    assert parse_identity(identity) == sender


@settings(PROFILE, max_examples=200)
@given(st.integers(0, INT32_MAX))
def test_identity_round_trip(node_id):
    assert parse_identity(identity_of(node_id)) == node_id


def test_from_frames_needs_identity_and_meta():
    for frames in ([], [b"ps9"]):
        with pytest.raises(ProtocolError):
            Message.from_frames(frames)


def test_to_frames_checks_data_type_count():
    with pytest.raises(ValueError):
        Message(Meta(head=0, customer_id=0), [b"x"]).to_frames()


def test_from_frames_accepts_buffer_frames():
    frames = DENSE_RSP["dense_push"]
    m = Message.from_frames([memoryview(f) for f in frames])
    assert m.sender == 9 and [bytes(d) for d in m.data] == frames[2:]
    assert decode_kv(m.data).keys.tolist() == [0]


# ---------------------------------------------------------------------------------------------------------------
# property: round trips

int32 = st.integers(INT32_MIN, INT32_MAX)
uint64 = st.integers(0, (1 << 64) - 1)

nodes = st.builds(Node, role=int32, id=int32, hostname=st.text(max_size=20), port=int32, is_recovery=st.booleans(),
                  customer_id=int32)


@st.composite
def controls(draw):
    """Controls PackMeta can write: cmd != EMPTY, barrier_group only for BARRIER, msg_sig only for ACK."""
    cmd = draw(st.sampled_from([TERMINATE, ADD_NODE, BARRIER, ACK, HEARTBEAT]) | int32.filter(lambda c: c != CMD_EMPTY))
    return Control(cmd=cmd, nodes=draw(st.lists(nodes, max_size=4)),
                   barrier_group=draw(int32) if cmd == BARRIER else 0,
                   msg_sig=draw(uint64) if cmd == ACK else 0)


metas = st.builds(
    Meta, head=int32, body=st.binary(max_size=64), control=st.just(Control()) | controls(),
    request=st.booleans(), push=st.booleans(), pull=st.booleans(), simple_app=st.booleans(),
    app_id=int32, timestamp=int32, data_type=st.lists(int32, max_size=5), customer_id=int32, data_size=int32,
    priority=int32)


@settings(PROFILE, max_examples=150)
@given(metas)
@example(Meta(head=INT32_MIN, priority=-1, app_id=-5, timestamp=INT32_MIN, customer_id=-1, data_type=[-1, 11],
              control=Control(cmd=BARRIER, barrier_group=-1668298112)))
@example(Meta(head=0, customer_id=0, control=Control(cmd=ACK, msg_sig=(1 << 64) - 1)))
def test_meta_round_trip(meta):
    encoded = encode_meta(meta)
    assert encoded == pbmeta._encode_meta_slow(meta)   # the fast encoder writes the reference bytes
    assert pbmeta._encode_meta_py(meta) == encoded      # so do both of its halves (the compiled one, or None)
    assert pbmeta._native_encode(meta.__dict__) in (None, encoded)
    decoded = decode_meta(encoded)
    assert decoded == meta
    assert pbmeta._decode_meta_native(encoded) in (None, meta)
    assert encode_meta(decoded) == encoded


@settings(PROFILE, max_examples=80)
@given(metas, st.lists(st.binary(max_size=40), max_size=4), st.integers(0, INT32_MAX))
def test_message_frames_round_trip(meta, data, sender):
    meta = meta.replace(data_type=[DT_OTHER] * len(data))
    frames = [identity_of(sender)] + Message(meta, data).to_frames()
    back = Message.from_frames(frames)
    assert back.sender == sender and back.meta == meta and [bytes(d) for d in back.data] == data


@settings(PROFILE, max_examples=150)
@given(st.lists(uint64, max_size=20).flatmap(
    lambda keys: st.tuples(st.just(keys), st.binary(max_size=64),
                           st.one_of(st.just([]), st.lists(int32, min_size=len(keys), max_size=len(keys))))))
def test_kv_round_trip(case):
    keys, vals, lens = case
    kv = KVPairs(np.array(keys, dtype=np.uint64), vals, np.array(lens, dtype=np.int32))
    data, types = kv.frames()
    if not keys:  # KVServer::Response sends no data frames when there are no keys
        assert (data, types) == ([], [])
    else:
        assert types == ([DT_UINT64, DT_OTHER, DT_INT32] if lens else [DT_UINT64, DT_OTHER])
        assert data[0] == struct.pack(f"<{len(keys)}Q", *keys)
    back = decode_kv(data)
    assert back.keys.tolist() == (keys if keys else [])
    assert bytes(back.vals) == (vals if keys else b"")
    assert back.lens.tolist() == (lens if keys else [])
    assert back.keys.dtype == np.dtype("<u8") and back.lens.dtype == np.dtype("<i4")


@pytest.mark.parametrize("data", [
    [b"\x00" * 8], [b"\x00" * 8] * 4, [b"\x00" * 7, b""], [b"\x00" * 8, b"", b"\x00" * 3],
    [b"\x00" * 8, b"", b"\x00" * 8], [b"\x00" * 16, b"", b"\x00" * 4], [b"", b"", b"\x00" * 4],
])
def test_decode_kv_rejects_bad_layouts(data):
    with pytest.raises(ProtocolError):
        decode_kv(data)


def test_decode_kv_accepts_zero_length_frames():
    kv = decode_kv([b"", b""])  # 2 frames with 0 keys is what KVServer::Process accepts too
    assert len(kv.keys) == 0 and len(kv.lens) == 0
    kv = decode_kv([b"\x01" + b"\x00" * 7, b"", b"\x00" * 4])
    assert kv.keys.tolist() == [1] and kv.lens.tolist() == [0] and bytes(kv.vals) == b""


# ---------------------------------------------------------------------------------------------------------------
# MXNet encodings: commands


DOC_TABLE = {  # pslite-wire.md (d): GetCommandType for d = 0..12
    mx.DEFAULT: [0, 2, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77, 90],
    mx.ROW_SPARSE: [1, 4, 8, 13, 19, 26, 34, 43, 53, 64, 76, 89, 103],
}


@pytest.mark.parametrize("request_type", [mx.DEFAULT, mx.ROW_SPARSE])
def test_command_code_matches_the_published_table(request_type):
    assert [mx.command_code(request_type, d) for d in range(13)] == DOC_TABLE[request_type]


def test_command_code_compressed_and_float32():
    assert [mx.command_code(mx.COMPRESSED, d) for d in range(3)] == [3, 7, 12]
    assert [mx.command_code(t, mx.FLOAT32) for t in (mx.DEFAULT, mx.ROW_SPARSE, mx.COMPRESSED)] == [0, 1, 3]


def _doc_decode(code: int) -> tuple[int, int]:
    """The facts sheet's float formula (MXNet's DepairDataHandleType)."""
    w = int(math.floor((math.sqrt(8 * code + 1) - 1) / 2))
    t = (w * w + w) // 2
    dtype = code - t
    return w - dtype, dtype


@pytest.mark.parametrize("request_type", [mx.DEFAULT, mx.ROW_SPARSE, mx.COMPRESSED])
@pytest.mark.parametrize("dtype_flag", range(13))
def test_decode_command_all_request_types_and_dtypes(request_type, dtype_flag):
    code = mx.command_code(request_type, dtype_flag)
    assert _doc_decode(code) == (request_type, dtype_flag)
    if dtype_flag in mx.MSHADOW_DTYPES:  # f32 f64 f16 u8 i32 i8 i64
        cmd = mx.decode_command(code)
        assert (cmd.request_type, cmd.dtype_flag) == (request_type, dtype_flag)
        assert cmd.dtype == mx.MSHADOW_DTYPES[dtype_flag]
    else:  # bool, i16, u16, u32, u64, bf16: not handled by this server
        with pytest.raises(ProtocolError):
            mx.decode_command(code)


@settings(PROFILE, max_examples=300)
@given(int32)
@example(-1)
@example(6)  # request type 3
@example(INT32_MAX)
def test_decode_command_any_head(code):
    try:
        cmd = mx.decode_command(code)
    except ProtocolError:
        assert code < 0 or _doc_decode(code)[0] not in mx.REQUEST_NAMES or \
            _doc_decode(code)[1] not in mx.MSHADOW_DTYPES
    else:
        assert mx.command_code(cmd.request_type, cmd.dtype_flag) == code


def test_mshadow_dtype_table():
    assert mx.MSHADOW_DTYPES == {0: np.float32, 1: np.float64, 2: np.float16, 3: np.uint8, 4: np.int32, 5: np.int8,
                                 6: np.int64}
    assert all(dt.byteorder in "<=|" for dt in mx.MSHADOW_DTYPES.values())


# ---------------------------------------------------------------------------------------------------------------
# MXNet encodings: rounding, partitions, key ranges, home server

_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.round.restype = ctypes.c_double
_LIBM.round.argtypes = [ctypes.c_double]
_LIBM.llround.restype = ctypes.c_longlong
_LIBM.llround.argtypes = [ctypes.c_double]


def c_round_ref(x: float) -> int:
    return int(_LIBM.round(x))


@pytest.mark.parametrize("x, expected", [
    (0.5, 1), (1.5, 2), (2.5, 3), (-0.5, -1), (-2.5, -3), (0.0, 0), (-0.0, 0), (0.49999999999999994, 0),
    (-0.49999999999999994, 0), (1500.5, 1501), (4503599627370497.0, 4503599627370497), (2.0 ** 60, 2 ** 60),
    (94.0, 94),
])
def test_c_round_examples(x, expected):
    assert mx.c_round(x) == expected == c_round_ref(x)


@settings(PROFILE, max_examples=300)
@given(st.floats(min_value=-2.0 ** 62, max_value=2.0 ** 62, allow_nan=False)
       | st.integers(-10 ** 6, 10 ** 6).map(lambda i: i / 2))
def test_c_round_matches_libm(x):
    assert mx.c_round(x) == c_round_ref(x) == _LIBM.llround(x)


def _c_partition(n: int, s: int, i: int) -> int:
    """part_i exactly as EncodeDefaultKey / EncodeRowSparseKey compute it, with libm's round in double."""
    return c_round_ref(float(n) / s * (i + 1)) - c_round_ref(float(n) / s * i)


@pytest.mark.parametrize("n, s, parts", [
    (5, 2, [3, 2]),            # C round: 2.5 -> 3 (Python's round would say 2)
    (3001, 2, [1501, 1500]),
    (10, 3, [3, 4, 3]),
    (7, 4, [2, 2, 1, 2]),     # 1.75, 3.5, 5.25 -> 2, 4, 5
    (1_000_000, 2, [500_000, 500_000]),
    (1, 2, [1, 0]),
    (0, 3, [0, 0, 0]),
])
def test_partition_examples(n, s, parts):
    for fn in (mx.dense_partition, mx.row_partition):
        got = [fn(n, s, i) for i in range(s)]
        assert [size for _, size in got] == parts
        assert [off for off, _ in got] == [sum(parts[:i]) for i in range(s)]


def test_compressed_partition_example_from_the_doc():
    # 3001 elements, 2 servers: c = ceil(3001/16) = 188 words; part_compr_0 = round(94) - round(0) = 94 -> 1504
    # original elements on server 0, the remaining 1497 on the last server.
    c = -(-3001 // 16)
    part0 = (mx.c_round(c / 2 * 1) - mx.c_round(c / 2 * 0)) * 16
    assert (part0, 3001 - part0) == (1504, 1497)


@settings(PROFILE, max_examples=150)
@given(st.integers(0, 1 << 50) | st.integers(0, 10_000), st.integers(1, 16))
def test_partitions_cover_the_array(n, s):
    for fn in (mx.dense_partition, mx.row_partition):
        parts = [fn(n, s, i) for i in range(s)]
        assert sum(size for _, size in parts) == n
        offset = 0
        for i, (off, size) in enumerate(parts):
            assert off == offset and size >= 0
            assert size == _c_partition(n, s, i)
            offset += size


@settings(PROFILE, max_examples=150)
@given(st.integers(1 << 53, 1 << 62), st.integers(1, 16))
@example((1 << 60) + 1, 3)
def test_partitions_use_double_arithmetic_like_cpp(n, s):
    """Beyond 2**53 elements the C++ (double)n/S*i differs from Python's exact int/int; we follow the C++."""
    for fn in (mx.dense_partition, mx.row_partition):
        assert [fn(n, s, i)[1] for i in range(s)] == [_c_partition(n, s, i) for i in range(s)]


def test_server_key_ranges_from_the_doc():
    assert (mx.server_key_begin(0, 1), mx.server_key_end(0, 1)) == (0, 2 ** 64 - 1)
    assert [mx.server_key_begin(i, 2) for i in range(2)] == [0, 9223372036854775807]
    assert [mx.server_key_end(i, 2) for i in range(2)] == [9223372036854775807, 18446744073709551614]
    assert mx.KMAX_KEY == 2 ** 64 - 1


@pytest.mark.parametrize("s", [1, 2, 3, 5, 8, 64])
def test_server_key_ranges_tile(s):
    begins = [mx.server_key_begin(i, s) for i in range(s)]
    ends = [mx.server_key_end(i, s) for i in range(s)]
    assert begins[0] == 0 and begins[1:] == ends[:-1] and ends[-1] <= mx.KMAX_KEY
    assert all(e - b == mx.KMAX_KEY // s for b, e in zip(begins, ends))


def _home_ref(key: int, s: int) -> int:
    product = ctypes.c_int32(key * 9973).value  # int arithmetic wraps (two's complement)
    r = abs(product) % s
    return -r if product < 0 else r  # C++ % truncates toward zero


@pytest.mark.parametrize("key, s, server", [
    (0, 1, 0), (5, 1, 0), (0, 2, 0), (1, 2, 1), (2, 2, 0), (3, 2, 1), (1, 3, 1), (2, 3, 2), (3, 3, 0),
    (215329, 2, 1),    # the last key whose key*9973 fits in an int (2147476117)
    (215330, 2, 0),    # 2147486090 wraps to -2147481206
    (215330, 3, -2),   # ... and a negative product gives a negative index in C++
])
def test_dense_home_server(key, s, server):
    assert mx.dense_home_server(key, s) == server == _home_ref(key, s)


@settings(PROFILE, max_examples=200)
@given(st.integers(0, INT32_MAX), st.integers(1, 64))
def test_dense_home_server_matches_c_int_arithmetic(key, s):
    assert mx.dense_home_server(key, s) == _home_ref(key, s)
    if key <= 215329:
        assert mx.dense_home_server(key, s) == key * 9973 % s


def test_is_partitioned():
    assert not mx.is_partitioned(999_999, 1_000_000)
    assert mx.is_partitioned(1_000_000, 1_000_000)


# ---------------------------------------------------------------------------------------------------------------
# fuzz: arbitrary bytes raise ProtocolError and nothing else (h11's rule)

_SEEDS = [f[1] for f in CAPTURED.values()] + [f[1] for f in HANDMADE.values()]


@st.composite
def mutated_meta(draw):
    """A captured or hand-made meta with a few bytes flipped, inserted, deleted or truncated."""
    buf = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, len(buf)))
        if op == "flip" and pos < len(buf):
            buf[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=11))
        elif op == "delete":
            del buf[pos:pos + draw(st.integers(1, 4))]
        else:
            del buf[pos:]
    return bytes(buf)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


@st.composite
def field_soup(draw):
    """Syntactically plausible fields (any number, any wire type), nested inside length-delimited ones."""
    def fields(depth):
        out = b""
        for _ in range(draw(st.integers(0, 6))):
            number = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 9, 10, 11, 13, 15, 30]))
            wire = draw(st.integers(0, 7))
            out += _varint(number << 3 | wire)
            if wire == 0:
                out += draw(st.sampled_from([b"\x00", b"\x7f", b"\xff\xff\xff\xff\x07", b"\x80" * 9 + b"\x01",
                                             b"\x80" * 10, b"\x80"]))
            elif wire == 2:
                inner = fields(depth + 1) if depth < 2 and draw(st.booleans()) else draw(st.binary(max_size=6))
                out += _varint(max(len(inner) + draw(st.integers(-1, 1)), 0)) + inner
            elif wire == 1:
                out += draw(st.binary(min_size=6, max_size=9))
            elif wire == 5:
                out += draw(st.binary(min_size=2, max_size=5))
        return out
    return fields(0)


def _decode_only_protocol_errors(fn, *args):
    try:
        fn(*args)
    except ProtocolError:
        pass


@settings(PROFILE, max_examples=500)
@given(st.binary(max_size=128) | mutated_meta() | field_soup())
def test_fuzz_decode_meta(data):
    try:
        meta = decode_meta(data)
    except ProtocolError:
        with pytest.raises(ProtocolError):   # the reference decoder refuses it too
            pbmeta._decode_meta_slow(data)
        return
    # the fast paths agree with the reference codec: same Meta decoded, same bytes encoded
    assert pbmeta._decode_meta_slow(data) == meta
    try:
        fast = pbmeta._decode_meta_fast(data)
    except (ProtocolError, IndexError):
        fast = None
    assert fast is None or fast == meta
    native = pbmeta._decode_meta_native(data)   # the compiled decoder: the reference's Meta, or None
    assert native is None or native == meta
    assert pbmeta._decode_meta_native(memoryview(data)) == native   # any buffer, as a received frame
    assert encode_meta(meta) == pbmeta._encode_meta_slow(meta)
    assert pbmeta._native_encode(meta.__dict__) in (None, pbmeta._encode_meta_slow(meta))
    # whatever decodes can be encoded again, and that encoding decodes
    decode_meta(encode_meta(meta))


@settings(PROFILE, max_examples=200)
@given(st.lists(st.binary(max_size=40) | mutated_meta(), max_size=5))
def test_fuzz_message_from_frames(frames):
    _decode_only_protocol_errors(Message.from_frames, frames)


@settings(PROFILE, max_examples=200)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_fuzz_decode_kv(frames):
    try:
        kv = decode_kv(frames)
    except ProtocolError:
        return
    assert len(kv.lens) in (0, len(kv.keys))


@settings(PROFILE, max_examples=200)
@given(st.integers())
def test_fuzz_decode_command(code):
    _decode_only_protocol_errors(mx.decode_command, code)
