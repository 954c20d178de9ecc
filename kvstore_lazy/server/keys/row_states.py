"""The row_sparse key's rows and optimizer states: how a row comes into the table, and the states' transfer.

Owns: a row's initial value (zero for a key that was not declared, else its declared initializer's), the one path
by which rows enter the table (:meth:`RowKeyStates._slots_for`: rows on disk come back first, absent rows are made
in one compiled pass where the loop can make them), changes of the table's layout (multi-precision's float32 table,
a new optimizer's number of states), and the rows and optimizer states a worker checkpoint lists, reads and writes
(``state_transfer``).
Does not own: which rows a push may create (``lifecycle.RowPolicy.admit``, asked by ``row_sparse``), the disk
tier (``row_disk``).
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from kvstore_lazy.numerics.optimizers import Optimizer
from kvstore_lazy.protocol.fast import native
from kvstore_lazy.server.keys.row_disk import RowKeyDisk
from kvstore_lazy.store.pieces import id_ranges


class RowKeyStates(RowKeyDisk):
    """The key's rows and optimizer states (see the module docstring)."""

    # -- rows into the table

    def initial_rows(self, row_ids: np.ndarray) -> np.ndarray:
        if self.spec is None:
            # Not declared: every row arrived at init, so a missing row can only be zero (an empty gradient row of
            # the stock server's dense-shaped rsp); the range check keeps ids within the init rows.
            return self._zeros(row_ids)
        out = np.empty((len(row_ids), self.row_size), self._table.dtype)   # (checked at the declaration)
        self.spec.initializer.fill(self.spec.seed, self.key, row_ids, self.spec.shape, out)
        return out

    def _zeros(self, row_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(row_ids), self.row_size), self._table.dtype)

    def _slots_for(self, row_ids: np.ndarray, make_rows: Callable | None = None, promoted: bool = False,
                   known: np.ndarray | None = None) -> np.ndarray:
        """Slots of `row_ids`, creating absent rows with their initial values (or `make_rows`); rows on disk come
        back first (unless the caller brought them back: `promoted`). `known`: their slots as a lookup found them
        while the table's ``moves`` were what they are now (-1: absent then): only the -1 ones are looked up again
        (a row made since is found), and the absent ones made in their order, as a lookup of all would make them."""
        if known is not None:
            if (known >= 0).all():
                return known
            slots, again = known.copy(), known < 0
            slots[again] = self._slots_for(row_ids[again], make_rows, promoted)
            return slots
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

    # -- the table's layout

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
        self._relayout_disk(zero_states=True)
        self._rebuilt = True         # every row's states changed (their number too): snapshot the whole key

    # -- rows and optimizer states, for worker checkpoints (state_transfer)

    def row_ids(self) -> np.ndarray:
        """The global ids of the rows that exist (in memory or on disk), ascending."""
        ids = self._table.row_ids()
        if self.disk is not None and len(self.disk):
            ids = np.concatenate([ids, self.disk.store.row_ids()])
        ids.sort()                  # (in place: a listing of a large key is 8 bytes a row, once)
        return ids

    def release_unused(self) -> None:
        """The memory of rows the table keeps zeroed past the ones in use goes back (``RowTable.release_unused``)."""
        self._table.release_unused()

    def row_id_chunks(self, chunk: int = 1 << 16):
        """:meth:`row_ids` as a stream: ascending, at most about ``chunk`` ids a piece (more where the two tiers'
        pieces meet). The rows in memory are sorted a range of ids at a time (store.pieces.id_ranges: about 1/16 of
        them at once), the rows on disk streamed from the disk index in its order, the two merged piece by piece (a
        row is in one tier): never a copy of every id of the key. Don't change the key while iterating."""
        view = self._table.row_ids_view()
        mem = (view[part[lo:lo + chunk]] for part in id_ranges(view) for lo in range(0, len(part), chunk))
        disk = self.disk.store.id_chunks(chunk) if self.disk is not None and len(self.disk) else iter(())
        a, b = next(mem, None), next(disk, None)
        while a is not None and b is not None:
            # everything up to the smaller of the two pieces' last ids is in hand: out, sorted
            upto = min(a[-1], b[-1])
            ia, ib = int(np.searchsorted(a, upto, side="right")), int(np.searchsorted(b, upto, side="right"))
            out = np.concatenate([a[:ia], b[:ib]])
            out.sort()
            yield out
            a = a[ia:] if ia < len(a) else next(mem, None)
            b = b[ib:] if ib < len(b) else next(disk, None)
        for rest, more in ((a, mem), (b, disk)):
            while rest is not None:
                yield rest
                rest = next(more, None)

    def state_rows(self, row_ids: np.ndarray, index: int) -> np.ndarray:
        """Optimizer state `index` of existing rows `row_ids`, (rows, row size)."""
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states, not {index + 1}")
        slots = self._table.lookup(row_ids)
        present = slots >= 0
        if self.disk is not None and not present.all():      # read from disk, not promoted (a listing)
            out = np.empty((len(row_ids), self.row_size), self._table.dtype)
            out[present] = self._table.states(slots[present])[index]
            try:            # (chunk by chunk; a row on neither tier is a KeyError there: no lookup of them first)
                self.disk.read_field(row_ids[~present], f"s{index}", out, np.flatnonzero(~present))
            except KeyError:
                raise KeyError(f"a listed row of key {self.key} no longer exists") from None
            return out
        if not present.all():
            raise KeyError(f"a listed row of key {self.key} no longer exists")
        return self._table.states(slots)[index]

    def set_state_rows(self, row_ids: np.ndarray, index: int, values: np.ndarray) -> None:
        """Write optimizer state `index` of rows `row_ids` (created with their initial values if absent). Rows on
        disk are written where they are unless the memory budget has room for them (a worker restoring a
        checkpoint's states sets every row's: that must not bring the disk tier into memory)."""
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states, not {index + 1}")
        if self.disk is not None and len(self.disk) and self.history is None:
            cold = self._table.lookup(row_ids) < 0
            on_disk = cold.copy()
            on_disk[cold] = self.disk.contains(row_ids[cold])
            if on_disk.any() and self.policy.lifecycle.headroom() < int(on_disk.sum()) * self._table.row_nbytes:
                values = values.reshape(len(row_ids), self.row_size).astype(self._table.dtype)
                self.disk.write_field(row_ids[on_disk], f"s{index}", values[on_disk])
                row_ids, values = row_ids[~on_disk], values[~on_disk]
        slots = self._slots_for(row_ids)
        states = self._table.states(slots)
        states[index] = values.reshape(len(row_ids), self.row_size).astype(self._table.dtype)
        self._table.set_states(slots, states)
