"""What a stock MXNet 1.9.1 worker puts on the wire, as ready frames, for the saturation load generator.

Owns: the requests of ps-lite's ``KVWorker<char>`` as MXNet's ``KVStoreDist`` issues them (row_sparse init, pull and
push of B rows; dense init, push and pull; the SimpleApp commands kSyncMode, kController, kStopServer and
kvstore_lazy's LAZY_DECLARE), built with kvstore_lazy.protocol's codec; the ADD_NODE and BARRIER control messages of
a worker; the cheap check of a reply (its timestamp, and for a pull the byte count of its values).
Does not own: sockets, identities, time (``loadgen``), or which rows a step touches (``common.ZipfRows``).

Why built and not replayed from a capture: a captured stream fixes the row ids and the timestamps, and a load
generator needs both to vary (B unique Zipf rows per step, one timestamp counter per simulated worker). The bytes are
the stock worker's nonetheless: tests/test_loadgen.py builds the messages of tests/fixtures/worker_dense_rsp_session
.hex (captured from a stock worker) with these functions and compares them byte for byte. What a stock worker does
and these requests match (pslite-wire.md (c), (e)):
- a request carries ``app_id=0, customer_id=0, request=1``, ``head`` = the Cantor-paired command (row_sparse
  float32: 1, default: 0), ``timestamp`` from the worker's one customer counter (commands share it), priority 0
  (the Python API's priority does not reach the wire);
- row_sparse keys are ``[begin+key (master)] + [begin+key+row ...]`` (sorted unique rows); a push carries lens
  ``[0] + [D*4]*B`` (bytes), a pull keys and an empty vals frame, no lens;
- a dense push carries keys ``[begin+key]``, the values and lens ``[nbytes]``; a pull keys and an empty vals.
The meta of one request kind differs only in its timestamp, so :class:`Request` keeps the encoded meta split
around the timestamp and a send costs one varint, not an encode.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass

import numpy as np

from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.message import KVPairs
from kvstore_lazy.protocol.pbmeta import ADD_NODE, BARRIER, WORKER, Control, Meta, Node, encode_meta

F32 = 0                                            # mshadow's float32 flag
RSP_HEAD = proto.command_code(proto.ROW_SPARSE, F32)
DENSE_HEAD = proto.command_code(proto.DEFAULT, F32)
ALL_GROUP, WORKER_GROUP = 7, 4                     # ps-lite barrier groups (scheduler+servers+workers, workers)
_TS_PROBE = 0x3FFF_FFFF                            # a timestamp whose varint cannot occur elsewhere in a meta


def _varint(value: int) -> bytes:
    """protobuf's base-128 varint of a non-negative int (a timestamp)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@dataclass
class Request:
    """One request kind of one simulated worker: its data frames (shared by every send) and its meta, encoded once
    with a placeholder timestamp and split around it (``frames(ts)`` puts the real varint in)."""
    head: bytes
    tail: bytes
    data: list[bytes]
    kind: str                  # "pull" | "push" | "command"
    rows: int = 0              # rows a row_sparse pull or push moves
    reply_vals: int = -1       # bytes of values the reply must carry (-1: not checked)

    @classmethod
    def of(cls, meta: Meta, data: list[bytes], kind: str, rows: int = 0, reply_vals: int = -1) -> "Request":
        meta.request, meta.app_id, meta.customer_id, meta.timestamp = True, 0, 0, _TS_PROBE
        encoded = encode_meta(meta)
        probe = b"\x40" + _varint(_TS_PROBE)       # field 8 (timestamp), varint
        at = encoded.index(probe)
        return cls(encoded[:at + 1], encoded[at + len(probe):], data, kind, rows, reply_vals)

    def frames(self, timestamp: int) -> list[bytes]:
        return [self.head + _varint(timestamp) + self.tail] + self.data


def _kv(head: int, pairs: KVPairs, push: bool, kind: str, rows: int = 0, reply_vals: int = -1) -> Request:
    data, types = pairs.frames()
    meta = Meta(head=head, push=push, pull=not push, data_type=types)
    return Request.of(meta, data, kind, rows, reply_vals)


def row_keys(begin: int, key: int, row_ids: np.ndarray) -> np.ndarray:
    """The keys of a row_sparse request (unpartitioned key): the master key, then begin+key+row for each row."""
    rows = np.asarray(row_ids, np.uint64)
    return np.concatenate([np.asarray([begin + key], np.uint64), np.uint64(begin + key) + rows])


def rsp_pull(begin: int, key: int, row_ids: np.ndarray, dim: int) -> Request:
    """kv.row_sparse_pull of `row_ids` (sorted, unique): the reply carries len(row_ids) rows of `dim` float32."""
    pairs = KVPairs(row_keys(begin, key, row_ids), b"", np.zeros(0, np.int32))
    return _kv(RSP_HEAD, pairs, False, "pull", len(row_ids), len(row_ids) * dim * 4)


def rsp_push(begin: int, key: int, row_ids: np.ndarray, grads: bytes, dim: int) -> Request:
    """kv.push of a row_sparse gradient: `grads` holds len(row_ids) rows of `dim` float32, in row order."""
    if len(grads) != len(row_ids) * dim * 4:
        raise ValueError(f"{len(grads)} bytes of gradient for {len(row_ids)} rows of {dim} float32")
    lens = np.concatenate([[0], np.full(len(row_ids), dim * 4)]).astype(np.int32)
    return _kv(RSP_HEAD, KVPairs(row_keys(begin, key, row_ids), grads, lens), True, "push", len(row_ids))


def rsp_init(begin: int, key: int, values: np.ndarray | None, dim: int) -> Request:
    """kv.init of a row_sparse key by rank 0: every row of `values` (T, dim) float32, as a stock user does, or
    None for kvstore_lazy.worker.init_lazy's init with no rows (the master key alone, lens [0])."""
    if values is None:
        pairs = KVPairs(np.asarray([begin + key], np.uint64), b"", np.zeros(1, np.int32))
        return _kv(RSP_HEAD, pairs, True, "push")
    values = np.ascontiguousarray(values, np.float32)
    return rsp_push(begin, key, np.arange(len(values), dtype=np.uint64), values.tobytes(), dim)


def dense_push(begin: int, key: int, values: bytes) -> Request:
    """kv.push (or kv.init by rank 0) of a dense key that lives on one server: keys [begin+key], lens [nbytes]."""
    pairs = KVPairs(np.asarray([begin + key], np.uint64), values, np.asarray([len(values)], np.int32))
    return _kv(DENSE_HEAD, pairs, True, "push")


def dense_pull(begin: int, key: int, nbytes: int) -> Request:
    pairs = KVPairs(np.asarray([begin + key], np.uint64), b"", np.zeros(0, np.int32))
    return _kv(DENSE_HEAD, pairs, False, "pull", 0, nbytes)


def command(head: int, body: bytes = b"") -> Request:
    """A SimpleApp command to a server (kv._send_command_to_servers): head, body, simple_app=1, no data."""
    return Request.of(Meta(head=head, body=body, simple_app=True), [], "command")


def optimizer_body(momentum: float = 0.9, learning_rate: float = 0.05, wd: float = 1e-5) -> bytes:
    """kController's body as kv.set_optimizer sends it: the protocol-0 pickle of mx.optimizer.SGD. Imports mxnet
    (call it in a process whose DMLC_ROLE is worker or unset: with server or scheduler the import starts a node)."""
    import mxnet as mx
    return pickle.dumps(mx.optimizer.SGD(learning_rate=learning_rate, momentum=momentum, wd=wd), 0)


def lazy_declare_body(key: int, rows: int, dim: int, seed: int = 1, bound: int = 1_000_000) -> bytes:
    """LAZY_DECLARE's body as kvstore_lazy.worker.lazy_spec_body writes it for Uniform(0.07), float32."""
    return json.dumps({"key": key, "rows": rows, "row_shape": [dim], "dtype": "float32",
                       "init": '["uniform", {"scale": 0.07}]', "seed": seed, "bound": bound}).encode()


def add_node(hostname: str, port: int, timestamp: int) -> list[bytes]:
    """A worker's registration (to the scheduler, on a socket without identity)."""
    node = Node(role=WORKER, hostname=hostname, port=port)
    return [encode_meta(Meta(control=Control(cmd=ADD_NODE, nodes=[node]), timestamp=timestamp))]


def barrier(group: int, timestamp: int) -> list[bytes]:
    return [encode_meta(Meta(request=True, app_id=0, customer_id=0, timestamp=timestamp,
                             control=Control(cmd=BARRIER, barrier_group=group)))]


def reply_error(request: Request, data_sizes: list[int]) -> str | None:
    """Why a reply to `request` (the byte sizes of its data frames) is wrong, or None. A pull's reply must carry
    keys, vals and lens (pslite-wire.md (c)) with exactly the requested rows' bytes; a push's and a command's carry
    no data."""
    if request.kind == "pull":
        if len(data_sizes) != 3:
            return f"a pull's reply has {len(data_sizes)} data frames, not 3"
        if request.reply_vals >= 0 and data_sizes[1] != request.reply_vals:
            return f"a pull's reply carries {data_sizes[1]} bytes of values, not {request.reply_vals}"
        if data_sizes[0] != len(request.data[0]):
            return f"a pull's reply carries {data_sizes[0] // 8} keys, not {len(request.data[0]) // 8}"
        return None
    if data_sizes:
        return f"a {request.kind}'s reply carries {len(data_sizes)} data frames"
    return None
