"""The SGD family: SGD, NAG and Signum (first-order steps with at most a momentum state), and mxnet's Test
optimizer.

Owns: each one's ``_step`` as MXNet 1.9.1's kernels compute it (SGDKernel / SGDMomKernel / MultiSGDKernel,
NAGMomKernel, signsgd / signum_update), in their float32 operation order, and SGD's compiled paths.
Does not own: the bookkeeping every optimizer shares (``base.py``), the float32 conversions (``floats.py``), the
compiled kernels themselves (``compiled.py``, store/kernels).

SGD, the hot one, runs float32 arrays through compiled one-pass kernels (same operations in the same order) and
keeps the numpy expressions for other dtypes; it also updates a row_sparse key's rows in place (``update_rows``).
Dense SGD weights take MXNet's multi_sgd path, whose lr and wd are a Tuple<float> (strtof, ``_tuple_f32``); a
row_sparse key's take sgd_update's dmlc::Parameter fields (``_op_f32``).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.optimizers.base import Optimizer
from kvstore_lazy.numerics.optimizers.compiled import _as_one_row, _sgd, _sgd_mom
from kvstore_lazy.numerics.optimizers.floats import _ONE, _clip, _f32, _op_f32, _scalar_f32, _sign, _tuple_f32
from kvstore_lazy.numerics.optimizers.rules import Rule, _finite
import kvstore_lazy.store.kernels as kernels


def _sgd_step_term(lr: np.float32, rescale: np.float32, clip: np.float32, grad: np.ndarray) -> np.ndarray:
    """The `lr * clip(rescale * grad)` term shared by the SGD-family kernels."""
    if clip >= 0:
        return lr * _clip(rescale * grad, clip)
    return (lr * rescale) * grad


def _sgd_kernel(weight: np.ndarray, grad: np.ndarray, lr: np.float32, wd: np.float32, rescale: np.float32,
                clip: np.float32) -> None:
    """sgd_update (SGDKernel / SGDDnsRspKernel)."""
    weight[...] = (_ONE - lr * wd) * weight - _sgd_step_term(lr, rescale, clip, grad)

_MOMENTUM: dict[str, Rule] = {'momentum': _finite}


class SGD(Optimizer):
    name = 'sgd'
    _extra = ('momentum',)
    _rules = _MOMENTUM
    momentum: float

    def num_states(self) -> int:
        return 1 if self.momentum != 0.0 else 0

    def _scalars(self, index: int, row_sparse: bool) -> tuple:
        """Count the update; the float32 kernel arguments (lr, wd, rescale, clip, momentum)."""
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        # SGD._update_impl always sends dense weights through multi_sgd[_mom]_update (whatever
        # aggregate_num is). row_sparse keys use sgd[_mom]_update.
        to_f32 = _op_f32 if row_sparse else _tuple_f32
        momentum = _op_f32(self.momentum) if self.momentum > 0 else _f32(0)
        return to_f32(lr), to_f32(wd), _op_f32(self.rescale_grad), self._clip_param(), momentum

    def update_rows(self, key: int, weight: np.ndarray, states: list[np.ndarray], slots: np.ndarray,
                    grad: np.ndarray) -> bool:
        if not kernels.accepts(weight, states, slots, grad):
            return False
        scalars = self._scalars(key, True)
        if not self._native(scalars, weight, states, slots, grad, True):
            self._kernel(scalars, weight, states, slots, grad, True)
        return True

    @staticmethod
    def _native(scalars: tuple, weight: np.ndarray, states: list[np.ndarray], slots: np.ndarray | None,
                grad: np.ndarray, row_sparse: bool) -> bool:
        """:meth:`_kernel` in one compiled call (slots None: the whole array is one row); False if it cannot."""
        if not states and row_sparse:
            return _sgd(weight, slots, grad, *scalars[:4])
        return _sgd_mom(weight, states[0] if states else None, slots, grad, *scalars)

    @staticmethod
    def _kernel(scalars: tuple, weight: np.ndarray, states: list[np.ndarray], slots: np.ndarray, grad: np.ndarray,
                row_sparse: bool) -> None:
        lr, wd, rescale, clip, momentum = scalars
        if not states and row_sparse:
            kernels.sgd_rows(weight, slots, grad, lr, wd, rescale, clip)
        else:   # SGDMomKernel / MultiSGDKernel: mom = m*mom - lr*wd*w - lr*g; w = w + mom
            kernels.sgd_mom_rows(weight, states[0] if states else weight, slots, grad, lr, wd, rescale, clip,
                                 momentum, bool(states))

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        scalars = self._scalars(index, row_sparse)
        if self._native(scalars, weight, states, None, grad, row_sparse):
            return
        flat = _as_one_row(weight, grad, states)
        if flat is not None:
            self._kernel(scalars, *flat, row_sparse)
            return
        lr, wd, rescale, clip, momentum = scalars
        if not states and row_sparse:
            _sgd_kernel(weight, grad, lr, wd, rescale, clip)
            return
        prev = momentum * states[0] if states else _f32(0)
        mom = prev - (lr * wd) * weight - _sgd_step_term(lr, rescale, clip, grad)
        if states:
            states[0][...] = mom
        weight += mom


class NAG(Optimizer):
    name = 'nag'
    _extra = ('momentum',)
    _rules = _MOMENTUM
    momentum: float

    def num_states(self) -> int:
        return 1 if self.momentum != 0.0 else 0

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        self._update_count(index)
        lr, wd = _op_f32(self._get_lr(index)), _op_f32(self._get_wd(index))
        rescale, clip = _op_f32(self.rescale_grad), self._clip_param()
        if not states:
            _sgd_kernel(weight, grad, lr, wd, rescale, clip)
            return
        momentum = _op_f32(self.momentum) if self.momentum > 0 else _f32(0)
        g = _clip(rescale * grad, clip) if clip >= 0 else rescale * grad
        mom = states[0]
        mom *= momentum
        weight[...] = (weight - mom) + (momentum + _ONE) * (mom - lr * (g + wd * weight))
        # NAGMomKernel writes out (== weight, in place) before this line, so it reads the new weight
        mom[...] = mom - lr * (g + wd * weight)


class Signum(Optimizer):
    name = 'signum'
    _extra = ('momentum', 'wd_lh')
    _rules = {'momentum': _finite, 'wd_lh': _finite}
    momentum: float
    wd_lh: float

    def num_states(self) -> int:
        return 1 if self.momentum != 0.0 else 0

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        self._update_count(index)
        lr, wd = _op_f32(self._get_lr(index)), _op_f32(self._get_wd(index))
        rescale, clip = _op_f32(self.rescale_grad), self._clip_param()
        if not states:   # signsgd_update: rescale, clip and wd_lh have no effect
            weight[...] = (_ONE - lr * wd) * weight - lr * _sign(grad)
            return
        momentum = _op_f32(self.momentum) if self.momentum > 0 else _f32(0)
        wd_lh = _op_f32(self.wd_lh) if self.wd_lh else _f32(0)
        one_m = _ONE - momentum
        if clip >= 0:
            g = one_m * _clip(rescale * grad, clip)
        else:
            g = (one_m * rescale) * grad
        mom = states[0]
        mom[...] = momentum * mom - (one_m * wd) * weight - g
        weight[...] = (_ONE - lr * wd_lh) * weight + lr * _sign(mom)


class Test(Optimizer):
    """mxnet's Test optimizer: weight += grad * rescale_grad; state = weight. It keeps no update count."""
    name = 'test'

    def num_states(self) -> int:
        return 1

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        weight += grad * _scalar_f32(self.rescale_grad)
        states[0][...] = weight

