"""Reading and restoring which rows exist and their optimizer states, through virtual keys a stock worker can use.

Owns: the LAZY_ROWS, LAZY_ALIAS and LAZY_SET_COUNTS commands and the virtual row_sparse keys of
``protocol.mxnet`` (``ROWS_HEADER_KEY`` and ``flat_state_key(j)``), as ``kvstore_lazy.worker.fetch_rows``,
``fetch_states`` and ``restore_states`` use them. A stock worker can only pull and push row_sparse arrays, so a
checkpoint of a lazy key goes: LAZY_ROWS names the key; a pull of ``ROWS_HEADER_KEY`` returns per server a header
row (:class:`~kvstore_lazy.protocol.kv.RowsHeader`) then the listed row ids; pulls of ``flat_state_key(j)`` return
state j of the listed rows, flattened into rows of ``ROWS_WIDTH``. A restore pushes the same keys back. Row ids are
the key's ``row_ids`` (global), except for a row_sparse key that was not declared lazy: its server never learnt
where its part of the key starts, so it lists and takes them by local id and says so in the header (``ids_local``).
Does not own: the keys' values (it goes through the key objects' methods only), the wire layout of replies
(``protocol.kv``).

Per requesting node it keeps one listing (the last LAZY_ROWS: a :class:`~kvstore_lazy.server.listing.Listing`, in a
temporary file for a key with a disk tier); at most :data:`MAX_LISTINGS` nodes at once, so a peer cannot make the
server hold listings without bound. A pull's reply is built from the listing or the key a piece at a time, so its
transient is the reply's bytes and a piece's, never the key's.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.protocol import kv as wire
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.kv import BadRequest, DataRequest, RowsHeader
from kvstore_lazy.protocol.message import Message
from kvstore_lazy.server.keys import DenseKey, RowSparseKey
from kvstore_lazy.server.keys.row_sparse import reply_bytes
from kvstore_lazy.server.listing import Listing
from kvstore_lazy.store.segments import SegmentError
from kvstore_lazy.store.arena import release_free_memory
from kvstore_lazy.store.tier import KVSTORE_LAZY_DISK_DIR, DiskTierFailure

MAX_LISTINGS = 256      # nodes with a row listing at once (one per worker in a real job)
MAX_ALIASES = 64        # string-key names of the (nine) virtual keys


def _chunks(n: int) -> int:
    return (n + mx.ROWS_WIDTH - 1) // mx.ROWS_WIDTH


def _int_field(body, name: str) -> int:
    if not isinstance(body, dict) or type(body.get(name)) is not int:
        raise ValueError(f"the command body must be a JSON object with an integer {name!r}, got {body!r}")
    return body[name]


class StateTransfer:
    def __init__(self, server) -> None:
        self.server = server                                    # its .keys, .optimizer, .rank, .num_servers
        self.listings: dict[int, Listing] = {}                  # node id -> its listing (the key's row ids then)
        self.aliases: dict[int, int] = {}                       # string-key int -> virtual key (LAZY_ALIAS)

    def resolve(self, key: int) -> int:
        """A string-key KVStore's name for a virtual key, or the key itself."""
        return self.aliases.get(key, key)

    # -- commands

    def list_rows(self, sender: int, body) -> None:
        """LAZY_ROWS {"key": K}: remember which rows of K exist now, for `sender`'s next virtual pulls."""
        key = _int_field(body, "key")
        if sender not in self.listings and len(self.listings) >= MAX_LISTINGS:
            raise ValueError(f"{MAX_LISTINGS} nodes already have a row listing open")
        entry = self.server.keys.get(key)
        self._drop(sender)                   # (its last listing goes first: not two of them at once)
        self.listings[sender] = self._new_listing(key, entry)
        # a checkpoint's pieces come next, adding no rows: not on top of the memory training left unused (the
        # tables' zeroed tails, the heap's free pages)
        for table in self.server.keys.values():
            if isinstance(table, RowSparseKey):
                table.release_unused()
        release_free_memory()

    @staticmethod
    def _new_listing(key: int, entry) -> Listing:
        """The rows of `entry` now: in memory for a key without a disk tier, else streamed into a temporary file in
        its disk tier's directory (a failure to write it stops the server as any failure of the tier: status 4,
        naming the directory)."""
        if not isinstance(entry, RowSparseKey):
            return Listing.of_array(key, np.zeros(0, np.uint64))
        if entry.disk is None:
            return Listing.of_array(key, entry.row_ids())
        try:
            return Listing.to_file(key, entry.row_id_chunks(), entry.disk.path)
        except (OSError, SegmentError) as exc:
            raise DiskTierFailure(f"disk tier failed ({KVSTORE_LAZY_DISK_DIR}={entry.disk.path.parent.parent}): "
                                  f"cannot write the row listing of key {key} in {entry.disk.path}: {exc}") from exc

    def _drop(self, sender: int) -> None:
        listing = self.listings.pop(sender, None)
        if listing is not None:
            listing.close()

    def register_alias(self, body) -> None:
        """LAZY_ALIAS: requests for int `alias` (a string key of a string-key KVStore) mean virtual key `key`."""
        alias, target = _int_field(body, "alias"), _int_field(body, "key")
        if not mx.is_virtual_key(target) or mx.is_virtual_key(alias) or alias < 0:
            raise ValueError(f"alias {alias} -> {target}: the target must be a virtual key and the alias not")
        if alias in self.server.keys or alias in self.server.specs:
            raise ValueError(f"alias {alias} -> {target}: key {alias} already holds values")
        known = self.aliases.get(alias)
        if known is not None and known != target:
            raise ValueError(f"key {alias} is already an alias of {known}, not {target}")
        if known is None and len(self.aliases) >= MAX_ALIASES:
            raise ValueError(f"{MAX_ALIASES} aliases are registered already")
        self.aliases[alias] = target

    def set_update_counts(self, body) -> None:
        """LAZY_SET_COUNTS: restore the optimizer's update count of a key (and num_update), per server rank when the
        checkpoint came from as many servers, else their maximum (counts are kept per server shard)."""
        optimizer = self.server.optimizer
        if optimizer is None:
            raise ValueError("update counts restored before an optimizer was set")
        key = _int_field(body, "key")
        counts, num_update = list(body.get("counts", [])), list(body.get("num_update", []))

        def mine(values: list) -> int:
            if not values:
                return 0
            return int(values[self.server.rank]) if len(values) == self.server.num_servers else int(max(values))

        optimizer.restore_count(key, mine(counts), mine(num_update))   # checked: bounded counts, scheduler steps

    # -- virtual keys

    def _listing(self, request: DataRequest, key: int) -> tuple[int, Listing]:
        if request.sender not in self.listings:
            raise BadRequest(key, f"{'push to' if request.push else 'pull of'} a virtual key without a LAZY_ROWS "
                                  f"command first")
        listing = self.listings[request.sender]
        return listing.key, listing

    def _header(self, key: int, ids: Listing) -> RowsHeader:
        entry = self.server.keys.get(key)
        counts = {}
        optimizer = self.server.optimizer
        if optimizer is not None:
            counts = {"update_count": optimizer.update_count(key), "num_update": int(optimizer.num_update)}
        if isinstance(entry, RowSparseKey):
            # a key not declared lazy knows its rows by local id only (its init push carried no more; row_offset 0):
            # say so, so that the worker adds the start of this server's part (RowsHeader)
            first, end = entry.global_range()
            return RowsHeader(len(ids), entry.num_states, entry.row_size, wire.KIND_ROW_SPARSE, **counts,
                              local_rows=end - first, ids_local=int(entry.spec is None))
        if isinstance(entry, DenseKey):
            return RowsHeader(entry.size, entry.num_states, 0, wire.KIND_DENSE, **counts)
        return RowsHeader(**counts)

    def pull(self, request: DataRequest, key: int) -> tuple[int, Message]:
        queried, ids = self._listing(request, key)
        if key == mx.ROWS_HEADER_KEY:
            if request.dtype != np.float64:
                raise BadRequest(key, "the row-listing key is float64")
            rows = self._listing_rows(request, key, queried, ids)
        elif mx.is_flat_state_key(key):
            rows = self._flat_state_rows(request, key, queried, ids)
        else:
            raise BadRequest(key, "pull of an unknown virtual key")
        return wire.rows_reply(request, reply_bytes(rows, request.dtype), rows.shape[1] if rows.ndim == 2 else 0)

    def _listing_rows(self, request: DataRequest, key: int, queried: int, ids: Listing) -> np.ndarray:
        """Rows of the listing key asked for: row 0 the header, row 1 + c the listed ids c * ROWS_WIDTH ... (as
        float64, padded with -1). Only the rows asked for are built, never the whole listing: a checkpoint reads a
        large key's listing piece by piece, each filled from the listing a piece at a time (Listing.fill)."""
        local_ids = request.local_ids
        total = 1 + _chunks(len(ids))
        if len(local_ids) and int(local_ids[-1]) >= total:
            raise BadRequest(key, f"row-listing row {int(local_ids[-1])} beyond the {total} this server has")
        header = local_ids == 0
        listed = np.flatnonzero(~header)
        chunk = local_ids[listed].astype(np.int64) - 1
        first, last = (int(chunk[0]), int(chunk[-1])) if len(chunk) else (0, -1)
        if not header.any() and last - first + 1 == len(chunk):     # rows first .. last (a checkpoint's piece)
            rows = np.full((len(chunk), mx.ROWS_WIDTH), -1.0)
            ids.fill(rows.reshape(-1), first * mx.ROWS_WIDTH)
            return rows
        rows = np.empty((len(local_ids), mx.ROWS_WIDTH))
        if header.any():
            rows[header] = self._header(queried, ids).row()
        if len(listed):
            window = np.full((last - first + 1) * mx.ROWS_WIDTH, -1.0)
            ids.fill(window, first * mx.ROWS_WIDTH)
            rows[listed] = window.reshape(-1, mx.ROWS_WIDTH)[chunk - first]
        return rows

    def _state_target(self, vkey: int, queried: int, ids: Listing) -> tuple[DenseKey | RowSparseKey, int]:
        """(key object, number of state values this server holds for the query) of a flat-state request."""
        entry = self.server.keys.get(queried)
        if isinstance(entry, RowSparseKey):
            return entry, len(ids) * entry.row_size
        if isinstance(entry, DenseKey):
            return entry, entry.size
        raise BadRequest(vkey, f"optimizer state of key {queried}, which this server does not hold")

    def _flat_state_rows(self, request: DataRequest, vkey: int, queried: int, ids: Listing) -> np.ndarray:
        if request.dtype != np.float32:
            raise BadRequest(vkey, "the optimizer-state keys are float32")
        if len(request.local_ids) == 0:   # a server that holds nothing of the key gets the master key only
            return np.zeros((0, mx.ROWS_WIDTH), np.float32)
        entry, n = self._state_target(vkey, queried, ids)
        state = vkey - mx.FLAT_STATE_BASE
        chunks = _chunks(n)
        if int(request.local_ids[-1]) >= chunks:
            raise BadRequest(vkey, f"state row {int(request.local_ids[-1])} beyond the {chunks} this server has")
        # only the values of the virtual rows asked for: a checkpoint reads a large key piece by piece (rows on a
        # disk tier are read from disk for each piece, not all at once)
        first, last = int(request.local_ids[0]), int(request.local_ids[-1])
        lo, hi = first * mx.ROWS_WIDTH, min((last + 1) * mx.ROWS_WIDTH, n)
        try:
            if isinstance(entry, RowSparseKey):
                r0, r1 = lo // entry.row_size, -(-hi // entry.row_size)
                flat = entry.state_rows(ids.ids(r0, r1), state).reshape(-1)[lo - r0 * entry.row_size:
                                                                        hi - r0 * entry.row_size]
            else:
                flat = entry.state(state).reshape(-1)[lo:hi]
        except (IndexError, KeyError) as exc:
            raise BadRequest(vkey, str(exc).strip("'\"")) from None
        whole = len(request.local_ids) == last - first + 1      # every row of the window (sorted, unique: checked)
        if whole and isinstance(entry, RowSparseKey) and len(flat) == (last - first + 1) * mx.ROWS_WIDTH:
            return flat.reshape(-1, mx.ROWS_WIDTH)      # (state_rows' own array: no second copy of a piece)
        window = np.zeros((last - first + 1) * mx.ROWS_WIDTH, np.float32)
        window[:len(flat)] = flat
        del flat
        if whole:
            return window.reshape(-1, mx.ROWS_WIDTH)
        return window.reshape(-1, mx.ROWS_WIDTH)[request.local_ids - first]

    def push(self, request: DataRequest, key: int) -> tuple[int, Message]:
        """Restore through the virtual keys: ROWS_HEADER_KEY rows name the rows (of the key the last LAZY_ROWS
        command named) whose states the following FLAT_STATE_BASE + j pushes carry. Answered at once (no round)."""
        if len(request.local_ids) == 0:   # an (empty) kv.init of a virtual key, for string-key KVStores
            return wire.reply(request.sender, request.meta)
        queried, ids = self._listing(request, key)
        try:
            if request.values.shape[1] != mx.ROWS_WIDTH:
                raise BadRequest(key, f"virtual rows are {mx.ROWS_WIDTH} wide, not {request.values.shape[1]}")
            if key == mx.ROWS_HEADER_KEY:
                self._push_listing(request, key, queried)
            elif mx.is_flat_state_key(key):
                self._push_state(request, key, queried, ids)
            else:
                raise BadRequest(key, "push to a virtual row-listing key")
        except BadRequest:
            if key == mx.ROWS_HEADER_KEY:
                # the state pushes that follow are for the rows this listing named: with no listing they are refused
                # too, instead of writing their states into the rows of the one before (a LAZY_ROWS listing of
                # every row the key holds)
                self._drop(request.sender)
            raise
        return wire.reply(request.sender, request.meta)

    def _push_listing(self, request: DataRequest, key: int, queried: int) -> None:
        if request.dtype != np.float64:
            raise BadRequest(key, "the row-listing key is float64")
        entry = self.server.keys.get(queried)
        if not isinstance(entry, RowSparseKey):
            raise BadRequest(key, f"row listing pushed for key {queried}, which holds no row_sparse value here")
        values, local_ids = request.values, request.local_ids
        count = int(values[0, 0]) if local_ids[0] == 0 else -1
        if count < 0 or not np.array_equal(local_ids, np.arange(1 + _chunks(count))):
            raise BadRequest(key, "a pushed row listing must be row 0 = [count] then every chunk of ids")
        listed = values[1:].reshape(-1)[:count]
        row_ids = listed.astype(np.int64)
        lo, hi = entry.global_range()
        if (np.any(row_ids != listed) or np.any(row_ids[1:] <= row_ids[:-1])
                or (count and (row_ids[0] < lo or row_ids[-1] >= hi))):
            raise BadRequest(key, f"pushed row ids must be sorted, unique and within [{lo}, {hi})")
        self._drop(request.sender)
        # (in memory: the state pushes that follow carry every row at once, so they take the ids whole)
        self.listings[request.sender] = Listing.of_array(queried, row_ids.astype(np.uint64))

    def _push_state(self, request: DataRequest, key: int, queried: int, ids: Listing) -> None:
        if request.dtype != np.float32:
            raise BadRequest(key, "the optimizer-state keys are float32")
        optimizer = self.server.optimizer
        if optimizer is None:
            raise BadRequest(key, "optimizer states pushed before an optimizer was set")
        entry, n = self._state_target(key, queried, ids)
        if not np.array_equal(request.local_ids, np.arange(_chunks(n))):
            raise BadRequest(key, f"a state push for key {queried} must carry all {_chunks(n)} rows ({n} values) "
                                  f"this server holds")
        flat = request.values.reshape(-1)[:n]
        state = key - mx.FLAT_STATE_BASE
        try:
            if isinstance(entry, RowSparseKey):
                entry.set_state_rows(ids.ids(0, len(ids)), state, flat)
            else:
                entry.set_state(state, flat, optimizer)
        except IndexError as exc:
            raise BadRequest(key, str(exc)) from None
