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

__all__ = ["init_lazy", "declare", "track", "key_id", "lazy_spec_body"]

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
