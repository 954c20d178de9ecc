"""Adam, as MXNet 1.9.1's adam_update computes it (AdamUpdateKernel, and AdamDnsRspDnsKernel for row_sparse keys).

Owns: Adam's bias-corrected float32 kernel arguments (``_scalars``), its compiled paths (the whole array in one
call, or a row_sparse key's rows in place: ``update_rows``) and the numpy expressions other dtypes take, in the
kernels' float32 operation order.
Does not own: the bookkeeping every optimizer shares (``base.py``), the compiled kernels (``compiled.py``,
store/kernels).

The one odd choice is MXNet's own: with clip_gradient on a row_sparse key, AdamDnsRspDnsKernel<cpu> squares the
clipped gradient first, so ``(1 - beta2) * (g * g)`` there and ``((1 - beta2) * g) * g`` everywhere else.
"""
from __future__ import annotations

import math

import numpy as np

from kvstore_lazy.numerics.optimizers.base import Optimizer
from kvstore_lazy.numerics.optimizers.compiled import _adam, _as_one_row
from kvstore_lazy.numerics.optimizers.floats import _NO_CLIP, _ONE, _clip, _op_f32
from kvstore_lazy.numerics.optimizers.rules import _between, _finite
import kvstore_lazy.store.kernels as kernels


class Adam(Optimizer):
    name = 'adam'
    _extra = ('beta1', 'beta2', 'epsilon')
    # the bias correction divides by 1 - beta1**t and takes sqrt(1 - beta2**t)
    _rules = {'beta1': _between(0.0, 1.0, high_open=True), 'beta2': _between(0.0, 1.0), 'epsilon': _finite}
    beta1: float
    beta2: float
    epsilon: float

    def num_states(self) -> int:
        return 2

    def _scalars(self, index: int) -> tuple:
        """Count the update; the float32 kernel arguments (lr, wd, beta1, beta2, epsilon, rescale, clip)."""
        self._update_count(index)
        lr, wd = self._get_lr(index), _op_f32(self._get_wd(index))
        t = self._index_update_count[index]
        lr_t = _op_f32(lr * (math.sqrt(1. - self.beta2 ** t) / (1. - self.beta1 ** t)))
        return (lr_t, wd, _op_f32(self.beta1), _op_f32(self.beta2), _op_f32(self.epsilon), _op_f32(self.rescale_grad),
                self._clip_param())

    def update_rows(self, key: int, weight: np.ndarray, states: list[np.ndarray], slots: np.ndarray,
                    grad: np.ndarray) -> bool:
        if not kernels.accepts(weight, states, slots, grad):
            return False
        scalars = self._scalars(key)
        if not _adam(weight, *states, slots, grad, *scalars, scalars[6] is not _NO_CLIP and scalars[6] >= 0):
            self._kernel(scalars, weight, states, slots, grad, True)
        return True

    @staticmethod
    def _kernel(scalars: tuple, weight: np.ndarray, states: list[np.ndarray], slots: np.ndarray, grad: np.ndarray,
                row_sparse: bool) -> None:
        lr, wd, beta1, beta2, eps, rescale, clip = scalars
        # AdamDnsRspDnsKernel<cpu> squares the clipped gradient first
        kernels.adam_rows(weight, states[0], states[1], slots, grad, lr, wd, beta1, beta2, eps, rescale, clip,
                          clip >= 0 and row_sparse)

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        scalars = self._scalars(index)
        if len(states) == 2 and _adam(weight, *states, None, grad, *scalars,
                                      row_sparse and scalars[6] is not _NO_CLIP and scalars[6] >= 0):
            return
        flat = _as_one_row(weight, grad, states)
        if flat is not None:
            self._kernel(scalars, *flat, row_sparse)
            return
        lr, wd, beta1, beta2, eps, rescale, clip = scalars
        mean, var = states
        g = grad * rescale + weight * wd
        if clip >= 0:
            g = _clip(g, clip)
        mean[...] = beta1 * mean + (_ONE - beta1) * g
        if clip >= 0 and row_sparse:   # AdamDnsRspDnsKernel<cpu> squares the clipped gradient first
            var[...] = beta2 * var + (_ONE - beta2) * (g * g)
        else:
            var[...] = beta2 * var + ((_ONE - beta2) * g) * g
        weight[...] = weight - (lr * mean) / (np.sqrt(var) + eps)



def adam_row_steps_update(opt: Adam, key: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
                          steps: np.ndarray) -> None:
    """Beyond stock (``KVSTORE_LAZY_ADAM_ROW_STEPS``): one counted lazy-Adam update of the gathered rows `weight` /
    `states` (float32, 2-D, in place) whose bias correction uses each row's own count of updates, ``steps + 1``
    (FBGEMM's per-row counter), instead of the key's. The float32 operations are the lazy kernel's
    (AdamDnsRspDnsKernel), with ``lr_t`` a column of per-row values: a row's update is what stock's lazy Adam would
    compute with the key's count at that row's; the key's count still advances (schedulers)."""
    _, wd, beta1, beta2, eps, rescale, clip = opt._scalars(key)
    lr = opt._get_lr(key)
    t, at = np.unique(np.asarray(steps, dtype=np.int64) + 1, return_inverse=True)
    lr_t = np.array([_op_f32(lr * (math.sqrt(1. - opt.beta2 ** int(n)) / (1. - opt.beta1 ** int(n)))) for n in t],
                    dtype=np.float32)[at.reshape(-1)]   # each as _scalars makes the key's (a few distinct counts)
    mean, var = states
    g = grad * rescale + weight * wd
    if clip >= 0:
        g = _clip(g, clip)
    mean[...] = beta1 * mean + (_ONE - beta1) * g
    if clip >= 0:   # as AdamDnsRspDnsKernel<cpu>: the clipped gradient squared first
        var[...] = beta2 * var + (_ONE - beta2) * (g * g)
    else:
        var[...] = beta2 * var + ((_ONE - beta2) * g) * g
    weight[...] = weight - (lr_t[:, None] * mean) / (np.sqrt(var) + eps)
