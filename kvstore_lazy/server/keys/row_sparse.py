"""The row_sparse key (DataHandleRowSparse of kvstore_dist_server.h): its init, push, update and pull.

Owns: a row_sparse key's requests: the init push (a declared key takes its shape from the declaration), a push's
gradient, the merge of a round's rows, the update of the merged rows (admission first, rows on disk updated in place
or brought back), a pull's rows (created, computed and left absent, or read where a tier keeps them), and what the
compiled fast path may take of the key (``resident_rows``, ``absent_fill``). :class:`RowSparseKey` is the key: the
classes it is built on (``row_fields`` -> ``row_disk`` -> ``row_states`` -> ``row_snapshot``) are its other parts.
Does not own: the wire, the round's bookkeeping, the optimizer, the lifecycle's rules (see the package docstring).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.optimizers import Adam, Optimizer, adam_row_steps_update
from kvstore_lazy.protocol.kv import BadRequest, DataRequest
from kvstore_lazy.server.declaration import LazySpec
from kvstore_lazy.server.keys.row_snapshot import RowKeySnapshots
from kvstore_lazy.server.lifecycle import Lifecycle
from kvstore_lazy.store import kernels


INIT_CHUNK = 1 << 16     # rows an init push with rows stores between budget passes (with a disk tier)
ROUND_BUFFER_MAX = 16 << 20   # bytes _RoundBuffers keeps for reuse; a larger round's arrays are its own, freed after


class _RoundBuffers:
    """The arrays a round's merge with slots (``RowSparseKey.merge_slots``) writes, one set for the process, grown
    to the largest round and reused: rounds complete one at a time and their update is done with the merged rows
    before the next merge, and only keys that reuse slots (no policy, disk tier or history: nothing keeps a round's
    gradient) merge into them. New arrays each round are a fresh mapping of a round's rows (8 MiB at N=8, B=8192,
    D=32: over glibc's mmap threshold), whose page faults took ~4% of the server's CPU."""

    def __init__(self) -> None:
        self.ids = self.slots = np.zeros(0, np.int64)
        self.values = np.zeros(0, np.float32)
        self.table, self.where = np.zeros(0, np.int64), np.zeros(0, np.int32)

    def hash_table(self, entries: int) -> tuple[np.ndarray, np.ndarray]:
        """The hash table of a merge in any order (``kernels.merge_round_slots``' `hashed`): ids and rows."""
        if entries * 12 > ROUND_BUFFER_MAX:
            return np.empty(entries, np.int64), np.empty(entries, np.int32)
        if len(self.table) < entries:
            self.table, self.where = np.empty(entries, np.int64), np.empty(entries, np.int32)
        return self.table[:entries], self.where[:entries]

    def __call__(self, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if rows * (16 + 4 * cols) > ROUND_BUFFER_MAX:       # (not kept: the budget does not count them)
            return np.empty(rows, np.int64), np.empty((rows, cols), np.float32), np.empty(rows, np.int64)
        if len(self.ids) < rows:
            self.ids, self.slots = np.empty(rows, np.int64), np.empty(rows, np.int64)
        if len(self.values) < rows * cols:
            self.values = np.empty(rows * cols, np.float32)
        return self.ids[:rows], self.values[:rows * cols].reshape(rows, cols), self.slots[:rows]


_ROUND_BUFFERS = _RoundBuffers()


def reply_bytes(rows: np.ndarray, dtype: np.dtype) -> memoryview:
    """A pull's rows as its reply's payload in the wire dtype, without a copy when they are in it already: `rows`
    is the pull's own array (nothing writes it afterwards), so the reply holds one copy of the rows asked for,
    not two (a checkpoint's pieces are 32 MB at D=32)."""
    return np.ascontiguousarray(rows.astype(dtype, copy=False)).reshape(-1).view(np.uint8).data


class RowSparseKey(RowKeySnapshots):
    """A row_sparse key: a table of the rows that exist (DataHandleRowSparse), lazy when a worker declared it.

    The one place a policy for rows plugs in: a lazy key with an active lifecycle policy (admission, TTL, the
    server's memory budget) consults its :class:`~kvstore_lazy.server.lifecycle.RowPolicy` (``policy``). Every row
    enters the table through :meth:`_slots_for` (after :meth:`RowPolicy.admit` for a push) and leaves it only
    through :meth:`expire` and :meth:`evict`, at the eviction points the server's ``Lifecycle`` runs.

    With a disk tier (``KVSTORE_LAZY_DISK_DIR``, under a memory budget) :meth:`evict` moves rows to ``disk`` (a
    :class:`~kvstore_lazy.store.tier.DiskTier`) instead of dropping them, and :meth:`_promote` is the one place that
    decides what happens to a row not in memory: a touch (pull, push, state write) of rows on disk brings them back
    with one batched read per request, as they left (weights, states, columns), before anything else looks at
    them. A pull promotes only while the memory budget has room for the rows (else it reads them where they are):
    a worker checkpoint lists every row and pulls them all, which must not bring the whole disk tier into memory.
    A row is in one tier at a time; "the rows that exist" are both tiers' rows.
    """

    @classmethod
    def first_push(cls, request: DataRequest, spec: LazySpec | None, storage_dtype: np.dtype, num_states: int,
                   num_servers: int, rank: int, lifecycle: Lifecycle | None = None,
                   optimizer: Optimizer | None = None, keys: dict | None = None) -> "RowSparseKey":
        """The init push: a declared key takes its shape from the declaration (its init may carry no rows); any
        other key gets the rows the init carries, and those are all the rows it has. With a disk tier the rows
        (a worker's checkpoint being loaded: every row it saved) go in INIT_CHUNK at a time, the memory budget's
        pass over the server's `keys` and this one after each, so that they do not all stay in memory until the
        first round ends."""
        values = request.values
        if spec is not None:
            if request.dtype != spec.dtype:
                raise BadRequest(request.key, f"init as {request.dtype.name} but declared {spec.dtype.name}")
            if len(values) and values.shape[1] != spec.row_size:
                raise BadRequest(request.key, f"init rows of {values.shape[1]} elements but declared "
                                              f"{spec.row_size}")
            offset, local_rows = spec.partition(num_servers, rank)
            row_size = spec.row_size
        else:
            if len(request.local_ids) == 0:
                raise BadRequest(request.key, "row_sparse init with no rows for a key that was not declared lazy "
                                              "(declare it with kvstore_lazy.worker.init_lazy, or init with rows)")
            offset, local_rows, row_size = 0, len(request.local_ids), values.shape[1]
        policy, track = None, False
        if lifecycle is not None:
            track = lifecycle.settings.track_changes
            if spec is not None:
                policy = lifecycle.policy_for(spec.row_policy(lifecycle.settings.defaults), request.key, spec.seed)
        row_steps = lifecycle is not None and lifecycle.settings.adam_row_steps
        if spec is not None and spec.adam_row_steps is not None:
            row_steps = spec.adam_row_steps
        entry = cls(request.key, request.dtype, row_size, storage_dtype, num_states, local_rows, offset, spec,
                    policy, track, row_steps)
        entry.rank = rank
        entry.closed_forms = lifecycle is not None and lifecycle.settings.catchup == "closed"
        entry.use_optimizer(optimizer)
        if lifecycle is not None:
            entry._open_disk(lifecycle)
        entry.check_rows(request.local_ids)
        if len(request.local_ids):
            # Rows given at init are stored as sent (this is also how a checkpoint is restored).
            row_ids = entry.row_ids_of(request.local_ids)
            step = INIT_CHUNK if entry.disk is not None and lifecycle is not None else len(row_ids)
            for lo in range(0, len(row_ids), step):
                slots = entry._slots_for(row_ids[lo:lo + step], entry._zeros)
                entry._table.set_weights(slots, values[lo:lo + step].astype(entry._table.dtype))
                if step < len(row_ids):
                    assert lifecycle is not None
                    lifecycle.enforce_budget({**(keys or {}), request.key: entry})
        return entry

    # -- push, apply, pull

    def gradient(self, request: DataRequest) -> tuple[np.ndarray, np.ndarray]:
        """A push's (local_ids, values) as the gradient this key merges and applies."""
        self.check_dtype(request.dtype, "push")
        values = request.values
        if len(values) == 0:
            values = values.reshape(0, self.row_size)
        elif values.shape[1] != self.row_size:
            raise BadRequest(self.key, f"rows of {values.shape[1]} elements pushed to a key of {self.row_size}")
        self.check_rows(request.local_ids)
        if self._table.dtype != request.dtype:
            values = values.astype(self._table.dtype)
        return request.local_ids, values

    @staticmethod
    def merge(pushes: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """A dist_sync round's merged gradient from its pushes (in arrival order; their arrays, never written), in
        one compiled pass over all their rows (``kernels.merge_round``): each row summed over the pushes that have it
        in arrival order, ``((p1 + p2) + p3) + ...`` in float32, as stock's merge buffer adds each push when it comes
        (and as merging push after push did, re-reading the growing union N - 1 times a round)."""
        first = pushes[0]
        if all(len(local_ids) == 0 for local_ids, _ in pushes[1:]):
            return first             # the message's arrays, never written: the update reads them
        got = kernels.merge_round([local_ids for local_ids, _ in pushes], [values for _, values in pushes])
        if got is not None:
            return got
        merged = first               # rows of another dtype: push after push (kernels.merge_rows' numpy merge)
        for local_ids, values in pushes[1:]:
            if len(local_ids):
                merged = kernels.merge_rows(merged[0], merged[1], local_ids, values)
        return merged

    def merge_slots_any_order(self, pushes: list[tuple[np.ndarray, np.ndarray]], slots: list[tuple | None]) -> tuple:
        """:meth:`merge_slots` for this key's round, its rows in the order each first came rather than sorted by id
        when the key :meth:`reuses_slots` (its update by slots takes rows in any order; the same sums, bit for bit:
        ``kernels.merge_round_slots``' `hashed`, a hash table of the ids instead of a tournament's comparisons)."""
        return self.merge_slots(pushes, slots, any_order=self.reuses_slots())

    @staticmethod
    def merge_slots(pushes: list[tuple[np.ndarray, np.ndarray]], slots: list[tuple | None],
                    any_order: bool = False) -> tuple:
        """:meth:`merge` and the merged rows' slots in the same pass (``kernels.merge_round_slots``): `slots[j]`
        (slots, slot_token, complete) as push j's rows had them when its worker pulled them (None: not known);
        ((ids, values), (slots, token, whether none is -1) or None). Pulls under different tokens: merged without
        slots. The merged arrays
        are the process's round buffers (``_RoundBuffers``), valid until the next such merge: for a key that
        :meth:`reuses_slots`, whose round the server applies at once."""
        tokens = [hint[1] for hint in slots if hint is not None]
        if not tokens or any(token != tokens[0] for token in tokens):
            return RowSparseKey.merge(pushes), None
        if all(len(local_ids) == 0 for local_ids, _ in pushes[1:]):
            return pushes[0], slots[0]
        got = kernels.merge_round_slots([local_ids for local_ids, _ in pushes], [values for _, values in pushes],
                                        [None if hint is None else hint[0] for hint in slots], _ROUND_BUFFERS,
                                        _ROUND_BUFFERS.hash_table if any_order else None)
        if got is None:
            return RowSparseKey.merge(pushes), None
        return got[:2], (got[2], tokens[0], bool((got[2] >= 0).all()))

    def apply(self, grad: tuple[np.ndarray, np.ndarray], optimizer: Optimizer | None, sync: bool = True,
              slots: tuple | None = None) -> None:
        """One update: a round's merged gradient (`sync`) or an async push. A round without rows still runs the
        updater (stock's ApplyUpdates does: the update is counted, and under dense semantics every row moves); an
        async push without rows changes nothing (stock answers it). `slots`: (the rows' slots as a lookup found
        them, -1: not in the table then; the :meth:`slot_token` then; whether none is -1): for a key that
        :meth:`reuses_slots`, with that token now, only the -1 ones are looked up again (:meth:`_slots_for`'s
        `known`), and with none the update runs at once."""
        local_ids, values = grad
        if len(local_ids) == 0:
            if sync and optimizer is not None:
                self._count_empty(optimizer)
            return
        if self.history is not None:
            self._apply_dense(local_ids, values, optimizer)
            return
        if slots is not None and slots[2] and self.reuses_slots() and slots[1] == self.slot_token():
            self._update(slots[0], values, optimizer)    # every row in the table, at the slots its pull found
            return
        if slots is not None and len(local_ids) > 1 and not (local_ids[1:] > local_ids[:-1]).all():
            order = np.argsort(local_ids, kind="stable")     # a round merged in any order (merge_slots_any_order)
            local_ids, values = local_ids[order], np.ascontiguousarray(values[order])    # whose slots went stale
            slots = (slots[0][order], slots[1], slots[2])
        row_ids = self.row_ids_of(local_ids)
        admit = None if self.row_steps else self._disk_admit()   # (rows with their own steps: updated in memory)
        if admit is None:
            self._promote(row_ids)   # rows on disk have a row: admission must see them
        else:                        # rows on disk the memory tier does not admit are updated where they are
            _, records = self.disk.promote_or_keep(self._table, row_ids, admit)
            if len(records):
                row_ids, values = self._update_on_disk(row_ids, values, records, optimizer)
        if self.policy is not None:
            keep = self.policy.admit(self._table, row_ids)
            if keep is not None:     # the gradient rows of ids not admitted (yet) are dropped; the update still
                # counts (a round without its rows is a round: update counts, Adam's t and lr schedules go on)
                row_ids, values = row_ids[keep], np.ascontiguousarray(values[keep])
        known = slots[0] if slots is not None and self.reuses_slots() and slots[1] == self.slot_token() else None
        at = self._slots_for(row_ids, promoted=True, known=known)
        self._update(at, values, optimizer)
        if self.policy is not None:
            self.policy.pushed(self._table, at)

    def _count_empty(self, optimizer: Optimizer) -> None:
        """The update of a round without rows of this server: counted (lr schedules, Adam's t), every row moved
        under dense semantics (recorded in the history)."""
        empty = np.zeros((0, self.row_size), self._table.dtype)
        if self.history is not None:
            self._update_touched(np.zeros(0, np.int64), empty, optimizer)
            return
        states = [np.zeros_like(empty, dtype=np.float32) for _ in range(self.num_states)]
        optimizer.update(self.key, empty.astype(np.float32), empty.astype(np.float32), states, row_sparse=True)

    def _update(self, slots: np.ndarray, values: np.ndarray, optimizer: Optimizer | None) -> None:
        if optimizer is None:
            self._table.set_weights(slots, values)
            return
        if self.row_steps and isinstance(optimizer, Adam):
            self._update_row_steps(slots, values, optimizer)
            return
        tables = self._table.arrays()
        if optimizer.update_rows(self.key, tables[0], tables[1:], slots, values):
            self._table.mark_changed(slots)
            return
        del tables
        weights, states = self._table.weights(slots), self._table.states(slots)
        optimizer.update(self.key, weights, values, states, row_sparse=True)
        self._table.set_weights(slots, weights)
        self._table.set_states(slots, states)

    def _update_row_steps(self, slots: np.ndarray, values: np.ndarray, optimizer: Adam) -> None:
        """Lazy Adam with each row's own count of updates in its bias correction (``adam_row_steps_update``)."""
        steps = self._table.column("steps")
        weights = self._table.weights(slots).astype(np.float32)
        states = [s.astype(np.float32) for s in self._table.states(slots)]
        adam_row_steps_update(optimizer, self.key, weights, values.astype(np.float32, copy=False), states,
                              steps[slots])
        self._table.set_weights(slots, weights.astype(self._table.dtype, copy=False))
        self._table.set_states(slots, [s.astype(self._table.dtype, copy=False) for s in states])
        steps[slots] += np.uint32(1)

    def pull(self, request: DataRequest, store: bool, known_absent: bool = False) -> memoryview:
        """The rows a pull asks for, in the wire dtype; with `store` (or for a key that is not lazy) absent rows are
        created, else they are computed and left absent. The caller has checked the request's dtype and rows
        (check_dtype, check_rows: KVServer._rows_pull does, before its poison check); `known_absent`: it found none of
        them in the table just now (the fast path's probe), so they are not looked up again."""
        row_ids = self.row_ids_of(request.local_ids)
        if store and self.policy is not None and not self.policy.stores_on_pull:
            store = False            # rows wait for admission: a pull never creates one
        if self.dense():
            return reply_bytes(self._pull_dense(row_ids, store), self.dtype)
        admit = self._disk_admit()
        if (store or self.spec is None) and admit is not None:
            # rows on disk the memory tier admits come back, the others are read where they are; absent rows
            # that are not on disk either are created
            self.disk.promote(self._table, row_ids, count=True, admit=admit)
            on_disk = self._table.lookup(row_ids) < 0
            on_disk[on_disk] = self.disk.contains(row_ids[on_disk])
            rows = np.empty((len(row_ids), self.row_size), self._table.dtype)
            rows[~on_disk] = self._table.weights(self._slots_for(row_ids[~on_disk], promoted=True))
            if on_disk.any():
                self.disk.read_weights(row_ids[on_disk], rows, np.flatnonzero(on_disk))
        elif store or self.spec is None:
            rows = self._pull_stored(row_ids)
        else:
            # (with no disk tier, rows the caller found absent are not looked up again)
            if known_absent:        # none of them is in the table (a disk tier may have them)
                slots = None if self.disk is None else np.full(len(row_ids), -1, np.int64)
            else:
                slots = self._table.lookup(row_ids)
            if slots is None or (self.disk is None and len(slots) and slots.max() < 0):   # none stored
                return reply_bytes(self.initial_rows(row_ids), self.dtype)
            if self.disk is not None:
                cold = row_ids[slots < 0]
                if len(cold) and len(self.disk) and \
                        self.policy.lifecycle.headroom() >= len(cold) * self._table.row_nbytes:
                    # room under the budget even if every absent row were on disk: they come back (one probe of
                    # the disk index; the hit rate counts them as promote finds them)
                    self.disk.count(hits=len(row_ids) - len(cold))
                    slots[slots < 0] = self.disk.promote_absent(self._table, cold, admit=admit)
                else:
                    on_disk = self.disk.contains(cold) if len(self.disk) else np.zeros(0, bool)
                    self.disk.count(hits=len(row_ids) - len(cold), misses=int(on_disk.sum()))
                    if on_disk.any() and self.policy.lifecycle.headroom() >= on_disk.sum() * self._table.row_nbytes:
                        # room under the budget: they come back (those the memory tier admits)
                        self.disk.promote(self._table, cold, count=False, admit=admit)
                        slots = self._table.lookup(row_ids)
            rows = np.empty((len(row_ids), self.row_size), self._table.dtype)
            present = slots >= 0
            rows[present] = self._table.weights(slots[present])
            if not present.all():
                absent = np.flatnonzero(~present)
                if self.disk is not None and len(self.disk):   # no room: read where they are, not promoted
                    on_disk = self.disk.contains(row_ids[absent])
                    self.disk.read_weights(row_ids[absent[on_disk]], rows, absent[on_disk])
                    absent = absent[~on_disk]
                rows[absent] = self.initial_rows(row_ids[absent])
        return reply_bytes(rows, self.dtype)

    def _pull_stored(self, row_ids: np.ndarray) -> np.ndarray:
        """A pull's rows where absent rows are created (KVSTORE_LAZY_MATERIALIZE=touch, or a key not declared lazy):
        rows on disk come back while the memory budget has room for them, else they are read where they are (a
        worker checkpoint lists and pulls every row: that must not bring the disk tier into memory; the push after
        a training pull brings them, from the records the read keeps)."""
        if self.disk is None or not len(self.disk):
            return self._table.weights(self._slots_for(row_ids))
        cold = self._table.lookup(row_ids) < 0
        if self.policy.lifecycle.headroom() >= int(cold.sum()) * self._table.row_nbytes:
            return self._table.weights(self._slots_for(row_ids))
        on_disk = cold.copy()
        on_disk[cold] = self.disk.contains(row_ids[cold])
        self.disk.count(hits=len(row_ids) - int(cold.sum()), misses=int(on_disk.sum()))
        rows = np.empty((len(row_ids), self.row_size), self._table.dtype)
        rows[~on_disk] = self._table.weights(self._slots_for(row_ids[~on_disk], promoted=True))
        self.disk.read_weights(row_ids[on_disk], rows, np.flatnonzero(on_disk))
        return rows

    # -- what the compiled fast path may take (server/fastpath.py)

    def absent_fill(self) -> tuple[int, float, float] | None:
        """For the compiled pull path: the declared initializer's compiled values (``compiled_fill``) when a row a
        pull finds absent is its initial value, left absent (:meth:`pull` without `store`: a lazy key with no row
        policy and no disk tier), else None."""
        if self.policy is not None or self.disk is not None or self.dense():
            return None
        return self._compiled_fill

    def reuses_slots(self) -> bool:
        """Whether an update may take its rows' slots as a pull's lookup found them (:meth:`apply`'s `slots`): a
        key whose rows enter the table only through :meth:`_slots_for` and leave it only by a removal
        (``RowTable.moves``): no row policy (admission drops rows), no disk tier (rows come back first), no dense
        semantics (its own update path)."""
        return self.policy is None and self.disk is None and self.history is None

    def slot_token(self) -> tuple:
        """What the slots a lookup finds now stay valid under: this table, and its removals so far (a removal
        moves rows into the freed slots; a new table, multi-precision's, has other slots)."""
        return self._table, self._table.moves

    def resident_rows(self) -> tuple | None:
        """For the compiled pull path (server/fastpath.py): (RowTable.probe_arrays(), row_offset, local_rows) if a
        pull whose rows are all in the table is a plain gather of them in the wire dtype (float32), else None; a
        pull with any row not in the table always comes to :meth:`pull`."""
        if self.dtype != np.float32 or self._table.dtype != np.float32 or self.dense():
            return None
        return self._table.probe_arrays(), self.row_offset, self.local_rows
