"""The row_sparse key's disk tier and its lifecycle upkeep: where rows go when they leave memory, and when they leave.

Owns: opening the key's disk tier (``KVSTORE_LAZY_DISK_DIR``, under a memory budget), bringing rows on disk back
(:meth:`RowKeyDisk._promote`, the one place that does), the memory tier's admission of rows on disk, a push's update
of rows left where they are on disk, rewriting the rows on disk when the table's layout changes, and the key's part
of the lifecycle at an eviction point: the TTL sweep (:meth:`RowKeyDisk.expire`), the budget's scores and evictions
(:meth:`RowKeyDisk.evict`: to disk if there is a tier, else dropped), the disk tier's compaction
(:meth:`RowKeyDisk.upkeep`) and the bytes the budget counts for the key.
Does not own: the disk tier's format and I/O (``store.tier.DiskTier``), when an eviction point is and which rows
the budget picks across keys (``lifecycle.Lifecycle``), the policy's rules (``lifecycle.RowPolicy``).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore_lazy import paths

from kvstore_lazy.numerics.optimizers import Optimizer
from kvstore_lazy.server.keys.row_fields import RowKeyFields
from kvstore_lazy.server.lifecycle import Lifecycle
from kvstore_lazy.store.tier import DiskTier, dense_rows, memtable_entries


class RowKeyDisk(RowKeyFields):
    """The key's disk tier and its part of the lifecycle (see the module docstring)."""

    def _open_disk(self, lifecycle: Lifecycle, source: Path | None = None) -> None:
        """This key's disk tier when the server has one and the key's rows are budget-managed: a fresh one, or
        (`source`: a snapshot's committed store) that store, its files linked into the key's directory and opened
        there. Only that one store and its index are built: never a fresh tier (with a dense index of its own, 4
        bytes a possible row) beside the snapshot's while it is restored."""
        if not (lifecycle.settings.disk_dir and self.policy is not None):
            return
        settings = lifecycle.settings
        if source is not None:
            self.disk = DiskTier.restore(source, self.disk_path(lifecycle), self._table, settings.disk_compact,
                                         memtable_entries(settings.memory_budget))
            return
        self.disk = DiskTier(self.disk_path(lifecycle), self._table, settings.disk_segment_rows,
                             compact_ratio=settings.disk_compact,
                             rows=dense_rows(self.row_offset, self.local_rows, settings.memory_budget),
                             memtable_entries=memtable_entries(settings.memory_budget))

    def disk_path(self, lifecycle: Lifecycle) -> Path:
        return paths.disk_store(lifecycle.settings.disk_dir, self.rank, self.key)

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

    def _relayout_disk(self, zero_states: bool = False) -> None:
        """The table's layout changed (dtype, number of states, columns): rewrite the rows on disk to match, chunk
        by chunk (weights cast to the table's dtype; states kept if their number did not change and not
        `zero_states` (a new optimizer), else zero, as in memory)."""
        if self.disk is None:
            return
        old, path = self.disk, self.disk.path
        new = DiskTier(path.with_name(path.name + ".relayout"), self._table, old.store.segment_rows,
                       compact_ratio=old.store.compact_ratio, rows=old.store.rows,
                       memtable_entries=old.store.memtable_entries)
        same_states = old.layout[2] == self._table.num_states and not zero_states
        for rows in old.chunks():
            self._relayout_rows(rows)
            rows["weights"] = rows["weights"].astype(self._table.dtype)
            rows["states"] = [s.astype(self._table.dtype) for s in rows["states"]] if same_states else \
                [np.zeros_like(rows["weights"]) for _ in range(self._table.num_states)]
            new.store.put(rows["row_ids"], new._pack(rows))
        new.counters = old.counters
        old.store.close()
        shutil.rmtree(path)
        new.commit()
        new.store.close()
        new.path.rename(path)
        self.disk = DiskTier.open(path, self._table, verify=False, compact_ratio=old.store.compact_ratio,
                                  memtable_entries=old.store.memtable_entries)
        self.disk.counters = new.counters

    def _relayout_rows(self, rows: dict) -> None:
        """A chunk of the rows on disk about to be rewritten in a new layout (``row_catchup`` brings them first)."""

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

    def scores(self, rows=None) -> np.ndarray:
        """The eviction score of the slots `rows` (a slice or slots; every slot by default), for the memory budget."""
        return self.policy.scores(self._table, rows)

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
