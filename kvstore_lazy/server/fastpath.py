"""The fast path for the server's most frequent requests: a pull answered whole in one pass, a dense push handed to
its round, with no DataRequest decoded.

Owns: recognising a plain pull (a dense key's value, or float32 row_sparse rows of a key whose table is a plain
store of them, see ``RowSparseKey.resident_rows``) straight from its decoded meta and raw key frame, and answering
it with the same bytes :class:`~kvstore_lazy.server.core.KVServer`'s general path would send. A row_sparse pull's
rows are checked, probed and gathered into the reply in one compiled call (``protocol/_fast.c`` ``gather_rows``);
the rows not in the table (new, pending admission, or kept elsewhere) are asked of ``RowSparseKey.pull``, as a pull
of just those rows, and put in their places: ``server.keys`` alone decides what a row not in memory is. When it
says such a row is its initial value, left absent, and the initializer's values are the compiled loop's
(``RowSparseKey.absent_fill``: Uniform, a scalar constant), the same call fills them in. Likewise a plain dense
push or pushpull (a gradient of a stored key's size and dtype) goes from its frames straight to the key's round
(``KVServer.train_push``, the general path's merge, update and replies). A pull's rows' slots are kept until the
same worker's next push of that key: a worker pushes the gradients of the rows it just pulled, and a push whose keys
frame is the pull's, byte for byte, hands them on (to the update in dist_async, to its round in dist_sync, which
merges them with the gradients: ``RowSparseKey.apply``'s `slots`) instead of the rows being looked up again, as
long as the key's ``slot_token`` is what it was at the pull (no row moved since). A ~64 KiB memcmp replaces a probe
of 8,192 rows of the table's index.
Does not own: anything else. Whatever it does not take (a row_sparse push, a command, an unusual frame layout, a
key range, alias, dtype or poison case, unsorted or out-of-range row ids) it hands back (None) before changing
anything, and the general path decides, logs and answers. Nor the server: it reads it through :class:`Server`, the
narrow interface ``KVServer`` passes itself in as (what the fast path reads per request, and ``train_push``, the one
method it calls), so this module imports nothing of ``core``: core imports it, never the other way round.

Every check of the general path that can refuse such a request is repeated here as a condition for taking it
(``protocol.kv.parse``, ``KVServer.handle``/``_data``/``_rows_pull``/``_dense_pull``/``_dense_push``), so a request
that would be refused never gets a fast answer; tests/test_fastpath.py compares both paths' replies and the state
they leave byte for byte.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from kvstore_lazy.protocol import kv as wire
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.fast import native
from kvstore_lazy.protocol.kv import MAX_ROW_ID, DataRequest
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.server.keys import DenseKey, RowSparseKey
from kvstore_lazy.server.modes import MATERIALIZE_ON_TOUCH

_ROWS_F32 = mx.command_code(mx.ROW_SPARSE, mx.FLOAT32)
_DENSE = {mx.command_code(mx.DEFAULT, flag): dtype for flag, dtype in mx.MSHADOW_DTYPES.items()}
_I32 = struct.Struct("<i")
_MAX_LEN = (1 << 31) - 1
PULLED_BYTES = 32 << 20       # what the pulls' kept slots and keys frames hold at most, all workers and keys together
MISSING_CHUNK = 1 << 15       # rows not in memory a pull takes from its key at once (a checkpoint asks 8 MiB a pull)
KEEP_SLOTS = 1 << 16          # a pull of at most this many rows keeps their slots for the push that follows
_gather_rows = native.gather_rows
_row_push = native.row_push
_same_bytes = native.same_bytes
_F32 = np.dtype(np.float32)


class Aliases(Protocol):
    aliases: dict[int, int]      # string-key int -> virtual key (state_transfer.StateTransfer)


class Server(Protocol):
    """What the fast path reads of the server (read per request: modes and keys change between requests) and the
    one thing it calls of it, ``train_push``: a push it took goes on as the general path's (KVServer is one)."""

    key_range: wire.KeyRange
    poisoned: set[tuple[int, int]]
    materialize: str
    sync_mode: bool

    @property
    def keys(self) -> Mapping[int, DenseKey | RowSparseKey]: ...

    @property
    def transfer(self) -> Aliases: ...

    @property
    def optimizer(self) -> object: ...

    def train_push(self, request: DataRequest, entry: DenseKey | RowSparseKey, grad,
                   slots: tuple | None = None) -> list[tuple[int, Message]]: ...


class FastPath:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.begin = server.key_range.begin
        self.span = server.key_range.end - server.key_range.begin
        self.answered = 0          # pulls answered here (tests, profiles)
        self.partial = 0           # of them, pulls with rows RowSparseKey.pull made
        self.pushes = 0            # dense pushes handed to their key's round here
        self.reused = 0            # pushes that took their rows' slots from the pull before them
        self.touch = MATERIALIZE_ON_TOUCH
        # (sender, key) -> (key entry, its slot_token, the pull's keys frame, the rows' slots): a pull's rows for
        # that worker's next push of the key (see the module docstring); taken (popped) by that push
        self._pulled: dict[tuple[int, int], tuple] = {}
        self._pulled_bytes = 0     # what they hold (their keys frames and slots): at most PULLED_BYTES, oldest out

    def answer(self, msg: Message) -> list[tuple[int, Message]] | None:
        """The replies to `msg` if it is a pull this path answers, else None (nothing was changed). Called by
        KVServer.handle after its own checks (an identified sender, a request, not a command), inside its handler
        of unexpected errors."""
        meta = msg.meta
        if meta.push is True:
            return self._rows_push(msg) if meta.head == _ROWS_F32 else self._dense_push(msg)
        if meta.pull is not True:
            return None
        data = msg.data
        if len(data) == 3:
            if len(data[2]) != len(data[0]) // 2:   # decode_kv: one int32 len per uint64 key
                return None
        elif len(data) != 2:
            return None
        raw = data[0]
        if len(raw) % 8 or not raw:
            return None
        key = int.from_bytes(raw[:8], "little") - self.begin
        if not 0 <= key < self.span or self.server.poisoned:
            return None
        got = self._rows_pull(msg, raw, key) if meta.head == _ROWS_F32 else self._dense_pull(meta.head, raw, key)
        if got is None:
            return None
        payload, lens = got
        self.answered += 1
        return [wire.pull_answer(msg.sender, meta, raw if type(raw) is bytes else bytes(raw), payload, lens)]

    def _rows_pull(self, msg: Message, raw, key: int) -> tuple | None:
        """A float32 row_sparse pull of a stored key: (payload, lens) of its reply, or None (nothing changed)."""
        server = self.server
        if len(raw) == 8 or key in server.transfer.aliases or mx.is_virtual_key(key):
            return None
        entry = server.keys.get(key)
        if type(entry) is not RowSparseKey:
            return None
        resident = entry.resident_rows()
        if resident is None:
            return None
        (table, slot_ids, shift, weights), row_offset, local_rows = resident
        store = server.materialize == self.touch
        # rows not in the table that are their initial values, left absent: filled in by the same call
        fill = None if store else entry.absent_fill()
        keep = len(raw) // 8 - 1 <= KEEP_SLOTS and entry.reuses_slots()
        slots = np.empty(len(raw) // 8 - 1, np.int64) if keep else None
        token = entry.slot_token() if keep else None
        got = _gather_rows(raw, table, slot_ids, shift, weights, row_offset, min(local_rows, MAX_ROW_ID + 1),
                           4 * entry.row_size, fill, slots)
        if got is None:
            return None
        payload, lens, missing, missing_ids = got
        del got
        if entry.disk is not None:    # the tier's hit rate counts the rows found in memory here too
            entry.disk.count(hits=(len(raw) - len(missing_ids or b"")) // 8 - 1)
        if missing_ids is None:
            self.partial += missing is not None
        else:
            if len(missing_ids) == len(raw) - 8:    # none of them was in the table: the gathered payload goes
                payload = None                      # before the key makes the rows (one reply's bytes at once)
            payload = self._missing_rows(msg, raw, key, entry, store, payload, missing, missing_ids)
            self.partial += 1
        if keep:   # (made after the rows' lookup: a removal since then shows in the token the push compares)
            self._keep_pulled((msg.sender, key), (entry, token, raw, slots, missing is None))
        return payload, lens

    def _keep_pulled(self, where: tuple[int, int], kept: tuple) -> None:
        """Keep a pull's slots for its worker's next push of the key. A pull no push follows (an evaluating worker,
        one that left, a key only pulled) would hold its entry for good: the oldest go past PULLED_BYTES."""
        self._drop_pulled(where)
        self._pulled[where] = kept
        self._pulled_bytes += len(kept[2]) + kept[3].nbytes
        while self._pulled_bytes > PULLED_BYTES and len(self._pulled) > 1:
            self._drop_pulled(next(iter(self._pulled)))

    def _drop_pulled(self, where: tuple[int, int]):
        kept = self._pulled.pop(where, None)
        if kept is not None:
            self._pulled_bytes -= len(kept[2]) + kept[3].nbytes
        return kept

    def _missing_rows(self, msg: Message, raw, key: int, entry: RowSparseKey, store: bool, payload, missing,
                      missing_ids):
        """The reply's payload with the rows not in the table: the key makes them (initial values, created or not,
        or wherever a tier keeps them), as it would for the whole pull; they go into the reply where they belong."""
        local_ids = np.frombuffer(missing_ids, np.int64)
        if payload is None:        # none of them was in the table
            return entry.pull(wire.row_pull(msg.sender, msg.meta, key, key + self.begin, local_ids), store=store,
                              known_absent=True)
        rows, where = np.frombuffer(payload, np.float32).reshape(-1, entry.row_size), np.frombuffer(missing, np.int64)
        # a large pull (a checkpoint's piece) takes its missing rows MISSING_CHUNK at a time: the reply's bytes and
        # a chunk's, not a second reply's worth of rows beside it
        for lo in range(0, len(local_ids), MISSING_CHUNK):
            values = entry.pull(wire.row_pull(msg.sender, msg.meta, key, key + self.begin,
                                              local_ids[lo:lo + MISSING_CHUNK]), store=store, known_absent=True)
            rows[where[lo:lo + MISSING_CHUNK]] = np.frombuffer(values, np.float32).reshape(-1, entry.row_size)
        del rows
        return memoryview(payload)

    def _dense_pull(self, head: int, raw, key: int) -> tuple | None:
        """A pull of a stored dense key in its dtype: (payload, lens) of its reply, or None."""
        dtype = _DENSE.get(head)
        if dtype is None or len(raw) != 8:
            return None
        entry = self.server.keys.get(key)
        if type(entry) is not DenseKey or entry.dtype != dtype:
            return None
        payload = entry.pull(dtype)
        if len(payload) > _MAX_LEN:
            return None
        return payload, _I32.pack(len(payload))

    def _rows_push(self, msg: Message) -> list[tuple[int, Message]] | None:
        """A float32 row_sparse push of at least one row to a stored key of its row size (what a worker sends for
        a gradient), checked in one compiled pass (``row_push``, as ``protocol.kv.parse`` does) and handed to the
        key's round without decoding a DataRequest; None for anything else: the init, a pushpull, no rows, another
        row size or dtype, rows beyond the key's, a virtual or aliased key, async with no optimizer."""
        meta, data = msg.meta, msg.data
        if meta.pull is not False or len(data) != 3:
            return None
        raw, vals, lens = data
        got = _row_push(raw, lens, len(vals), 4)
        if got is None:
            return None
        ids, row_size, master = got
        key = master - self.begin
        server = self.server
        if not 0 <= key < self.span or server.poisoned or key in server.transfer.aliases or mx.is_virtual_key(key):
            return None
        entry = server.keys.get(key)
        if type(entry) is not RowSparseKey or not entry.plain_gradient(_F32, row_size):
            return None
        if not server.sync_mode and server.optimizer is None:
            return None
        local_ids = np.frombuffer(ids, np.int64)
        if int(local_ids[-1]) >= entry.local_rows:
            return None
        values = np.frombuffer(vals, np.float32).reshape(len(local_ids), row_size)
        self.pushes += 1
        return server.train_push(wire.row_push(msg.sender, meta, key, raw, local_ids, values), entry,
                                 (local_ids, values), self._pulled_slots(msg.sender, key, entry, raw))

    def _pulled_slots(self, sender: int, key: int, entry: RowSparseKey, raw) -> tuple | None:
        """(slots, slot_token, whether every row was in the table): the slots the sender's last pull of `key` found
        for the rows of this push (its keys frame, `raw`), if they are still those rows' (the key's slot_token
        unchanged: no row moved since), else None; taken either way. The update checks the token again when it
        runs (a round's, later)."""
        kept = self._drop_pulled((sender, key))
        if kept is None:
            return None
        pulled_entry, token, pulled_raw, slots, complete = kept
        if pulled_entry is not entry or token != entry.slot_token() or not _same_bytes(raw, pulled_raw):
            return None
        self.reused += 1
        return slots, token, complete

    def _dense_push(self, msg: Message) -> list[tuple[int, Message]] | None:
        """A dense push or pushpull (what Gluon's Trainer sends for a dense parameter; not compressed) of a gradient
        to a stored key, taken from its frames to the key's round (``KVServer.train_push``: the merge, the update, the
        replies, a pushpull's with the new value) without decoding a DataRequest; None for anything else: the init,
        a multi-precision key, a wrong size or dtype, async with no optimizer."""
        meta, data = msg.meta, msg.data
        dtype = _DENSE.get(meta.head)
        if dtype is None or len(data) != 3:
            return None
        raw, vals, lens = data
        if len(raw) != 8 or len(lens) != 4 or _I32.unpack(lens)[0] != len(vals) or len(vals) % dtype.itemsize:
            return None
        key = int.from_bytes(raw, "little") - self.begin
        server = self.server
        if not 0 <= key < self.span or server.poisoned:
            return None
        entry = server.keys.get(key)
        if type(entry) is not DenseKey or not entry.plain_gradient(dtype, len(vals) // dtype.itemsize):
            return None
        if not server.sync_mode and server.optimizer is None:
            return None
        values = np.frombuffer(vals, dtype)
        self.pushes += 1
        return server.train_push(wire.dense_push(msg.sender, meta, key, bytes(raw), values), entry, values)
