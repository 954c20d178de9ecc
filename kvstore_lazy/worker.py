"""What runs inside a stock MXNet 1.9.1 training process: declaring lazy row_sparse keys to kvstore_lazy servers.

Owns: the LAZY_DECLARE command a worker sends before ``kv.init``, and an ``kv.init`` that ships no rows. It uses
only what a stock worker can do (``KVStore._send_command_to_servers``, ``kv.init``), so mxnet needs no rebuild.
This is the only module of the package that imports mxnet.

String keys: MXNet maps a string key to the int it sends to servers in the order each process first inits string
keys (KVStoreLocal::Init, ``next_str_key_``). To declare a string key the worker must know that int, so
:func:`track` wraps ``kv.init`` to record the order; call it (or :func:`init_lazy`) before any ``kv.init`` on that
KVStore.
"""
from __future__ import annotations

import json
import os
import weakref

import mxnet as mx
import numpy as np

from .protocol import mxnet as proto

__all__ = ["init_lazy", "declare", "track", "key_id", "lazy_spec_body", "fetch_rows", "save_rows", "stats"]

_str_keys: "weakref.WeakKeyDictionary[mx.kv.KVStore, list[str]]" = weakref.WeakKeyDictionary()


def track(kv: "mx.kv.KVStore") -> None:
    """Record the order of string-key inits on `kv` (idempotent)."""
    if kv in _str_keys:
        return
    order: list[str] = []
    _str_keys[kv] = order
    original = kv.init

    def init(key, value):
        keys = key if isinstance(key, (list, tuple)) else [key]
        for k in keys:
            if isinstance(k, str) and k not in order:
                order.append(k)
        return original(key, value)

    kv.init = init


def key_id(kv: "mx.kv.KVStore", key) -> int:
    """The int MXNet sends to servers for `key` (an int key is itself; a string key its init order)."""
    if isinstance(key, (int, np.integer)):
        return int(key)
    track(kv)
    order = _str_keys[kv]
    return order.index(key) if key in order else len(order)


def _initializer_dumps(init) -> str:
    if init is None:
        init = mx.init.Uniform(0.07)   # the default of Gluon's Embedding/SparseEmbedding
    if isinstance(init, str):
        return init if init.startswith("[") else mx.init.create(init).dumps()
    return init.dumps()


def lazy_spec_body(key: int, shape, dtype="float32", init=None, seed: int = 0) -> bytes:
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"a lazy row_sparse key needs at least 2 dimensions, got shape {shape}")
    bound = int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000"))
    return json.dumps({"key": key, "rows": shape[0], "row_shape": list(shape[1:]), "dtype": np.dtype(dtype).name,
                       "init": _initializer_dumps(init), "seed": int(seed), "bound": bound}).encode()


def declare(kv: "mx.kv.KVStore", key, shape, dtype="float32", init=None, seed: int = 0) -> int:
    """Tell every server the shape, dtype, initializer and seed of lazy key `key`; returns its int id.

    Stock servers ignore the command. Every worker may send it; servers accept identical declarations.
    """
    kid = key_id(kv, key)
    kv._send_command_to_servers(proto.LAZY_DECLARE, lazy_spec_body(kid, shape, dtype, init, seed).decode())
    return kid


def init_lazy(kv: "mx.kv.KVStore", key, shape, dtype="float32", init=None, seed: int = 0) -> int:
    """Declare `key` lazy and ``kv.init`` it with an empty row_sparse array: the init push carries no rows.

    Rows then come into existence on the servers the first time a worker pulls or pushes them, with values
    ``init`` would give as a pure function of (seed, key, row id). Call it on every worker, as ``kv.init``.
    """
    track(kv)
    kid = declare(kv, key, shape, dtype, init, seed)
    kv.init(key, mx.nd.sparse.zeros("row_sparse", tuple(shape), dtype=dtype))
    return kid


def stats(kv: "mx.kv.KVStore") -> None:
    """Ask every server to log its per-key row counts and bytes now (they also do on a timer and at exit)."""
    kv._send_command_to_servers(proto.LAZY_STATS, "")


def _num_servers() -> int:
    return int(os.environ.get("DMLC_NUM_SERVER", "1"))


def _pull_rows(kv, key, shape, dtype, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = mx.nd.sparse.zeros("row_sparse", tuple(shape), dtype=dtype)
    kv.row_sparse_pull(key, out=out, row_ids=mx.nd.array(row_ids, dtype="int64"))
    return out.indices.asnumpy().astype(np.int64), out.data.asnumpy()


def fetch_rows(kv: "mx.kv.KVStore", key, shape, dtype="float32", states: bool = False):
    """The rows of lazy key `key` that exist on the servers: ``(row_ids, values)`` or, with ``states=True``,
    ``(row_ids, values, [state arrays])``. Row ids are sorted int64; values are ``(len(row_ids),) + shape[1:]``.

    Built on requests a stock worker makes: a LAZY_ROWS command asks each server to list the rows it holds, a
    row_sparse_pull of the virtual key ``ROWS_HEADER_KEY`` reads the counts and then the ids, and ordinary
    row_sparse_pulls read the values (and states, through ``rows_state_key``). Nothing is materialized. Int-key
    KVStores only (Gluon's Trainer, plain kv.init with ints).
    """
    kid = key_id(kv, key)
    kv._send_command_to_servers(proto.LAZY_ROWS, json.dumps({"key": kid}))
    servers = _num_servers()
    part = proto.rows_part(servers)
    header_shape = (servers * part, proto.ROWS_WIDTH)
    firsts = np.arange(servers, dtype=np.int64) * part
    _, headers = _pull_rows(kv, proto.ROWS_HEADER_KEY, header_shape, "float64", firsts)
    counts = headers[:, 0].astype(np.int64)
    num_states = int(headers[:, 1].max()) if len(headers) else 0
    wanted = np.concatenate([firsts[s] + 1 + np.arange(-(-counts[s] // proto.ROWS_WIDTH))
                             for s in range(servers)]).astype(np.int64)
    ids = np.zeros(0, np.int64)
    if len(wanted):
        got_rows, chunks = _pull_rows(kv, proto.ROWS_HEADER_KEY, header_shape, "float64", wanted)
        per_server = np.searchsorted(got_rows, firsts, side="left").tolist() + [len(got_rows)]
        parts = [chunks[per_server[s]:per_server[s + 1]].ravel()[:counts[s]] for s in range(servers)]
        ids = np.sort(np.concatenate(parts).astype(np.int64))
    row_shape = tuple(int(d) for d in shape[1:])
    if len(ids) == 0:
        empty = np.zeros((0,) + row_shape, dtype)
        return (ids, empty, [empty.copy() for _ in range(num_states)]) if states else (ids, empty)
    got, values = _pull_rows(kv, key, shape, dtype, ids)
    assert np.array_equal(got, ids)
    if not states:
        return ids, values
    state_values = [_pull_rows(kv, proto.rows_state_key(kid, j), shape, "float32", ids)[1] for j in range(num_states)]
    return ids, values, state_values


def save_rows(path: str, arrays: dict, prefix: str = "arg:") -> None:
    """Atomically ``mx.nd.save`` RowSparseNDArrays holding only the given rows.

    `arrays` maps a name to ``(shape, row_ids, values)`` (a RowSparseNDArray) or to an NDArray (saved as is). Names
    get `prefix` as MXNet's checkpoints do (``arg:NAME``); pass ``prefix=""`` to keep them. The file is written
    beside `path`, fsynced and renamed over it, so a crash mid-save leaves the previous file intact.
    """
    nd = {}
    for name, value in arrays.items():
        if isinstance(value, tuple):
            shape, row_ids, values = value
            values = np.asarray(values).reshape((len(row_ids),) + tuple(shape[1:]))
            nd[prefix + name] = mx.nd.sparse.row_sparse_array(
                (values, np.asarray(row_ids, np.int64)), shape=tuple(shape), dtype=values.dtype)
        else:
            nd[prefix + name] = value
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        mx.nd.save(tmp, nd)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
