"""The keys a server stores, one object each: a dense tensor or a table of rows, with its own sync round.

Owns: each key's stored values, float32 master copy, optimizer states and pending dist_sync round; how a round
merges pushes; how an update is applied; what a pull of the key returns; the key's snapshot and stats. Nothing
outside a key reads its fields: :class:`~kvstore_lazy.server.core.KVServer` and the state transfer go through the
methods here.
Does not own: the wire (requests arrive decoded as ``protocol.kv.DataRequest``), which key a request is for, the
optimizer (passed in), dist_sync vs dist_async (the server decides whether a push joins a round).

Names: ``local_ids`` are row ids as a worker sent them (relative to this server's first row of a partitioned key),
``row_ids`` global row ids (``local_ids + row_offset``, what the row table and the initializers use), ``slots``
arena indexes of the row table.

Behaviour follows MXNet 1.9.1's kvstore_dist_server.h: the first push is the init (stored as sent); a round's merged
gradient goes through the updater once (or, with no optimizer, replaces the stored value); under multi-precision the
stored value is a float32 master copy and pulls get it cast back (CreateMultiPrecisionCopies).
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore_lazy.numerics.optimizers import Optimizer
from kvstore_lazy.protocol.fast import native
from kvstore_lazy.protocol.kv import BadRequest, DataRequest
from kvstore_lazy.store import kernels
from kvstore_lazy.store.rows import RowTable
from kvstore_lazy.store.tier import DiskTier, dense_rows
from kvstore_lazy.server.declaration import LazySpec
from kvstore_lazy.server.lifecycle import Lifecycle, RowPolicy

_merge_rows = native.merge_rows   # (its kernel's address comes from optimizers, imported above)


class SyncRound:
    """One key's dist_sync round: pushes merged until NUM_WORKER *requests* (not distinct workers) arrived."""

    def __init__(self) -> None:
        self.requests: list[DataRequest] = []
        self.merged = None

    @property
    def pending(self) -> bool:
        return bool(self.requests)

    def add(self, request: DataRequest, grad, merge: Callable, num_workers: int):
        """Merge one push; the round's (merged gradient, requests) once it is complete, else None."""
        self.merged = merge(self.merged, grad, len(self.requests))
        self.requests.append(request)
        if len(self.requests) < num_workers:
            return None
        done = self.merged, self.requests
        self.requests, self.merged = [], None
        return done

    def describe(self) -> list:
        """The waiting requests as (sender, timestamp): for snapshots' checks and tests."""
        return [(r.sender, r.meta.timestamp) for r in self.requests]


class DenseKey:
    """A dense tensor (DataHandleDefault / DataHandleCompressed)."""

    kind = "dense"

    def __init__(self, key: int, value: np.ndarray, multi_precision: bool) -> None:
        self.key = key
        self.dtype = value.dtype
        self._value = value                       # in the key's dtype: what pulls return
        self._master = value.astype(np.float32) if multi_precision and value.dtype != np.float32 else None
        self._states: list[np.ndarray] | None = None   # optimizer states, created at the first update
        self._merge_buffer: np.ndarray | None = None   # reused for merged sums, round after round
        self._payload: bytes | None = None             # value.tobytes(), shared by pulls until the next update
        self.round = SyncRound()

    @classmethod
    def first_push(cls, key: int, values: np.ndarray, multi_precision: bool) -> "DenseKey":
        """The init: stored as sent."""
        return cls(key, np.array(values), multi_precision)

    @property
    def size(self) -> int:
        return self._value.size

    @property
    def num_states(self) -> int:
        return len(self._states or [])

    @property
    def _stored(self) -> np.ndarray:
        """The array updates run on (store_realt_ under multi-precision, else store_)."""
        return self._master if self._master is not None else self._value

    def gradient(self, dtype: np.dtype, values: np.ndarray) -> np.ndarray:
        """A push's values as the gradient this key merges and applies."""
        if dtype != self.dtype or values.size != self._value.size:
            raise BadRequest(self.key, f"push of {values.size} {dtype.name} values to a key of {self._value.size} "
                                       f"{self.dtype.name}")
        return values.astype(np.float32) if self._master is not None else values

    def plain_gradient(self, dtype: np.dtype, size: int) -> bool:
        """Whether a push of `size` `dtype` values is a gradient :meth:`gradient` takes as it is (no master copy):
        the fast path's condition for handing it to the round (server/fastpath.py)."""
        return dtype == self.dtype and size == self._value.size and self._master is None

    def merge(self, merged, grad: np.ndarray, count: int) -> np.ndarray:
        if count == 0:
            return grad              # the message's buffer, never written: the 2nd push sums elsewhere
        if count == 1:
            if self._merge_buffer is None or self._merge_buffer.dtype != grad.dtype:
                self._merge_buffer = np.empty_like(grad)
            return np.add(merged, grad, out=self._merge_buffer)
        merged += grad
        return merged

    def apply(self, grad: np.ndarray, optimizer: Optimizer | None) -> None:
        self._payload = None
        if optimizer is None:
            self._stored[...] = grad
        else:
            if self._states is None:
                self._states = optimizer.init_states(self._stored)
            optimizer.update(self.key, self._stored, grad, self._states)
        if self._master is not None:
            self._value[...] = self._master.astype(self.dtype)

    def pull(self, dtype: np.dtype) -> bytes:
        if dtype != self.dtype:
            raise BadRequest(self.key, f"pull as {dtype.name} of a {self.dtype.name} key")
        if self._payload is None:    # every worker pulls the same value after an update: serialize it once
            self._payload = self._value.tobytes()
        return self._payload

    def use_master_copy(self) -> None:
        """kSetMultiPrecision for a key already stored."""
        if self.dtype != np.float32:
            self._master = self._value.astype(np.float32)

    def reset_states(self, optimizer: Optimizer) -> None:
        self._states = None

    # -- optimizer states, for worker checkpoints (state_transfer)

    def state(self, index: int) -> np.ndarray:
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states here, not {index + 1}")
        return self._states[index].reshape(-1)

    def set_state(self, index: int, flat: np.ndarray, optimizer: Optimizer) -> None:
        if self._states is None:
            self._states = optimizer.init_states(self._stored)
        if index >= len(self._states):
            raise IndexError(f"key {self.key} has {len(self._states)} optimizer states, not {index + 1}")
        self._states[index][...] = flat.reshape(self._states[index].shape)

    # -- snapshots and stats

    def snapshot(self) -> dict:
        return {"row_ids": np.zeros(1, np.uint64), "weights": self._stored.reshape(1, -1),
                "states": [s.reshape(1, -1) for s in (self._states or [])],
                "meta": {"kind": self.kind, "dtype": self.dtype.name}}

    def inspect(self) -> dict:
        """Everything a rejected request must leave alone, as bytes (tests compare it before and after)."""
        return {"dtype": self.dtype.name, "value": self._value.tobytes(),
                "master": None if self._master is None else self._master.tobytes(),
                "states": [s.tobytes() for s in self._states or []],
                "merged": None if not self.round.pending else np.asarray(self.round.merged).tobytes(),
                "round": self.round.describe()}

    def delta(self) -> dict:
        """What an incremental snapshot holds of this key: all of it (a dense value changes as a whole)."""
        return dict(self.snapshot(), mode="full")

    def snapshot_written(self) -> None:
        pass

    @classmethod
    def restore(cls, key: int, table: dict, multi_precision: bool) -> "DenseKey":
        dtype = np.dtype(table["meta"]["dtype"])
        entry = cls(key, table["weights"].reshape(-1).astype(dtype), multi_precision)
        if entry._master is not None:
            entry._master = table["weights"].reshape(-1).astype(np.float32)
        entry._states = [s.reshape(-1).copy() for s in table["states"]] or None
        return entry

    def nbytes(self) -> int:
        return self._value.nbytes + (self._master.nbytes if self._master is not None else 0)


class RowSparseKey:
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

    kind = "row_sparse"

    def __init__(self, key: int, dtype: np.dtype, row_size: int, storage_dtype: np.dtype, num_states: int,
                 local_rows: int, row_offset: int = 0, spec: LazySpec | None = None,
                 policy: RowPolicy | None = None, track_changes: bool = False) -> None:
        self.key = key
        self.dtype = dtype                  # the key's dtype (what the wire carries)
        self.row_size = row_size            # elements per row ("unit_len")
        self.local_rows = local_rows        # rows this server holds (local ids < local_rows)
        self.row_offset = row_offset        # global row id of local row 0 (partitioned keys)
        self.spec = spec
        self.policy = policy
        self._track = track_changes         # tables record changes for incremental snapshots
        self._table = self._new_table(storage_dtype, num_states)   # float32 under multi-precision
        self._rebuilt = True                # the next incremental snapshot must hold the whole key
        self.round = SyncRound()
        self.rank = 0                       # the server's rank (names the disk tier's directory)
        self.disk: DiskTier | None = None   # rows the budget moved out of memory

    def _new_table(self, dtype, num_states: int, rows: dict | None = None, buckets: int | None = None) -> RowTable:
        columns = self.policy.columns if self.policy is not None else None
        if rows is None:
            return RowTable(self.row_size, dtype, num_states=num_states, columns=columns, track_changes=self._track)
        return RowTable.load(rows, dtype=dtype, columns=columns, track_changes=self._track, buckets=buckets)

    @classmethod
    def first_push(cls, request: DataRequest, spec: LazySpec | None, storage_dtype: np.dtype, num_states: int,
                   num_servers: int, rank: int, lifecycle: Lifecycle | None = None) -> "RowSparseKey":
        """The init push: a declared key takes its shape from the declaration (its init may carry no rows); any
        other key gets the rows the init carries, and those are all the rows it has."""
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
        entry = cls(request.key, request.dtype, row_size, storage_dtype, num_states, local_rows, offset, spec,
                    policy, track)
        entry.rank = rank
        if lifecycle is not None:
            entry._open_disk(lifecycle)
        entry.check_rows(request.local_ids)
        if len(request.local_ids):
            # Rows given at init are stored as sent (this is also how a checkpoint is restored).
            slots = entry._slots_for(entry.row_ids_of(request.local_ids), entry._zeros)
            entry._table.set_weights(slots, values.astype(entry._table.dtype))
        return entry

    # -- ids

    def row_ids_of(self, local_ids: np.ndarray) -> np.ndarray:
        ids = local_ids.astype(np.uint64)   # a new array: the offset is added in place
        if self.row_offset:
            ids += np.uint64(self.row_offset)
        return ids

    def check_rows(self, local_ids: np.ndarray) -> None:
        """Every id of a request (sorted) within the rows this server holds."""
        if len(local_ids) and int(local_ids[-1]) >= self.local_rows:
            where = (f" (this server holds global rows [{self.row_offset}, {self.row_offset + self.local_rows}))"
                     if self.row_offset else "")
            raise BadRequest(self.key, f"row {int(local_ids[-1]) + self.row_offset} is out of range: the key has "
                                       f"{self.local_rows + self.row_offset} rows{where}")

    def plain_gradient(self, dtype: np.dtype, row_size: int) -> bool:
        """Whether a push of rows of `row_size` `dtype` values is a gradient :meth:`gradient` takes as it is (the
        key's dtype and row size, no cast): the fast path's condition for handing it to the round."""
        return dtype == self.dtype == self._table.dtype and row_size == self.row_size

    def check_dtype(self, dtype: np.dtype, what: str) -> None:
        if dtype != self.dtype:
            raise BadRequest(self.key, f"{what} as {dtype.name} {'of' if what == 'pull' else 'to'} a "
                                       f"{self.dtype.name} key")

    # -- rows in and out of the table

    def initial_rows(self, row_ids: np.ndarray) -> np.ndarray:
        if self.spec is None:
            # Not declared: every row arrived at init, so a missing row can only be zero (an empty gradient row of
            # the stock server's dense-shaped rsp); the range check keeps ids within the init rows.
            return self._zeros(row_ids)
        out = np.empty((len(row_ids), self.row_size), self._table.dtype)   # (checked at the declaration)
        self.spec.initializer.fill(self.spec.seed, self.key, row_ids, self.spec.shape, out)
        return out

    def _open_disk(self, lifecycle: Lifecycle) -> None:
        """A fresh disk tier for this key when the server has one and the key's rows are budget-managed."""
        if lifecycle.settings.disk_dir and self.policy is not None:
            self.disk = DiskTier(self.disk_path(lifecycle), self._table, lifecycle.settings.disk_segment_rows,
                                 compact_ratio=lifecycle.settings.disk_compact,
                                 rows=dense_rows(self.row_offset, self.local_rows, lifecycle.settings.memory_budget))

    def disk_path(self, lifecycle: Lifecycle) -> Path:
        return Path(lifecycle.settings.disk_dir) / f"rank{self.rank}" / f"key{self.key}"

    def _promote(self, row_ids: np.ndarray, count: bool = True) -> None:
        """Rows of `row_ids` (unique) on disk come back into the table as they left (one batched read); `count`:
        they are a request's rows, for the tier's hit rate."""
        if self.disk is not None:
            self.disk.promote(self._table, row_ids, count=count)

    def _disk_admit(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """The memory tier's admission of rows on disk (KVSTORE_LAZY_DISK_ADMIT_WINDOW W rounds): a row comes back
        into memory when it was pushed in the key's last W rounds (its record's last push round), else it is
        served where it is; a function of a batch of record payloads giving the admitted mask. None: no disk tier,
        or W = 0 (every touched row comes back). Deterministic: rounds and the records' columns only."""
        if self.disk is None or self.policy is None:
            return None
        window = self.policy.lifecycle.settings.disk_admit_window
        if not window:
            return None
        since = np.int32(max(self.policy.round - window, -(1 << 31)))
        return lambda payload: payload["c_last"] >= since

    def _update_on_disk(self, row_ids: np.ndarray, values: np.ndarray, records: np.ndarray,
                        optimizer: Optimizer | None) -> tuple[np.ndarray, np.ndarray]:
        """Push `values` (rows of `row_ids`) into the rows of `records` (whole disk records of some of those rows,
        not admitted into memory): the same optimizer code on a scratch batch of their bytes, their policy columns
        stamped as a push stamps them, written back in place (DiskTier.write_back). The optimizer's update count
        is left as it was: the round's one count comes with the rows in memory (apply calls _update once, also
        with no rows). Returns the row ids and values still to apply."""
        sorter = np.argsort(row_ids, kind="stable")
        pos = sorter[np.searchsorted(row_ids, records["id"], sorter=sorter)]
        payload = records["payload"]
        weights = np.ascontiguousarray(payload["w"])
        states = [np.ascontiguousarray(payload[f"s{i}"]) for i in range(self._table.num_states)]
        grad = np.ascontiguousarray(values[pos])
        if optimizer is None:
            weights[...] = grad
        else:
            optimizer.update_uncounted(self.key, weights, states, grad)
        payload["w"] = weights
        for i, state in enumerate(states):
            payload[f"s{i}"] = state
        self.policy.pushed_on_disk(payload)
        self.disk.write_back(records)
        rest = np.ones(len(row_ids), bool)
        rest[pos] = False
        return row_ids[rest], np.ascontiguousarray(values[rest])

    def _zeros(self, row_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(row_ids), self.row_size), self._table.dtype)

    def _slots_for(self, row_ids: np.ndarray, make_rows: Callable | None = None, promoted: bool = False) -> np.ndarray:
        """Slots of `row_ids`, creating absent rows with their initial values (or `make_rows`); rows on disk come
        back first (unless the caller brought them back: `promoted`)."""
        if not promoted:
            self._promote(row_ids)
        before = len(self._table)
        if make_rows is None:   # the initial values: made in one compiled pass where the loop can make them
            slots = self._table.ensure(row_ids, self.initial_rows, self._place_new_rows)
        else:
            slots = self._table.ensure(row_ids, make_rows)
        if self.policy is not None and len(self._table) > before:
            self.policy.created(self._table, before, len(self._table))
        return slots

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
    def merge(merged, grad: tuple[np.ndarray, np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray]:
        local_ids, values = grad
        if count == 0:
            return grad              # the message's arrays, never written: merge_rows sums into new ones
        if len(local_ids) == 0:
            return merged
        got = _merge_rows(merged[0], merged[1], local_ids, values)   # kernels.merge_rows in one compiled call
        if got is None:
            return kernels.merge_rows(merged[0], merged[1], local_ids, values)
        return np.frombuffer(got[0], np.int64), np.frombuffer(got[1], np.float32).reshape(-1, values.shape[1])

    def apply(self, grad: tuple[np.ndarray, np.ndarray], optimizer: Optimizer | None) -> None:
        local_ids, values = grad
        if len(local_ids) == 0:
            return
        row_ids = self.row_ids_of(local_ids)
        admit = self._disk_admit()
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
        slots = self._slots_for(row_ids, promoted=True)
        self._update(slots, values, optimizer)
        if self.policy is not None:
            self.policy.pushed(self._table, slots)

    def _update(self, slots: np.ndarray, values: np.ndarray, optimizer: Optimizer | None) -> None:
        if optimizer is None:
            self._table.set_weights(slots, values)
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

    def pull(self, request: DataRequest, store: bool, known_absent: bool = False) -> bytes:
        """The rows a pull asks for, in the wire dtype; with `store` (or for a key that is not lazy) absent rows are
        created, else they are computed and left absent. The caller has checked the request's dtype and rows
        (check_dtype, check_rows: KVServer._rows_pull does, before its poison check); `known_absent`: it found none of
        them in the table just now (the fast path's probe), so they are not looked up again."""
        row_ids = self.row_ids_of(request.local_ids)
        if store and self.policy is not None and not self.policy.stores_on_pull:
            store = False            # rows wait for admission: a pull never creates one
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
            rows = self._table.weights(self._slots_for(row_ids))
        else:
            # (with no disk tier, rows the caller found absent are not looked up again)
            if known_absent:        # none of them is in the table (a disk tier may have them)
                slots = None if self.disk is None else np.full(len(row_ids), -1, np.int64)
            else:
                slots = self._table.lookup(row_ids)
            if slots is None or (self.disk is None and len(slots) and slots.max() < 0):   # none stored
                return self.initial_rows(row_ids).astype(self.dtype, copy=False).tobytes()
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
        return rows.astype(self.dtype, copy=False).tobytes()

    def absent_fill(self) -> tuple[int, float, float] | None:
        """For the compiled pull path: the declared initializer's compiled values (``compiled_fill``) when a row a
        pull finds absent is its initial value, left absent (:meth:`pull` without `store`: a lazy key with no row
        policy and no disk tier), else None."""
        if self.policy is not None or self.disk is not None:
            return None
        return self._compiled_fill

    @functools.cached_property
    def _compiled_fill(self) -> tuple[int, float, float] | None:
        """The declared initializer's compiled values for this key (the spec's: the same for every pull)."""
        return None if self.spec is None else self.spec.initializer.compiled_fill(self.spec.seed, self.key)

    @functools.cached_property
    def _place_new_rows(self) -> Callable | None:
        """``RowTable.ensure``'s compiled routine for this key's new rows (``_fast.c`` ``ensure_rows`` with the row
        size and :meth:`initial_rows`' values as the compiled loop's ``(key_state, span, low)``: zero for a key that
        is not declared, else the initializer's ``compiled_fill``), or None when the loop cannot make them."""
        fill = (0, 0.0, 0.0) if self.spec is None else self._compiled_fill
        return None if fill is None else functools.partial(native.ensure_rows, 4 * self.row_size, fill)

    def resident_rows(self) -> tuple | None:
        """For the compiled pull path (server/fastpath.py): (RowTable.probe_arrays(), row_offset, local_rows) if a
        pull whose rows are all in the table is a plain gather of them in the wire dtype (float32), else None; a
        pull with any row not in the table always comes to :meth:`pull`."""
        if self.dtype != np.float32 or self._table.dtype != np.float32:
            return None
        return self._table.probe_arrays(), self.row_offset, self.local_rows

    def use_master_copy(self) -> None:
        """kSetMultiPrecision: the rows move to a float32 table."""
        if self.dtype != np.float32 and self._table.dtype != np.float32:
            rows = self._table.export()
            rows["states"] = [s.astype(np.float32) for s in rows["states"]]
            self._table = self._new_table(np.float32, self.num_states, rows, self._table.buckets)
            self._relayout_disk()
            self._rebuilt = True

    def reset_states(self, optimizer: Optimizer) -> None:
        self._table.set_num_states(optimizer.num_states())
        self._relayout_disk()
        self._rebuilt = True         # every row's states changed (their number too): snapshot the whole key

    def _relayout_disk(self) -> None:
        """The table's layout changed (dtype, number of states): rewrite the rows on disk to match, chunk by chunk
        (weights cast to the table's dtype; states kept if their number did not change, else zero, as in memory)."""
        if self.disk is None:
            return
        old, path = self.disk, self.disk.path
        new = DiskTier(path.with_name(path.name + ".relayout"), self._table, old.store.segment_rows,
                       compact_ratio=old.store.compact_ratio, rows=old.store.rows)
        same_states = old.layout[2] == self._table.num_states
        for rows in old.chunks():
            rows["weights"] = rows["weights"].astype(self._table.dtype)
            rows["states"] = [s.astype(self._table.dtype) for s in rows["states"]] if same_states else \
                [np.zeros_like(rows["weights"]) for _ in range(self._table.num_states)]
            new.store.put(rows["row_ids"], new._pack(rows))
        new.counters = old.counters
        old.store.close()
        shutil.rmtree(path)
        new.store.commit()
        new.store.close()
        new.path.rename(path)
        self.disk = DiskTier.open(path, self._table, verify=False, compact_ratio=old.store.compact_ratio)
        self.disk.counters = new.counters

    # -- rows and optimizer states, for worker checkpoints (state_transfer)

    @property
    def num_states(self) -> int:
        return self._table.num_states

    def row_ids(self) -> np.ndarray:
        """The global ids of the rows that exist (in memory or on disk), ascending."""
        ids = self._table.row_ids()
        if self.disk is not None and len(self.disk):
            ids = np.concatenate([ids, self.disk.store.row_ids()])
        return np.sort(ids)

    def global_range(self) -> tuple[int, int]:
        return self.row_offset, self.row_offset + self.local_rows

    def state_rows(self, row_ids: np.ndarray, index: int) -> np.ndarray:
        """Optimizer state `index` of existing rows `row_ids`, (rows, row size)."""
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states, not {index + 1}")
        slots = self._table.lookup(row_ids)
        present = slots >= 0
        if self.disk is not None and not present.all():      # read from disk, not promoted (a listing)
            absent = row_ids[~present]
            if not self.disk.contains(absent).all():
                raise KeyError(f"a listed row of key {self.key} no longer exists")
            out = np.empty((len(row_ids), self.row_size), self._table.dtype)
            out[present] = self._table.states(slots[present])[index]
            out[~present] = self.disk.read(absent)["states"][index]
            return out
        if not present.all():
            raise KeyError(f"a listed row of key {self.key} no longer exists")
        return self._table.states(slots)[index]

    def set_state_rows(self, row_ids: np.ndarray, index: int, values: np.ndarray) -> None:
        """Write optimizer state `index` of rows `row_ids` (created with their initial values if absent)."""
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states, not {index + 1}")
        slots = self._slots_for(row_ids)
        states = self._table.states(slots)
        states[index] = values.reshape(len(row_ids), self.row_size).astype(self._table.dtype)
        self._table.set_states(slots, states)

    # -- the lifecycle: eviction points and the memory budget (see server.lifecycle)

    def expire(self) -> int:
        """The TTL sweep at an eviction point: remove the rows whose time ran out, in memory and on disk."""
        cuts = self.policy.sweep()
        slots = self.policy.expired(self._table, cuts)
        gone = len(slots)
        if gone:
            self._table.remove_slots(slots)
        if cuts and self.disk is not None and len(self.disk):
            gone += self.disk.expire(lambda columns: self.policy.dead(columns, cuts))
        self.policy.counters["evicted_ttl"] += gone
        return gone

    def scores(self) -> np.ndarray:
        """The eviction score of every slot, for the memory budget."""
        return self.policy.scores(self._table)

    def ids_at(self, slots: np.ndarray) -> np.ndarray:
        """Global row ids of existing slots."""
        return self._table.ids_at(slots)

    def evict(self, slots: np.ndarray) -> int:
        """Remove the rows at `slots` (the budget's choice, from :meth:`scores` of this table as it is): to the disk
        tier if there is one, else dropped (their next touch starts them over)."""
        if self.disk is not None:
            self.disk.demote(self._table, slots)
            return len(slots)
        self._table.remove_slots(slots)
        self.policy.counters["evicted_budget"] += len(slots)
        return len(slots)

    def upkeep(self) -> None:
        """At every eviction point, after the budget's pass: the disk tier compacts its sealed segments past the
        garbage ratio (promotions and expiries leave garbage). Every round a little (a segment or so), not much at
        once after each pass: a round end's work the workers then wait for stays short."""
        if self.disk is not None:
            self.disk.compact()

    def accounted_bytes(self) -> int:
        """What the memory budget counts for this key: its row table, its pending-admission table and the index of
        its rows on disk."""
        disk = self.disk.index_nbytes() if self.disk is not None else 0
        return self._table.nbytes() + (self.policy.pending_bytes() if self.policy is not None else 0) + disk

    def row_nbytes(self) -> int:
        """Accounted bytes evicting one row of this key frees (the index's buckets aside): its row, less its entry
        in the disk tier's index if it goes there."""
        return self._table.row_nbytes - (self.disk.index_row_nbytes() if self.disk is not None else 0)

    # -- snapshots and stats

    def snapshot(self) -> dict:
        """The key's state for a server snapshot: the rows in memory (sorted), and with a disk tier its store
        (``"disk"``: checkpoint commits it into the snapshot, hard-linking its segments: no row is read)."""
        out = self._snapshot(self._table.export(), None if self.policy is None else self.policy.pending_rows())
        if self.disk is not None:
            out["disk"] = self.disk.store
        return out

    def all_rows(self) -> dict:
        """Every row that exists, memory and disk, sorted by id (a copy)."""
        rows = self._table.export()
        if self.disk is None or not len(self.disk):
            return rows
        parts = [rows] + list(self.disk.chunks())
        ids = np.concatenate([p["row_ids"] for p in parts])
        order = np.argsort(ids, kind="stable")
        return {"row_ids": ids[order], "weights": np.concatenate([p["weights"] for p in parts])[order],
                "states": [np.concatenate([p["states"][i] for p in parts])[order] for i in range(self.num_states)],
                "columns": {name: np.concatenate([p["columns"][name] for p in parts])[order]
                            for name in rows["columns"]}}

    def _snapshot(self, rows: dict, pending: dict | None) -> dict:
        meta = {"kind": self.kind, "dtype": self.dtype.name, "row_size": self.row_size,
                "local_rows": self.local_rows, "row_offset": self.row_offset, "lazy": self.spec is not None,
                "buckets": self._table.buckets, "rank": self.rank}
        arrays = {f"col_{name}": values for name, values in rows["columns"].items()}
        if "removed" in rows:
            arrays["dead_ids"] = rows["removed"]
        if self.policy is not None:
            meta["policy_state"] = self.policy.state()
        if pending is not None:
            arrays.update(pending_ids=pending["row_ids"], pending_count=pending["weights"].reshape(-1),
                          pending_last=pending["columns"]["last"])
            if "removed" in pending:
                arrays["pending_dead"] = pending["removed"]
        return {"row_ids": rows["row_ids"], "weights": rows["weights"], "states": rows["states"], "meta": meta,
                "arrays": arrays}

    def delta(self) -> dict:
        """What an incremental snapshot holds of this key: the rows created or written since the last snapshot
        (with their columns), ``dead_ids`` for rows removed since then, the same for the pending table, and the
        policy state; the whole key (``mode: full``) if it is new or was rebuilt since."""
        if self._rebuilt or not self._table.tracks_changes:
            return dict(self.snapshot(), mode="full")
        pending = None if self.policy is None else self.policy.pending_rows(changes=True)
        out = dict(self._snapshot(self._table.changes(), pending), mode="delta")
        if self.disk is not None:    # rows demoted since are tombstones of the memory part and rows of the store
            out["disk"] = self.disk.store
        return out

    def snapshot_written(self) -> None:
        """The state now is on disk (a base or a delta of the snapshot chain): changes start over from here."""
        self._table.clear_changes()
        if self.policy is not None:
            self.policy.clear_changes()
        self._rebuilt = False

    def inspect(self) -> dict:
        """Everything a rejected request must leave alone, as bytes (tests compare it before and after)."""
        table = self._snapshot(self.all_rows(), None if self.policy is None else self.policy.pending_rows())
        merged = self.round.merged if self.round.pending else None
        return {"meta": table["meta"], "storage": self._table.dtype.name, "row_ids": table["row_ids"].tobytes(),
                "weights": table["weights"].tobytes(), "states": [s.tobytes() for s in table["states"]],
                "arrays": {name: a.tobytes() for name, a in table["arrays"].items()},
                "merged": None if merged is None else (merged[0].tobytes(), merged[1].tobytes()),
                "round": self.round.describe()}

    @classmethod
    def restore(cls, key: int, table: dict, spec: LazySpec | None, num_states: int | None,
                lifecycle: Lifecycle | None = None) -> "RowSparseKey":
        info = table["meta"]
        arrays = table.get("arrays", {})
        spec = spec if info.get("lazy") else None
        policy = None
        if lifecycle is not None and spec is not None:
            if info.get("policy_state") is not None:       # the snapshot's policy and its state rule
                pending = None
                if "pending_ids" in arrays:
                    pending = {"row_ids": arrays["pending_ids"], "weights": arrays["pending_count"].reshape(-1, 1),
                               "states": [], "columns": {"last": arrays["pending_last"]}}
                policy = RowPolicy.restore(info["policy_state"], lifecycle, key, spec.seed, pending)
                lifecycle.adopt(policy)
            else:
                policy = lifecycle.policy_for(spec.row_policy(lifecycle.settings.defaults), key, spec.seed)
        entry = cls(key, np.dtype(info["dtype"]), int(info["row_size"]), table["weights"].dtype,
                    len(table["states"]), int(info["local_rows"]), int(info["row_offset"]), spec, policy,
                    lifecycle.settings.track_changes if lifecycle is not None else False)
        rows = {"row_ids": table["row_ids"], "weights": table["weights"], "states": table["states"],
                "columns": {name[4:]: a for name, a in arrays.items() if name.startswith("col_")}}
        entry._table = entry._new_table(table["weights"].dtype, len(table["states"]), rows, info.get("buckets"))
        entry.snapshot_written()      # what was loaded is what is on disk
        if num_states is not None and entry.num_states != num_states:
            entry._table.set_num_states(num_states)
        entry.rank = int(info.get("rank", 0))
        if lifecycle is not None:
            entry._open_disk(lifecycle)
        disk = table.get("disk")                    # the snapshot's disk tier (a committed store's directory)
        if disk is not None and entry.disk is not None:
            entry.disk = DiskTier.restore(disk, entry.disk.path, entry._table, lifecycle.settings.disk_compact)
        elif disk is not None:                      # no disk tier now: its rows come into memory
            for rows in DiskTier.open(disk, entry._table).chunks():
                entry._table.insert_rows(rows)
            entry._rebuilt = True
        return entry

    def stats(self) -> dict:
        out = {"rows": len(self._table), "bytes": self._table.nbytes(), "lazy": self.spec is not None,
               "local_rows": self.local_rows, "row_offset": self.row_offset}
        if self.disk is not None:
            out.update(self.disk.stats())
        if self.policy is not None:
            out.update(self.policy.stats())
        return out

    def __len__(self) -> int:
        return len(self._table)
