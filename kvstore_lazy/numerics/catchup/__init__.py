"""Dense-update semantics for lazily stored rows: what stock computes for the rows a row_sparse key did not touch,
computed when a row is next touched.

With ``lazy_update=False`` (SGD, Adam), and always for NAG with momentum, Signum and RMSProp, the stock server moves
every row of a row_sparse weight at every update; the rows without a gradient take the step with a zero gradient.
Between two touches a row's recurrence depends only on per-step scalars of its key (lr from the scheduler, wd,
multipliers, bias corrections), so the server keeps those scalars per key (a :class:`History` of :class:`StepLog`) and
each row's last step (its tick), and brings a row to the current step when it is next read or written.

The parts, each with a header saying what it owns:

  base.py        ZeroRule (the interface: an optimizer's zero-gradient step and its scalars), shared helpers
  sgd_family.py  SGD (lazy_update=False, with and without momentum), NAG, Signum, signSGD
  adaptive.py    RMSProp (plain, centered), Adam (lazy_update=False) and Adam's standard touched-row update
  touched.py     touched_update: the rows a gradient has (Adam's standard kernel, NAG's fallback rounding)
  closed.py      closed_catch_up: the linear rules (SGD, SGD momentum, NAG, signSGD) in O(log gap) a run, within
                 a measured tolerance of stock's float32 iteration (opt-in; replay is the exact path)
  registry.py    rule_for(optimizer): which optimizers stock runs densely, and their rules
  steplog.py     StepLog: the scalars of every step of a key, run-length encoded
  replay.py      catch_up: the missed steps replayed in float32 (bit-identical), vectorised over rows
  history.py     History: a key's eras (optimizers, count jumps) and their logs; brings any row, stored or
                 never stored (tick 0), to the current step

"""
from __future__ import annotations

from kvstore_lazy.numerics.catchup.adaptive import adam_std_update
from kvstore_lazy.numerics.catchup.base import ZeroRule
from kvstore_lazy.numerics.catchup.history import History
from kvstore_lazy.numerics.catchup.registry import dense_semantics, rule_for, rule_named
from kvstore_lazy.numerics.catchup.replay import catch_up, replay_cost
from kvstore_lazy.numerics.catchup.steplog import StepLog
from kvstore_lazy.numerics.catchup.touched import touched_update

__all__ = ['ZeroRule', 'StepLog', 'History', 'rule_for', 'rule_named', 'dense_semantics', 'catch_up', 'replay_cost',
           'adam_std_update', 'touched_update']
