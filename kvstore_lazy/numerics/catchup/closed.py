"""Closed forms for the linear zero-gradient steps (SGD with and without momentum, NAG, signSGD): a row brought
over a run of identical scalars in O(log gap) numpy passes instead of one pass a step, within a measured
tolerance of stock's float32 iteration (not bit-identical: the float32 rounding of every step is not reproduced).

Owns: :func:`closed_catch_up` (the same contract as ``replay.catch_up``, for the rules in ``LINEAR``) and the
per-rule transition matrices. A step of these rules is linear in (w, mom) with coefficients from the step's
scalars, so a run of n identical steps is the matrix power A^n, computed in float64 by repeated squaring,
batched over the rows (each row its own n), applied once per run, and rounded to float32 once at the end.

Measured (lr 0.1, wd 1e-4, momentum 0.9; 512 rows of 16 N(0, 1) values, half of them 10k steps behind): the closed
form agrees with a float64 iteration of the same steps to 1.2e-7 absolute (its one rounding to float32); what
separates it from stock is stock's own float32 rounding, accumulated over the steps: after 10k steps the largest
difference to the exact replay is 1.8e-5 of the element (281 ulp) for SGD and signSGD, 2.2e-6 of the row's largest
element for SGD momentum and 3.6e-6 for NAG (5.5e-6 and 7.5e-6 with wd 1e-2; elementwise up to 6e-5 and 3e-3
relative, on elements that shrank near 0; rows that decayed into float32 subnormals, below 1.2e-38, agree only to
that). ``tests/test_catchup.py`` pins these bounds. Cost: 1-2 ms for those 512 rows against 0.1-1 s replayed.
Not for: Signum with momentum (sign of the momentum), RMSProp and Adam (the weight's step divides by a root of
its own state): those have no closed form and are replayed.
Does not own: the scalars' log (``steplog.py``), the exact path (``replay.py``).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup.base import ZeroRule, negative_zero
from kvstore_lazy.numerics.catchup.sgd_family import NAGMomentum, SGDDecay, SGDMomentum, SignSGD
from kvstore_lazy.numerics.catchup.steplog import StepLog

LINEAR = (SGDDecay, SGDMomentum, NAGMomentum, SignSGD)


def _matrix(rule: ZeroRule, sc: np.ndarray) -> np.ndarray:
    """The step's transition of (w, mom) as a float64 2x2 matrix (w' = a w + b mom; mom' = c w + d mom)."""
    s = sc.astype(np.float64)
    if isinstance(rule, (SGDDecay, SignSGD)):
        return np.array([[s[0], 0.0], [0.0, 1.0]])
    if isinstance(rule, SGDMomentum):         # mom' = m*mom - r*w; w' = w + mom'
        m, r = s[0], s[1]
        return np.array([[1.0 - r, m], [-r, m]])
    m, m1, lr, wd = s[0], s[1], s[2], s[3]    # NAG: mom' = m*mom - r*w; w' = (1 - m1*r) w + m^2 mom
    r = lr * wd
    return np.array([[1.0 - m1 * r, m * m1 - m], [-r, m]])


def _powers(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    """a^n[i] for every row's n (int64 >= 0), (rows, 2, 2), by repeated squaring batched over the rows."""
    out = np.broadcast_to(np.eye(2), (len(n), 2, 2)).copy()
    base, left = a.copy(), n.copy()
    while left.any():
        odd = (left & 1).astype(bool)
        if odd.any():
            out[odd] = out[odd] @ base
        base = base @ base
        left >>= 1
    return out


def closed_catch_up(rule: ZeroRule, log: StepLog, weight: np.ndarray, states: list[np.ndarray], last: np.ndarray,
                    upto: int) -> None:
    """``replay.catch_up`` by the closed form (``rule`` one of ``LINEAR``): rows brought to step `upto`, in place,
    within the tolerance above. KeyError, changing nothing, if the log lacks a step."""
    if not isinstance(rule, LINEAR):
        raise TypeError(f'{rule.name} has no closed form: use replay.catch_up')
    last = np.asarray(last, dtype=np.int64)
    behind = np.flatnonzero(last < upto)
    if not behind.size:
        return
    spans = list(log.spans(int(last[behind].min()), upto))
    w = weight[behind].reshape(len(behind), -1).astype(np.float64)
    mom = states[0][behind].reshape(len(behind), -1).astype(np.float64) if states else np.zeros_like(w)
    for first, end, sc in spans:
        if rule.identity(sc):
            continue
        if isinstance(rule, (SGDMomentum, SignSGD)) and negative_zero(sc[-1]):
            raise ValueError('a negative zero gradient term (negative lr): use replay.catch_up')
        n = np.clip(end - np.maximum(last[behind], first - 1), 0, None)
        p = _powers(_matrix(rule, sc), n)
        w, mom = p[:, 0, 0, None] * w + p[:, 0, 1, None] * mom, p[:, 1, 0, None] * w + p[:, 1, 1, None] * mom
    weight[behind] = w.reshape(weight[behind].shape).astype(weight.dtype)
    if states:
        states[0][behind] = mom.reshape(states[0][behind].shape).astype(states[0].dtype)
