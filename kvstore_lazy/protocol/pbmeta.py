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
from typing import Any, Iterator

from kvstore_lazy.protocol.errors import ProtocolError
from kvstore_lazy.protocol.fast import native

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

    def replace(self, **changes: Any) -> "Meta":
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


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
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


def _known_fields(buf: bytes, schema: dict[int, int]) -> Iterator[tuple[int, Any]]:
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


def _encode_meta_slow(meta: Meta) -> bytes:
    """Reference encoder. Serialize like Van::PackMeta: the same fields set, in field-number order (the order
    protobuf writes)."""
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


def _decode_meta_slow(buf: bytes) -> Meta:
    """Reference decoder. Parse a PBMeta; unknown fields are skipped as protobuf does, malformed bytes raise
    ProtocolError."""
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


# ---------------------------------------------------------------------------------------------------------------
# fast paths
#
# encode_meta/decode_meta are on the server's per-message path, so they have fast paths for the shapes ps-lite sends
# (one-byte tags, small varints, no unknown fields): first the compiled one (_fast.c), then one in Python. Anything
# else falls back to the reference implementations above, which define the behaviour: the fast paths either produce
# exactly their result or hand over to them.

_VARINTS = tuple(_varint(i) for i in range(1 << 14))  # encodings of 0 .. 16383 (one or two bytes)
_FALSE, _TRUE = b"\x00", b"\x01"

_new = object.__new__


_native_encode, _native_decode = native.encode_meta, native.decode_meta


def encode_meta(meta: Meta) -> bytes:
    """Serialize like Van::PackMeta: the same fields set, in field-number order (the order protobuf writes)."""
    encoded = _native_encode(meta.__dict__)   # None: a body, a control command or unusual values
    if encoded is not None:
        return encoded
    return _encode_meta_py(meta)


def _encode_meta_py(meta: Meta) -> bytes:
    """encode_meta's Python fast path (for what the compiled one hands back)."""
    try:
        V = _VARINTS
        head = meta.head
        parts = [b"\x08", V[head] if 0 <= head < 16384 else _varint(int(head))]
        body = meta.body
        if body:
            return _encode_meta_slow(meta)
        control = meta.control
        if control.cmd != CMD_EMPTY:
            parts.append(_field_bytes(3, encode_control(control)))
        x: Any = meta.request   # any value a caller set: not a bool goes through _field_int
        parts.append(b"\x20\x01" if x is True else b"\x20\x00" if x is False else _field_int(4, x))
        x = meta.push
        parts.append(b"\x28\x01" if x is True else b"\x28\x00" if x is False else _field_int(5, x))
        x = meta.simple_app
        parts.append(b"\x30\x01" if x is True else b"\x30\x00" if x is False else _field_int(6, x))
        x = meta.app_id
        if x != EMPTY:
            parts.append(b"\x38")
            parts.append(V[x] if 0 <= x < 16384 else _varint(int(x)))
        x = meta.timestamp
        if x != EMPTY:
            parts.append(b"\x40")
            parts.append(V[x] if 0 <= x < 16384 else _varint(int(x)))
        x = meta.data_type
        if x:
            packed = b"".join([V[t] if 0 <= t < 16384 else _varint(t) for t in x])
            parts.append(b"\x4a")
            parts.append(V[len(packed)] if len(packed) < 16384 else _varint(len(packed)))
            parts.append(packed)
        x = meta.customer_id
        parts.append(b"\x50")
        parts.append(V[x] if 0 <= x < 16384 else _varint(int(x)))
        x = meta.data_size
        if x:
            parts.append(b"\x58")
            parts.append(V[x] if 0 <= x < 16384 else _varint(int(x)))
        x = meta.pull
        parts.append(b"\x60\x01" if x is True else b"\x60\x00" if x is False else _field_int(12, x))
        x = meta.priority
        parts.append(b"\x68")
        parts.append(V[x] if 0 <= x < 16384 else _varint(int(x)))
        return b"".join(parts)
    except Exception:  # an unusual value (float, numpy bool, ...): let the reference encoder decide
        return _encode_meta_slow(meta)


_META_NAMES = {1: "head", 4: "request", 5: "push", 6: "simple_app", 7: "app_id", 8: "timestamp", 10: "customer_id",
               11: "data_size", 12: "pull", 13: "priority"}
_BOOL_FIELDS = (4, 5, 6, 12)
_SMALL_INTS = tuple(range(0x80))
_SMALL_BOOLS = (False,) + (True,) * 0x7F
# one-byte key (field number << 3 | wire type) of a scalar PBMeta varint field -> (attribute name, its decoded value
# for each one-byte varint 0..127); None for every other byte (LEN fields, data_type, wrong wire types, unknown
# fields, the first byte of a multi-byte key)
_VARINT_ENTRY = tuple(
    (_META_NAMES[key >> 3], _SMALL_BOOLS if key >> 3 in _BOOL_FIELDS else _SMALL_INTS)
    if key < 0x80 and key & 7 == _VARINT and key >> 3 in _META_NAMES else None for key in range(256))
_META_DEFAULTS = {"head": 0, "body": b"", "control": None, "request": False, "push": False, "pull": False,
                  "simple_app": False, "app_id": EMPTY, "timestamp": EMPTY, "data_type": None, "customer_id": 0,
                  "data_size": 0, "priority": 0}
assert list(_META_DEFAULTS) == [f.name for f in dataclasses.fields(Meta)]


def _packed_int32s(buf: bytes, pos: int, stop: int, out: list[int]) -> int:
    """Append the varints of buf[pos:stop] (a packed repeated int32) to `out`; the position after them, or -1 if
    the last one runs past `stop`."""
    while pos < stop:
        item = buf[pos]
        if item >= 0x80:
            item, pos = _read_varint(buf, pos)
            if pos > stop:
                return -1
            out.append(_int32(item))
        else:
            pos += 1
            out.append(item)
    return pos


def _decode_meta_fast(buf: bytes) -> Meta | None:
    """The Meta of `buf`, or None if it is not in the common shape (then _decode_meta_slow decides)."""
    entries = _VARINT_ENTRY
    values = _META_DEFAULTS.copy()
    data_type: list[int] = []
    values["data_type"] = data_type
    control_parts = None
    end = len(buf)
    pos = 0
    while pos < end:
        key = buf[pos]
        entry = entries[key]
        if entry is not None:
            value = buf[pos + 1]
            if value < 0x80:
                pos += 2
                values[entry[0]] = entry[1][value]
            elif buf[pos + 2] < 0x80:  # two-byte varint (< 16384): int32 unchanged
                value = (value & 0x7F) | buf[pos + 2] << 7
                pos += 3
                values[entry[0]] = bool(value) if entry[1] is _SMALL_BOOLS else value
            else:
                value, pos = _read_varint(buf, pos + 1)
                values[entry[0]] = bool(value) if entry[1] is _SMALL_BOOLS else _int32(value)
        elif key == 0x4A:  # packed data_type
            size = buf[pos + 1]
            if size >= 0x80 or pos + 2 + size > end:
                return None
            pos = _packed_int32s(buf, pos + 2, pos + 2 + size, data_type)
            if pos < 0:
                return None
        elif key == 0x1A or key == 0x12:  # control, body
            size = buf[pos + 1]
            if size < 0x80:
                pos += 2
            else:
                size, pos = _read_varint(buf, pos + 1)
            stop = pos + size
            if stop > end:
                return None
            if key == 0x12:
                values["body"] = buf[pos:stop]
            elif control_parts is None:
                control_parts = [buf[pos:stop]]
            else:
                control_parts.append(buf[pos:stop])
            pos = stop
        else:
            return None
    if control_parts is None:
        values["control"] = no_control()
    else:
        values["control"] = decode_control(control_parts[0] if len(control_parts) == 1 else b"".join(control_parts))
    meta = _new(Meta)
    meta.__dict__ = values
    return meta


def no_control() -> Control:
    """A fresh Control of a data message (no command), as Control() but without its __init__."""
    control = _new(Control)
    control.__dict__ = {"cmd": CMD_EMPTY, "nodes": [], "barrier_group": 0, "msg_sig": 0}
    return control


def _decode_meta_native(buf: bytes | memoryview) -> Meta | None:
    """The compiled decoder's Meta of `buf`, or None if it hands `buf` back (malformed, groups)."""
    values = _native_decode(buf)
    if values is None:
        return None
    control = values["control"]
    values["control"] = no_control() if control is None else decode_control(control)
    meta = _new(Meta)
    meta.__dict__ = values
    return meta


def decode_meta(buf: bytes | memoryview) -> Meta:
    """Parse a PBMeta; unknown fields are skipped as protobuf does, malformed bytes raise ProtocolError."""
    meta = _decode_meta_native(buf)
    if meta is not None:
        return meta
    if type(buf) is not bytes:
        buf = bytes(buf)
    try:
        meta = _decode_meta_fast(buf)
    except (ProtocolError, IndexError):  # malformed: let the reference decoder report it
        meta = None
    if meta is None:
        return _decode_meta_slow(buf)
    return meta
