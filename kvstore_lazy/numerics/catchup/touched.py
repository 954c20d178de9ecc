"""The update of the rows a gradient has, on a key with dense semantics: the optimizer's own row update, except
where stock's kernel for a row_sparse weight rounds differently.

Owns: :func:`touched_update`, which picks, per optimizer: Adam with ``lazy_update=False`` takes
AdamStdDnsRspDnsKernel's rounding (``adaptive.adam_std_update``), NAG with momentum the storage fallback's
(``sgd_family.nag_rows_update``); every other rule's touched rows are exactly what
``Optimizer.update(..., row_sparse=True)`` computes (SGD's SGDDnsRspKernel / SGDMomStdDnsRspDnsKernel rows, and
the densified Signum / RMSProp kernels, element by element).
Does not own: bringing the rows to the step before (``replay.catch_up``: call it first, to the step before this
update), recording this step's scalars (the caller, with ``rule.scalars`` after this update).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup.adaptive import AdamStd, adam_std_update
from kvstore_lazy.numerics.catchup.base import ZeroRule
from kvstore_lazy.numerics.catchup.sgd_family import NAGMomentum, nag_rows_update
from kvstore_lazy.numerics.optimizers import NAG, Adam, Optimizer


def touched_update(rule: ZeroRule, opt: Optimizer, key: int, weight: np.ndarray, grad: np.ndarray,
                   states: list[np.ndarray]) -> None:
    """One counted update of the gathered rows `weight` / `states` (float32, in place) with their gradient rows."""
    if isinstance(rule, AdamStd) and isinstance(opt, Adam):
        adam_std_update(opt, key, weight, grad, states)
    elif isinstance(rule, NAGMomentum) and isinstance(opt, NAG):
        nag_rows_update(opt, key, weight, grad, states)
    else:
        opt.update(key, weight, grad, states, row_sparse=True)
