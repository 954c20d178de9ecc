"""Bringing rows to the current step exactly: the missed zero-gradient steps replayed in float32, step by step,
vectorised over the rows.

Owns: :func:`catch_up` (rows with their own last steps, brought to one target step, bit-identical to stock's
step-by-step iteration: the numpy reference), :func:`compiled_catch_up` (the same by the compiled kernel, a row at a
time: what the server runs), :func:`replay_cost` (how many row-steps a call would run).
Does not own: the steps themselves (each optimizer's rule), the log of their scalars (``steplog.py``), which rows
and when (the server's keys).

How: the rows are ordered by last step. Step k applies to the rows whose last step is below k, a prefix of that
order, so one numpy call per operation covers all of them; runs of identical scalars are applied without looking
them up again. Cost: (largest gap) x (operations of one step) numpy calls, plus (sum of the rows' gaps) x (elements
of a row) float operations: exactly the work stock spent on those rows, no more (a row never missed a step costs
nothing). Steps whose scalars change nothing (SGD with wd 0, signSGD with wd 0) are skipped, and rows that reach a
fixed point leave the run (:func:`_steps`): without weight decay a catch-up costs a bounded number of steps.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup.base import ZeroRule
from kvstore_lazy.numerics.catchup.steplog import StepLog
import kvstore_lazy.store.kernels as kernels


def replay_cost(last: np.ndarray, upto: int) -> tuple[int, int]:
    """``(steps, row_steps)``: the numpy passes (the largest gap) and the row-steps a catch-up to `upto` runs."""
    gaps = np.maximum(upto - np.asarray(last, dtype=np.int64), 0)
    return (int(gaps.max()) if gaps.size else 0), int(gaps.sum())


def catch_up(rule: ZeroRule, log: StepLog, weight: np.ndarray, states: list[np.ndarray], last: np.ndarray,
             upto: int) -> None:
    """Bring rows ``weight[i]`` / ``states[j][i]`` (float32 row arrays, updated in place), last updated at step
    ``last[i]``, to step `upto` by applying the zero-gradient steps ``last[i]+1 .. upto`` that `log` recorded.

    Rows with ``last[i] >= upto`` are left as they are. KeyError (changing nothing) if the log lacks a step."""
    last = np.asarray(last, dtype=np.int64)
    behind = np.flatnonzero(last < upto)
    if not behind.size:
        return
    lo = int(last[behind].min())
    if not log.covers(lo, upto):
        raise KeyError(f'steps {lo + 1}..{upto} are not all in the log ({log.first}..{log.last})')
    order = behind[np.argsort(last[behind], kind='stable')]
    # already in order and adjacent: work on the rows where they are (views), else on a gathered copy
    contiguous = bool(weight.flags.c_contiguous and all(st.flags.c_contiguous for st in states)
                      and np.all(np.diff(order) == 1))
    w = weight[order[0]:order[-1] + 1] if contiguous else weight[order]
    s = [st[order[0]:order[-1] + 1] if contiguous else st[order] for st in states]
    w2, s2 = _rows2d(w), [_rows2d(x) for x in s]
    tmp = [np.empty_like(w2) for _ in range(rule.scratch)]
    sorted_last = last[order]
    for first, end, sc in log.spans(lo, upto):
        if rule.identity(sc):
            continue
        _apply_run(rule, sc, first, end, sorted_last, w2, s2, tmp)
    if not contiguous:
        weight[order] = w
        for st, x in zip(states, s):
            st[order] = x


def compiled_catch_up(rule: ZeroRule, log: StepLog, weight: np.ndarray, states: list[np.ndarray], last: np.ndarray,
                      upto: int) -> None:
    """:func:`catch_up` by the compiled kernel (``store/kernels_catchup.c``: the same float32 operations in the
    same order, a row at a time, so bit-identical; no numpy pass a step), where the arrays are its (float32 rows,
    C-contiguous); else :func:`catch_up`."""
    last = np.asarray(last, dtype=np.int64)
    behind = last < upto
    if not behind.any():
        return
    lo = int(last[behind].min())
    if not log.covers(lo, upto):
        raise KeyError(f'steps {lo + 1}..{upto} are not all in the log ({log.first}..{log.last})')
    starts, values = log.table()
    if kernels.catchup_rows(rule.name, weight, states, last, upto, starts, values, log.last) is None:
        catch_up(rule, log, weight, states, last, upto)


def _rows2d(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1)


def _apply_run(rule: ZeroRule, sc: np.ndarray, first: int, end: int, sorted_last: np.ndarray, w: np.ndarray,
               states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
    """Steps ``first .. end`` (one run of scalars) on the rows behind them: step k covers the rows with last < k
    (a prefix of the order), less the leading rows found at a fixed point (:func:`_unchanged`)."""
    k, start = first, 0
    while k <= end:
        n = int(np.searchsorted(sorted_last, k, side='left'))       # rows with last < k
        # the same rows until the next row's last step is passed
        nxt = int(sorted_last[n]) + 1 if n < len(sorted_last) else end + 1
        stop = min(end, nxt - 1)
        start = _steps(rule, sc, stop - k + 1, start, n, w, states, tmp)
        k = stop + 1


def _steps(rule: ZeroRule, sc: np.ndarray, count: int, start: int, n: int, w: np.ndarray, states: list[np.ndarray],
           tmp: list[np.ndarray]) -> int:
    """`count` steps of one run on rows ``start:n``; returns the new start. A row that a step with these scalars
    leaves bit for bit as it was (weights and states) is at a fixed point: every later step of the run leaves it so
    too (a step is a function of the row and the scalars alone), so the leading rows found there are dropped, and
    when all are, the steps end. Checked after steps 1, 2, 4, 8, ... of each call: rows at their initial values with
    zero states and no weight decay are fixed at once; momentum and moving averages once they decay to zero (a few
    hundred to a few thousand float32 steps). So without weight decay a row's catch-up costs a bounded number of
    steps however long it waited; with it, one step per missed step (rows decay toward zero)."""
    check, done = 1, 0
    while done < count and start < n:
        wv, sv, tv = w[start:n], [x[start:n] for x in states], [x[start:n] for x in tmp]
        if done + 1 == check:
            before = [wv.copy()] + [x.copy() for x in sv]
            rule.step(sc, wv, sv, tv)
            start += _unchanged(before, [wv] + sv)
            check *= 2
        else:
            rule.step(sc, wv, sv, tv)
        done += 1
    return start


def _unchanged(before: list[np.ndarray], after: list[np.ndarray]) -> int:
    """How many leading rows are bit for bit the same in `before` and `after` (2-D float32 arrays, row-aligned)."""
    same = np.ones(len(after[0]), bool)
    for a, b in zip(before, after):
        same &= (a.view(np.uint32) == b.view(np.uint32)).all(axis=1)
    changed = np.flatnonzero(~same)
    return int(changed[0]) if len(changed) else len(same)
