"""The optimizers that scale each element's step by its own gradient history: AdaGrad, RMSProp and Ftrl.

Owns: each one's ``_step`` as MXNet 1.9.1 computes it (AdaGrad: the sparse adagrad_update kernel for row_sparse
keys without wd, else optimizer.py's sequence of NDArray ops; RMSProp: RMSPropUpdateKernel / RMSPropAlexUpdateKernel;
Ftrl: FtrlUpdateKernel), in their float32 operation order, with in-place paths over ``_Scratch`` buffers when
every array is float32 and shaped alike.
Does not own: the bookkeeping every optimizer shares (``base.py``), the float32 conversions (``floats.py``).

Where MXNet runs NDArray ops (AdaGrad's dense path), the scalars are NDArray-scalar arguments (``_scalar_f32``);
where it runs one kernel, they are the op's dmlc::Parameter fields (``_op_f32``). None of these has a compiled path.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.optimizers.base import Optimizer
from kvstore_lazy.numerics.optimizers.floats import _NO_CLIP, _ONE, _clip, _op_f32, _scalar_f32, _sign
from kvstore_lazy.numerics.optimizers.rules import _finite, _one_of, _optional


class AdaGrad(Optimizer):
    name = 'adagrad'
    _extra = ('float_stable_eps',)
    _rules = {'float_stable_eps': _finite}
    float_stable_eps: float

    def num_states(self) -> int:
        return 1

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        history = states[0]
        bufs = self._buffers(weight, grad, states, 2)
        if row_sparse and wd == 0 and bufs is not None:
            g, t = bufs
            np.multiply(grad, _op_f32(self.rescale_grad), out=g)
            clip = self._clip_param()
            if clip >= 0:
                np.clip(g, -clip, clip, out=g)
            np.add(history, np.multiply(g, g, out=t), out=history)
            np.add(history, _op_f32(self.float_stable_eps), out=t)
            np.sqrt(t, out=t)
            np.divide(g, t, out=g)
            np.multiply(g, _op_f32(lr), out=g)
            np.subtract(weight, g, out=weight)
            return
        if bufs is not None:   # the dense NDArray-op path below, in place
            g, t = bufs
            np.multiply(grad, _scalar_f32(self.rescale_grad), out=g)
            if self.clip_gradient is not None:
                np.clip(g, _op_f32(-self.clip_gradient), _op_f32(self.clip_gradient), out=g)
            np.add(history, np.multiply(g, g, out=t), out=history)
            np.add(history, _scalar_f32(self.float_stable_eps), out=t)
            np.sqrt(t, out=t)
            np.divide(g, t, out=g)
            np.add(g, np.multiply(weight, _scalar_f32(wd), out=t), out=g)
            np.multiply(g, _scalar_f32(-lr), out=g)
            np.add(weight, g, out=weight)
            return
        if row_sparse and wd == 0:   # sparse adagrad_update kernel (it refuses wd != 0)
            g = grad * _op_f32(self.rescale_grad)
            clip = self._clip_param()
            if clip >= 0:
                g = _clip(g, clip)
            history += g * g
            weight[...] = weight - (g / np.sqrt(history + _op_f32(self.float_stable_eps))) * _op_f32(lr)
            return
        # the dense path is a sequence of NDArray ops in optimizer.py
        g = grad * _scalar_f32(self.rescale_grad)
        if self.clip_gradient is not None:
            g = np.clip(g, _op_f32(-self.clip_gradient), _op_f32(self.clip_gradient))
        history += g * g
        div = g / np.sqrt(history + _scalar_f32(self.float_stable_eps))
        weight += (div + weight * _scalar_f32(wd)) * _scalar_f32(-lr)


class RMSProp(Optimizer):
    name = 'rmsprop'
    _extra = ('gamma1', 'gamma2', 'epsilon', 'centered', 'clip_weights')
    _rules = {'gamma1': _finite, 'gamma2': _finite, 'epsilon': _finite, 'centered': _one_of(False, True, 0, 1),
              'clip_weights': _optional(_finite)}
    gamma1: float
    gamma2: float
    epsilon: float
    centered: bool
    clip_weights: float | None

    def num_states(self) -> int:
        return 3 if self.centered else 1

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        self._update_count(index)
        lr, wd = _op_f32(self._get_lr(index)), _op_f32(self._get_wd(index))
        gamma1, eps = _op_f32(self.gamma1), _op_f32(self.epsilon)
        rescale, clip = _op_f32(self.rescale_grad), self._clip_param()
        clip_weights = _op_f32(self.clip_weights) if self.clip_weights else _NO_CLIP
        g = rescale * grad + wd * weight
        if clip >= 0:
            g = _clip(g, clip)
        if not self.centered:   # RMSPropUpdateKernel
            n = states[0]
            n[...] = (_ONE - gamma1) * (g * g) + gamma1 * n
            new = weight - lr * (g / np.sqrt(n + eps))
        else:                   # RMSPropAlexUpdateKernel
            gamma2 = _op_f32(self.gamma2)
            n, g_avg, delta = states
            n[...] = ((_ONE - gamma1) * g) * g + gamma1 * n
            g_avg[...] = (_ONE - gamma1) * g + gamma1 * g_avg
            delta[...] = gamma2 * delta - (lr * g) / np.sqrt(n - g_avg * g_avg + eps)
            new = weight + delta
        weight[...] = _clip(new, clip_weights) if clip_weights >= 0 else new


class Ftrl(Optimizer):
    name = 'ftrl'
    _extra = ('lamda1', 'beta')
    _rules = {'lamda1': _finite, 'beta': _finite}
    lamda1: float
    beta: float

    def num_states(self) -> int:
        return 2

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        self._update_count(index)
        wd, lr = _op_f32(self._get_wd(index)), _op_f32(self._get_lr(index))
        lamda1, beta = _op_f32(self.lamda1), _op_f32(self.beta)
        rescale, clip = _op_f32(self.rescale_grad), self._clip_param()
        z, n = states
        bufs = self._buffers(weight, grad, states, 3)
        if bufs is not None:
            g, t, u = bufs
            np.multiply(grad, rescale, out=g)
            if clip >= 0:
                np.clip(g, -clip, clip, out=g)
            # z += g - ((sqrt(n + g*g) - sqrt(n)) * w) / lr
            np.multiply(g, g, out=t)
            np.add(n, t, out=t)
            np.sqrt(t, out=t)
            np.subtract(t, np.sqrt(n, out=u), out=t)
            np.multiply(t, weight, out=t)
            np.divide(t, lr, out=t)
            np.subtract(g, t, out=t)
            np.add(z, t, out=z)
            # n += g*g
            np.add(n, np.multiply(g, g, out=t), out=n)
            # w = (sign(z)*lamda1 - z) / ((beta + sqrt(n))/lr + wd) * (|z| > lamda1)
            np.greater(z, 0, out=g)
            np.subtract(g, np.less(z, 0, out=t), out=g)
            np.multiply(g, lamda1, out=g)
            np.subtract(g, z, out=g)
            np.sqrt(n, out=t)
            np.add(beta, t, out=t)
            np.divide(t, lr, out=t)
            np.add(t, wd, out=t)
            np.divide(g, t, out=g)
            np.abs(z, out=t)
            np.greater(t, lamda1, out=t)
            np.multiply(g, t, out=weight)
            return
        g = grad * rescale
        if clip >= 0:
            g = _clip(g, clip)
        z += g - ((np.sqrt(n + g * g) - np.sqrt(n)) * weight) / lr
        n += g * g
        weight[...] = ((_sign(z) * lamda1 - z) / ((beta + np.sqrt(n)) / lr + wd)
                       * (np.abs(z) > lamda1).astype(np.float32))

