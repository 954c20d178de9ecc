"""What the parameter server does with each request: MXNet's KVStoreDistServer, row for row, plus lazy row tables.

Owns: the stored values (dense tensors and row tables), dist_sync merge rounds, dist_async updates, the SimpleApp
commands, and the replies each request gets. Sans-IO: :meth:`KVServer.handle` takes one decoded :class:`Message`
and returns the messages to send; no sockets, threads or clocks here.

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

import copy
import json
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ..compression import Compression, CompressionError, dequantize_2bit
from ..initializers import InitializerError, RowInitializer, parse_initializer
from ..optimizers import Optimizer, UnsafePickleError, UnsupportedOptimizerError, load_optimizer
from ..protocol import ProtocolError
from ..protocol import mxnet as mx
from ..protocol.message import KVPairs, Message, decode_kv
from ..protocol.pbmeta import EMPTY, Meta
from ..store import kernels
from ..store.rows import RowTable

log = logging.getLogger("kvstore_lazy.server")

MATERIALIZE_ON_TOUCH = "touch"   # first pull or push creates the row
MATERIALIZE_ON_PUSH = "push"     # pulls of absent rows get computed initial values, only pushes store rows


class BadRequest(Exception):
    """A request this server refuses; the message says why (logged with sender and key)."""

    def __init__(self, key, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


def node_name(node_id: int) -> str:
    if node_id == EMPTY:
        return "an unidentified node"
    if node_id == 1:
        return "the scheduler"
    role = "server" if node_id % 2 == 0 else "worker"
    return f"{role} {max((node_id - 8) // 2, 0)} (node {node_id})"


@dataclass
class Request:
    sender: int
    meta: Meta


@dataclass
class DenseEntry:
    dtype: np.dtype
    value: np.ndarray                        # in the key's dtype: what pulls return
    master: np.ndarray | None = None         # float32 master copy under multi-precision
    merged: np.ndarray | None = None
    merge_buffer: np.ndarray | None = None   # reused for merged sums, round after round
    requests: list[Request] = field(default_factory=list)
    states: list[np.ndarray] | None = None   # optimizer states, created at the first update
    payload: bytes | None = None             # value.tobytes() for pull replies, shared until the next update

    @property
    def stored(self) -> np.ndarray:
        """The array updates run on (store_realt_ under multi-precision, else store_)."""
        return self.master if self.master is not None else self.value

    def publish(self) -> None:
        if self.master is not None:
            self.value[...] = self.master.astype(self.dtype)


@dataclass
class LazySpec:
    """What a worker declared for a lazy row_sparse key (command LAZY_DECLARE)."""

    key: int
    total_rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    init: str
    seed: int
    bound: int
    initializer: RowInitializer

    @property
    def row_size(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.total_rows,) + self.row_shape

    def to_json(self) -> dict:
        return {"key": self.key, "rows": self.total_rows, "row_shape": list(self.row_shape),
                "dtype": self.dtype.name, "init": self.init, "seed": self.seed, "bound": self.bound}

    @classmethod
    def from_json(cls, body: dict) -> "LazySpec":
        _check_declaration(body)   # issue 11 (defect 8): exact types and ranges, caps (defect 5)
        try:
            row_shape = tuple(int(d) for d in body["row_shape"])
            spec = cls(key=int(body["key"]), total_rows=int(body["rows"]), row_shape=row_shape,
                       dtype=np.dtype(body.get("dtype", "float32")), init=str(body["init"]),
                       seed=int(body.get("seed", 0)), bound=int(body.get("bound", 1_000_000)),
                       initializer=parse_initializer(str(body["init"])))
        except InitializerError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad lazy declaration {body!r}: {exc}") from exc
        if spec.total_rows <= 0 or spec.row_size <= 0 or spec.dtype not in mx.DTYPE_FLAGS:
            raise ValueError(f"bad lazy declaration {body!r}: rows, row shape and dtype must be positive/supported")
        spec.initializer.rows(spec.seed, spec.key, np.zeros(1, np.uint64), spec.shape, spec.dtype)  # fails now if ever
        return spec


@dataclass
class SparseEntry:
    dtype: np.dtype                          # the key's dtype (what the wire carries)
    row_size: int                            # elements per row ("unit_len")
    table: RowTable                          # rows in float32 under multi-precision, else in `dtype`
    local_rows: int                          # rows this server holds the range of (local ids < local_rows)
    row_offset: int = 0                      # global row id of local row 0 (partitioned keys)
    spec: LazySpec | None = None
    merged_ids: np.ndarray | None = None     # sync round buffer: sorted local row ids ...
    merged_vals: np.ndarray | None = None    # ... and their summed gradients
    requests: list[Request] = field(default_factory=list)

    def initial_rows(self, key: int, global_ids: np.ndarray) -> np.ndarray:
        assert self.spec is not None
        return self.spec.initializer.rows(self.spec.seed, key, global_ids, self.spec.shape,
                                          self.table.dtype).reshape(len(global_ids), self.row_size)


class KVServer:
    def __init__(self, rank: int, num_servers: int, num_workers: int,
                 materialize: str = MATERIALIZE_ON_TOUCH) -> None:
        if materialize not in (MATERIALIZE_ON_TOUCH, MATERIALIZE_ON_PUSH):
            raise ValueError(f"materialize must be {MATERIALIZE_ON_TOUCH!r} or {MATERIALIZE_ON_PUSH!r}")
        self.rank = rank
        self.num_servers = num_servers
        self.num_workers = num_workers
        self.materialize = materialize
        self.key_begin = mx.server_key_begin(rank, num_servers)
        self.key_end = mx.server_key_end(rank, num_servers)
        self.sync_mode = False
        self.multi_precision = False
        self.compression = Compression()
        self.optimizer: Optimizer | None = None
        self.dense: dict[int, DenseEntry] = {}
        self.sparse: dict[int, SparseEntry] = {}
        self.specs: dict[int, LazySpec] = {}
        self.poisoned: set[tuple[int, int]] = set()   # (worker node id, key) whose next pull must fail loudly
        self.poisoned_all: set[int] = set()   # issue 11: workers past MAX_POISONED pairs: every pull fails
        self.row_queries: dict[int, tuple[int, np.ndarray]] = {}  # worker node id -> (key, existing row ids)
        self.aliases: dict[int, int] = {}   # string-key int -> virtual key (LAZY_ALIAS)
        self.stopped = False
        self.bad_requests = 0
        self.optimizer_body: bytes | None = None
        self.snapshot_requested = False

    # ------------------------------------------------------------------------------------------------------------
    # entry point

    def handle(self, msg: Message) -> list[tuple[int, Message]]:
        """Process one request; return (recipient node id, message) pairs to send, in order."""
        if msg.sender == EMPTY:
            log.error("dropping a request from an unidentified node (no ps<id> identity): head %s", msg.meta.head)
            return []
        if msg.meta.simple_app:
            return self._command(msg)
        kv = None
        try:
            kv = decode_kv(msg.data)
            command = mx.decode_command(msg.meta.head)
        except ProtocolError as exc:
            return self._reject(msg, self._key_hint(msg), str(exc), kv)
        try:
            if command.request_type == mx.ROW_SPARSE:
                return self._row_sparse(msg, command, kv)
            if command.request_type == mx.COMPRESSED:
                return self._compressed(msg, command, kv)
            return self._default(msg, command, kv)
        except BadRequest as exc:
            return self._reject(msg, exc.key, exc.reason, kv)
        except Exception as exc:   # a hostile value past every check: answer it, never take the server down
            log.debug("request from %s failed", node_name(msg.sender), exc_info=True)
            return self._reject(msg, self._key_hint(msg), f"could not handle the request: {exc!r}", kv)

    # ------------------------------------------------------------------------------------------------------------
    # replies

    @staticmethod
    def _reply(req: Request, kv: KVPairs | None = None) -> tuple[int, Message]:
        """KVServer::Response: echo head/timestamp/customer/push/pull; data only when there are keys."""
        meta = Meta(head=req.meta.head, app_id=0, customer_id=req.meta.customer_id, timestamp=req.meta.timestamp,
                    request=False, push=req.meta.push, pull=req.meta.pull)
        data: list[bytes] = []
        if kv is not None:
            data, meta.data_type = kv.frames()
        return req.sender, Message(meta, data)

    def _reject(self, msg: Message, key, reason: str, kv: KVPairs | None = None) -> list[tuple[int, Message]]:
        """Log, then answer so the worker is not left waiting. A pull gets its keys back with no values, which the
        worker's KVWorker rejects (its buffer size check) instead of using wrong values."""
        self.bad_requests += 1
        log.error("bad request from %s, key %s: %s", node_name(msg.sender), key if key is not None else "?", reason)
        req = Request(msg.sender, msg.meta)
        if key is not None and msg.meta.push:
            if len(self.poisoned) < MAX_POISONED:
                self.poisoned.add((msg.sender, key))
            else:
                self.poisoned_all.add(msg.sender)
        if msg.meta.pull and kv is not None and len(kv.keys):
            return [self._reply(req, KVPairs(kv.keys, b"", np.zeros(len(kv.keys), np.int32)))]
        return [self._reply(req)]

    def _check_poison(self, sender: int, key: int) -> None:
        if (sender, key) in self.poisoned or sender in self.poisoned_all:
            self.poisoned.discard((sender, key))
            raise BadRequest(key, "an earlier push of this key from this worker was rejected (see above); "
                                  "failing this pull so the worker does not train on wrong values")

    def _decode_key(self, raw: int) -> int:
        if not self.key_begin <= raw < self.key_end:
            raise BadRequest(raw, f"key {raw} is outside this server's key range "
                                  f"[{self.key_begin}, {self.key_end})")
        return raw - self.key_begin

    def _key_hint(self, msg: Message) -> int | None:
        """The key a request whose frames or head do not decode names (keys[0]; keys[1] for a compressed push,
        whose keys[0] carries the size), or None: for the log line and the poison set."""
        raw = bytes(msg.data[0]) if msg.data else b""
        keys = np.frombuffer(raw[:len(raw) - len(raw) % 8], "<u8")
        i = 1 if msg.meta.push and msg.meta.head == mx.command_code(mx.COMPRESSED, mx.FLOAT32) else 0
        if len(keys) <= i or not self.key_begin <= int(keys[i]) < self.key_end:
            return None
        return int(keys[i]) - self.key_begin

    # ------------------------------------------------------------------------------------------------------------
    # SimpleApp commands

    def _command(self, msg: Message) -> list[tuple[int, Message]]:
        head, body = msg.meta.head, bytes(msg.meta.body)
        reply_body = b""
        try:
            if head == mx.STOP_SERVER:
                self.stopped = True
            elif head == mx.SYNC_MODE:
                self.sync_mode = True
            elif head == mx.CONTROLLER:
                self._set_optimizer(body)
            elif head == mx.SET_MULTI_PRECISION:
                self._set_multi_precision()
            elif head == mx.SET_GRADIENT_COMPRESSION:
                self.compression = Compression.parse(body)
            elif head == mx.SET_PROFILER_PARAMS:
                log.info("ignoring profiler command from %s (no MXNet profiler in this server)",
                         node_name(msg.sender))
            elif head == mx.LAZY_DECLARE:
                self.declare(LazySpec.from_json(json.loads(body)))
            elif head == mx.LAZY_ROWS:
                self._prepare_rows_query(msg.sender, json.loads(body))
            elif head == mx.LAZY_SNAPSHOT:
                self.snapshot_requested = True
            elif head == mx.LAZY_ALIAS:
                self.register_alias(json.loads(body))
            elif head == mx.LAZY_SET_COUNTS:
                self.set_update_counts(json.loads(body))
            elif head == mx.LAZY_STATS:
                reply_body = json.dumps(self.stats()).encode()
                log.info("stats: %s", reply_body.decode())
            else:
                log.info("ignoring unknown command %d from %s", head, node_name(msg.sender))
        except Exception as exc:   # any bad body (KeyError, OverflowError, RecursionError...): log and answer
            self.bad_requests += 1
            log.error("bad command %d from %s: %s", head, node_name(msg.sender), exc)
        meta = Meta(head=head, body=reply_body, timestamp=msg.meta.timestamp, request=False, simple_app=True,
                    app_id=0, customer_id=msg.meta.customer_id)
        return [(msg.sender, Message(meta))]

    def _set_optimizer(self, body: bytes) -> None:
        # The stock server builds a fresh Updater per kController, so optimizer states start over.
        optimizer = load_optimizer(body)
        _check_runs(optimizer)
        self.optimizer, self.optimizer_body = optimizer, body
        for entry in self.dense.values():
            entry.states = None
        for entry in self.sparse.values():
            entry.table.set_num_states(optimizer.num_states())
        log.info("optimizer set: %s", optimizer.name)

    def _set_multi_precision(self) -> None:
        """kSetMultiPrecision: float32 master copies for keys already stored (CreateMultiPrecisionCopies)."""
        if self.multi_precision:
            return
        for key, entry in self.dense.items():
            if entry.requests:
                raise ValueError(f"multi-precision cannot be set while pushes of key {key} are underway")
        self.multi_precision = True
        for entry in self.dense.values():
            if entry.dtype != np.float32:
                entry.master = entry.value.astype(np.float32)
                entry.merged = None
        for entry in self.sparse.values():
            if entry.dtype != np.float32 and entry.table.dtype != np.float32:
                entry.table = _retyped(entry.table, np.float32)
                entry.merged_ids = entry.merged_vals = None

    def declare(self, spec: LazySpec) -> None:
        known = self.specs.get(spec.key)
        if known is not None:
            if known.shape != spec.shape or known.dtype != spec.dtype:
                raise ValueError(f"key {spec.key} already declared with shape {known.shape} {known.dtype.name}, "
                                 f"not {spec.shape} {spec.dtype.name}")
            if known.to_json() != spec.to_json():
                log.warning("key %d re-declared with another initializer or seed; keeping the first", spec.key)
            return
        if spec.key in self.dense:   # issue 11
            raise ValueError(f"key {spec.key} already holds a dense value; it cannot be declared lazy")
        if len(self.specs) >= MAX_DECLARED_KEYS:
            raise ValueError(f"key {spec.key}: this server already has {len(self.specs)} declared keys, its limit")
        self.specs[spec.key] = spec
        log.info("lazy key %d declared: %s rows x %s %s, init %s, seed %d", spec.key, spec.total_rows,
                 spec.row_shape, spec.dtype.name, spec.init, spec.seed)

    def _storage_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(np.float32) if self.multi_precision and dtype != np.float32 else dtype

    def _new_states(self, weight: np.ndarray) -> list[np.ndarray]:
        assert self.optimizer is not None
        return self.optimizer.init_states(weight)

    # ------------------------------------------------------------------------------------------------------------
    # dense keys (DataHandleDefault)

    def _default(self, msg: Message, command: mx.DataCommand, kv: KVPairs) -> list[tuple[int, Message]]:
        req = Request(msg.sender, msg.meta)
        if len(kv.keys) != 1:
            raise BadRequest(None, f"a default request carries exactly one key, got {len(kv.keys)}")
        key = self._decode_key(int(kv.keys[0]))
        if not msg.meta.push:
            return [self._dense_pull_reply(req, key, kv, command.dtype)]
        if len(kv.lens) != 1 or len(kv.vals) != int(kv.lens[0]):
            raise BadRequest(key, f"push of {len(kv.vals)} value bytes with lens {kv.lens.tolist()}")
        if len(kv.vals) % command.dtype.itemsize:
            raise BadRequest(key, f"{len(kv.vals)} bytes is not a whole number of {command.dtype.name}")
        recved = np.frombuffer(kv.vals, dtype=command.dtype)
        return self._dense_push(req, key, command.dtype, recved, kv)

    def _dense_push(self, req: Request, key: int, dtype: np.dtype, recved: np.ndarray,
                    kv: KVPairs) -> list[tuple[int, Message]]:
        entry = self.dense.get(key)
        if entry is None:
            if key in self.sparse:
                raise BadRequest(key, "dense push to a row_sparse key")
            entry = DenseEntry(dtype=dtype, value=recved.copy())
            if self.multi_precision and dtype != np.float32:
                entry.master = recved.astype(np.float32)
            self.dense[key] = entry
            return [self._reply(req)]
        if dtype != entry.dtype or recved.size != entry.value.size:
            raise BadRequest(key, f"push of {recved.size} {dtype.name} values to a key of {entry.value.size} "
                                  f"{entry.dtype.name}")
        grad = recved.astype(np.float32) if entry.master is not None else recved
        if self.sync_mode:
            if not entry.requests:
                entry.merged = grad              # the message's buffer, never written: the 2nd push sums elsewhere
            elif len(entry.requests) == 1:
                if entry.merge_buffer is None or entry.merge_buffer.dtype != grad.dtype:
                    entry.merge_buffer = np.empty_like(grad)
                entry.merged = np.add(entry.merged, grad, out=entry.merge_buffer)
            else:
                entry.merged += grad
            entry.requests.append(req)
            if len(entry.requests) < self.num_workers:
                return []
            grad, requests = entry.merged, entry.requests
            entry.requests = []
        else:
            requests = [req]
            if self.optimizer is None:
                raise BadRequest(key, "dist_async push with no optimizer set (the stock server aborts: "
                                      "'Updater needs to be set for async mode')")
        self._apply_dense(key, entry, grad)
        return [self._reply(r, self._dense_kv(entry, r, kv) if r.meta.pull else None) for r in requests]

    def _apply_dense(self, key: int, entry: DenseEntry, grad: np.ndarray) -> None:
        entry.payload = None
        if self.optimizer is None:
            entry.stored[...] = grad
        else:
            if entry.states is None:
                entry.states = self._new_states(entry.stored)
            self.optimizer.update(key, entry.stored, grad, entry.states)
        entry.publish()

    def _dense_kv(self, entry: DenseEntry, req: Request, kv: KVPairs) -> KVPairs:
        if entry.payload is None:   # every worker pulls the same value after an update: serialize it once
            entry.payload = entry.value.tobytes()
        payload = entry.payload
        return KVPairs(kv.keys, payload, np.array([len(payload)], np.int32))

    def _dense_pull_reply(self, req: Request, key: int, kv: KVPairs, dtype: np.dtype) -> tuple[int, Message]:
        entry = self.dense.get(key)
        if entry is None:
            raise BadRequest(key, "pull of a key that was never initialized (init it first)")
        if dtype != entry.dtype:
            raise BadRequest(key, f"pull as {dtype.name} of a {entry.dtype.name} key")
        self._check_poison(req.sender, key)
        return self._reply(req, self._dense_kv(entry, req, kv))

    # ------------------------------------------------------------------------------------------------------------
    # 2-bit compressed pushes (DataHandleCompressed)

    def _compressed(self, msg: Message, command: mx.DataCommand, kv: KVPairs) -> list[tuple[int, Message]]:
        req = Request(msg.sender, msg.meta)
        if command.dtype_flag != mx.FLOAT32:
            raise BadRequest(None, "gradient compression is supported for float32 only")
        if not msg.meta.push:
            if len(kv.keys) != 1:
                raise BadRequest(None, f"a compressed pull carries one key, got {len(kv.keys)}")
            return [self._dense_pull_reply(req, self._decode_key(int(kv.keys[0])), kv, command.dtype)]
        if len(kv.keys) != 2 or len(kv.lens) != 2 or len(kv.vals) != int(kv.lens[1]):
            raise BadRequest(None, f"a compressed push carries 2 keys and 2 lens matching the values, got "
                                   f"keys {len(kv.keys)} lens {kv.lens.tolist()} vals {len(kv.vals)} bytes")
        original_size = self._decode_key(int(kv.keys[0]))
        key = self._decode_key(int(kv.keys[1]))
        if self.compression.kind == 0:
            raise BadRequest(key, "compressed push but gradient compression was never set")
        try:
            grad = dequantize_2bit(bytes(kv.vals), original_size, self.compression.threshold)
        except CompressionError as exc:
            raise BadRequest(key, str(exc)) from None
        return self._dense_push(req, key, np.dtype(np.float32), grad, kv)

    # ------------------------------------------------------------------------------------------------------------
    # row_sparse keys (DataHandleRowSparse), with lazy row tables

    # ------------------------------------------------------------------------------------------------------------
    # reading which rows exist, through virtual row_sparse keys a stock worker can pull (worker.fetch_rows)

    def _prepare_rows_query(self, sender: int, body: dict) -> None:
        key = int(body["key"])
        entry = self.sparse.get(key)
        ids = entry.table.row_ids() if entry is not None else np.zeros(0, np.uint64)
        self.row_queries[sender] = (key, np.sort(ids))

    def _virtual_pull(self, req: Request, key: int, command: mx.DataCommand, kv: KVPairs,
                      row_ids: np.ndarray) -> tuple[int, Message]:
        if req.sender not in self.row_queries:
            raise BadRequest(key, "pull of a row-listing key without a LAZY_ROWS command first")
        queried, ids = self.row_queries[req.sender]
        entry = self.sparse.get(queried)
        if key == mx.ROWS_HEADER_KEY:
            if command.dtype != np.float64:
                raise BadRequest(key, "the row-listing key is float64")
            width = mx.ROWS_WIDTH
            padded = np.full((len(ids) + width - 1) // width * width, -1.0)
            padded[:len(ids)] = ids
            chunks = padded.reshape(-1, width)
            table = np.concatenate([self._rows_header(queried, ids), chunks])
            if len(row_ids) and int(row_ids[-1]) >= len(table):
                raise BadRequest(key, f"row-listing row {int(row_ids[-1])} beyond the {len(table)} this server has")
            rows = table[row_ids]
        elif mx.is_flat_state_key(key):
            rows = self._flat_state_rows(key, command, queried, ids, row_ids)
        else:
            state = (key - mx.STATE_KEY_BASE) % mx.MAX_STATES
            if entry is None or (key - mx.STATE_KEY_BASE) // mx.MAX_STATES != queried:
                raise BadRequest(key, f"state pull for a key other than the one queried ({queried})")
            if state >= entry.table.num_states:
                raise BadRequest(key, f"key {queried} has {entry.table.num_states} optimizer states, not {state + 1}")
            global_ids = row_ids.astype(np.uint64) + np.uint64(entry.row_offset)
            slots = entry.table.lookup(global_ids)
            if np.any(slots < 0):
                missing = int(global_ids[np.argmax(slots < 0)])
                raise BadRequest(key, f"state of row {missing} of key {queried} requested, but the row does not exist")
            rows = entry.table.states(slots)[state]
        payload = rows.astype(command.dtype, copy=False).tobytes()
        lens = np.full(len(kv.keys), rows.shape[1] if rows.ndim == 2 else 0, np.int32)
        lens[0] = 0
        return self._reply(req, KVPairs(kv.keys, payload, lens))

    # ------------------------------------------------------------------------------------------------------------
    # optimizer states and update counts for worker checkpoints (kvstore_lazy.integration: save_states/load_states),
    # and string-key names of the virtual keys

    def register_alias(self, body: dict) -> None:
        """LAZY_ALIAS: requests for int `alias` (a string key of a string-key KVStore) mean virtual key `key`."""
        alias, target = int(body["alias"]), int(body["key"])
        if not mx.is_virtual_key(target) or mx.is_virtual_key(alias) or alias < 0:
            raise ValueError(f"alias {alias} -> {target}: the target must be a virtual key and the alias not")
        if alias in self.sparse or alias in self.dense or alias in self.specs:
            raise ValueError(f"alias {alias} -> {target}: key {alias} already holds values")
        known = self.aliases.get(alias)
        if known is not None and known != target:
            raise ValueError(f"key {alias} is already an alias of {known}, not {target}")
        self.aliases[alias] = target

    def set_update_counts(self, body: dict) -> None:
        """LAZY_SET_COUNTS: restore the optimizer's update count of a key (and num_update), per server rank when the
        checkpoint came from as many servers, else their maximum (counts are kept per server shard)."""
        if self.optimizer is None:
            raise ValueError("update counts restored before an optimizer was set")
        key = int(body["key"])
        counts, num_update = list(body.get("counts", [])), list(body.get("num_update", []))

        def mine(values: list) -> int:
            if not values:
                return 0
            return int(values[self.rank]) if len(values) == self.num_servers else int(max(values))

        self.optimizer.restore_count(key, mine(counts), mine(num_update))   # issue 11: checked (bounded scheduler)

    def _rows_header(self, key: int, ids: np.ndarray) -> np.ndarray:
        """Local row 0 of ROWS_HEADER_KEY: [rows listed (row_sparse) or elements here (dense), optimizer states,
        row size, kind (0 absent, 1 row_sparse, 2 dense), this server's update count of the key, num_update]."""
        header = np.zeros((1, mx.ROWS_WIDTH))
        sparse, dense = self.sparse.get(key), self.dense.get(key)
        if sparse is not None:
            header[0, :4] = [len(ids), sparse.table.num_states, sparse.row_size, 1]
        elif dense is not None:
            header[0, :4] = [dense.value.size, len(dense.states or []), 0, 2]
        if self.optimizer is not None:
            header[0, 4:6] = [self.optimizer._index_update_count.get(key, 0), self.optimizer.num_update]
        return header

    def _flat_state_target(self, vkey: int, queried: int, ids: np.ndarray, state: int):
        """(entry, number of state values this server holds for the query) of a flat-state request."""
        sparse, dense = self.sparse.get(queried), self.dense.get(queried)
        if sparse is not None:
            if state >= sparse.table.num_states:
                raise BadRequest(vkey, f"key {queried} has {sparse.table.num_states} optimizer states, not {state + 1}")
            return sparse, len(ids) * sparse.row_size
        if dense is not None:
            return dense, dense.value.size
        raise BadRequest(vkey, f"optimizer state of key {queried}, which this server does not hold")

    @staticmethod
    def _chunk_count(n: int) -> int:
        return (n + mx.ROWS_WIDTH - 1) // mx.ROWS_WIDTH

    def _flat_state_rows(self, vkey: int, command: mx.DataCommand, queried: int, ids: np.ndarray,
                         row_ids: np.ndarray) -> np.ndarray:
        if command.dtype != np.float32:
            raise BadRequest(vkey, "the optimizer-state keys are float32")
        if len(row_ids) == 0:   # a server that holds nothing of the key gets the master key only
            return np.zeros((0, mx.ROWS_WIDTH), np.float32)
        state = vkey - mx.FLAT_STATE_BASE
        entry, n = self._flat_state_target(vkey, queried, ids, state)
        if isinstance(entry, SparseEntry):
            slots = entry.table.lookup(ids)
            if np.any(slots < 0):
                raise BadRequest(vkey, f"a listed row of key {queried} no longer exists")
            flat = entry.table.states(slots)[state].reshape(-1)
        else:
            if not entry.states or state >= len(entry.states):
                raise BadRequest(vkey, f"key {queried} has {len(entry.states or [])} optimizer states here, "
                                       f"not {state + 1}")
            flat = entry.states[state].reshape(-1)
        chunks = self._chunk_count(n)
        if int(row_ids[-1]) >= chunks:
            raise BadRequest(vkey, f"state row {int(row_ids[-1])} beyond the {chunks} this server has")
        padded = np.zeros(chunks * mx.ROWS_WIDTH, np.float32)
        padded[:n] = flat
        return padded.reshape(chunks, mx.ROWS_WIDTH)[row_ids]

    def _virtual_push(self, req: Request, key: int, command: mx.DataCommand, kv: KVPairs,
                      row_ids: np.ndarray) -> tuple[int, Message]:
        """Restore through the virtual keys: ROWS_HEADER_KEY rows name the rows (of the key the last LAZY_ROWS
        command named) whose states the following FLAT_STATE_BASE + j pushes carry. Answered at once (no round)."""
        if req.sender not in self.row_queries:
            raise BadRequest(key, "push to a virtual key without a LAZY_ROWS command first")
        queried, ids = self.row_queries[req.sender]
        values = self._rows_of(key, None, command.dtype, kv, row_ids)
        if values.shape[1] != mx.ROWS_WIDTH:
            raise BadRequest(key, f"virtual rows are {mx.ROWS_WIDTH} wide, not {values.shape[1]}")
        if key == mx.ROWS_HEADER_KEY:
            if command.dtype != np.float64:
                raise BadRequest(key, "the row-listing key is float64")
            entry = self.sparse.get(queried)
            if entry is None:
                raise BadRequest(key, f"row listing pushed for key {queried}, which holds no row_sparse value here")
            count = int(values[0, 0]) if row_ids[0] == 0 else -1
            if count < 0 or not np.array_equal(row_ids, np.arange(1 + self._chunk_count(count))):
                raise BadRequest(key, "a pushed row listing must be row 0 = [count] then every chunk of ids")
            listed = values[1:].reshape(-1)[:count]
            new_ids = listed.astype(np.int64)
            lo, hi = entry.row_offset, entry.row_offset + entry.local_rows
            if (np.any(new_ids != listed) or np.any(new_ids[1:] <= new_ids[:-1])
                    or (count and (new_ids[0] < lo or new_ids[-1] >= hi))):
                raise BadRequest(key, f"pushed row ids must be sorted, unique and within [{lo}, {hi})")
            self.row_queries[req.sender] = (queried, new_ids.astype(np.uint64))
            return self._reply(req)
        if not mx.is_flat_state_key(key):
            raise BadRequest(key, "push to a virtual row-listing key")
        if command.dtype != np.float32:
            raise BadRequest(key, "the optimizer-state keys are float32")
        if self.optimizer is None:
            raise BadRequest(key, "optimizer states pushed before an optimizer was set")
        state = key - mx.FLAT_STATE_BASE
        entry, n = self._flat_state_target(key, queried, ids, state)
        if not np.array_equal(row_ids, np.arange(self._chunk_count(n))):
            raise BadRequest(key, f"a state push for key {queried} must carry all {self._chunk_count(n)} rows "
                                  f"({n} values) this server holds")
        flat = values.reshape(-1)[:n]
        if isinstance(entry, SparseEntry):
            slots = entry.table.ensure(ids, lambda missing: self._initial_rows(queried, entry, missing))
            states = entry.table.states(slots)
            states[state] = flat.reshape(len(ids), entry.row_size).astype(entry.table.dtype)
            entry.table.set_states(slots, states)
        else:
            if entry.states is None:
                entry.states = self._new_states(entry.stored)
            if state >= len(entry.states):
                raise BadRequest(key, f"key {queried} has {len(entry.states)} optimizer states, not {state + 1}")
            entry.states[state][...] = flat.reshape(entry.states[state].shape)
        return self._reply(req)

    def _row_sparse(self, msg: Message, command: mx.DataCommand, kv: KVPairs) -> list[tuple[int, Message]]:
        req = Request(msg.sender, msg.meta)
        if len(kv.keys) == 0:
            raise BadRequest(None, "row_sparse request without keys")
        key = self._decode_key(int(kv.keys[0]))
        key = self.aliases.get(key, key)   # a string-key KVStore's name for a virtual key
        # Row keys are master key + local row id; decode in uint64 (the stock server truncates to int).
        row_ids = (kv.keys[1:] - kv.keys[0]).astype(np.int64)
        if np.any(kv.keys[1:] < kv.keys[0]):
            raise BadRequest(key, "row key below its master key")
        if len(row_ids) and int(kv.keys[1:].max() - kv.keys[0]) >= 1 << 63:   # issue 11: int64 would wrap
            raise BadRequest(key, f"row id {int(kv.keys[1:].max() - kv.keys[0])} is beyond 2^63 - 1")
        if len(row_ids) > 1 and not np.all(row_ids[1:] > row_ids[:-1]):
            bad = int(np.argmax(row_ids[1:] <= row_ids[:-1])) + 1
            raise BadRequest(key, f"row ids are not sorted and unique (row {int(row_ids[bad])} at position {bad})")
        if mx.is_virtual_key(key):
            if msg.meta.push:
                if len(row_ids) == 0:   # an (empty) kv.init of a virtual key, for string-key KVStores
                    return [self._reply(req)]
                return [self._virtual_push(req, key, command, kv, row_ids)]
            return [self._virtual_pull(req, key, command, kv, row_ids)]
        if msg.meta.push:
            return self._sparse_push(req, key, command, kv, row_ids)
        return [self._sparse_pull(req, key, command, kv, row_ids)]

    def _sparse_entry_for_init(self, key: int, dtype: np.dtype, row_size: int | None, num_rows: int) -> SparseEntry:
        spec = self.specs.get(key)
        if spec is not None:
            if dtype != spec.dtype:
                raise BadRequest(key, f"init as {dtype.name} but declared {spec.dtype.name}")
            if row_size is not None and row_size != spec.row_size:
                raise BadRequest(key, f"init rows of {row_size} elements but declared {spec.row_size}")
            if spec.total_rows * spec.row_size >= spec.bound:
                offset, local_rows = mx.row_partition(spec.total_rows, self.num_servers, self.rank)
            else:
                offset, local_rows = 0, spec.total_rows
            row_size = spec.row_size
        else:
            if num_rows == 0:
                raise BadRequest(key, "row_sparse init with no rows for a key that was not declared lazy "
                                      "(declare it with kvstore_lazy.worker.init_lazy, or init with rows)")
            offset, local_rows = 0, num_rows
        num_states = self.optimizer.num_states() if self.optimizer is not None else 0
        table = RowTable(row_size, self._storage_dtype(dtype), num_states=num_states)
        return SparseEntry(dtype=dtype, row_size=row_size, table=table, local_rows=local_rows, row_offset=offset,
                           spec=spec)

    def _rows_of(self, key: int, entry: SparseEntry | None, dtype: np.dtype, kv: KVPairs,
                 row_ids: np.ndarray) -> np.ndarray:
        """Validate a push's lens/vals against its rows and return the values as (rows, row_size)."""
        num_rows = len(row_ids)
        if len(kv.lens) != len(kv.keys) or (len(kv.lens) and kv.lens[0] != 0):
            raise BadRequest(key, f"row_sparse push needs one len per key and lens[0] == 0, got {kv.lens[:4]}")
        if num_rows == 0:
            return np.zeros((0, entry.row_size if entry else 0), dtype)
        # issue 11, defect 9: the values, not lens[1:], give the row size. A stock worker's lens are bytes per row,
        # but MXNet's KVStoreDist shares one lens buffer per key between pushes and row_sparse pulls, and a pull's
        # reply (lens in elements, RowSparsePullResponse) arriving while a push of the key is still being sent
        # overwrites the push's lens: [0, 10, 10] for two 40-byte rows. Keys and values are intact.
        row_bytes, extra = divmod(len(kv.vals), num_rows)
        row_size = row_bytes // dtype.itemsize
        if extra or row_bytes == 0 or row_bytes % dtype.itemsize:
            raise BadRequest(key, f"{len(kv.vals)} value bytes are not {num_rows} rows of whole {dtype.name} values")
        lens = kv.lens[1:]
        if np.any((lens != row_bytes) & (lens != row_size)):
            raise BadRequest(key, f"row lens must each be a row's bytes ({row_bytes}) or elements ({row_size}), got "
                                  f"lens {kv.lens[:8].tolist()} for {len(kv.keys)} keys, {len(kv.vals)} value bytes")
        if entry is not None and row_size != entry.row_size:
            raise BadRequest(key, f"rows of {row_size} elements pushed to a key of {entry.row_size}")
        return np.frombuffer(kv.vals, dtype=dtype).reshape(num_rows, row_size)

    def _check_rows(self, key: int, entry: SparseEntry, row_ids: np.ndarray) -> None:
        if len(row_ids) and int(row_ids[-1]) >= entry.local_rows:
            raise BadRequest(key, f"row {int(row_ids[-1]) + entry.row_offset} is out of range: the key has "
                                  f"{entry.local_rows + entry.row_offset} rows"
                                  + (f" (this server holds global rows [{entry.row_offset}, "
                                     f"{entry.row_offset + entry.local_rows}))" if entry.row_offset else ""))

    def _sparse_push(self, req: Request, key: int, command: mx.DataCommand, kv: KVPairs,
                     row_ids: np.ndarray) -> list[tuple[int, Message]]:
        entry = self.sparse.get(key)
        if entry is None:
            if key in self.dense:
                raise BadRequest(key, "row_sparse push to a dense key")
            values = self._rows_of(key, None, command.dtype, kv, row_ids)
            entry = self._sparse_entry_for_init(key, command.dtype, values.shape[1] if len(values) else None,
                                                len(row_ids))
            self._check_rows(key, entry, row_ids)
            self.sparse[key] = entry
            if len(row_ids):
                # Rows given at init are stored as sent (this is also how a checkpoint is restored).
                slots = entry.table.ensure(row_ids.astype(np.uint64) + np.uint64(entry.row_offset),
                                           lambda ids: np.zeros((len(ids), entry.row_size), entry.table.dtype))
                entry.table.set_weights(slots, values.astype(entry.table.dtype))
            return [self._reply(req)]
        if command.dtype != entry.dtype:
            raise BadRequest(key, f"push as {command.dtype.name} to a {entry.dtype.name} key")
        values = self._rows_of(key, entry, command.dtype, kv, row_ids)
        self._check_rows(key, entry, row_ids)
        grad = values.astype(entry.table.dtype) if entry.table.dtype != command.dtype else values
        if self.sync_mode:
            if not entry.requests:
                entry.merged_ids, entry.merged_vals = row_ids.copy(), grad.copy()
            elif len(row_ids):
                entry.merged_ids, entry.merged_vals = kernels.merge_rows(entry.merged_ids, entry.merged_vals, row_ids,
                                                                         grad)
            entry.requests.append(req)
            if len(entry.requests) < self.num_workers:
                return []
            row_ids, grad, requests = entry.merged_ids, entry.merged_vals, entry.requests
            entry.requests, entry.merged_ids, entry.merged_vals = [], None, None
        else:
            requests = [req]
            if self.optimizer is None:
                raise BadRequest(key, "dist_async push with no optimizer set (the stock server aborts)")
        if len(row_ids):
            self._apply_rows(key, entry, row_ids, grad)
        return [self._reply(r) for r in requests]

    def _apply_rows(self, key: int, entry: SparseEntry, row_ids: np.ndarray, grad: np.ndarray) -> None:
        global_ids = row_ids.astype(np.uint64) + np.uint64(entry.row_offset)
        slots = entry.table.ensure(global_ids, lambda ids: self._initial_rows(key, entry, ids))
        if self.optimizer is None:
            entry.table.set_weights(slots, grad)
            return
        tables = entry.table.arrays()
        if self.optimizer.update_rows(key, tables[0], tables[1:], slots, grad):
            return
        del tables
        weights = entry.table.weights(slots)
        states = entry.table.states(slots)
        self.optimizer.update(key, weights, grad, states, row_sparse=True)
        entry.table.set_weights(slots, weights)
        entry.table.set_states(slots, states)

    def _initial_rows(self, key: int, entry: SparseEntry, global_ids: np.ndarray) -> np.ndarray:
        if entry.spec is None:
            # Not declared: every row arrived at init, so a missing row can only be zero (an empty gradient row
            # of the stock server's dense-shaped rsp); the range check above keeps ids within the init rows.
            return np.zeros((len(global_ids), entry.row_size), entry.table.dtype)
        return entry.initial_rows(key, global_ids)

    def _sparse_pull(self, req: Request, key: int, command: mx.DataCommand, kv: KVPairs,
                     row_ids: np.ndarray) -> tuple[int, Message]:
        entry = self.sparse.get(key)
        if len(row_ids) == 0 and entry is None and key not in self.specs:
            raise BadRequest(key, "row_sparse pull of a key that was never initialized or declared")
        if entry is None:
            raise BadRequest(key, "row_sparse pull before the key was initialized (kv.init it first)")
        if command.dtype != entry.dtype:
            raise BadRequest(key, f"pull as {command.dtype.name} of a {entry.dtype.name} key")
        self._check_rows(key, entry, row_ids)
        self._check_poison(req.sender, key)
        if len(row_ids) == 0:
            return self._reply(req, KVPairs(kv.keys, b"", np.zeros(len(kv.keys), np.int32)))
        global_ids = row_ids.astype(np.uint64) + np.uint64(entry.row_offset)
        if self.materialize == MATERIALIZE_ON_TOUCH or entry.spec is None:
            slots = entry.table.ensure(global_ids, lambda ids: self._initial_rows(key, entry, ids))
            rows = entry.table.weights(slots)
        else:
            slots = entry.table.lookup(global_ids)
            rows = np.empty((len(global_ids), entry.row_size), entry.table.dtype)
            present = slots >= 0
            rows[present] = entry.table.weights(slots[present])
            if not present.all():
                rows[~present] = self._initial_rows(key, entry, global_ids[~present])
        payload = rows.astype(entry.dtype, copy=False).tobytes()
        lens = np.full(len(kv.keys), entry.row_size, np.int32)   # in elements, as the stock server sends
        lens[0] = 0
        return self._reply(req, KVPairs(kv.keys, payload, lens))

    # ------------------------------------------------------------------------------------------------------------
    # visibility

    def stats(self) -> dict:
        keys = {}
        for key, entry in sorted(self.sparse.items()):
            keys[str(key)] = {"rows": len(entry.table), "bytes": entry.table.nbytes(),
                              "lazy": entry.spec is not None, "local_rows": entry.local_rows,
                              "row_offset": entry.row_offset}
        dense_bytes = sum(e.value.nbytes + (e.master.nbytes if e.master is not None else 0)
                          for e in self.dense.values())
        return {"rank": self.rank, "sparse": keys, "dense_keys": len(self.dense), "dense_bytes": dense_bytes,
                "bad_requests": self.bad_requests}


# ----------------------------------------------------------------------------------------------------------------
# issue 11: what one peer can make the server hold (defect 5) and what a declaration may say (defect 8)

MAX_POISONED = 4096              # (worker, key) pairs remembered for a failing next pull; past it, every pull fails
MAX_DECLARED_KEYS = 4096         # lazy keys one server accepts declarations of
MAX_ROW_ELEMENTS = 1 << 16       # elements in one declared row (256 KiB of float32)


def _check_declaration(body) -> None:
    """ValueError naming the field unless a LAZY_DECLARE body has exactly the types and ranges a worker's
    lazy_spec_body writes: no floats for ints (1.5 rows), no strings for lists ("8"), no null dtype."""
    if not isinstance(body, dict):
        raise ValueError(f"a lazy declaration is a JSON object, got {type(body).__name__}")

    def integer(name: str, low: int, high: int, default=None) -> int:
        value = body.get(name, default)
        if type(value) is not int or not low <= value < high:
            raise ValueError(f"lazy declaration: {name} = {value!r} must be an integer in [{low}, {high})")
        return value

    integer("key", 0, mx.ROWS_HEADER_KEY)
    integer("rows", 1, 1 << 63)
    integer("seed", -(1 << 63), 1 << 64, 0)
    integer("bound", 1, 1 << 63, 1_000_000)
    shape = body.get("row_shape")
    if not isinstance(shape, list) or not shape or any(type(d) is not int or d < 1 for d in shape):
        raise ValueError(f"lazy declaration: row_shape = {shape!r} must be a non-empty list of integers >= 1")
    if math.prod(shape) > MAX_ROW_ELEMENTS:
        raise ValueError(f"lazy declaration: rows of {math.prod(shape)} elements, more than this server's limit of "
                         f"{MAX_ROW_ELEMENTS}")
    if not isinstance(body.get("dtype", "float32"), str) or not isinstance(body.get("init"), str):
        raise ValueError(f"lazy declaration: dtype = {body.get('dtype')!r} and init = {body.get('init')!r} must be "
                         f"strings")


# ----------------------------------------------------------------------------------------------------------------
# snapshots: what a restarted server needs to carry on (rows, states, dense values, mode, optimizer, declarations)

def snapshot_state(server: KVServer) -> tuple[dict, dict[int, dict]]:
    """(server-wide JSON state, per-key tables) for checkpoint.write_snapshot. Pending sync-round merges are not
    included: their pushes were not acknowledged yet."""
    opt = server.optimizer
    meta = {
        "sync_mode": server.sync_mode, "multi_precision": server.multi_precision,
        "compression": [server.compression.kind, float(server.compression.threshold)],
        "optimizer": server.optimizer_body.decode("latin-1") if server.optimizer_body else None,
        "optimizer_counts": None if opt is None else {
            "num_update": int(opt.num_update),
            "counts": {str(k): int(v) for k, v in opt._index_update_count.items()}},
        "specs": [spec.to_json() for spec in server.specs.values()],
        "aliases": {str(alias): key for alias, key in server.aliases.items()},
    }
    tables: dict[int, dict] = {}
    for key, entry in server.sparse.items():
        ids, weights, states = entry.table.items()
        tables[key] = {"row_ids": ids, "weights": weights, "states": states,
                       "meta": {"kind": "row_sparse", "dtype": entry.dtype.name, "row_size": entry.row_size,
                                "local_rows": entry.local_rows, "row_offset": entry.row_offset,
                                "lazy": entry.spec is not None}}
    for key, dense in server.dense.items():
        tables[key] = {"row_ids": np.zeros(1, np.uint64), "weights": dense.stored.reshape(1, -1),
                       "states": [s.reshape(1, -1) for s in (dense.states or [])],
                       "meta": {"kind": "dense", "dtype": dense.dtype.name}}
    return meta, tables


def restore_state(server: KVServer, meta: dict, tables: dict[int, dict]) -> None:
    """Inverse of snapshot_state, into a fresh server of the same rank."""
    server.sync_mode = bool(meta.get("sync_mode"))
    server.multi_precision = bool(meta.get("multi_precision"))
    kind, threshold = meta.get("compression", [0, 0.5])
    server.compression = Compression(int(kind), np.float32(threshold))
    for spec in meta.get("specs", []):
        server.declare(LazySpec.from_json(spec))
    server.aliases.update({int(alias): int(key) for alias, key in meta.get("aliases", {}).items()})
    if meta.get("optimizer"):
        server._set_optimizer(meta["optimizer"].encode("latin-1"))
        counts = meta.get("optimizer_counts") or {}
        server.optimizer.num_update = counts.get("num_update", server.optimizer.num_update)
        server.optimizer._index_update_count.update({int(k): v for k, v in counts.get("counts", {}).items()})
    for key, table in tables.items():
        info = table["meta"]
        dtype = np.dtype(info["dtype"])
        if info["kind"] == "dense":
            entry = DenseEntry(dtype=dtype, value=table["weights"].reshape(-1).astype(dtype))
            if server.multi_precision and dtype != np.float32:
                entry.master = table["weights"].reshape(-1).astype(np.float32)
            entry.states = [s.reshape(-1).copy() for s in table["states"]] or None
            server.dense[key] = entry
            continue
        rows = RowTable(int(info["row_size"]), table["weights"].dtype, num_states=len(table["states"]))
        slots = rows.ensure(table["row_ids"], lambda ids: np.zeros((len(ids), rows.row_size), rows.dtype))
        rows.set_weights(slots, table["weights"])
        if table["states"]:
            rows.set_states(slots, table["states"])
        if server.optimizer is not None and rows.num_states != server.optimizer.num_states():
            rows.set_num_states(server.optimizer.num_states())
        server.sparse[key] = SparseEntry(dtype=dtype, row_size=int(info["row_size"]), table=rows,
                                         local_rows=int(info["local_rows"]), row_offset=int(info["row_offset"]),
                                         spec=server.specs.get(key) if info.get("lazy") else None)


def _check_runs(optimizer: Optimizer) -> None:
    """One dense and one row_sparse step on a copy: a pickle of a real optimizer class whose hyper-parameters cannot
    run (a string learning rate) is refused by kController instead of failing every later push."""
    trial = copy.deepcopy(optimizer)
    for row_sparse in (False, True):
        weight = np.zeros((1, 1), np.float32)
        try:
            with np.errstate(all="ignore"):   # zeros may make 0/0 for a valid optimizer: only exceptions count
                trial.update(0, weight, np.zeros((1, 1), np.float32), trial.init_states(weight),
                             row_sparse=row_sparse)
        except Exception as exc:
            raise ValueError(f"optimizer {optimizer.name} cannot run: {exc!r}") from None


def _retyped(table: RowTable, dtype) -> RowTable:
    ids, weights, states = table.items()
    fresh = RowTable(table.row_size, dtype, num_states=table.num_states)
    slots = fresh.ensure(ids, lambda missing: np.zeros((len(missing), table.row_size), dtype))
    fresh.set_weights(slots, weights.astype(dtype))
    fresh.set_states(slots, [s.astype(dtype) for s in states])
    return fresh
