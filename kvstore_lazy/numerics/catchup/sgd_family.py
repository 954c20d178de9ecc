"""Zero-gradient steps of the SGD family as stock runs them on a row_sparse weight: SGD with ``lazy_update=False``
(with and without momentum), NAG with momentum, Signum and signSGD.

Owns: each rule's scalars and its step, in the float32 operation order of the kernel stock runs for a row without
gradient:

* SGD, no momentum (SGDUpdateDnsRspImpl, not lazy): every row ``w *= (1 - lr*wd)`` first, then the gradient rows
  get ``w - lr*g`` with wd 0. A touched row is the lazy kernel's ``(1 - lr*wd)*w - lr*g`` on the same rounding.
* SGD, momentum (SGDMomStdDnsRspDnsKernel): ``mom = momentum*mom - (lr*wd)*w - lr*rescale*0; w = w + mom``.
* NAG (NAGMomKernel on the densified weight): ``mom *= momentum``, then the weight, then ``mom`` from the OLD
  weight. On a dense key the kernel writes out == weight in place first and its last line reads the new weight
  (``numerics.optimizers.NAG``); on a row_sparse key MXNet's storage fallback gives the kernel a dense copy of the
  weight as input and another as output, so the last line reads the old one (measured against mxnet in-process).
  That holds for the touched rows too: :func:`nag_rows_update` is their update.
* Signum (SignumKernel): ``mom = momentum*mom - ((1-momentum)*wd)*w - 0; w = (1 - lr*wd_lh)*w + lr*sign(mom)``.
  sign(mom) makes it piecewise linear with no closed form: it is replayed (``replay.py``).
* signSGD (SignSGDKernel): ``w = (1 - lr*wd)*w - lr*sign(0)``: a product, like SGD.

Does not own: the touched rows' updates other than NAG's (``numerics.optimizers``, unchanged: their row paths
compute the same expressions), replaying the steps (``replay.py``).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup.base import (ZeroRule, kernel_lr_wd, negative_zero, rescale_clip, zero_term)
from kvstore_lazy.numerics.optimizers import NAG, SGD, Optimizer, Signum
from kvstore_lazy.numerics.optimizers.floats import _ONE, _f32, _op_f32


def _momentum(opt: Optimizer) -> np.float32:
    # the ops get momentum only when > 0 (else their default 0)
    assert isinstance(opt, (SGD, NAG, Signum))
    momentum = float(opt.momentum)
    return _op_f32(momentum) if momentum > 0 else _f32(0)


class SGDDecay(ZeroRule):
    """SGD without momentum, lazy_update=False: scalars (decay,)."""
    name, width = 'sgd', 1

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        lr, wd = kernel_lr_wd(opt, key)
        return np.array([_ONE - lr * wd], dtype=_f32)   # static_cast<DType>(1 - param.lr * param.wd)

    def identity(self, sc: np.ndarray) -> bool:
        return bool(sc[0] == 1)

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        np.multiply(weight, sc[0], out=weight)


class SGDMomentum(ZeroRule):
    """SGD with momentum, lazy_update=False: scalars (momentum, lr*wd, the gradient term at 0)."""
    name, width, scratch = 'sgd_mom', 3, 1

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        lr, wd = kernel_lr_wd(opt, key)
        rescale, clip = rescale_clip(opt)
        return np.array([_momentum(opt), lr * wd, zero_term(lr, rescale, clip)], dtype=_f32)

    def zero_rows(self, sc: np.ndarray) -> int:
        # mom = m*0 - 0*w - (+0) = +0 (m >= 0); w + (+0) turns -0 into +0
        return 1 if sc[1] == 0 and not negative_zero(sc[2]) and sc[0] >= 0 else -1

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        mom, t = states[0], tmp[0]
        np.multiply(weight, sc[1], out=t)
        np.multiply(mom, sc[0], out=mom)
        np.subtract(mom, t, out=mom)
        if negative_zero(sc[2]):
            np.subtract(mom, sc[2], out=mom)
        np.add(weight, mom, out=weight)


class NAGMomentum(ZeroRule):
    """NAG with momentum: scalars (momentum, momentum + 1, lr, wd, rescale*0 or its clip)."""
    name, width, scratch = 'nag', 5, 2

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        lr, wd = kernel_lr_wd(opt, key)
        rescale, clip = rescale_clip(opt)
        momentum = _momentum(opt)
        return np.array([momentum, momentum + _ONE, lr, wd, zero_term(_ONE, rescale, clip)], dtype=_f32)

    def zero_rows(self, sc: np.ndarray) -> int:
        # lr*(+0 + 0*w) = +0, so mom and u stay +0; (w - 0) + 0 turns -0 into +0
        return 1 if sc[3] == 0 and not negative_zero(sc[4]) and sc[2] >= 0 and sc[0] >= 0 else -1

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        momentum, momentum1, lr, wd, g0 = sc
        mom, t, u = states[0], tmp[0], tmp[1]
        np.multiply(mom, momentum, out=mom)
        self._lr_grad(weight, lr, wd, g0, t)        # lr * (rescale*0 + wd*w), of the old weight, used twice
        np.subtract(mom, t, out=u)
        np.multiply(u, momentum1, out=u)
        np.subtract(weight, mom, out=weight)
        np.add(weight, u, out=weight)
        np.subtract(mom, t, out=mom)

    @staticmethod
    def _lr_grad(weight: np.ndarray, lr: np.float32, wd: np.float32, g0: np.float32, out: np.ndarray) -> None:
        np.multiply(weight, wd, out=out)
        np.add(out, g0, out=out)                    # g0 + wd*w: turns -0 into +0, so it is kept
        np.multiply(out, lr, out=out)


class SignumMomentum(ZeroRule):
    """Signum with momentum: scalars (momentum, (1-momentum)*wd, the gradient term at 0, 1 - lr*wd_lh, lr)."""
    name, width, scratch = 'signum', 5, 2

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        lr, wd = kernel_lr_wd(opt, key)
        rescale, clip = rescale_clip(opt)
        momentum = _momentum(opt)
        one_m = _ONE - momentum
        assert isinstance(opt, Signum)
        wd_lh = _op_f32(opt.wd_lh) if opt.wd_lh else _f32(0)
        return np.array([momentum, one_m * wd, zero_term(one_m, rescale, clip), _ONE - lr * wd_lh, lr], dtype=_f32)

    def zero_rows(self, sc: np.ndarray) -> int:
        # mom stays +0, sign(+0) = 0: w*1 + lr*0 turns -0 into +0
        return 1 if sc[1] == 0 and not negative_zero(sc[2]) and sc[3] == 1 and sc[4] >= 0 and sc[0] >= 0 else -1

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        momentum, decay, g0, keep, lr = sc
        mom, t, s = states[0], tmp[0], tmp[1]
        np.multiply(weight, decay, out=t)
        np.multiply(mom, momentum, out=mom)
        np.subtract(mom, t, out=mom)
        if negative_zero(g0):
            np.subtract(mom, g0, out=mom)
        if keep != 1:
            np.multiply(weight, keep, out=weight)
        np.greater(mom, 0, out=t)                   # (mom > 0) - (mom < 0), as the kernel (NaN: 0)
        np.less(mom, 0, out=s)
        np.subtract(t, s, out=t)
        np.multiply(t, lr, out=t)
        np.add(weight, t, out=weight)


class SignSGD(ZeroRule):
    """signSGD (Signum without momentum): scalars (1 - lr*wd, lr*sign(0))."""
    name, width = 'signsgd', 2

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        lr, wd = kernel_lr_wd(opt, key)
        return np.array([_ONE - lr * wd, lr * _f32(0)], dtype=_f32)

    def identity(self, sc: np.ndarray) -> bool:
        return bool(sc[0] == 1 and not negative_zero(sc[1]))

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        if sc[0] != 1:
            np.multiply(weight, sc[0], out=weight)
        if negative_zero(sc[1]):
            np.subtract(weight, sc[1], out=weight)


def nag_rows_update(opt: NAG, key: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray]) -> None:
    """One counted NAG update (momentum on) of the gathered rows of a row_sparse key, as stock computes them: the
    kernel on the storage fallback's separate output, so the momentum's last term reads the old weight."""
    opt._update_count(key)
    lr, wd = kernel_lr_wd(opt, key)
    rescale, clip = rescale_clip(opt)
    momentum = _momentum(opt)
    g = rescale * np.asarray(grad, dtype=_f32)
    if clip >= 0:
        g = np.clip(g, -clip, clip)
    mom = states[0]
    mom *= momentum
    step = lr * (g + wd * weight)
    weight[...] = (weight - mom) + (momentum + _ONE) * (mom - step)
    mom -= step
