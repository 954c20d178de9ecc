"""What runs inside a stock MXNet 1.9.1 training process: declaring lazy row_sparse keys to kvstore_lazy servers.

Owns: the LAZY_DECLARE command a worker sends before ``kv.init``, and an ``kv.init`` that ships no rows; reading
the rows that exist and the optimizer states (:func:`fetch_rows`, :func:`fetch_states`) and writing states back
(:func:`restore_states`) through the virtual keys of ``protocol.mxnet``; atomic ``mx.nd.save`` of checkpoints with
their sidecar (what each lazy key was declared with: :func:`declared`, ``kvstore_lazy.persist.checkpoint``). It uses
only what a
stock worker can do (``KVStore._send_command_to_servers``, ``kv.init``, pushes and pulls), so mxnet needs no
rebuild. This module and ``integration`` (what the mxnet patches call) are the only ones that import mxnet; this one
imports it on first use, so that ``python -m kvstore_lazy.worker.patch`` (which edits mxnet's files, and must work
on an mxnet that cannot be imported) does not import it through its package.

String keys: MXNet maps a string key to the int it sends to servers in the order each process first inits string
keys (KVStoreLocal::Init and ::Broadcast, ``next_str_key_``). To declare a string key the worker must know that int,
so :func:`track` wraps ``kv.init`` and ``kv.broadcast`` to record the order; call it (or :func:`init_lazy`) before
any ``kv.init`` on that KVStore. A string-key KVStore also refuses int keys ("Mixed key types"), so it reaches the
virtual keys through string keys that :func:`register_virtual_keys` names to the servers (LAZY_ALIAS).
"""
from __future__ import annotations

import importlib
import json
import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore_lazy.persist import checkpoint
from kvstore_lazy.protocol import mxnet as proto
from kvstore_lazy.protocol.kv import KIND_DENSE, KIND_ROW_SPARSE, RowsHeader

if TYPE_CHECKING:
    import mxnet as mx
else:
    class _MXNet:
        """mxnet, imported when first used (see the module's docstring)."""

        def __getattr__(self, name: str):
            return getattr(importlib.import_module("mxnet"), name)

    mx = _MXNet()

__all__ = ["init_lazy", "declare", "declared", "track", "key_id", "lazy_spec_body", "fetch_rows", "save_rows", "stats",
           "snapshot", "register_virtual_keys", "fetch_states", "restore_states", "save_ndarrays"]

_str_keys: "weakref.WeakKeyDictionary[mx.kv.KVStore, list[str]]" = weakref.WeakKeyDictionary()
# per KVStore: virtual key -> the key to use for it (itself on an int-key KVStore, an alias name on a string-key one)
_virtual_keys: "weakref.WeakKeyDictionary[mx.kv.KVStore, dict[int, object]]" = weakref.WeakKeyDictionary()
# per KVStore: key id -> the declaration this process sent for it (what a checkpoint's sidecar records)
_declarations: "weakref.WeakKeyDictionary[mx.kv.KVStore, dict[int, dict]]" = weakref.WeakKeyDictionary()


def track(kv: "mx.kv.KVStore") -> None:
    """Record the order of string-key inits on `kv` (idempotent). ``kv.broadcast`` numbers its keys too (MXNet's
    KVStoreLocal::Broadcast inits them), so it is recorded as well."""
    if kv in _str_keys:
        return
    order: list[str] = []
    _str_keys[kv] = order
    original, original_broadcast = kv.init, kv.broadcast

    def note(key) -> None:
        for k in key if isinstance(key, (list, tuple)) else [key]:
            if isinstance(k, str) and k not in order:
                order.append(k)

    def init(key, value):
        note(key)
        return original(key, value)

    def broadcast(key, value, out, priority=0):
        note(key)
        return original_broadcast(key, value, out, priority=priority)

    kv.init = init
    kv.broadcast = broadcast


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


def lazy_spec_body(key: int, shape, dtype="float32", init=None, seed: int = 0, adam_row_steps: bool | None = None,
                   **policy) -> bytes:
    """The LAZY_DECLARE body; `policy`: the row lifecycle fields (see :func:`init_lazy`) that are not None;
    `adam_row_steps` (None: the server's default) as :func:`init_lazy` says."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"a lazy row_sparse key needs at least 2 dimensions, got shape {shape}")
    bound = int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000"))
    body = {"key": key, "rows": shape[0], "row_shape": list(shape[1:]), "dtype": np.dtype(dtype).name,
            "init": _initializer_dumps(init), "seed": int(seed), "bound": bound}
    policy = {name: value for name, value in policy.items() if value is not None}
    if policy:
        body["policy"] = policy      # checked by the server (server.lifecycle.Policy.check)
    if adam_row_steps is not None:
        body["adam_row_steps"] = bool(adam_row_steps)
    return json.dumps(body).encode()


def declare(kv: "mx.kv.KVStore", key, shape, dtype="float32", init=None, seed: int = 0, **policy) -> int:
    """Tell every server the shape, dtype, initializer, seed and row lifecycle policy of lazy key `key`; returns
    its int id.

    Stock servers ignore the command. Every worker may send it; servers accept identical declarations.
    """
    kid = key_id(kv, key)
    body = lazy_spec_body(kid, shape, dtype, init, seed, **policy)
    kv._send_command_to_servers(proto.LAZY_DECLARE, body.decode())
    _declarations.setdefault(kv, {})[kid] = checkpoint.lazy_spec(json.loads(body))
    return kid


def declared(kv: "mx.kv.KVStore", key) -> dict:
    """The declaration this process sent for lazy key `key` (:func:`declare`, :func:`init_lazy`): its key id, full
    shape, dtype, initializer and seed, as a checkpoint's sidecar records them (``save_rows(..., specs=...)``)."""
    kid = key_id(kv, key)
    try:
        return dict(_declarations[kv][kid])
    except KeyError:
        raise KeyError(f"key {key!r} (id {kid}) was not declared lazy on this KVStore") from None


def init_lazy(kv: "mx.kv.KVStore", key, shape, dtype="float32", init=None, seed: int = 0, *,
              admit_min_count: int | None = None, admit_prob: float | None = None, ttl_rounds: int | None = None,
              ttl_seconds: float | None = None, adam_row_steps: bool | None = None) -> int:
    """Declare `key` lazy and ``kv.init`` it with an empty row_sparse array: the init push carries no rows.

    Rows then come into existence on the servers the first time a worker pulls or pushes them, with values
    ``init`` would give as a pure function of (seed, key, row id). Call it on every worker, as ``kv.init``.

    Row lifecycle (None: the server's default, ``KVSTORE_LAZY_ADMIT_MIN_COUNT`` etc.; see the README):
    ``admit_min_count`` N stores a row only once its id was pushed in N rounds (dist_sync) / N pushes (dist_async);
    ``admit_prob`` p admits an id at such a round with a probability p decided by a hash of (seed, key, row id,
    count); ``ttl_rounds`` / ``ttl_seconds`` remove a row not pushed for that long.

    ``adam_row_steps`` (beyond stock; None: the server's ``KVSTORE_LAZY_ADAM_ROW_STEPS``): under lazy Adam, each
    row's bias correction counts the updates that row received instead of the key's (FBGEMM's per-row counter).
    """
    track(kv)
    kid = declare(kv, key, shape, dtype, init, seed, admit_min_count=admit_min_count, admit_prob=admit_prob,
                  ttl_rounds=ttl_rounds, ttl_seconds=ttl_seconds, adam_row_steps=adam_row_steps)
    kv.init(key, mx.nd.sparse.zeros("row_sparse", tuple(shape), dtype=dtype))
    return kid


def stats(kv: "mx.kv.KVStore") -> None:
    """Ask every server to log its per-key row counts and bytes now (they also do on a timer and at exit)."""
    kv._send_command_to_servers(proto.LAZY_STATS, "")


def snapshot(kv: "mx.kv.KVStore", tag=None) -> None:
    """Ask every server to write a tagged snapshot now (``<KVSTORE_LAZY_SNAPSHOT_DIR>/tagged/rank<r>``), before it
    answers: a whole job restarted later resumes from it (``KVSTORE_LAZY_RESUME=auto``). `tag` (JSON-serialisable,
    e.g. ``{"step": 40}``) is kept in the snapshot and logged. Call it between steps (after ``mx.nd.waitall()`` and a
    barrier in dist_sync), so that no round is half-way."""
    kv._send_command_to_servers(proto.LAZY_SNAPSHOT, "" if tag is None else json.dumps(tag))


def _num_servers() -> int:
    return int(os.environ.get("DMLC_NUM_SERVER", "1"))


def _pull_rows(kv, key, shape, dtype, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out = mx.nd.sparse.zeros("row_sparse", tuple(shape), dtype=dtype)
    kv.row_sparse_pull(key, out=out, row_ids=mx.nd.array(row_ids, dtype="int64"))
    return out.indices.asnumpy().astype(np.int64), out.data.asnumpy()


# Bytes of reply a pull of fetch_rows/fetch_states asks for: a server answers a checkpoint's reads in pieces of this
# size (rows on a disk tier are read from disk piece by piece, never all at once), a piece whatever the rows' width,
# so that what a server holds for a checkpoint's pull is a small fixed part of any memory budget.
FETCH_BYTES = 8 << 20


def piece_rows(row_bytes: int) -> int:
    """Rows (or virtual rows of ROWS_WIDTH values) a pull of fetch_rows/fetch_states asks for: FETCH_BYTES of reply,
    at least one row."""
    return max(1, FETCH_BYTES // max(1, int(row_bytes)))


def fetch_rows(kv: "mx.kv.KVStore", key, shape, dtype="float32", states: bool = False):
    """The rows of lazy key `key` that exist on the servers: ``(row_ids, values)`` or, with ``states=True``,
    ``(row_ids, values, [state arrays])``. Row ids are sorted int64; values are ``(len(row_ids),) + shape[1:]``.

    Built on requests a stock worker makes: a LAZY_ROWS command asks each server to list the rows it holds, a
    row_sparse_pull of the virtual key ``ROWS_HEADER_KEY`` reads the counts and then the ids, and ordinary
    row_sparse_pulls read the values (and states, through the flat-state keys ``flat_state_key(j)``). Nothing is
    materialized. On a string-key KVStore (Module) call :func:`register_virtual_keys` first, on every worker.

    A row_sparse key that was not declared lazy works too (every row it was inited with exists): its servers list
    its rows by ids local to their part of the key, which `shape` and ``MXNET_KVSTORE_BIGARRAY_BOUND`` place, as
    MXNet's worker split the key (:func:`_id_offsets`).
    """
    headers = _query(kv, key)
    num_states = max((h.num_states for h in headers), default=0)
    per_server = _listed_ids(kv, headers)
    ids = _global_ids(kv, key, shape, headers, per_server)
    row_shape = tuple(int(d) for d in shape[1:])
    if len(ids) == 0:
        empty = np.zeros((0,) + row_shape, dtype)
        return (ids, empty, [empty.astype(np.float32) for _ in range(num_states)]) if states else (ids, empty)
    piece = piece_rows(int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    parts = [_pull_rows(kv, key, shape, dtype, ids[lo:lo + piece]) for lo in range(0, len(ids), piece)]
    got, values = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    assert np.array_equal(got, ids)
    if not states:
        return ids, values
    counts = [len(p) * int(np.prod(row_shape, dtype=np.int64)) for p in per_server]
    state_values = [_read_flat(kv, proto.flat_state_key(j), counts).reshape((len(ids),) + row_shape)
                    for j in range(num_states)]
    return ids, values, state_values


# ----------------------------------------------------------------------------------------------------------------
# optimizer states for checkpoints (kvstore_lazy.worker.integration: Trainer.save_states/load_states, Module's optimizer
# states), through the virtual keys of kvstore_lazy.protocol.mxnet. Dense keys go the same way: each server answers
# for its part of the key.

def _bound() -> int:
    return int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000"))


def _virtual_shape(servers: int) -> tuple[int, int]:
    return servers * proto.rows_part(servers), proto.ROWS_WIDTH


def _vkey(kv, virtual: int):
    """The key this KVStore reaches virtual key `virtual` by (string-key KVStores need register_virtual_keys)."""
    known = _virtual_keys.get(kv, {})
    if virtual in known:
        return known[virtual]
    if _str_keys.get(kv):
        raise RuntimeError("this KVStore uses string keys: call kvstore_lazy.worker.register_virtual_keys(kv, ..., "
                           "string_keys=True) on every worker while initializing, before fetching rows or states")
    return virtual


def register_virtual_keys(kv: "mx.kv.KVStore", num_states: int, string_keys: bool) -> None:
    """``kv.init`` the virtual keys (the row listing and `num_states` flat optimizer-state keys) with empty values,
    so that this KVStore can pull and push them. Collective, like ``kv.init``: every worker, same order, same
    arguments. On a string-key KVStore (Module) each gets a string name, whose int (MXNet numbers string keys in
    init order, see :func:`track`) a LAZY_ALIAS command tells the servers first. Idempotent per KVStore."""
    if string_keys:
        track(kv)
    known = _virtual_keys.setdefault(kv, {})
    wanted = [(proto.ROWS_HEADER_KEY, "float64")]
    wanted += [(proto.flat_state_key(j), "float32") for j in range(min(int(num_states), proto.MAX_STATES))]
    shape = _virtual_shape(_num_servers())
    for virtual, dtype in wanted:
        if virtual in known:
            continue
        name: int | str = virtual
        if string_keys:
            name = f"__kvstore_lazy_virtual_{virtual - proto.ROWS_HEADER_KEY}__"
            kv._send_command_to_servers(proto.LAZY_ALIAS, json.dumps({"alias": key_id(kv, name), "key": virtual}))
        kv.init(name, mx.nd.sparse.zeros("row_sparse", shape, dtype=dtype))
        known[virtual] = name


def _query(kv, key) -> list[RowsHeader]:
    """LAZY_ROWS for `key`, then each server's header row (protocol.kv.RowsHeader), one per server.

    Waits for this worker's pushes first: the command and the virtual keys are not ordered after them by the
    engine, and in dist_sync a push is answered once its round is applied, so what is read includes every round
    this worker took part in."""
    mx.nd.waitall()
    kv._send_command_to_servers(proto.LAZY_ROWS, json.dumps({"key": key_id(kv, key)}))
    servers = _num_servers()
    firsts = np.arange(servers, dtype=np.int64) * proto.rows_part(servers)
    _, headers = _pull_rows(kv, _vkey(kv, proto.ROWS_HEADER_KEY), _virtual_shape(servers), "float64", firsts)
    return [RowsHeader.from_row(row) for row in headers]


def _chunks(n: int) -> int:
    return -(-int(n) // proto.ROWS_WIDTH)


def _read_chunks(kv, virtual: int, dtype, counts: list[int], first_row: int) -> list[np.ndarray]:
    """Per server s, the first counts[s] values of its virtual rows first_row, first_row + 1, ..."""
    servers = len(counts)
    part = proto.rows_part(servers)
    wanted = [s * part + first_row + np.arange(_chunks(c)) for s, c in enumerate(counts)]
    rows = np.concatenate(wanted).astype(np.int64)
    if len(rows) == 0:
        return [np.zeros(0, dtype) for _ in counts]
    piece = piece_rows(proto.ROWS_WIDTH * np.dtype(dtype).itemsize)
    pulled = [_pull_rows(kv, _vkey(kv, virtual), _virtual_shape(servers), dtype, rows[lo:lo + piece])
              for lo in range(0, len(rows), piece)]
    got, chunks = np.concatenate([p[0] for p in pulled]), np.concatenate([p[1] for p in pulled])
    assert np.array_equal(got, rows)
    out, at = [], 0
    for s, c in enumerate(counts):
        out.append(chunks[at:at + len(wanted[s])].reshape(-1)[:c])
        at += len(wanted[s])
    return out


def _listed_ids(kv, headers: list[RowsHeader]) -> list[np.ndarray]:
    counts = [h.count for h in headers]
    if any(h.kind == KIND_DENSE for h in headers):   # a dense key: no rows to list
        return [np.zeros(0, np.int64) for _ in counts]
    return [ids.astype(np.int64) for ids in _read_chunks(kv, proto.ROWS_HEADER_KEY, "float64", counts, 1)]


def _id_offsets(kv, key, shape, headers: list[RowsHeader]) -> list[int]:
    """Per server, what turns the row ids it lists (and takes in a restore) into global row ids: 0 for a server that
    lists global ids, the first row of its part of the key for one that lists local ids (a key not declared lazy:
    its init push carried ids relative to the server's part, so the server never learnt where the part starts;
    RowsHeader.ids_local). The parts are the ones MXNet's worker splits the key into (EncodeRowSparseKey: the
    key's shape, the number of servers and MXNET_KVSTORE_BIGARRAY_BOUND), checked against the rows each such
    server holds."""
    parts = _row_parts(key_id(kv, key), shape, len(headers))
    offsets = []
    for s, (header, (first, rows)) in enumerate(zip(headers, parts)):
        if header.kind == KIND_ROW_SPARSE and header.ids_local:
            if header.local_rows != rows:
                raise RuntimeError(
                    f"key {key!r}: server {s} holds {header.local_rows} rows of it, but this worker splits "
                    f"shape {tuple(shape)} over {len(headers)} servers giving it {rows} (MXNET_KVSTORE_BIGARRAY_BOUND"
                    f"={_bound()}); pass the key's shape, and the bound the job's workers ran with")
            offsets.append(first)
        else:
            offsets.append(0)
    return offsets


def _global_ids(kv, key, shape, headers: list[RowsHeader], per_server: list[np.ndarray]) -> np.ndarray:
    """The row ids the servers listed (:func:`_listed_ids`), global, in server order: sorted and unique."""
    offsets = _id_offsets(kv, key, shape, headers)
    ids = np.concatenate([listed + offset for listed, offset in zip(per_server, offsets)] or [np.zeros(0, np.int64)])
    if np.any(ids[1:] <= ids[:-1]):
        raise RuntimeError(f"key {key!r}: the servers listed overlapping or unsorted rows (servers older than this "
                           f"worker list a key that was not declared lazy by local row id: update them)")
    return ids


def _read_flat(kv, virtual: int, counts: list[int]) -> np.ndarray:
    return np.concatenate(_read_chunks(kv, virtual, "float32", counts, 0))


def fetch_states(kv: "mx.kv.KVStore", key, shape, dtype="float32") -> dict:
    """Everything the servers hold for `key` that a checkpoint of training needs besides the weights:
    ``{"kind": "row_sparse" | "dense" | "absent", "row_ids": (row_sparse), "states": [arrays], "counts": [update
    count per server], "num_update": [per server]}``. Row-sparse states are ``(len(row_ids),) + shape[1:]`` for the
    rows that exist; dense ones have `shape`. Not collective; reads, never creates, rows."""
    shape = tuple(int(d) for d in shape)
    headers = _query(kv, key)
    kinds = {h.kind for h in headers} - {0}
    result: dict[str, Any] = {"counts": [h.update_count for h in headers],
                              "num_update": [h.num_update for h in headers], "states": []}
    num_states = max((h.num_states for h in headers), default=0)
    if not kinds:
        return dict(result, kind="absent")
    if kinds == {KIND_ROW_SPARSE}:
        per_server = _listed_ids(kv, headers)
        ids = _global_ids(kv, key, shape, headers, per_server)
        row_size = int(np.prod(shape[1:], dtype=np.int64))
        counts = [len(p) * row_size for p in per_server]
        result.update(kind="row_sparse", row_ids=ids)
        result["states"] = [_read_flat(kv, proto.flat_state_key(j), counts).reshape((len(ids),) + shape[1:])
                            for j in range(num_states)]
        return result
    if kinds != {KIND_DENSE}:
        raise RuntimeError(f"key {key!r} is row_sparse on some servers and dense on others")
    size = int(np.prod(shape, dtype=np.int64))
    counts = [h.count for h in headers]
    if sum(counts) != size:
        raise RuntimeError(f"servers hold {sum(counts)} values of key {key!r}, expected {size}")
    if num_states and min(h.num_states for h in headers if h.kind == KIND_DENSE) != num_states:
        raise RuntimeError(f"key {key!r} has optimizer states on some servers only (not updated yet?)")
    result["kind"] = "dense"
    result["states"] = [_read_flat(kv, proto.flat_state_key(j), counts).reshape(shape) for j in range(num_states)]
    return result


def _row_parts(kid: int, shape, servers: int) -> list[tuple[int, int]]:
    """(first global row, rows) of each server's part of row_sparse key `kid`, as EncodeRowSparseKey splits it:
    every server a part of a key of MXNET_KVSTORE_BIGARRAY_BOUND elements or more, else all rows on one server."""
    total = int(shape[0])
    if proto.is_partitioned(total * int(np.prod(shape[1:], dtype=np.int64)), _bound()):
        return [proto.row_partition(total, servers, s) for s in range(servers)]
    home = proto.dense_home_server(kid, servers)
    return [(0, total) if s == home else (0, 0) for s in range(servers)]


def _row_split(kid: int, shape, ids: np.ndarray, servers: int) -> list[np.ndarray]:
    """The ids (global, sorted) each server holds of a row_sparse key, as EncodeRowSparseKey splits them."""
    return [ids[(ids >= first) & (ids < first + rows)] for first, rows in _row_parts(kid, shape, servers)]


def _dense_split(kid: int, size: int, servers: int) -> list[tuple[int, int]]:
    """(offset, size) of each server's part of a dense key, as EncodeDefaultKey splits it."""
    if proto.is_partitioned(size, _bound()):
        return [proto.dense_partition(size, servers, s) for s in range(servers)]
    home = proto.dense_home_server(kid, servers)
    return [(0, size) if s == home else (0, 0) for s in range(servers)]


def _push_chunks(kv, virtual: int, dtype, per_server: list[np.ndarray]) -> None:
    """Push each server's values as its virtual rows 0, 1, ... (zero-padded), then wait for every answer."""
    servers = len(per_server)
    part = proto.rows_part(servers)
    rows, data = [], []
    for s, flat in enumerate(per_server):
        n = _chunks(len(flat))
        if n == 0:
            continue
        padded = np.zeros(n * proto.ROWS_WIDTH, dtype)
        padded[:len(flat)] = flat
        rows.append(s * part + np.arange(n))
        data.append(padded.reshape(n, proto.ROWS_WIDTH))
    if not rows:
        return
    value = mx.nd.sparse.row_sparse_array((np.concatenate(data), np.concatenate(rows).astype(np.int64)),
                                          shape=_virtual_shape(servers), dtype=dtype)
    kv.push(_vkey(kv, virtual), value)
    mx.nd.waitall()   # answered before the next command, which travels outside the engine's ordering


def restore_states(kv: "mx.kv.KVStore", key, shape, saved: dict) -> None:
    """Write back what :func:`fetch_states` returned (possibly from a job with another number of servers): the
    optimizer states of the saved rows (rows absent on the servers get their initial values first) or of the dense
    key, and the update counts. Call on one worker (rank 0), after ``kv.init`` of the key, the optimizer set and
    :func:`register_virtual_keys` on every worker; then barrier."""
    shape = tuple(int(d) for d in shape)
    kid = key_id(kv, key)
    servers = _num_servers()
    states = [np.asarray(s, np.float32) for s in saved.get("states", [])]
    if saved["kind"] == "row_sparse" and states:
        ids = np.asarray(saved["row_ids"], np.int64)
        if len(ids) > 1 and not np.all(ids[1:] > ids[:-1]):
            raise ValueError("saved row ids must be sorted and unique")
        if len(ids) and (ids[0] < 0 or ids[-1] >= shape[0]):
            raise ValueError(f"saved row ids must be within the key's {shape[0]} rows, got "
                             f"[{int(ids[0])}, {int(ids[-1])}]")
        offsets = [0] * servers
        if any(first for first, _ in _row_parts(kid, shape, servers)):
            # a split key: a server of a key not declared lazy takes its rows by local id (_id_offsets), which the
            # headers say (_query sends LAZY_ROWS first)
            offsets = _id_offsets(kv, key, shape, _query(kv, key))
        else:
            kv._send_command_to_servers(proto.LAZY_ROWS, json.dumps({"key": kid}))
        split = _row_split(kid, shape, ids, servers)
        positions = [np.searchsorted(ids, part_ids) for part_ids in split]
        headers = [np.concatenate([[len(p)], np.zeros(proto.ROWS_WIDTH - 1), p - offset]).astype(np.float64)
                   if len(p) else np.zeros(0) for p, offset in zip(split, offsets)]
        _push_chunks(kv, proto.ROWS_HEADER_KEY, "float64", headers)
        for j, state in enumerate(states):
            flat = state.reshape(len(ids), -1)
            _push_chunks(kv, proto.flat_state_key(j), "float32", [flat[pos].reshape(-1) for pos in positions])
    elif saved["kind"] != "absent" and states:
        kv._send_command_to_servers(proto.LAZY_ROWS, json.dumps({"key": kid}))
        size = int(np.prod(shape, dtype=np.int64))
        parts = _dense_split(kid, size, servers)
        for j, state in enumerate(states):
            flat = state.reshape(-1)
            _push_chunks(kv, proto.flat_state_key(j), "float32", [flat[o:o + n] for o, n in parts])
    kv._send_command_to_servers(proto.LAZY_SET_COUNTS, json.dumps(
        {"key": kid, "counts": [int(c) for c in saved.get("counts", [])],
         "num_update": [int(c) for c in saved.get("num_update", [])]}))


def save_ndarrays(path: str, arrays: dict, save_fn=None, lazy: dict | None = None) -> None:
    """``mx.nd.save(path, arrays)`` (or ``save_fn(path, arrays)``), atomically: written beside `path`, fsynced,
    renamed over it, so a crash mid-save leaves the previous file intact. `lazy` (entry name -> declaration, as
    :func:`declared` returns it) writes the checkpoint's sidecar with it (kvstore_lazy.persist.checkpoint); ``{}``
    removes
    a stale one.

    Waits for every pending write to the arrays first: MXNet's NDArray::Save writes a sparse array's storage shape
    (its number of rows) *before* waiting for the array, and its rows after, so saving an array that a pending
    ``copyto`` is giving another row count (``Module.get_params`` of a lazy weight) writes a header that does not
    match the data, a file no reader can parse."""
    values = arrays.values() if isinstance(arrays, dict) else arrays if isinstance(arrays, (list, tuple)) else [arrays]
    for value in values:
        if isinstance(value, mx.nd.NDArray):   # (anything else: save_fn says what is wrong)
            value.wait_to_read()
    with checkpoint.atomic_path(path, lazy) as tmp:
        (save_fn or mx.nd.save)(tmp, arrays)


def save_rows(path: str, arrays: dict, prefix: str = "arg:", specs: dict | None = None) -> None:
    """Atomically ``mx.nd.save`` RowSparseNDArrays holding only the given rows.

    `arrays` maps a name to ``(shape, row_ids, values)`` (a RowSparseNDArray) or to an NDArray (saved as is). Names
    get `prefix` as MXNet's checkpoints do (``arg:NAME``); pass ``prefix=""`` to keep them. `specs` maps a name of
    `arrays` to the declaration of its lazy key (``declared(kv, key)``): the checkpoint's sidecar then says how to
    rebuild the rows the file does not hold (``python -m kvstore_lazy.persist.checkpoint densify``, the patched
    loaders).
    The file is written beside `path`, fsynced and renamed over it, so a crash mid-save leaves the previous file.
    """
    for name, spec in (specs or {}).items():
        value = arrays.get(name)
        shape = value[0] if isinstance(value, tuple) else getattr(value, "shape", ())
        want = (int(spec["rows"]),) + tuple(int(d) for d in spec["row_shape"])
        stype = "row_sparse" if isinstance(value, tuple) else getattr(value, "stype", "default")
        if value is None or tuple(int(d) for d in shape) != want or stype != "row_sparse":
            got = "missing" if value is None else f"{stype} of shape {tuple(shape)}"
            raise ValueError(f"save_rows: specs[{name!r}] describes a row_sparse array of shape {want}, but "
                             f"arrays[{name!r}] is {got}")
    nd = {}
    for name, value in arrays.items():
        if isinstance(value, tuple):
            shape, row_ids, values = value
            values = np.asarray(values).reshape((len(row_ids),) + tuple(shape[1:]))
            nd[prefix + name] = mx.nd.sparse.row_sparse_array(
                (values, np.asarray(row_ids, np.int64)), shape=tuple(shape), dtype=values.dtype)
        else:
            nd[prefix + name] = value
    save_ndarrays(path, nd, lazy={prefix + name: spec for name, spec in (specs or {}).items()})
