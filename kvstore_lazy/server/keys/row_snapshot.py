"""The row_sparse key's snapshots: the whole key, what changed since the last one, and the key restored from one.

Owns: the key's tables for a server snapshot (the rows in memory, the pending-admission table, the policy's state,
the disk tier's store, which the checkpoint hard-links), the incremental part (rows created or written since the
last snapshot, ``dead_ids`` for rows removed; a dense key's history in its meta, its rows' ticks as a column),
:meth:`RowKeySnapshots.inspect` (everything a rejected request must leave alone, for tests) and
:meth:`RowKeySnapshots.restore`, the inverse of the snapshot.
Does not own: the snapshot files, their chain of deltas and their atomic writes (``persist.checkpoint``), the
row table's change tracking (``store.rows.RowTable``).
"""
from __future__ import annotations

from typing import Self

import numpy as np

from kvstore_lazy.server.declaration import LazySpec
from kvstore_lazy.numerics.catchup import History
from kvstore_lazy.server.keys.row_catchup import RowKeyCatchUp
from kvstore_lazy.server.lifecycle import Lifecycle, RowPolicy
from kvstore_lazy.store.arena import release_free_memory
from kvstore_lazy.store.tier import DiskTier


class RowKeySnapshots(RowKeyCatchUp):
    """The key's snapshots and its restore (see the module docstring)."""

    def snapshot(self, stream: bool = False) -> dict:
        """The key's state for a server snapshot: the rows in memory (sorted), and with a disk tier its store
        (``"disk"``: its DiskTier, which checkpoint commits into the snapshot, hard-linking its segments and index
        runs: no row is read; a full disk there stops the server as anywhere in the tier). With
        `stream` the rows' arrays are ``store.rows.Pieces``, gathered chunk by chunk as the snapshot file is written
        (never a copy of the table; write them before the table changes), else copies. The heap's free pages go
        back to the kernel first (``release_free_memory``): the write's buffers do not come on top of them."""
        release_free_memory()
        rows = self._table.export_pieces() if stream else self._table.export()
        out = self._snapshot(rows, None if self.policy is None else self.policy.pending_rows())
        if self.disk is not None:
            out["disk"] = self.disk
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
        if self.history is not None:
            meta["history"] = self.history.to_json()
        if self.row_steps:
            meta["adam_row_steps"] = True
        if pending is not None:
            arrays.update(pending_ids=pending["row_ids"], pending_count=pending["weights"].reshape(-1),
                          pending_last=pending["columns"]["last"])
            if "removed" in pending:
                arrays["pending_dead"] = pending["removed"]
        return {"row_ids": rows["row_ids"], "weights": rows["weights"], "states": rows["states"], "meta": meta,
                "arrays": arrays}

    def delta(self, stream: bool = False) -> dict:
        """What an incremental snapshot holds of this key: the rows created or written since the last snapshot
        (with their columns), ``dead_ids`` for rows removed since then, the same for the pending table, and the
        policy state; the whole key (``mode: full``) if it is new or was rebuilt since, or if its tables removed too
        many rows since to list them (``RowTable.changes_complete``: a disk tier's demotions, many times the rows in
        memory between two snapshots; the whole key is then its rows in memory and its store, as any snapshot)."""
        pending_table = None if self.policy is None else self.policy.pending
        if self._rebuilt or not self._table.changes_complete or \
                (pending_table is not None and not pending_table.changes_complete):
            return dict(self.snapshot(stream), mode="full")
        release_free_memory()           # (as snapshot)
        pending = None if self.policy is None else self.policy.pending_rows(changes=True)
        out = dict(self._snapshot(self._table.changes(pieces=stream), pending), mode="delta")
        if self.disk is not None:    # rows demoted since are tombstones of the memory part and rows of the store
            out["disk"] = self.disk
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
                lifecycle: Lifecycle | None = None) -> Self:
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
                    lifecycle.settings.track_changes if lifecycle is not None else False,
                    bool(info.get("adam_row_steps")))
        entry.closed_forms = lifecycle is not None and lifecycle.settings.catchup == "closed"
        if info.get("history") is not None:
            entry.history = History.from_json(info["history"])
            entry.history.closed = entry.closed_forms
        rows = {"row_ids": table["row_ids"], "weights": table["weights"], "states": table["states"],
                "columns": {name[4:]: a for name, a in arrays.items() if name.startswith("col_")}}
        entry._table = entry._new_table(table["weights"].dtype, len(table["states"]), rows, info.get("buckets"))
        entry.snapshot_written()      # what was loaded is what is on disk
        if num_states is not None and entry.num_states != num_states:
            entry._table.set_num_states(num_states)
        entry.rank = int(info.get("rank", 0))
        disk = table.get("disk")                    # the snapshot's disk tier (a committed store's directory)
        if lifecycle is not None:                   # (that store itself if there is one: no fresh tier beside it)
            entry._open_disk(lifecycle, source=disk)
        if disk is not None and entry.disk is None:     # no disk tier now: its rows come into memory
            for rows in DiskTier.open(disk, entry._table).chunks():
                entry._table.insert_rows(rows)
            entry._rebuilt = True
        return entry
