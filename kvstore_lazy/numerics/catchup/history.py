"""A key's history of zero-gradient steps, across optimizers and count changes: what brings any row of the key, stored
or never stored, to the current step.

Owns: :class:`History`, a list of eras. An era is one optimizer's stretch of updates of the key (a rule, or None for
a lazy optimizer, whose rows without gradient do not move) with the log of its steps' scalars; a new era starts when
a new optimizer is set (kController: its states start at zero, ``reset``) or when the key's update count jumps (a
checkpoint's counts restored: states carry on). Every recorded step has a *tick*, one number across eras, so that a
row's position in the history is one integer (the server keeps it per row, in the table's ``tick`` column):

* tick 0: the row holds its initial value with zero states (never updated, or given at init / by a checkpoint);
* tick t > 0: the row holds its values after the step with tick t (or, for an era's first tick, its origin).

A row at its initial values (tick 0, zero states) crosses an era whose every step leaves zero-state rows alone
(``ZeroRule.zero_rows``: most rules without weight decay) at no cost; otherwise every missed step is replayed.

:meth:`History.bring` applies the missing steps to rows in place (``replay.catch_up``, bit-identical to stock's
float32 iteration), era by era; a row entering an era that reset the states gets zero states first. The server
brings every stored row to the end of an era before it resets its states (``RowKeyCatchUp.reset_states``), so a
stored row with tick > 0 is always in the eras since the last reset, and its states have the current optimizer's
shape; a row at tick 0 may cross resets (its states are zero at each), with states of each era's own shape.

Does not own: the rules (``sgd_family``, ``adaptive``), the per-era log (``steplog.StepLog``), when rows are brought
(the server's keys), the tick column.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore_lazy.numerics.catchup.base import ZeroRule
from kvstore_lazy.numerics.catchup.closed import LINEAR, closed_catch_up
from kvstore_lazy.numerics.catchup.registry import rule_named
from kvstore_lazy.numerics.catchup.replay import compiled_catch_up
from kvstore_lazy.numerics.catchup.steplog import StepLog

_f32 = np.float32


@dataclass
class Era:
    """One optimizer's stretch of a key's updates: its rule (None: lazy), states a row has in it, whether they
    start at zero, the tick of its origin and, once it has steps, the update count before its first."""
    rule: ZeroRule | None
    num_states: int
    reset: bool
    tick0: int
    origin: int | None = None
    log: StepLog | None = field(default=None)
    _zero: tuple[int, int] = (-1, 0)      # (last step looked at, zero_rows of the steps up to it)

    def __post_init__(self) -> None:
        if self.log is None and self.rule is not None:
            self.log = StepLog(self.rule.width)

    @property
    def steps(self) -> int:
        if self.log is None or self.origin is None or self.log.last < 0:
            return 0
        return self.log.last - self.origin

    @property
    def end(self) -> int:
        """The tick of the era's last step (its origin's while it has none)."""
        return self.tick0 + self.steps

    def zero_rows(self) -> int:
        """What the era's steps do to rows with zero states (``ZeroRule.zero_rows`` over every run: 0, 1, or -1
        once any run says -1), remembered up to the last step looked at, so each run is asked once."""
        if self.rule is None or not self.steps:
            return 0
        assert self.log is not None and self.origin is not None
        seen, status = self._zero
        if status >= 0 and seen < self.log.last:
            for _, _, sc in self.log.spans(max(seen, self.origin), self.log.last):
                answer = self.rule.zero_rows(sc)
                status = max(status, answer) if answer >= 0 else -1
                if status < 0:
                    break
            self._zero = (self.log.last, status)
        return status


class History:
    """A key's eras (see the module docstring). ``tick``: the tick of the key's current state."""

    def __init__(self, rule: ZeroRule | None, num_states: int) -> None:
        self.eras: list[Era] = [Era(rule, num_states, True, 0)]
        self.closed = False      # closed forms for the linear rules (KVSTORE_LAZY_CATCHUP=closed): a setting, not
                                 # part of the history's state

    def _catch_up(self, era: Era, weight: np.ndarray, states: list[np.ndarray], last: np.ndarray) -> None:
        assert era.rule is not None and era.log is not None and era.origin is not None
        if self.closed and isinstance(era.rule, LINEAR):
            try:
                closed_catch_up(era.rule, era.log, weight, states, last, era.origin + era.steps)
                return
            except ValueError:           # (a negative zero gradient term, a negative lr: replayed, changed nothing)
                pass
        compiled_catch_up(era.rule, era.log, weight, states, last, era.origin + era.steps)

    @property
    def tick(self) -> int:
        return self.eras[-1].end

    @property
    def rule(self) -> ZeroRule | None:
        return self.eras[-1].rule

    def runs(self) -> int:
        """Runs of equal scalars kept, over every era (what the history costs: a run is its scalars)."""
        return sum(e.log.runs() for e in self.eras if e.log is not None)

    def dense(self) -> bool:
        """Whether any era moves rows without gradient (else nothing ever needs bringing)."""
        return any(e.rule is not None for e in self.eras)

    # -- what the server tells it

    def new_optimizer(self, rule: ZeroRule | None, num_states: int) -> None:
        """kController: states restart at zero. An era with no step yet is replaced, not kept."""
        last = self.eras[-1]
        if last.steps == 0:
            tick0 = last.tick0
            reset = True
            self.eras.pop()
        else:
            tick0, reset = last.end + 1, True
        self.eras.append(Era(rule, num_states, reset, tick0))

    def record(self, count: int, scalars: np.ndarray | None) -> None:
        """The key's update that made its count `count`, with the rule's scalars for it (None for a lazy era)."""
        era = self.eras[-1]
        if era.rule is None:
            return
        assert scalars is not None and era.log is not None
        if era.origin is None:
            era.origin = count - 1
        elif count != era.origin + era.steps + 1:      # the count jumped (restored): a new era, states carried
            era = Era(era.rule, era.num_states, False, era.end + 1, count - 1)
            self.eras.append(era)
        assert era.log is not None
        era.log.record(count, scalars)

    # -- rows

    def behind(self, ticks: np.ndarray) -> np.ndarray:
        """Positions of the rows whose tick is not the current one."""
        return np.flatnonzero(np.asarray(ticks) != self.tick)

    def bring(self, weight: np.ndarray, states: list[np.ndarray], ticks: np.ndarray) -> None:
        """Rows `weight` (2-D) and `states` (the current era's, same shape), at `ticks`, to the current tick, in
        place. The caller then sets their ticks to :attr:`tick`. Rows at tick 0 whose states are all +0.0 (their
        initial values: never updated) take :meth:`initial`, the others :meth:`_bring`."""
        ticks = np.asarray(ticks, dtype=np.int64)
        fresh = ticks == 0
        for st in states:
            fresh &= ~st.view(np.uint32).any(axis=1)
        for part, initial in ((np.flatnonzero(fresh), True), (np.flatnonzero(~fresh & (ticks != self.tick)), False)):
            if not len(part):
                continue
            w, s = weight[part], [st[part] for st in states]
            if initial:
                self.initial(w, s)
            else:
                self._bring(w, s, ticks[part])
            weight[part] = w
            for st, x in zip(states, s):
                st[part] = x

    def initial(self, weight: np.ndarray, states: list[np.ndarray]) -> None:
        """Rows at their initial values (tick 0, zero states) to the current tick: through every era, with zero
        states of each era's shape at each reset. `states` (the current era's) receive the final states."""
        carried: list[np.ndarray] = []
        zero = True                          # the carried states are all +0.0
        for i, era in enumerate(self.eras):
            if i == 0 or era.reset:
                carried, zero = [np.zeros_like(weight) for _ in range(era.num_states)], True
            if era.rule is None or not era.steps:
                continue
            status = era.zero_rows() if zero else -1
            if status == 1:                  # rows with zero states: only -0.0 weights become +0.0
                weight[weight == 0] = 0
            elif status < 0:
                assert era.origin is not None
                self._catch_up(era, weight, carried, np.full(len(weight), era.origin, np.int64))
                zero = False
        for st, x in zip(states, carried):
            st[...] = x

    def _bring(self, weight: np.ndarray, states: list[np.ndarray], ticks: np.ndarray) -> None:
        """Rows whose states have the current era's shape (every stored row, and initial rows when no era after
        the first reset the states)."""
        for i, era in enumerate(self.eras):
            entering = ticks < era.tick0
            need = ticks < era.end
            if not need.any() and not (era.reset and i and entering.any()):
                continue
            if era.reset and i and entering.any():
                for st in states:
                    st[entering] = 0
            if era.rule is None or not era.steps or not need.any():
                continue
            assert era.origin is not None
            self._catch_up(era, weight, states, era.origin + np.maximum(ticks - era.tick0, 0))

    # -- snapshots

    def to_json(self) -> dict:
        """The history as JSON values; scalars as their float32 bit patterns (exact)."""
        eras = []
        for e in self.eras:
            item: dict = {"rule": None if e.rule is None else e.rule.name, "num_states": e.num_states,
                          "reset": e.reset, "tick0": e.tick0, "origin": e.origin}
            if e.log is not None:
                arrays = e.log.to_arrays()
                item["starts"] = [int(s) for s in arrays["starts"]]
                item["bits"] = arrays["values"].view(np.uint32).tolist()
                item["last"] = int(arrays["last"][0])
            eras.append(item)
        return {"eras": eras}

    @classmethod
    def from_json(cls, body: dict) -> History:
        """Inverse of :meth:`to_json`; ValueError naming what is wrong."""
        eras_json = body.get("eras") if isinstance(body, dict) else None
        if not isinstance(eras_json, list) or not eras_json:
            raise ValueError("a key's step history must have a list of eras")
        history = cls(None, 0)
        history.eras = []
        for item in eras_json:
            rule = None if item.get("rule") is None else rule_named(str(item["rule"]))
            era = Era(rule, int(item["num_states"]), bool(item["reset"]), int(item["tick0"]),
                      None if item.get("origin") is None else int(item["origin"]))
            if rule is not None:
                bits = np.asarray(item.get("bits", []), dtype=np.uint32).reshape(-1, rule.width)
                era.log = StepLog.from_arrays({"starts": np.asarray(item.get("starts", []), np.int64),
                                               "values": bits.view(_f32),
                                               "last": np.asarray([int(item.get("last", -1))], np.int64)})
            if history.eras and era.tick0 < history.eras[-1].end:
                raise ValueError("a key's step history has eras out of order")
            history.eras.append(era)
        return history
