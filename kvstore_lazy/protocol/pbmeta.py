"""Encode and decode ps-lite's ``PBMeta`` protobuf (meta.proto, proto2) by hand, without protobuf.

Owns: the wire representation of :class:`Meta`, :class:`Control` and :class:`Node`.
Does not own: framing (see ``message``) or what any field means to MXNet (see ``mxnet``).

Wire-compatibility notes (ps-lite @34fd45c, ``Van::PackMeta``/``UnpackMeta``):
- int32 fields may be negative and then arrive as 10-byte varints (Gluon sends ``priority=-idx``; the scheduler's
  BARRIER reply carries an uninitialised ``barrier_group``). We decode them as signed 32-bit.
- ``app_id``, ``timestamp`` and ``node.id`` are "kEmpty" (INT_MAX) when absent; every other field takes its proto
  default.
- ``data_type`` (field 9) is written packed and accepted packed or unpacked.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import ProtocolError

EMPTY = 2147483647  # ps-lite's kEmpty = INT_MAX

# PBNode.role
SERVER, WORKER, SCHEDULER = 0, 1, 2
# PBControl.cmd
CMD_EMPTY, TERMINATE, ADD_NODE, BARRIER, ACK, HEARTBEAT = 0, 1, 2, 3, 4, 5
# PBMeta.data_type values (ps::DataType)
DT_INT32, DT_UINT64, DT_OTHER = 3, 8, 11

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass
class Node:
    role: int
    id: int = EMPTY
    hostname: str = ""
    port: int = 0
    is_recovery: bool = False
    customer_id: int = 0


@dataclass
class Control:
    cmd: int = CMD_EMPTY
    nodes: list[Node] = field(default_factory=list)
    barrier_group: int = 0
    msg_sig: int = 0


@dataclass
class Meta:
    head: int = EMPTY
    body: bytes = b""
    control: Control = field(default_factory=Control)
    request: bool = False
    push: bool = False
    pull: bool = False
    simple_app: bool = False
    app_id: int = EMPTY
    timestamp: int = EMPTY
    data_type: list[int] = field(default_factory=list)
    customer_id: int = EMPTY
    data_size: int = 0
    priority: int = 0

    def replace(self, **changes) -> "Meta":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------------------
# primitives


def _varint(value: int) -> bytes:
    if value < 0:  # proto2 int32/int64: negative numbers are sign-extended to 64 bits
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtocolError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & ((1 << 64) - 1), pos
        shift += 7
        if shift >= 70:
            raise ProtocolError("varint longer than 10 bytes")


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _field_int(number: int, value: int) -> bytes:
    return _tag(number, _VARINT) + _varint(int(value))


def _field_bytes(number: int, value: bytes) -> bytes:
    return _tag(number, _LEN) + _varint(len(value)) + value


def _fields(buf: bytes):
    """Yield (field number, wire type, value) for each field; value is an int or a bytes slice."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtocolError("field number 0")
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ProtocolError("length-delimited field runs past the end")
            value, pos = buf[pos:pos + size], pos + size
        elif wire == _I64:
            if pos + 8 > len(buf):
                raise ProtocolError("truncated fixed64")
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == _I32:
            if pos + 4 > len(buf):
                raise ProtocolError("truncated fixed32")
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise ProtocolError(f"unsupported wire type {wire}")
        yield number, wire, value


def _expect_int(number: int, wire: int, value) -> int:
    if wire != _VARINT:
        raise ProtocolError(f"field {number}: expected a varint")
    return value


def _expect_bytes(number: int, wire: int, value) -> bytes:
    if wire != _LEN:
        raise ProtocolError(f"field {number}: expected a length-delimited value")
    return bytes(value)


# ---------------------------------------------------------------------------------------------------------------
# messages


def encode_node(node: Node) -> bytes:
    # Van::PackMeta sets every PBNode field.
    return b"".join([
        _field_int(1, node.role),
        _field_int(2, node.id),
        _field_bytes(3, node.hostname.encode()),
        _field_int(4, node.port),
        _field_int(5, int(node.is_recovery)),
        _field_int(10, node.customer_id),
    ])


def decode_node(buf: bytes) -> Node:
    node = Node(role=-1)
    for number, wire, value in _fields(buf):
        if number == 1:
            node.role = _int32(_expect_int(number, wire, value))
        elif number == 2:
            node.id = _int32(_expect_int(number, wire, value))
        elif number == 3:
            try:
                node.hostname = _expect_bytes(number, wire, value).decode()
            except UnicodeDecodeError as exc:
                raise ProtocolError("node hostname is not UTF-8") from exc
        elif number == 4:
            node.port = _int32(_expect_int(number, wire, value))
        elif number == 5:
            node.is_recovery = bool(_expect_int(number, wire, value))
        elif number == 10:
            node.customer_id = _int32(_expect_int(number, wire, value))
    if node.role == -1:
        raise ProtocolError("PBNode without its required role")
    return node


def encode_control(control: Control) -> bytes:
    parts = [_field_int(1, control.cmd)]
    parts += [_field_bytes(2, encode_node(n)) for n in control.nodes]
    if control.cmd == BARRIER:
        parts.append(_field_int(3, control.barrier_group))
    if control.cmd == ACK:
        parts.append(_field_int(4, control.msg_sig))
    return b"".join(parts)


def decode_control(buf: bytes) -> Control:
    control = Control(cmd=-1)
    for number, wire, value in _fields(buf):
        if number == 1:
            control.cmd = _int32(_expect_int(number, wire, value))
        elif number == 2:
            control.nodes.append(decode_node(_expect_bytes(number, wire, value)))
        elif number == 3:
            control.barrier_group = _int32(_expect_int(number, wire, value))
        elif number == 4:
            control.msg_sig = _expect_int(number, wire, value)
    if control.cmd == -1:
        raise ProtocolError("PBControl without its required cmd")
    return control


def encode_meta(meta: Meta) -> bytes:
    """Serialize like Van::PackMeta: the same fields set, in field-number order."""
    parts = [_field_int(1, meta.head)]
    if meta.body:
        parts.append(_field_bytes(2, meta.body))
    if meta.control.cmd != CMD_EMPTY:
        parts.append(_field_bytes(3, encode_control(meta.control)))
    parts += [_field_int(4, meta.request), _field_int(5, meta.push), _field_int(6, meta.simple_app)]
    if meta.app_id != EMPTY:
        parts.append(_field_int(7, meta.app_id))
    if meta.timestamp != EMPTY:
        parts.append(_field_int(8, meta.timestamp))
    if meta.data_type:
        packed = b"".join(_varint(t) for t in meta.data_type)
        parts.append(_field_bytes(9, packed))
    parts += [
        _field_int(10, meta.customer_id),
        _field_int(11, meta.data_size),
        _field_int(12, meta.pull),
        _field_int(13, meta.priority),
    ]
    return b"".join(parts)


def decode_meta(buf: bytes) -> Meta:
    """Parse a PBMeta; unknown fields are skipped as protobuf does, malformed bytes raise ProtocolError."""
    meta = Meta(head=0, customer_id=0)
    for number, wire, value in _fields(bytes(buf)):
        if number == 1:
            meta.head = _int32(_expect_int(number, wire, value))
        elif number == 2:
            meta.body = _expect_bytes(number, wire, value)
        elif number == 3:
            meta.control = decode_control(_expect_bytes(number, wire, value))
        elif number == 4:
            meta.request = bool(_expect_int(number, wire, value))
        elif number == 5:
            meta.push = bool(_expect_int(number, wire, value))
        elif number == 6:
            meta.simple_app = bool(_expect_int(number, wire, value))
        elif number == 7:
            meta.app_id = _int32(_expect_int(number, wire, value))
        elif number == 8:
            meta.timestamp = _int32(_expect_int(number, wire, value))
        elif number == 9:
            if wire == _LEN:  # packed
                pos, packed = 0, bytes(value)
                while pos < len(packed):
                    item, pos = _read_varint(packed, pos)
                    meta.data_type.append(_int32(item))
            else:
                meta.data_type.append(_int32(_expect_int(number, wire, value)))
        elif number == 10:
            meta.customer_id = _int32(_expect_int(number, wire, value))
        elif number == 11:
            meta.data_size = _int32(_expect_int(number, wire, value))
        elif number == 12:
            meta.pull = bool(_expect_int(number, wire, value))
        elif number == 13:
            meta.priority = _int32(_expect_int(number, wire, value))
    return meta
