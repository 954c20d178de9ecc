"""The row_sparse key's fields, its ids and checks, and its stats: the base the other parts of the key build on.

Owns: what a row_sparse key is made of (its row table, the shape of the rows this server holds, its declaration and
lifecycle policy, its sync round, its disk tier's handle), the mapping of a worker's local ids to global row ids,
the checks of a request against the key (dtype, row range) and the key's stats.
Does not own: anything a request does to the rows (the classes built on this one: ``row_disk``, ``row_states``,
``row_snapshot``, ``row_sparse``; the package docstring lists them). :class:`RowKeyFields` is never made on its
own: :class:`~kvstore_lazy.server.keys.row_sparse.RowSparseKey` is the key.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup import History
from kvstore_lazy.protocol.kv import BadRequest
from kvstore_lazy.server.declaration import LazySpec
from kvstore_lazy.server.keys.sync_round import SyncRound
from kvstore_lazy.server.lifecycle import RowPolicy
from kvstore_lazy.store.rows import RowTable
from kvstore_lazy.store.tier import DiskTier


class RowKeyFields:
    """A row_sparse key's state (the attributes every part of the key reads) and what it says of itself."""

    kind = "row_sparse"

    def __init__(self, key: int, dtype: np.dtype, row_size: int, storage_dtype: np.dtype, num_states: int,
                 local_rows: int, row_offset: int = 0, spec: LazySpec | None = None,
                 policy: RowPolicy | None = None, track_changes: bool = False, row_steps: bool = False) -> None:
        self.key = key
        self.dtype = dtype                  # the key's dtype (what the wire carries)
        self.row_size = row_size            # elements per row ("unit_len")
        self.local_rows = local_rows        # rows this server holds (local ids < local_rows)
        self.row_offset = row_offset        # global row id of local row 0 (partitioned keys)
        self.spec = spec
        self.policy = policy
        self._track = track_changes         # tables record changes for incremental snapshots
        self.history: History | None = None  # dense semantics: the key's steps (row_catchup), with a tick column
        self.row_steps = row_steps          # per-row Adam bias correction: each row's updates, a steps column
        self.closed_forms = False           # KVSTORE_LAZY_CATCHUP=closed (set by whoever makes the key)
        self._table = self._new_table(storage_dtype, num_states)   # float32 under multi-precision
        self._rebuilt = True                # the next incremental snapshot must hold the whole key
        self.round = SyncRound()
        self.rank = 0                       # the server's rank (names the disk tier's directory)
        self.disk: DiskTier | None = None   # rows the budget moved out of memory

    def _new_table(self, dtype, num_states: int, rows: dict | None = None, buckets: int | None = None) -> RowTable:
        columns = dict(self.policy.columns) if self.policy is not None else None
        if self.history is not None:
            columns = dict(columns or {}, tick=np.int64)
        if self.row_steps:
            columns = dict(columns or {}, steps=np.uint32)
        # a key whose rows a policy keeps (a memory budget may hold it): its index grows with the old table gone
        # first, so the rehash of a table of millions of rows does not hold both (the old one is half the new)
        lean = self.policy is not None
        if rows is None:
            return RowTable(self.row_size, dtype, num_states=num_states, columns=columns, track_changes=self._track,
                            lean_rehash=lean)
        return RowTable.load(rows, dtype=dtype, columns=columns, track_changes=self._track, buckets=buckets,
                             lean_rehash=lean)

    # -- ids and checks

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
        """Whether a push of rows of `row_size` `dtype` values is a gradient ``RowSparseKey.gradient`` takes as it is
        (the key's dtype and row size, no cast): the fast path's condition for handing it to the round."""
        return dtype == self.dtype == self._table.dtype and row_size == self.row_size

    def check_dtype(self, dtype: np.dtype, what: str) -> None:
        if dtype != self.dtype:
            raise BadRequest(self.key, f"{what} as {dtype.name} {'of' if what == 'pull' else 'to'} a "
                                       f"{self.dtype.name} key")

    def global_range(self) -> tuple[int, int]:
        return self.row_offset, self.row_offset + self.local_rows

    @property
    def num_states(self) -> int:
        return self._table.num_states

    # -- stats

    def stats(self) -> dict:
        out = {"rows": len(self._table), "bytes": self._table.nbytes(), "lazy": self.spec is not None,
               "local_rows": self.local_rows, "row_offset": self.row_offset}
        if self.disk is not None:
            out.update(self.disk.stats())
        if self.policy is not None:
            out.update(self.policy.stats())
        if self.history is not None:        # dense semantics: the steps rows are brought over
            out.update(history_steps=self.history.tick, history_runs=self.history.runs())
        return out

    def __len__(self) -> int:
        return len(self._table)
