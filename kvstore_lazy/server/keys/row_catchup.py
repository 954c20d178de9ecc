"""The row_sparse key under an optimizer stock runs densely: every row moves every step, computed when it is next read.

Owns: the key's :class:`~kvstore_lazy.numerics.catchup.History` (``history``: None until an optimizer with dense
semantics is set for the key; kept from then on) and its rows' ``tick`` column; bringing rows to the current step
before anything reads or writes them (:meth:`RowKeyCatchUp._bring_slots` for rows in the table, written back;
:meth:`_bring_rows` for copies read from disk; :meth:`_initial_now` for rows never stored, left unstored, and kept
for the tick in :class:`FreshRows`, so a round's pulls and push of new rows bring them once); a push's
update of such a key (:meth:`_apply_dense`: the rows brought to the step before, the touched-row update stock's
kernel does, the step's scalars recorded, the rows stamped); its pulls and checkpoint reads; a new optimizer
(kController: stored rows finish the old optimizer's steps before their states restart at zero).
Does not own: the zero-gradient arithmetic (``numerics.catchup``), which rows exist (``row_states``), the disk
tier's format (``store.tier``).

Which optimizers: ``numerics.catchup.rule_for`` (SGD and Adam with ``lazy_update=False``, NAG with momentum, Signum,
RMSProp). With any other optimizer (``lazy_update=True``, AdaGrad, Ftrl) a key has no history and nothing here runs.
A row pulled, pushed, listed for a checkpoint or written by a state transfer is brought first; a row never stored is
answered with its initial value brought through the history (its value on stock), and stays unstored. Snapshots
hold each row as it is with its tick, and the history (``row_snapshot``): restored, a row is brought when next read.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup import History, rule_for, touched_update
from kvstore_lazy.numerics.optimizers import Optimizer
from kvstore_lazy.server.keys.row_states import RowKeyStates

TICK = "tick"
_f32 = np.dtype(np.float32)


class FreshRows:
    """Rows brought from their initial values to one tick, kept until the tick moves on: a round's pulls of rows
    never stored, by every worker, and the push that then stores them would each bring the same rows over the
    same steps again. A row is taken from here only if its values now are the initial values it was brought from
    (bit for bit), at the same tick; at most LIMIT rows are kept."""

    LIMIT = 1 << 18

    def __init__(self) -> None:
        self.clear()

    def clear(self, tick: int = -1) -> None:
        """Keep nothing (the history changed, or the tick moved on to `tick`)."""
        self.tick = tick
        self.ids = np.zeros(0, np.uint64)
        self.initial = self.weights = np.zeros((0, 0), _f32)
        self.states: list[np.ndarray] = []

    def take(self, tick: int, ids: np.ndarray, initial: np.ndarray, weights: np.ndarray,
             states: list[np.ndarray]) -> np.ndarray:
        """Rows `ids` (whose values are `initial`) found here are written into `weights` / `states`; the mask of
        those found."""
        if tick != self.tick or not len(self.ids) or not len(ids):
            return np.zeros(len(ids), bool)
        ids = np.asarray(ids, np.uint64)
        at = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        found = self.ids[at] == ids
        found[found] = (self.initial[at[found]].view(np.uint32) == initial[found].view(np.uint32)).all(axis=1)
        weights[found] = self.weights[at[found]]
        for st, kept in zip(states, self.states):
            st[found] = kept[at[found]]
        return found

    def keep(self, tick: int, ids: np.ndarray, initial: np.ndarray, weights: np.ndarray,
             states: list[np.ndarray]) -> None:
        if tick != self.tick:
            self.clear(tick)
        if not len(ids) or len(self.ids) + len(ids) > self.LIMIT:
            return
        if not len(self.ids):
            self.initial, self.weights = np.zeros((0, initial.shape[1]), _f32), np.zeros((0, initial.shape[1]), _f32)
            self.states = [np.zeros((0, initial.shape[1]), _f32) for _ in states]
        ids = np.asarray(ids, np.uint64)
        new = ~np.isin(ids, self.ids)
        ids = np.concatenate([self.ids, ids[new]])
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        self.initial = np.concatenate([self.initial, initial[new]])[order]
        self.weights = np.concatenate([self.weights, weights[new]])[order]
        self.states = [np.concatenate([kept, st[new]])[order] for kept, st in zip(self.states, states)]


class RowKeyCatchUp(RowKeyStates):
    """The key's dense semantics (see the module docstring)."""

    def dense(self) -> bool:
        """Whether rows of this key may need bringing to the current step before they are read."""
        return self.history is not None and self.history.dense()

    def use_optimizer(self, optimizer: Optimizer | None) -> None:
        """A key made (or restored without a history) while `optimizer` is set: a history if it is dense."""
        if optimizer is None or self.history is not None:
            return
        rule = rule_for(optimizer)
        if rule is not None:
            self._start_history(History(rule, optimizer.num_states()))
            self._relayout_disk()           # the rows on disk get their tick column (0: as they are)

    @property
    def _fresh(self) -> FreshRows:
        """The key's :class:`FreshRows` (made when first asked: most keys never have a history)."""
        cache: FreshRows | None = getattr(self, "_fresh_rows", None)
        if cache is None:
            cache = self._fresh_rows = FreshRows()
        return cache

    def _start_history(self, history: History) -> None:
        """Give the key a history and its table a tick column (every row at tick 0: at its values now)."""
        history.closed = self.closed_forms
        self.history = history
        self._fresh.clear()
        rows = self._table.export()
        rows["columns"][TICK] = np.zeros(len(rows["row_ids"]), np.int64)
        self._table = self._new_table(self._table.dtype, self.num_states, rows, self._table.buckets)
        self._rebuilt = True

    def reset_states(self, optimizer: Optimizer) -> None:
        """kController: stored rows finish the old optimizer's steps, then every state restarts at zero (the
        stock server builds a new updater) and a new era of the history starts."""
        rule = rule_for(optimizer)
        if self.history is None and rule is None:
            super().reset_states(optimizer)
            return
        if self.history is None:
            self._start_history(History(rule, optimizer.num_states()))
        else:
            self._bring_slots(np.arange(len(self._table), dtype=np.int64))
            self.history.new_optimizer(rule, optimizer.num_states())
            self._fresh.clear()             # (a new era may keep the tick)
        super().reset_states(optimizer)     # zero states; the rows on disk through _relayout_rows
        self._stamp(np.arange(len(self._table), dtype=np.int64))

    def _relayout_rows(self, rows: dict) -> None:
        """A chunk of the rows on disk, as the table's layout changes: brought to the current tick (a new era's
        reset included), stamped."""
        if self.history is None:
            return
        rows["columns"].setdefault(TICK, np.zeros(len(rows["row_ids"]), np.int64))
        self._bring_rows(rows)

    # -- bringing rows

    def _bring_slots(self, slots: np.ndarray) -> None:
        """Rows of the table at `slots` to the current tick, written back."""
        if not self.dense() or not len(slots):
            return
        assert self.history is not None
        ticks = self._table.column(TICK)[slots]
        behind = self.history.behind(ticks)
        if not len(behind):
            return
        at = slots[behind]
        weights, states = self._as_f32(self._table.weights(at)), [self._as_f32(s) for s in self._table.states(at)]
        ticks = ticks[behind]
        fresh = ticks == 0                   # rows at their initial values a pull of this round may have brought
        for st in states:
            fresh &= ~st.view(np.uint32).any(axis=1)
        if fresh.any():                      # those it did are taken from it, already at the current tick
            part = np.flatnonzero(fresh)
            w, s = weights[part], [st[part] for st in states]
            ticks[part[self._fresh.take(self.history.tick, self._table.ids_at(at[part]), w.copy(), w, s)]] = \
                self.history.tick
            weights[part] = w
            for st, x in zip(states, s):
                st[part] = x
        self.history.bring(weights, states, ticks)
        self._table.set_weights(at, weights.astype(self._table.dtype, copy=False))
        self._table.set_states(at, [s.astype(self._table.dtype, copy=False) for s in states])
        self._stamp(at)

    def _bring_rows(self, rows: dict) -> None:
        """Rows given whole (``RowTable.export``'s form, e.g. read from disk) to the current tick, in place."""
        if not self.dense() or not len(rows["row_ids"]):
            if self.history is not None:
                rows["columns"][TICK] = np.full(len(rows["row_ids"]), self.history.tick, np.int64)
            return
        assert self.history is not None
        weights = self._as_f32(rows["weights"])
        states = [self._as_f32(s) for s in rows["states"]]
        self.history.bring(weights, states, rows["columns"][TICK])
        rows["weights"] = weights.astype(rows["weights"].dtype, copy=False)
        rows["states"] = [s.astype(o.dtype, copy=False) for s, o in zip(states, rows["states"])]
        rows["columns"][TICK] = np.full(len(rows["row_ids"]), self.history.tick, np.int64)

    def _initial_now(self, row_ids: np.ndarray) -> np.ndarray:
        """The current values of rows never stored: their initial values brought through the history."""
        weights = self._as_f32(self.initial_rows(row_ids))
        if self.dense():
            assert self.history is not None
            initial, tick = weights.copy(), self.history.tick
            states = [np.zeros_like(weights) for _ in range(self.num_states)]
            miss = np.flatnonzero(~self._fresh.take(tick, row_ids, initial, weights, states))
            if len(miss):
                w, s = weights[miss], [st[miss] for st in states]
                self.history.initial(w, s)
                weights[miss] = w
                self._fresh.keep(tick, row_ids[miss], initial[miss], w, s)
        return weights.astype(self._table.dtype, copy=False)

    def _stamp(self, slots: np.ndarray) -> None:
        if self.history is not None and len(slots):
            self._table.column(TICK)[slots] = self.history.tick

    def _as_f32(self, a: np.ndarray) -> np.ndarray:
        """A float32 copy of rows, 2-D (what the rules compute on)."""
        a = a.reshape(len(a), self.row_size)
        return np.ascontiguousarray(a, dtype=_f32) if a.dtype != _f32 else np.array(a, copy=True)

    # -- the requests of a key with a history

    def _apply_dense(self, local_ids: np.ndarray, values: np.ndarray, optimizer: Optimizer | None) -> None:
        """A push's (or a round's merged) gradient: its rows brought to the step before, updated as stock's kernel
        updates the rows a gradient has, the step recorded, the rows stamped. Rows on disk come back first."""
        assert self.history is not None
        row_ids = self.row_ids_of(local_ids)
        self._promote(row_ids)
        if self.policy is not None:
            keep = self.policy.admit(self._table, row_ids)
            if keep is not None:
                row_ids, values = row_ids[keep], np.ascontiguousarray(values[keep])
        slots = self._slots_for(row_ids, promoted=True)
        self._bring_slots(slots)
        if optimizer is None:
            self._table.set_weights(slots, values)
        else:
            self._update_touched(slots, values, optimizer)
        self._stamp(slots)
        if self.policy is not None:
            self.policy.pushed(self._table, slots)

    def _update_touched(self, slots: np.ndarray, values: np.ndarray, optimizer: Optimizer) -> None:
        """One counted update of the rows at `slots` (none: a round without rows still counts) and its record."""
        assert self.history is not None
        rule = self.history.rule
        weights = self._as_f32(self._table.weights(slots))
        states = [self._as_f32(s) for s in self._table.states(slots)]
        grad = np.ascontiguousarray(values.reshape(len(slots), self.row_size), dtype=_f32)
        if rule is None:
            optimizer.update(self.key, weights, grad, states, row_sparse=True)
        else:
            touched_update(rule, optimizer, self.key, weights, grad, states)
        if len(slots):
            self._table.set_weights(slots, weights.astype(self._table.dtype, copy=False))
            self._table.set_states(slots, [s.astype(self._table.dtype, copy=False) for s in states])
        self.history.record(optimizer.update_count(self.key),
                            None if rule is None else rule.scalars(optimizer, self.key))

    def _pull_dense(self, row_ids: np.ndarray, store: bool) -> np.ndarray:
        """A pull's rows, current: stored rows brought (and written back); with `store` (or a key that was not
        declared) absent rows are created and brought, else rows on disk are read and brought where they are and
        rows never stored are computed (left unstored)."""
        if store or self.spec is None:
            slots = self._slots_for(row_ids)
            self._bring_slots(slots)
            return self._table.weights(slots)
        slots = self._table.lookup(row_ids)
        present = slots >= 0
        rows = np.empty((len(row_ids), self.row_size), self._table.dtype)
        if present.any():
            self._bring_slots(slots[present])
            rows[present] = self._table.weights(slots[present])
        absent = np.flatnonzero(~present)
        if len(absent) and self.disk is not None and len(self.disk):
            on_disk = self.disk.contains(row_ids[absent])
            if on_disk.any():
                at = absent[on_disk]
                for lo, got in self.disk.read_pieces(row_ids[at]):     # (chunk by chunk: a checkpoint's pulls)
                    self._bring_rows(got)
                    rows[at[lo:lo + len(got["row_ids"])]] = got["weights"]
                absent = absent[~on_disk]
        if len(absent):
            rows[absent] = self._initial_now(row_ids[absent])
        return rows

    def state_rows(self, row_ids: np.ndarray, index: int) -> np.ndarray:
        """Optimizer state `index` of existing rows `row_ids`, current (see ``RowKeyStates.state_rows``)."""
        if not self.dense():
            return super().state_rows(row_ids, index)
        if index >= self.num_states:
            raise IndexError(f"key {self.key} has {self.num_states} optimizer states, not {index + 1}")
        slots = self._table.lookup(row_ids)
        present = slots >= 0
        out = np.empty((len(row_ids), self.row_size), self._table.dtype)
        if present.any():
            self._bring_slots(slots[present])
            out[present] = self._table.states(slots[present])[index]
        if not present.all():
            absent = row_ids[~present]
            if self.disk is None or not self.disk.contains(absent).all():
                raise KeyError(f"a listed row of key {self.key} no longer exists")
            at = np.flatnonzero(~present)
            for lo, got in self.disk.read_pieces(absent):               # (chunk by chunk: a checkpoint's pulls)
                self._bring_rows(got)
                out[at[lo:lo + len(got["row_ids"])]] = got["states"][index]
        return out

    def set_state_rows(self, row_ids: np.ndarray, index: int, values: np.ndarray) -> None:
        """Write optimizer state `index` of rows `row_ids` (brought first; created if absent)."""
        if self.dense():
            self._bring_slots(self._slots_for(row_ids))
        super().set_state_rows(row_ids, index, values)
        if self.history is not None:
            self._stamp(self._table.lookup(row_ids))
