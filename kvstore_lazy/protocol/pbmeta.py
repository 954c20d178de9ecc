"""Encode and decode ps-lite's ``PBMeta`` protobuf (meta.proto, proto2) by hand, without protobuf.

Owns: the wire representation of :class:`Meta`, :class:`Control` and :class:`Node`.
Does not own: framing (see ``message``) or what any field means to MXNet (see ``mxnet``).

Wire-compatibility notes (ps-lite @34fd45c, ``Van::PackMeta``/``UnpackMeta``):
- int32 fields may be negative and then arrive as 10-byte varints (the scheduler's BARRIER reply carries an
  uninitialised ``barrier_group``; its own PBNode an uninitialised ``customer_id``). We decode them as signed 32-bit:
  the low 32 bits of the varint, as protobuf does.
- ``app_id``, ``timestamp`` and ``node.id`` are "kEmpty" (INT_MAX) when absent; every other field takes its proto
  default.
- ``data_type`` (field 9) is written packed and accepted packed or unpacked.
- ``data_size`` (field 11) is never written by this ps-lite: stock workers and the stock scheduler send no field 11
  (captured in tests/fixtures/*.hex) and UnpackMeta ignores it. We write it only when it is non-zero, so that
  re-encoding a decoded stock message gives back the stock bytes.
- Where a peer's bytes could differ from what ps-lite writes, decoding follows protobuf's parser: unknown fields (any
  wire type, groups included) and known fields arriving with another wire type are skipped; repeated occurrences of
  ``control`` are merged; the last occurrence of a scalar wins; strings are not checked for UTF-8 (proto2).
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

_VARINT, _I64, _LEN, _START_GROUP, _END_GROUP, _I32 = 0, 1, 2, 3, 4, 5
_MAX_GROUP_DEPTH = 100  # protobuf's default recursion limit


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


def _read_tag(buf: bytes, pos: int) -> tuple[int, int, int]:
    key, pos = _read_varint(buf, pos)
    number, wire = key >> 3, key & 7
    if number == 0:
        raise ProtocolError("field number 0")
    return number, wire, pos


def _read_value(buf: bytes, pos: int, wire: int) -> tuple[object, int]:
    """The value of a non-group field whose tag ended at `pos`: an int (varint, fixed) or a bytes slice."""
    if wire == _VARINT:
        return _read_varint(buf, pos)
    if wire == _LEN:
        size, pos = _read_varint(buf, pos)
        if pos + size > len(buf):
            raise ProtocolError("length-delimited field runs past the end")
        return buf[pos:pos + size], pos + size
    if wire == _I64:
        if pos + 8 > len(buf):
            raise ProtocolError("truncated fixed64")
        return int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
    if wire == _I32:
        if pos + 4 > len(buf):
            raise ProtocolError("truncated fixed32")
        return int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
    raise ProtocolError(f"unsupported wire type {wire}")


def _skip_group(buf: bytes, pos: int, number: int) -> int:
    """Skip a group (a deprecated encoding ps-lite never uses) after its start tag, as protobuf skips an unknown one.

    Iterative, with protobuf's nesting limit, so hostile input cannot exhaust the stack."""
    open_groups = [number]
    while open_groups:
        inner, wire, pos = _read_tag(buf, pos)
        if wire == _START_GROUP:
            if len(open_groups) >= _MAX_GROUP_DEPTH:
                raise ProtocolError("groups nested too deeply")
            open_groups.append(inner)
        elif wire == _END_GROUP:
            if open_groups.pop() != inner:
                raise ProtocolError(f"end-group tag of field {inner} does not match its start")
        else:
            _, pos = _read_value(buf, pos, wire)
    return pos


def _fields(buf: bytes):
    """Yield (field number, wire type, value) for each field; value is an int or a bytes slice. Groups are skipped."""
    pos = 0
    while pos < len(buf):
        number, wire, pos = _read_tag(buf, pos)
        if wire == _START_GROUP:
            pos = _skip_group(buf, pos, number)
            continue
        if wire == _END_GROUP:
            raise ProtocolError(f"end-group tag of field {number} without its start")
        value, pos = _read_value(buf, pos, wire)
        yield number, wire, value


# field number -> wire type of each known field (meta.proto). Anything else is an unknown field, which protobuf skips.
_NODE_FIELDS = {1: _VARINT, 2: _VARINT, 3: _LEN, 4: _VARINT, 5: _VARINT, 10: _VARINT}
_CONTROL_FIELDS = {1: _VARINT, 2: _LEN, 3: _VARINT, 4: _VARINT}
_META_FIELDS = {1: _VARINT, 2: _LEN, 3: _LEN, 4: _VARINT, 5: _VARINT, 6: _VARINT, 7: _VARINT, 8: _VARINT,
                10: _VARINT, 11: _VARINT, 12: _VARINT, 13: _VARINT}


def _known_fields(buf: bytes, schema: dict[int, int]):
    for number, wire, value in _fields(buf):
        if schema.get(number) == wire:
            yield number, value


# ---------------------------------------------------------------------------------------------------------------
# messages


def encode_node(node: Node) -> bytes:
    # Van::PackMeta sets every PBNode field.
    return b"".join([
        _field_int(1, node.role),
        _field_int(2, node.id),
        _field_bytes(3, node.hostname.encode("utf-8", "surrogateescape")),
        _field_int(4, node.port),
        _field_int(5, int(node.is_recovery)),
        _field_int(10, node.customer_id),
    ])


def decode_node(buf: bytes) -> Node:
    node, has_role = Node(role=0), False
    for number, value in _known_fields(buf, _NODE_FIELDS):
        if number == 1:
            node.role, has_role = _int32(value), True
        elif number == 2:
            node.id = _int32(value)
        elif number == 3:
            # proto2 does not check strings for UTF-8: keep any bytes (surrogateescape re-encodes them unchanged)
            node.hostname = bytes(value).decode("utf-8", "surrogateescape")
        elif number == 4:
            node.port = _int32(value)
        elif number == 5:
            node.is_recovery = bool(value)
        elif number == 10:
            node.customer_id = _int32(value)
    if not has_role:
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
    control, has_cmd = Control(), False
    for number, value in _known_fields(buf, _CONTROL_FIELDS):
        if number == 1:
            control.cmd, has_cmd = _int32(value), True
        elif number == 2:
            control.nodes.append(decode_node(value))
        elif number == 3:
            control.barrier_group = _int32(value)
        elif number == 4:
            control.msg_sig = value
    if not has_cmd:
        raise ProtocolError("PBControl without its required cmd")
    return control


def encode_meta(meta: Meta) -> bytes:
    """Serialize like Van::PackMeta: the same fields set, in field-number order (the order protobuf writes)."""
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
    parts.append(_field_int(10, meta.customer_id))
    if meta.data_size:  # never set by ps-lite @34fd45c (see the module docstring)
        parts.append(_field_int(11, meta.data_size))
    parts += [_field_int(12, meta.pull), _field_int(13, meta.priority)]
    return b"".join(parts)


def decode_meta(buf: bytes) -> Meta:
    """Parse a PBMeta; unknown fields are skipped as protobuf does, malformed bytes raise ProtocolError."""
    meta = Meta(head=0, customer_id=0)
    control_parts: list[bytes] = []
    for number, wire, value in _fields(bytes(buf)):
        if number == 9:  # repeated int32 data_type, accepted packed or not
            if wire == _LEN:
                pos, packed = 0, bytes(value)
                while pos < len(packed):
                    item, pos = _read_varint(packed, pos)
                    meta.data_type.append(_int32(item))
            elif wire == _VARINT:
                meta.data_type.append(_int32(value))
        elif _META_FIELDS.get(number) != wire:
            continue  # unknown field, or a known one with another wire type: protobuf skips it
        elif number == 1:
            meta.head = _int32(value)
        elif number == 2:
            meta.body = bytes(value)
        elif number == 3:
            control_parts.append(bytes(value))
        elif number == 4:
            meta.request = bool(value)
        elif number == 5:
            meta.push = bool(value)
        elif number == 6:
            meta.simple_app = bool(value)
        elif number == 7:
            meta.app_id = _int32(value)
        elif number == 8:
            meta.timestamp = _int32(value)
        elif number == 10:
            meta.customer_id = _int32(value)
        elif number == 11:
            meta.data_size = _int32(value)
        elif number == 12:
            meta.pull = bool(value)
        elif number == 13:
            meta.priority = _int32(value)
    if control_parts:
        # protobuf merges repeated occurrences of a message field, which is the same as parsing their concatenation
        meta.control = decode_control(b"".join(control_parts))
    return meta
