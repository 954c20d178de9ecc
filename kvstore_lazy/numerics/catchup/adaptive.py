"""Zero-gradient steps of RMSProp (plain and centered) and of Adam with ``lazy_update=False``, and the one touched-
row update whose rounding differs from the lazy one (Adam's standard kernel).

Owns:

* RMSProp (RMSPropUpdateKernel / RMSPropAlexUpdateKernel on the densified weight): a row without gradient gets
  ``g = rescale*0 + wd*w``, so with wd it keeps moving, by a step that depends on its own history (no closed form:
  replayed). Without wd, ``g`` is +0: the weight stays (up to clip_weights) and ``n`` decays by gamma1 a step.
* Adam, not lazy (AdamStdDnsRspDnsKernel<cpu>): a row without gradient gets ``g = w*wd`` (no rescale term), then
  ``mean = beta1*mean + (1-beta1)*g; var = beta2*var + (1-beta2)*(g*g); w -= lr_t*mean / (sqrt(var) + eps)``.
  With epsilon inside the division the weight's sum over the missed steps has no closed form: replayed.
* :func:`adam_std_update`: the touched rows of that kernel. It squares the (clipped) gradient FIRST,
  ``(1-beta2)*(g*g)``, where the lazy kernels compute ``((1-beta2)*g)*g`` without clip: a touched row of a
  ``lazy_update=False`` key must take this one to stay bit-identical.

Does not own: Adam's and RMSProp's lazy updates (``numerics.optimizers``), replaying the steps (``replay.py``).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.catchup.base import ZeroRule, kernel_lr_wd, negative_zero, rescale_clip, zero_term
from kvstore_lazy.numerics.optimizers import Adam, Optimizer, RMSProp
from kvstore_lazy.numerics.optimizers.floats import _NO_CLIP, _ONE, _clip, _f32, _op_f32


class RMSPropZero(ZeroRule):
    """RMSProp, plain: scalars (lr, wd, rescale*0, clip, 1-gamma1, gamma1, eps, clip_weights)."""
    name, width, scratch = 'rmsprop', 8, 2

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        lr, wd = kernel_lr_wd(opt, key)
        assert isinstance(opt, RMSProp)
        rescale, clip = rescale_clip(opt)
        gamma1 = _op_f32(opt.gamma1)
        clip_weights = _op_f32(opt.clip_weights) if opt.clip_weights else _NO_CLIP
        return np.array([lr, wd, zero_term(_ONE, rescale, _NO_CLIP), clip, _ONE - gamma1, gamma1,
                         _op_f32(opt.epsilon), clip_weights], dtype=_f32)

    def zero_rows(self, sc: np.ndarray) -> int:
        # g = 0*w + (+0) = +0, n stays +0, w - lr*(0 / sqrt(eps)) = w (eps > 0, no weight clip)
        return 0 if _zero_grad(sc) and sc[6] > 0 and sc[7] < 0 else -1

    @staticmethod
    def grad(sc: np.ndarray, weight: np.ndarray, g: np.ndarray) -> None:
        """``g = rescale*0 + wd*w``, clipped: the kernel's grad_rescaled for a row without gradient."""
        np.multiply(weight, sc[1], out=g)
        np.add(g, sc[2], out=g)
        if sc[3] >= 0:
            np.clip(g, -sc[3], sc[3], out=g)

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        lr, one_m, gamma1, eps, clip_weights = sc[0], sc[4], sc[5], sc[6], sc[7]
        n, (g, t) = states[0], tmp
        self.grad(sc, weight, g)
        np.multiply(g, g, out=t)                    # (1-gamma1)*(g*g) + gamma1*n
        np.multiply(t, one_m, out=t)
        np.multiply(n, gamma1, out=n)
        np.add(t, n, out=n)
        np.add(n, eps, out=t)                       # w - lr*(g / sqrt(n + eps))
        np.sqrt(t, out=t)
        np.divide(g, t, out=g)
        np.multiply(g, lr, out=g)
        np.subtract(weight, g, out=weight)
        if clip_weights >= 0:
            np.clip(weight, -clip_weights, clip_weights, out=weight)


class RMSPropCentered(ZeroRule):
    """RMSProp, centered: the plain scalars and gamma2."""
    name, width, scratch = 'rmsprop_centered', 9, 2

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        assert isinstance(opt, RMSProp)
        return np.append(RMSPropZero().scalars(opt, key), _op_f32(opt.gamma2)).astype(_f32)

    def zero_rows(self, sc: np.ndarray) -> int:
        # n, g_avg and delta stay +0; w + (+0) turns -0 into +0
        return 1 if _zero_grad(sc) and sc[6] > 0 and sc[7] < 0 and sc[8] >= 0 else -1

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        lr, one_m, gamma1, eps, clip_weights, gamma2 = sc[0], sc[4], sc[5], sc[6], sc[7], sc[8]
        (n, g_avg, delta), (g, t) = states, tmp
        RMSPropZero.grad(sc, weight, g)
        np.multiply(g, one_m, out=t)                # n = ((1-gamma1)*g)*g + gamma1*n
        np.multiply(t, g, out=t)
        np.multiply(n, gamma1, out=n)
        np.add(t, n, out=n)
        np.multiply(g, one_m, out=t)                # g_avg = (1-gamma1)*g + gamma1*g_avg
        np.multiply(g_avg, gamma1, out=g_avg)
        np.add(t, g_avg, out=g_avg)
        np.multiply(g, lr, out=g)                   # delta = gamma2*delta - (lr*g) / sqrt(n - g_avg^2 + eps)
        np.multiply(g_avg, g_avg, out=t)
        np.subtract(n, t, out=t)
        np.add(t, eps, out=t)
        np.sqrt(t, out=t)
        np.divide(g, t, out=g)
        np.multiply(delta, gamma2, out=delta)
        np.subtract(delta, g, out=delta)
        np.add(weight, delta, out=weight)
        if clip_weights >= 0:
            np.clip(weight, -clip_weights, clip_weights, out=weight)


class AdamStd(ZeroRule):
    """Adam, lazy_update=False: scalars (lr_t, wd, clip, beta1, 1-beta1, beta2, 1-beta2, eps)."""
    name, width, scratch = 'adam', 8, 2

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        assert isinstance(opt, Adam)
        lr_t, wd, beta1, beta2, eps, _, clip = _adam_scalars(opt, key)
        return np.array([lr_t, wd, clip, beta1, _ONE - beta1, beta2, _ONE - beta2, eps], dtype=_f32)

    def zero_rows(self, sc: np.ndarray) -> int:
        # g = w*0 = +-0: mean and var stay +0, w - (lr*0) / (0 + eps) = w (eps > 0)
        return 0 if sc[1] == 0 and sc[0] >= 0 and min(sc[3:7]) >= 0 and sc[7] > 0 else -1

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        lr, wd, clip, beta1, one_b1, beta2, one_b2, eps = sc
        (mean, var), (g, t) = states, tmp
        np.multiply(weight, wd, out=g)              # static_cast<DType>(weight * wd)
        if clip >= 0:
            np.clip(g, -clip, clip, out=g)
        _moments(g, t, mean, var, beta1, one_b1, beta2, one_b2)
        _adam_weight(weight, mean, var, lr, eps, g, t)


def _zero_grad(sc: np.ndarray) -> bool:
    """RMSProp's scalars give a row with zero states g = +0 and keep n (and g_avg) +0: no wd, the gradient term
    +0, lr, 1-gamma1 and gamma1 not negative."""
    return bool(sc[1] == 0 and not negative_zero(sc[2]) and sc[0] >= 0 and sc[4] >= 0 and sc[5] >= 0)


def _adam_scalars(opt: Adam, key: int) -> tuple:
    """Adam._scalars for the key's current count, without counting an update: (lr_t, wd, beta1, beta2, eps,
    rescale, clip)."""
    counts = opt._index_update_count
    had, count, num = key in counts, counts.get(key, 0), opt.num_update
    try:
        if had:
            counts[key] = count - 1
        return opt._scalars(key)
    finally:
        if had:
            counts[key] = count
        else:
            counts.pop(key, None)
        opt.num_update = num


def _moments(g: np.ndarray, t: np.ndarray, mean: np.ndarray, var: np.ndarray, beta1: np.float32,
             one_b1: np.float32, beta2: np.float32, one_b2: np.float32) -> None:
    np.multiply(g, one_b1, out=t)                   # mean = beta1*mean + (1-beta1)*g
    np.multiply(mean, beta1, out=mean)
    np.add(mean, t, out=mean)
    np.multiply(g, g, out=t)                        # var = beta2*var + (1-beta2)*(g*g)
    np.multiply(t, one_b2, out=t)
    np.multiply(var, beta2, out=var)
    np.add(var, t, out=var)


def _adam_weight(weight: np.ndarray, mean: np.ndarray, var: np.ndarray, lr: np.float32, eps: np.float32,
                 g: np.ndarray, t: np.ndarray) -> None:
    np.sqrt(var, out=t)                             # w - (lr*mean) / (sqrt(var) + eps)
    np.add(t, eps, out=t)
    np.multiply(mean, lr, out=g)
    np.divide(g, t, out=g)
    np.subtract(weight, g, out=weight)


def adam_std_update(opt: Adam, key: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray]) -> None:
    """One counted Adam update of the gathered rows `weight` / `states` (float32) with their gradient rows, as
    AdamStdDnsRspDnsKernel<cpu> computes the rows the gradient has (lazy_update=False)."""
    lr, wd, beta1, beta2, eps, rescale, clip = opt._scalars(key)
    mean, var = states
    g = np.multiply(grad, rescale, dtype=_f32)      # grad*rescale + weight*wd
    g += weight * wd
    if clip >= 0:
        g = _clip(g, clip)
    t = np.empty_like(g)
    _moments(g, t, mean, var, beta1, _ONE - beta1, beta2, _ONE - beta2)
    _adam_weight(weight, mean, var, lr, eps, g, t)
