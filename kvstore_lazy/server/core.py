"""What the parameter server does with each request: MXNet's KVStoreDistServer, row for row, plus lazy row tables.

Owns: dispatch (a SimpleApp head -> command handler table; a data request -> its key's behaviour), the server-wide
modes (dist_sync, multi-precision, gradient compression), the optimizer, refusals and the poison set. Sans-IO:
:meth:`KVServer.handle` takes one decoded :class:`Message` and returns the messages to send; no sockets, threads
or clocks here. The stored values live in key objects (``keys``), the state-transfer sub-protocol in
``state_transfer``, the wire layout in ``protocol.kv``.

Behaviour follows src/kvstore/kvstore_dist_server.h of MXNet 1.9.1:
- the first push to a key is its init: stored as sent, answered at once, no optimizer;
- dist_sync: pushes are merged until NUM_WORKER *requests* (not distinct workers) arrived, then the updater runs
  (or, with no optimizer, stored = merged) and every buffered request is answered; pulls are answered at once with
  the current value, even mid-round;
- dist_async: every push is applied at once;
- multi-precision: keys whose dtype is not float32 keep a float32 master copy; merging and updates run on it.
Where the stock server CHECK-fails on a peer's input we log one line (sender, key, reason), leave stored values
untouched, answer so nobody hangs, and make that worker's next pull of the key fail loudly (a reply whose size the
worker's KVWorker checks and rejects), since a push reply carries nothing a worker could check.

Deliberate differences from the stock server (each a stock bug or crash):
- row_sparse push with no optimizer writes the merged rows at their row ids (stock writes them into the first rows);
- a row_sparse init push with zero rows is accepted for declared (lazy) keys;
- row ids are 64-bit (stock truncates them to int).
"""
from __future__ import annotations

import json
import logging
from typing import TypeVar

import numpy as np

from kvstore_lazy.numerics.compression import Compression, CompressionError, dequantize_2bit
from kvstore_lazy.numerics.optimizers import Optimizer, check_runs, load_optimizer
from kvstore_lazy.protocol import kv as wire
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.kv import BadRequest, DataRequest
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.protocol.pbmeta import EMPTY
from kvstore_lazy.server.declaration import LazySpec
from kvstore_lazy.server.fastpath import FastPath
from kvstore_lazy.server.keys import DenseKey, RowSparseKey
from kvstore_lazy.server.lifecycle import Lifecycle, Settings
from kvstore_lazy.server.modes import MATERIALIZE_ON_PUSH, MATERIALIZE_ON_TOUCH
from kvstore_lazy.server.state_transfer import StateTransfer

log = logging.getLogger("kvstore_lazy.server")

MAX_DECLARED_KEYS = 4096         # lazy declarations one server keeps (a real job declares a few dozen)
FULL_INIT_ROWS = 4096           # rows of an undeclared row_sparse init that a lazy job (KVSTORE_LAZY=1) is warned of


def node_name(node_id: int) -> str:
    if node_id == EMPTY:
        return "an unidentified node"
    if node_id == 1:
        return "the scheduler"
    role = "server" if node_id % 2 == 0 else "worker"
    return f"{role} {max((node_id - 8) // 2, 0)} (node {node_id})"


Key = DenseKey | RowSparseKey
K = TypeVar("K", DenseKey, RowSparseKey)


class KVServer:
    def __init__(self, rank: int, num_servers: int, num_workers: int,
                 materialize: str = MATERIALIZE_ON_PUSH, lifecycle: Settings | None = None,
                 lazy_job: bool = False) -> None:
        if materialize not in (MATERIALIZE_ON_TOUCH, MATERIALIZE_ON_PUSH):
            raise ValueError(f"materialize must be {MATERIALIZE_ON_TOUCH!r} or {MATERIALIZE_ON_PUSH!r}")
        self.rank, self.num_servers, self.num_workers = rank, num_servers, num_workers
        self.materialize = materialize
        self.lazy_job = lazy_job     # KVSTORE_LAZY=1 in the job: an undeclared full row_sparse init is suspicious
        self.key_range = wire.KeyRange(rank, num_servers)
        self.sync_mode = False
        self.multi_precision = False
        self.compression = Compression()
        self.optimizer: Optimizer | None = None
        self.optimizer_body: bytes | None = None
        self.keys: dict[int, Key] = {}
        self.lifecycle = Lifecycle(lifecycle, num_workers)   # row admission/eviction, the memory budget
        self.specs: dict[int, LazySpec] = {}
        self.transfer = StateTransfer(self)
        self.poisoned: set[tuple[int, int]] = set()   # (worker node id, key) whose next pull must fail loudly
        self.stopped = False
        self.bad_requests = 0
        self.fast = FastPath(self)
        self._commands = {
            mx.STOP_SERVER: self._stop, mx.SYNC_MODE: self._set_sync_mode,
            mx.CONTROLLER: lambda sender, body: self.set_optimizer(body),
            mx.SET_MULTI_PRECISION: self._set_multi_precision, mx.SET_GRADIENT_COMPRESSION: self._set_compression,
            mx.SET_PROFILER_PARAMS: self._ignore_profiler, mx.LAZY_DECLARE: self._declare_command,
            mx.LAZY_ROWS: self._list_rows, mx.LAZY_SNAPSHOT: self._snapshot_command,
            mx.LAZY_ALIAS: lambda sender, body: self.transfer.register_alias(json.loads(body)),
            mx.LAZY_SET_COUNTS: lambda sender, body: self.transfer.set_update_counts(json.loads(body)),
            mx.LAZY_STATS: self._stats_command,
        }

    # ------------------------------------------------------------------------------------------------------------
    # entry point

    def handle(self, msg: Message) -> list[tuple[int, Message]]:
        """Process one request; return (recipient node id, message) pairs to send, in order."""
        self.settle()
        if msg.sender == EMPTY:
            log.error("dropping a request from an unidentified node (no ps<id> identity): head %s", msg.meta.head)
            return []
        if not msg.meta.request:
            log.error("dropping a reply from %s that arrived where requests do (head %s)", node_name(msg.sender),
                      msg.meta.head)
            return []
        if msg.meta.simple_app:
            return self._command(msg)
        try:
            answer = self.fast.answer(msg)   # a pull answered by the fast path (server/fastpath.py), or None
            if answer is not None:
                return answer
            request = wire.parse(msg, self.key_range)
            return self._data(request)
        except BadRequest as exc:
            return self._reject(msg, exc.key, exc.reason)
        except Exception as exc:   # a hostile value past every check: answer it, never take the server down
            log.debug("request from %s failed", node_name(msg.sender), exc_info=True)
            return self._reject(msg, self.key_range.hint(msg), f"could not handle the request: {exc!r}")

    def _reject(self, msg: Message, key: int | None, reason: str) -> list[tuple[int, Message]]:
        """Log, then answer so the worker is not left waiting (see wire.refusal)."""
        self.bad_requests += 1
        log.error("bad request from %s, key %s: %s", node_name(msg.sender), key if key is not None else "?", reason)
        if key is not None and msg.meta.push and (key in self.keys or key in self.specs):
            self.poisoned.add((msg.sender, key))   # bounded: senders x keys this server holds
        return [wire.refusal(msg)]

    def _check_poison(self, sender: int, key: int) -> None:
        if (sender, key) in self.poisoned:
            self.poisoned.discard((sender, key))
            raise BadRequest(key, "an earlier push of this key from this worker was rejected (see above); "
                                  "failing this pull so the worker does not train on wrong values")

    # ------------------------------------------------------------------------------------------------------------
    # SimpleApp commands: handler(sender, body) -> reply body or None

    def _command(self, msg: Message) -> list[tuple[int, Message]]:
        handler = self._commands.get(msg.meta.head)
        reply_body = b""
        try:
            if handler is None:
                log.info("ignoring unknown command %d from %s", msg.meta.head, node_name(msg.sender))
            else:
                reply_body = handler(msg.sender, bytes(msg.meta.body)) or b""
        except Exception as exc:   # any bad body (KeyError, OverflowError, RecursionError...): log and answer
            self.bad_requests += 1
            log.error("bad command %d from %s: %s", msg.meta.head, node_name(msg.sender), exc)
        return [wire.command_reply(msg, reply_body)]

    def _stop(self, sender: int, body: bytes) -> None:
        self.stopped = True

    def _set_sync_mode(self, sender: int, body: bytes) -> None:
        self.sync_mode = True

    def _set_compression(self, sender: int, body: bytes) -> None:
        self.compression = Compression.parse(body)

    def _ignore_profiler(self, sender: int, body: bytes) -> None:
        log.info("ignoring profiler command from %s (no MXNet profiler in this server)", node_name(sender))

    def _declare_command(self, sender: int, body: bytes) -> None:
        self.declare(LazySpec.from_json(json.loads(body)))

    def _list_rows(self, sender: int, body: bytes) -> None:
        self.transfer.list_rows(sender, json.loads(body))

    def _snapshot_command(self, sender: int, body: bytes) -> None:
        """LAZY_SNAPSHOT: answered here; the runtime writes the snapshot before the answer goes out."""

    def _stats_command(self, sender: int, body: bytes) -> bytes:
        reply_body = json.dumps(self.stats()).encode()
        log.info("stats: %s", reply_body.decode())
        return reply_body

    def set_optimizer(self, body: bytes) -> None:
        """kController. The stock server builds a fresh Updater per kController, so optimizer states start over."""
        optimizer = load_optimizer(body)
        check_runs(optimizer)
        again = body == self.optimizer_body   # every worker of a stock job sends its set_optimizer
        self.optimizer, self.optimizer_body = optimizer, body
        for entry in self.keys.values():
            entry.reset_states(optimizer)
        (log.debug if again else log.info)("optimizer set: %s", optimizer.name)

    def _set_multi_precision(self, sender: int, body: bytes) -> None:
        """kSetMultiPrecision: float32 master copies for keys already stored (CreateMultiPrecisionCopies)."""
        if self.multi_precision:
            return
        for key, entry in self.keys.items():
            if entry.round.pending:
                raise ValueError(f"multi-precision cannot be set while pushes of key {key} are underway")
        self.multi_precision = True
        for entry in self.keys.values():
            entry.use_master_copy()

    def declare(self, spec: LazySpec) -> None:
        known = self.specs.get(spec.key)
        if known is not None:
            if known.shape != spec.shape or known.dtype != spec.dtype:
                raise ValueError(f"key {spec.key} already declared with shape {known.shape} {known.dtype.name}, "
                                 f"not {spec.shape} {spec.dtype.name}")
            if known.to_json() != spec.to_json():
                log.warning("key %d re-declared with another initializer or seed; keeping the first", spec.key)
            return
        if isinstance(self.keys.get(spec.key), DenseKey):
            raise ValueError(f"key {spec.key} already holds a dense value; it cannot be declared row_sparse")
        if len(self.specs) >= MAX_DECLARED_KEYS:
            raise ValueError(f"the limit of {MAX_DECLARED_KEYS} declared keys is reached; refusing key {spec.key}")
        self.specs[spec.key] = spec
        log.info("lazy key %d declared: %s rows x %s %s, init %s, seed %d", spec.key, spec.total_rows,
                 spec.row_shape, spec.dtype.name, spec.init, spec.seed)

    def _storage_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(np.float32) if self.multi_precision and dtype != np.float32 else dtype

    # ------------------------------------------------------------------------------------------------------------
    # data requests

    def _data(self, request: DataRequest) -> list[tuple[int, Message]]:
        if request.request_type == mx.ROW_SPARSE:
            key = self.transfer.resolve(request.key)
            if mx.is_virtual_key(key):
                return [self.transfer.push(request, key) if request.push else self.transfer.pull(request, key)]
            return self._rows_push(request) if request.push else [self._rows_pull(request)]
        if not request.push:
            return [self._dense_pull(request)]
        values, dtype = request.values, request.dtype
        if request.request_type == mx.COMPRESSED:
            if self.compression.kind == 0:
                raise BadRequest(request.key, "compressed push but gradient compression was never set")
            try:
                values = dequantize_2bit(bytes(values), request.original_size, self.compression.threshold)
            except CompressionError as exc:
                raise BadRequest(request.key, str(exc)) from None
        return self._dense_push(request, dtype, values)

    def _key_of(self, request: DataRequest, kind: type[K]) -> K | None:
        entry = self.keys.get(request.key)
        if entry is not None and not isinstance(entry, kind):
            what = "row_sparse" if kind is RowSparseKey else "dense"
            raise BadRequest(request.key, f"{what} {'push' if request.push else 'pull'} to a {entry.kind} key")
        return entry

    def train_push(self, request: DataRequest, entry: Key, grad, slots=None) -> list[tuple[int, Message]]:
        """A training push: into the key's dist_sync round, or applied at once (dist_async); the answers due. The
        general path's and the fast path's pushes (``fastpath.Server``) both end here. `slots`: a row push's rows'
        slots as the worker's pull of them found them (``RowSparseKey.apply``; a round merges them with its
        gradients: ``RowSparseKey.merge_slots``)."""
        if self.sync_mode:
            merge_slots = entry.merge_slots_any_order if slots is not None and isinstance(entry, RowSparseKey) \
                else None
            done = entry.round.add(request, grad, entry.merge, self.num_workers, slots, merge_slots)
            if done is None:
                return []
            grad, requests, slots = done
        else:
            if self.optimizer is None:
                raise BadRequest(request.key, "dist_async push with no optimizer set (the stock server aborts: "
                                              "'Updater needs to be set for async mode')")
            requests = [request]
        self.lifecycle.apply(entry, grad, self.optimizer, self.sync_mode, self.keys, slots)
        if isinstance(entry, DenseKey):
            return [wire.value_reply(r, entry.pull(entry.dtype)) if r.pull else wire.reply(r.sender, r.meta)
                    for r in requests]
        return [wire.reply(r.sender, r.meta) for r in requests]

    def _dense_push(self, request: DataRequest, dtype: np.dtype, values: np.ndarray) -> list[tuple[int, Message]]:
        entry = self._key_of(request, DenseKey)
        if entry is None:
            self.keys[request.key] = DenseKey.first_push(request.key, values, self.multi_precision)
            return [wire.reply(request.sender, request.meta)]
        return self.train_push(request, entry, entry.gradient(dtype, values))

    def _dense_pull(self, request: DataRequest) -> tuple[int, Message]:
        entry = self._key_of(request, DenseKey)
        if entry is None:
            raise BadRequest(request.key, "pull of a key that was never initialized (init it first)")
        payload = entry.pull(request.dtype)
        self._check_poison(request.sender, request.key)
        return wire.value_reply(request, payload)

    def _rows_push(self, request: DataRequest) -> list[tuple[int, Message]]:
        entry = self._key_of(request, RowSparseKey)
        if entry is None:
            if self.lazy_job and request.key not in self.specs and len(request.local_ids) >= FULL_INIT_ROWS:
                log.warning("key %d: an init of %d rows of a row_sparse key that was not declared lazy, in a job "
                            "with KVSTORE_LAZY=1: every row is stored. Is the workers' mxnet patched? (run "
                            "`kvstore-lazy patch` in their Python) Or declare the key with "
                            "kvstore_lazy.worker.init_lazy", request.key, len(request.local_ids))
            num_states = self.optimizer.num_states() if self.optimizer is not None else 0
            self.keys[request.key] = RowSparseKey.first_push(
                request, self.specs.get(request.key), self._storage_dtype(request.dtype), num_states,
                self.num_servers, self.rank, self.lifecycle, self.optimizer, self.keys)
            return [wire.reply(request.sender, request.meta)]
        return self.train_push(request, entry, entry.gradient(request))

    def _rows_pull(self, request: DataRequest) -> tuple[int, Message]:
        entry = self._key_of(request, RowSparseKey)
        if entry is None:
            if request.key in self.specs:
                raise BadRequest(request.key, "row_sparse pull before the key was initialized (kv.init it first)")
            raise BadRequest(request.key, "row_sparse pull of a key that was never initialized or declared")
        entry.check_dtype(request.dtype, "pull")
        entry.check_rows(request.local_ids)
        self._check_poison(request.sender, request.key)
        if len(request.local_ids) == 0:
            return wire.rows_reply(request, b"", 0)
        payload = entry.pull(request, store=self.materialize == MATERIALIZE_ON_TOUCH)
        return wire.rows_reply(request, payload, entry.row_size)

    def settle(self) -> None:
        """Run what the last round end left for after its replies (the memory budget's pass, when the runtime
        defers it: ``lifecycle.defer``, Lifecycle.run_due). Everything that handles a request or reads the state
        calls this first, so a pass always runs at the same point of the request stream."""
        self.lifecycle.run_due()

    # ------------------------------------------------------------------------------------------------------------
    # what the runtime and tools read: stats, quiescence, snapshots

    def stats(self) -> dict:
        self.settle()
        keys = {str(k): e.stats() for k, e in sorted(self.keys.items()) if isinstance(e, RowSparseKey)}
        dense = [e for e in self.keys.values() if isinstance(e, DenseKey)]
        return {"rank": self.rank, "sparse": keys, "dense_keys": len(dense),
                "dense_bytes": sum(e.nbytes() for e in dense), "bad_requests": self.bad_requests,
                "lifecycle": self.lifecycle.stats(self.keys)}

    def key_ids(self) -> list[int]:
        return list(self.keys)

    def quiescent(self) -> bool:
        """No dist_sync round is half-way: every push received so far is applied and answered."""
        return not any(e.round.pending for e in self.keys.values())

    def snapshot(self, delta: bool = False, stream: bool = False) -> tuple[dict, dict[int, dict]]:
        """(server-wide JSON state, per-key tables) for checkpoint.write_snapshot; with `delta`, per key only what
        changed since the last :meth:`snapshot_written` (checkpoint.SnapshotChain). Pending sync-round merges are not
        included: their pushes were not acknowledged yet. With `stream` the row_sparse keys' rows are
        ``store.rows.Pieces`` that the snapshot writer gathers chunk by chunk (no copy of a table): write them before
        the next request."""
        self.settle()
        opt = self.optimizer
        meta = {
            "sync_mode": self.sync_mode, "multi_precision": self.multi_precision,
            "compression": [self.compression.kind, float(self.compression.threshold)],
            "optimizer": self.optimizer_body.decode("latin-1") if self.optimizer_body else None,
            "optimizer_counts": None if opt is None else {
                "num_update": int(opt.num_update), "counts": {str(k): v for k, v in opt.update_counts().items()}},
            "specs": [spec.to_json() for spec in self.specs.values()],
            "aliases": {str(alias): key for alias, key in self.transfer.aliases.items()},
            "lifecycle": self.lifecycle.state(),
        }
        return meta, {key: entry.delta(stream) if delta else entry.snapshot(stream) for key, entry in self.keys.items()}

    def snapshot_written(self) -> None:
        """A snapshot of the chain (base or delta) holds the state now: the next delta starts from here."""
        for entry in self.keys.values():
            entry.snapshot_written()

    def inspect(self) -> dict:
        """Everything requests can change, pending rounds included, as comparable values (tests)."""
        meta, _ = self.snapshot()
        return {"server": meta, "keys": {key: entry.inspect() for key, entry in self.keys.items()}}

    def restore(self, meta: dict, tables: dict[int, dict]) -> None:
        """Inverse of :meth:`snapshot`, into a fresh server of the same rank."""
        self.sync_mode = bool(meta.get("sync_mode"))
        self.multi_precision = bool(meta.get("multi_precision"))
        kind, threshold = meta.get("compression", [0, 0.5])
        self.compression = Compression(int(kind), np.float32(threshold))
        for spec in meta.get("specs", []):
            self.declare(LazySpec.from_json(spec))
        self.transfer.aliases.update({int(alias): int(key) for alias, key in meta.get("aliases", {}).items()})
        self.lifecycle.restore(meta.get("lifecycle"))
        if meta.get("optimizer"):
            self.set_optimizer(meta["optimizer"].encode("latin-1"))
            counts = meta.get("optimizer_counts") or {}
            self.optimizer.num_update = counts.get("num_update", self.optimizer.num_update)
            for key, count in counts.get("counts", {}).items():
                self.optimizer.set_update_count(int(key), count)
        num_states = self.optimizer.num_states() if self.optimizer is not None else None
        for key, table in tables.items():
            if table["meta"]["kind"] == DenseKey.kind:
                self.keys[key] = DenseKey.restore(key, table, self.multi_precision)
            else:
                entry = RowSparseKey.restore(key, table, self.specs.get(key), num_states, self.lifecycle)
                entry.use_optimizer(self.optimizer)    # (a snapshot without a history: from here on)
                self.keys[key] = entry
