"""One KV data request, decoded and checked once: the boundary between a peer's bytes and the server's semantics.

Owns: turning a ps-lite data message into a frozen :class:`DataRequest` (request type, dtype, this server's key,
row ids, values shaped) or one :class:`BadRequest`; the layout of replies (:func:`reply`, :func:`rows_reply`,
:func:`refusal`); the header row of the row-listing virtual key (:class:`RowsHeader`), read by the worker and
written by the server.
Does not own: what a request means (``server``), sockets (``transport``).

Like ps-lite's ``KVServer::Process`` (kv_app.h), a request is decoded once before any semantics run; handlers never
look at frames again. Layout checks follow MXNet 1.9.1's ``KVStoreDistServer`` (kvstore_dist_server.h): a default
request carries one key (``DataHandleDefault``), a compressed push two keys ``[original size, key]`` and two lens
(``DataHandleCompressed``), a row_sparse request the master key then one key per row, ``lens[0] == 0`` and every
row's len equal (``DataHandleRowSparse``). Where the stock server CHECK-fails, this raises :class:`BadRequest`.

Names: ``key`` is this server's key (the wire key minus the start of the server's key range), ``local_ids`` the
row ids as the worker sent them (row key minus master key; for a partitioned key, relative to the server's first
row). Row ids are checked against the whole 64-bit range: the stock server truncates them to int.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.errors import ProtocolError
from kvstore_lazy.protocol.fast import native
from kvstore_lazy.protocol.message import KVPairs, Message, decode_kv
from kvstore_lazy.protocol.pbmeta import DT_INT32, DT_OTHER, DT_UINT64, Meta, no_control

MAX_ROW_ID = (1 << 63) - 1   # row ids are int64 on the worker (MXNet's row_sparse indices)
_new = object.__new__
_sorted_rows, _row_lens, _row_push = native.sorted_rows, native.row_lens, native.row_push
_U64 = np.dtype("<u8")


class BadRequest(Exception):
    """A request this server refuses; `key` (or None) and `reason` go into the one log line."""

    def __init__(self, key: int | None, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class DataRequest:
    sender: int
    meta: Meta
    request_type: int                 # mx.DEFAULT, mx.ROW_SPARSE or mx.COMPRESSED
    dtype: np.dtype
    key: int                          # this server's key
    keys: np.ndarray                  # the keys as sent, echoed in replies
    local_ids: np.ndarray             # row_sparse: sorted unique int64 row ids as sent; else empty
    values: np.ndarray | None = None  # a push's values: (n,) dense, (rows, row size) row_sparse, uint8 compressed
    original_size: int = 0            # a compressed push: how many values its payload decodes to

    @property
    def push(self) -> bool:
        return bool(self.meta.push)

    @property
    def pull(self) -> bool:
        return bool(self.meta.pull)


class KeyRange:
    """The keys of server `rank` of `num_servers` (Postoffice::GetServerKeyRanges)."""

    def __init__(self, rank: int, num_servers: int) -> None:
        self.begin = mx.server_key_begin(rank, num_servers)
        self.end = mx.server_key_end(rank, num_servers)

    def decode(self, raw: int) -> int:
        if not self.begin <= raw < self.end:
            raise BadRequest(raw, f"key {raw} is outside this server's key range [{self.begin}, {self.end})")
        return raw - self.begin

    def hint(self, msg: Message) -> int | None:
        """The key a request names even when its frames or head do not decode (keys[0]; keys[1] for a compressed
        push, whose keys[0] carries the size), or None: for the log line, the poison set and the resume gate."""
        raw = bytes(msg.data[0]) if msg.data else b""
        keys = np.frombuffer(raw[:len(raw) - len(raw) % 8], "<u8")
        i = 1 if msg.meta.push and msg.meta.head == mx.command_code(mx.COMPRESSED, mx.FLOAT32) else 0
        if len(keys) <= i or not self.begin <= int(keys[i]) < self.end:
            return None
        return int(keys[i]) - self.begin


# Every valid data head, decoded once (3 request types x 7 dtypes): parse looks a head up instead of decoding it;
# a head not in it goes through mx.decode_command, which says what is wrong with it.
_COMMANDS = {mx.command_code(t, f): mx.DataCommand(t, f) for t in mx.REQUEST_NAMES for f in mx.MSHADOW_DTYPES}
_ROW_COMMANDS = {code: command for code, command in _COMMANDS.items() if command.request_type == mx.ROW_SPARSE}
_NO_ROWS = np.zeros(0, np.int64)
_NO_ROWS.flags.writeable = False   # shared by every request without rows


def parse(msg: Message, keys: KeyRange) -> DataRequest:
    """The one typed request a data message is, or BadRequest (naming the key when it can)."""
    command = _ROW_COMMANDS.get(msg.meta.head)
    data = msg.data
    if command is not None and msg.meta.push and len(data) == 3:
        # a row_sparse push as a worker sends it: every check of decode_kv, _row_sparse and _rows in one compiled
        # pass (_fast.c row_push), else those checks decide
        got = _row_push(data[0], data[2], len(data[1]), command.dtype.itemsize)
        if got is not None:
            ids, row_size, master = got
            local_ids = np.frombuffer(ids, np.int64)
            values = np.frombuffer(data[1], command.dtype).reshape(len(local_ids), row_size)
            return _request(msg, command, np.frombuffer(bytes(data[0]), _U64), keys.decode(master), local_ids,
                            values)
    try:
        kv = decode_kv(msg.data)
        command = _COMMANDS.get(msg.meta.head) or mx.decode_command(msg.meta.head)
    except ProtocolError as exc:
        raise BadRequest(keys.hint(msg), str(exc)) from None
    return _PARSERS[command.request_type](msg, command, kv, keys)


def _built(sender: int, meta: Meta, request_type: int, dtype: np.dtype, key: int, keys: np.ndarray,
           local_ids: np.ndarray = _NO_ROWS, values: np.ndarray | None = None, original_size: int = 0) -> DataRequest:
    # DataRequest(...) without the frozen dataclass's __init__ (an object.__setattr__ per field, a few microseconds
    # on every request): the same fields, set once, still frozen to everyone after
    request = _new(DataRequest)
    request.__dict__.update(sender=sender, meta=meta, request_type=request_type, dtype=dtype, key=key, keys=keys,
                            local_ids=local_ids, values=values, original_size=original_size)
    return request


def _request(msg: Message, command: mx.DataCommand, kv_keys: np.ndarray, key: int, local_ids: np.ndarray = _NO_ROWS,
             values: np.ndarray | None = None, original_size: int = 0) -> DataRequest:
    return _built(msg.sender, msg.meta, command.request_type, mx.MSHADOW_DTYPES[command.dtype_flag], key, kv_keys,
                  local_ids, values, original_size)


def _default(msg: Message, command: mx.DataCommand, kv: KVPairs, keys: KeyRange) -> DataRequest:
    if len(kv.keys) != 1:
        raise BadRequest(None, f"a default request carries exactly one key, got {len(kv.keys)}")
    key = keys.decode(int(kv.keys[0]))
    if not msg.meta.push:
        return _request(msg, command, kv.keys, key)
    if len(kv.lens) != 1 or len(kv.vals) != int(kv.lens[0]):
        raise BadRequest(key, f"push of {len(kv.vals)} value bytes with lens {kv.lens.tolist()}")
    if len(kv.vals) % command.dtype.itemsize:
        raise BadRequest(key, f"{len(kv.vals)} bytes is not a whole number of {command.dtype.name}")
    return _request(msg, command, kv.keys, key, values=np.frombuffer(kv.vals, dtype=command.dtype))


def _compressed(msg: Message, command: mx.DataCommand, kv: KVPairs, keys: KeyRange) -> DataRequest:
    if command.dtype_flag != mx.FLOAT32:
        raise BadRequest(None, "gradient compression is supported for float32 only")
    if not msg.meta.push:
        if len(kv.keys) != 1:
            raise BadRequest(None, f"a compressed pull carries one key, got {len(kv.keys)}")
        return _request(msg, command, kv.keys, keys.decode(int(kv.keys[0])))
    if len(kv.keys) != 2 or len(kv.lens) != 2 or len(kv.vals) != int(kv.lens[1]):
        raise BadRequest(None, f"a compressed push carries 2 keys and 2 lens matching the values, got "
                               f"keys {len(kv.keys)} lens {kv.lens.tolist()} vals {len(kv.vals)} bytes")
    original_size = keys.decode(int(kv.keys[0]))
    key = keys.decode(int(kv.keys[1]))
    return _request(msg, command, kv.keys, key, values=np.frombuffer(kv.vals, np.uint8),
                    original_size=original_size)


def _row_sparse(msg: Message, command: mx.DataCommand, kv: KVPairs, keys: KeyRange) -> DataRequest:
    if len(kv.keys) == 0:
        raise BadRequest(None, "row_sparse request without keys")
    raw = kv.keys
    master = int(raw[0])
    key = keys.decode(master)
    if _sorted_rows(raw):
        # what a worker sends (one compiled pass): row keys strictly increasing from the master key on, the last at
        # most MAX_ROW_ID past it, so every check below passes (none below the master, the largest row id the last,
        # sorted and unique) and no id wraps into int64
        local_ids = (raw[1:] - raw[0]).view(np.int64)
    else:
        if np.any(raw[1:] < raw[0]):
            raise BadRequest(key, "row key below its master key")
        local_ids = raw[1:] - raw[0]                  # uint64: every row id a 64-bit key can carry
        if len(local_ids) and int(local_ids.max()) > MAX_ROW_ID:
            raise BadRequest(key, f"row id {int(local_ids.max())} is beyond the int64 row ids of MXNet")
        local_ids = local_ids.astype(np.int64)
        if len(local_ids) > 1 and not np.all(local_ids[1:] > local_ids[:-1]):
            bad = int(np.argmax(local_ids[1:] <= local_ids[:-1])) + 1
            raise BadRequest(key, f"row ids are not sorted and unique (row {int(local_ids[bad])} at position {bad})")
    values = _rows(key, mx.MSHADOW_DTYPES[command.dtype_flag], kv, len(local_ids)) if msg.meta.push else None
    return _request(msg, command, kv.keys, key, local_ids, values)


_F32 = np.dtype(np.float32)


def row_pull(sender: int, meta: Meta, key: int, master: int, local_ids: np.ndarray) -> DataRequest:
    """The float32 row_sparse pull of `local_ids` (sorted unique int64, below the key's rows) of this server's `key`,
    as :func:`parse` decodes it from a worker (`master`: the master key on the wire): how the fast path asks for
    the rows of a pull it does not have (server/fastpath.py)."""
    keys = np.empty(len(local_ids) + 1, np.uint64)
    keys[0] = master
    np.add(local_ids.view(np.uint64), np.uint64(master), out=keys[1:])
    return _built(sender, meta, mx.ROW_SPARSE, _F32, key, keys, local_ids)


def dense_push(sender: int, meta: Meta, key: int, raw_key: bytes, values: np.ndarray) -> DataRequest:
    """The dense push of `values` (its dtype the wire's) to this server's `key` (`raw_key`: the keys frame as sent),
    as :func:`parse` decodes it from a worker: how the fast path hands a push to a sync round (server/fastpath.py)."""
    return _built(sender, meta, mx.DEFAULT, values.dtype, key, np.frombuffer(raw_key, _U64), values=values)


def row_push(sender: int, meta: Meta, key: int, raw_keys: bytes | memoryview, local_ids: np.ndarray,
             values: np.ndarray) -> DataRequest:
    """The float32 row_sparse push of `values` to rows `local_ids` of this server's `key` (`raw_keys`: the keys
    frame as sent), as :func:`parse` decodes it from a worker: how the fast path hands such a push to a sync round
    (server/fastpath.py)."""
    return _built(sender, meta, mx.ROW_SPARSE, _F32, key, np.frombuffer(raw_keys, _U64), local_ids, values)


def _rows(key: int, dtype: np.dtype, kv: KVPairs, num_rows: int) -> np.ndarray:
    """A row_sparse push's values as (rows, row size); (0, 0) for a push of no rows."""
    if len(kv.lens) != len(kv.keys) or (len(kv.lens) and kv.lens[0] != 0):
        raise BadRequest(key, f"row_sparse push needs one len per key and lens[0] == 0, got {kv.lens[:4]}")
    if num_rows == 0:
        return np.zeros((0, 0), dtype)
    # The values, not lens[1:], give the row size (issue 11, defect 9). A stock worker's lens are bytes per row, but
    # MXNet's KVStoreDist shares one lens buffer per key between pushes and row_sparse pulls (EncodeRowSparseKey,
    # ZPull(..., &pskv.lens) in kvstore_dist.h), and a pull's reply (lens in elements, RowSparsePullResponse) that
    # lands while a push of the key is still being sent overwrites the push's lens: [0, 10, 10] for two 40-byte
    # rows. Keys and values are intact, so each len may be the row's bytes or its elements.
    row_bytes, extra = divmod(len(kv.vals), num_rows)
    row_size = row_bytes // dtype.itemsize
    if extra or row_bytes == 0 or row_bytes % dtype.itemsize:
        raise BadRequest(key, f"{len(kv.vals)} value bytes are not {num_rows} rows of whole {dtype.name} values")
    # _row_lens: one compiled pass over what a worker sends; the numpy check only when it fails
    if not _row_lens(kv.lens, row_bytes, row_size) and np.count_nonzero((kv.lens[1:] != row_bytes)
                                                                         & (kv.lens[1:] != row_size)):
        raise BadRequest(key, f"row lens must each be a row's bytes ({row_bytes}) or elements ({row_size}), got "
                              f"lens {kv.lens[:8].tolist()} for {len(kv.keys)} keys, {len(kv.vals)} value bytes")
    return np.frombuffer(kv.vals, dtype=dtype).reshape(num_rows, row_size)


_PARSERS = {mx.DEFAULT: _default, mx.COMPRESSED: _compressed, mx.ROW_SPARSE: _row_sparse}


# ----------------------------------------------------------------------------------------------------------------
# replies

_I32 = struct.Struct("<i")     # ps-lite's lens are int32
_LEN_0 = _I32.pack(0)
_MAX_LEN = (1 << 31) - 1

_PULL_ANSWER_TYPES = (DT_UINT64, DT_OTHER, DT_INT32)


def _response_meta(meta: Meta, data_type: list[int]) -> Meta:
    """KVServer::Response's meta: head, timestamp, customer, push and pull echoed. Built from its fields (what
    Meta(...) would set: the server's most frequent object, the dataclass __init__ costs a microsecond)."""
    out = _new(Meta)
    out.__dict__ = {"head": meta.head, "body": b"", "control": no_control(), "request": False, "push": meta.push,
                    "pull": meta.pull, "simple_app": False, "app_id": 0, "timestamp": meta.timestamp,
                    "data_type": data_type, "customer_id": meta.customer_id, "data_size": 0, "priority": 0}
    return out


def reply(sender: int, meta: Meta, kv: KVPairs | None = None) -> tuple[int, Message]:
    """KVServer::Response: data only when there are keys."""
    data: list[bytes] = []
    data_type: list[int] = []
    if kv is not None:
        data, data_type = kv.frames()
    return sender, Message(_response_meta(meta, data_type), data)


def pull_answer(sender: int, meta: Meta, keys: bytes | memoryview, payload: bytes | memoryview,
                lens: bytes) -> tuple[int, Message]:
    """reply() with keys (the request's keys frame, at least one key), `payload` and `lens` (int32 bytes, one per
    key): the frames KVPairs.frames() lays out, built directly (a pull's answer is the server's most frequent
    message)."""
    return sender, Message(_response_meta(meta, list(_PULL_ANSWER_TYPES)), [keys, payload, lens])


def _values_reply(request: DataRequest, payload: bytes | memoryview, lens: bytes) -> tuple[int, Message]:
    return pull_answer(request.sender, request.meta, request.keys.tobytes(), payload, lens)


def value_reply(request: DataRequest, payload: bytes) -> tuple[int, Message]:
    """A dense pull's answer: the keys back, the values, one len in bytes."""
    if len(request.keys) != 1 or len(payload) > _MAX_LEN:
        return reply(request.sender, request.meta, KVPairs(request.keys, payload, np.array([len(payload)],
                                                                                           np.int32)))
    return _values_reply(request, payload, _I32.pack(len(payload)))


def rows_reply(request: DataRequest, payload: bytes | memoryview, row_size: int) -> tuple[int, Message]:
    """A row_sparse pull's answer: the keys back, the rows, lens in elements with 0 for the master key (as the stock
    server sends them)."""
    return _values_reply(request, payload, _LEN_0 + _I32.pack(row_size) * (len(request.keys) - 1))


def refusal(msg: Message) -> tuple[int, Message]:
    """The answer to a refused request, so the worker is not left waiting. A pull gets its keys back with no values,
    which the worker's KVWorker rejects (its buffer size check) instead of using wrong values."""
    if msg.meta.pull:
        try:
            keys = decode_kv(msg.data).keys
        except ProtocolError:
            keys = np.zeros(0, np.uint64)
        if len(keys):
            return reply(msg.sender, msg.meta, KVPairs(keys, b"", np.zeros(len(keys), np.int32)))
    return reply(msg.sender, msg.meta)


def command_reply(msg: Message, body: bytes = b"") -> tuple[int, Message]:
    """A SimpleApp command's answer: head, timestamp and customer echoed, an optional body."""
    meta = Meta(head=msg.meta.head, body=body, timestamp=msg.meta.timestamp, request=False, simple_app=True,
                app_id=0, customer_id=msg.meta.customer_id)
    return msg.sender, Message(meta)


# ----------------------------------------------------------------------------------------------------------------
# the row-listing key's header row

KIND_ABSENT, KIND_ROW_SPARSE, KIND_DENSE = 0, 1, 2


@dataclass(frozen=True)
class RowsHeader:
    """Local row 0 of ``mx.ROWS_HEADER_KEY`` (float64, ``mx.ROWS_WIDTH`` wide) after a LAZY_ROWS command: what this
    server holds of the queried key.

    Fields only ever go at the end, in the row's zero padding: a reader takes the fields it knows and ignores the
    rest, and a field a peer from before it does not send reads as 0, so a field's 0 must mean what such a peer
    meant. ``ids_local``: MXNet's worker splits a row_sparse key over the servers (EncodeRowSparseKey) and the init
    push gives each server ids relative to its part, so the server of a key that was not declared lazy never learns
    where its part starts: it lists and takes the key's rows by those local ids, and the worker, which knows the
    split, adds or subtracts the part's start (0 from an older server: its ids are taken as global, as they
    were)."""

    count: int = 0          # rows listed (row_sparse) or elements here (dense)
    num_states: int = 0     # optimizer states
    row_size: int = 0       # elements per row (row_sparse)
    kind: int = KIND_ABSENT
    update_count: int = 0   # this server's optimizer update count of the key
    num_update: int = 0     # this server's optimizer num_update
    local_rows: int = 0     # rows of this server's part of the key (row_sparse; 0 from an older server)
    ids_local: int = 0      # 1: the row ids listed (and pushed) are local to this server's part, see above

    FIELDS = ("count", "num_states", "row_size", "kind", "update_count", "num_update", "local_rows", "ids_local")

    def row(self) -> np.ndarray:
        out = np.zeros((1, mx.ROWS_WIDTH))
        out[0, :len(self.FIELDS)] = [getattr(self, name) for name in self.FIELDS]
        return out

    @classmethod
    def from_row(cls, row: np.ndarray) -> "RowsHeader":
        return cls(*(int(v) for v in np.asarray(row).reshape(-1)[:len(cls.FIELDS)]))
