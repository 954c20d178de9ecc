"""What a zero-gradient rule is: the step stock applies to a row that got no gradient, and the scalars it needs.

Owns: :class:`ZeroRule` (the interface every optimizer's rule implements), the float32 helpers the rules share
(``kernel_lr_wd``: the lr and wd an op's dmlc::Parameter receives; ``zero_term``: a kernel's gradient term at a
gradient of +0, with its sign).
Does not own: any optimizer's arithmetic (``sgd_family.py``, ``adaptive.py``), which optimizer gets which rule
(``registry.py``).

Why a rule exists at all: with ``lazy_update=False`` (SGD, Adam) and always for NAG, Signum and RMSProp (their
kernels have no row_sparse path, so MXNet densifies the weight and runs the dense kernel), the stock server moves
every row of a row_sparse weight at every update, the rows without a gradient with a gradient of zero. A rule is
that step, in the kernel's own float32 operation order, so that applying it step by step to a row that missed
steps gives the stock row bit for bit.
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.numerics.optimizers import Optimizer
from kvstore_lazy.numerics.optimizers.floats import _f32, _op_f32

ZERO = _f32(0)


def kernel_lr_wd(opt: Optimizer, key: int) -> tuple[np.float32, np.float32]:
    """The lr and wd the key's last update passed to its op (dmlc::Parameter floats). The scheduler is asked again
    for the same ``num_update``: every stock scheduler answers that without moving on."""
    return _op_f32(opt._get_lr(key)), _op_f32(opt._get_wd(key))


def rescale_clip(opt: Optimizer) -> tuple[np.float32, np.float32]:
    """rescale_grad and the clip_gradient kernel argument (-1: off)."""
    return _op_f32(opt.rescale_grad), opt._clip_param()


def zero_term(scale: np.float32, rescale: np.float32, clip: np.float32) -> np.float32:
    """``scale * clip(rescale * g)`` (clip on) or ``(scale * rescale) * g`` (off) at g = +0, as float32: +0 or -0.
    Subtracting +0 changes no float (x - +0 == x, -0 included), so rules skip it; -0 they apply."""
    if clip >= 0:
        return _f32(scale * np.clip(_f32(rescale * ZERO), -clip, clip))
    return _f32(_f32(scale * rescale) * ZERO)


def negative_zero(x: np.float32) -> bool:
    return bool(x == 0 and np.signbit(x))


class ZeroRule:
    """One optimizer's step for rows whose gradient is zero. Subclasses set ``name``, ``width`` (scalars a step)
    and ``scratch`` (work arrays a step needs, shaped like the rows), and implement ``scalars`` and ``step``."""
    name = 'rule'
    width = 0
    scratch = 0

    def scalars(self, opt: Optimizer, key: int) -> np.ndarray:
        """The float32 scalars of the key's latest update (its count now), as ``step`` takes them."""
        raise NotImplementedError

    def step(self, sc: np.ndarray, weight: np.ndarray, states: list[np.ndarray], tmp: list[np.ndarray]) -> None:
        """One zero-gradient step of the rows `weight` (2-D) and `states`, in place; `tmp`: ``scratch`` work
        arrays of the same shape."""
        raise NotImplementedError

    def identity(self, sc: np.ndarray) -> bool:
        """Whether the step with these scalars changes no row whatever its values (no step to apply)."""
        return False

    def zero_rows(self, sc: np.ndarray) -> int:
        """What the step with these scalars does to rows whose states are all +0.0, whatever their weights: 0
        nothing, bit for bit; 1 only weights of -0.0 become +0.0 (states stay +0.0); -1 more, or not known (the
        step must be applied). Rows never stored start so, and without weight decay most rules leave them so: a
        row at its initial value then needs no step at all (``History.initial``). tests/test_catchup.py checks
        every rule's answer against its step on signed zeros, subnormals and large values."""
        return 0 if self.identity(sc) else -1
