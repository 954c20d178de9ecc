"""Optimizers for the kvstore server: safe loading and numpy updates.

This module owns two things:

* ``load_optimizer(body)``, which turns the worker's protocol-0 pickle of an
  ``mxnet.optimizer`` object (the body of the ps-lite kController command) into
  a local stub object. It uses a restricted unpickler. It never imports mxnet
  and never resolves a global that is not on an allow-list.
* The stubs, which are numpy re-implementations of MXNet 1.9.1's optimizer
  update operators: SGD, NAG, Signum, Adam, AdaGrad, Ftrl, RMSProp and Test,
  plus the four stock lr schedulers. They follow the kernels'
  float32 operation order. Scalar hyper-parameters become float32 in the same
  way MXNet's ops receive them: ``str(value)``, parsed by dmlc-core's inexact
  ``ParseFloat``. SGD and Adam, the hot ones, run float32 arrays through
  compiled one-pass kernels (``store.kernels``, same operations in the same
  order) and keep the numpy expressions for other dtypes.

``Optimizer.update`` works element by element. The server can call it on a
whole dense array, or on the gathered rows of a row_sparse key, which gives
MXNet's lazy_update semantics.

Every field the server computes with is checked when the pickle is loaded
(:func:`validate`, issue 11): a value that would make an update loop without
end or fail later (a FactorScheduler ``step`` of 0, NaN or a string where a
number goes, MultiFactor steps that do not increase, an update count of 2**60)
refuses the whole optimizer with :class:`UnusableOptimizerError` naming the
field. The rules are MXNet's own ``__init__`` checks where it has them (the
pickle's state never went through ``__init__`` on the server), plus "finite"
for every number.
"""
from __future__ import annotations

import copy
import functools
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore_lazy.protocol.fast import native
from kvstore_lazy.store import kernels

__all__ = ['load_optimizer', 'validate', 'Optimizer', 'UnsafePickleError', 'UnsupportedOptimizerError',
           'UnusableOptimizerError',
           'SGD', 'NAG', 'Signum', 'Adam', 'AdaGrad', 'Ftrl', 'RMSProp', 'Test',
           'FactorScheduler', 'MultiFactorScheduler', 'PolyScheduler', 'CosineScheduler']

_f32 = np.float32
_ONE = _f32(1)   # np.float32(1) + 1 would be float64 in numpy 1.23; keep literals float32
_NO_CLIP = _f32(-1)
# updates (and keys.py's round merges) in one compiled call: _fast.c calls store/kernels.c's own kernels, without
# ctypes' per-call set-up
native.set_update_kernels(*(kernels.address(name) for name in ('sgd_rows', 'sgd_mom_rows', 'adam_rows',
                                                                 'merge_rows_f32')))
_sgd, _sgd_mom, _adam = native.sgd, native.sgd_mom, native.adam
_parse_float32 = native.parse_float32


class UnsafePickleError(ValueError):
    """The optimizer pickle references a global outside the allow-list, or is malformed."""


class UnsupportedOptimizerError(ValueError):
    """The pickle holds a genuine mxnet optimizer/scheduler class that is not implemented here."""


class UnusableOptimizerError(ValueError):
    """A supported optimizer or scheduler class whose fields the server cannot compute with (the message names the
    field, its value and the rule)."""


MAX_COUNT = 2 ** 53              # update counts and scheduler steps: integers float64 holds exactly
MAX_SCHEDULER_STEPS = 10 ** 7    # loop iterations one FactorScheduler call may make (about a second)


# --------------------------------------------------------------------------------------
# How MXNet turns Python hyper-parameters into float32 kernel arguments.
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _dmlc_parse(text: str, ftype: type) -> Any:
    """dmlc::ParseFloat<ftype> (dmlc-core strtonum.h), step by step.

    It is not correctly rounded. About 14% of random values parse 1 ulp away
    from np.float32(value).
    """
    s, i, neg = text.strip(), 0, False
    if s[:1] in ('+', '-'):
        neg, i = s[0] == '-', 1
    low = s[i:].lower()
    if low.startswith('inf') or low.startswith('nan'):
        value = ftype('inf' if low.startswith('inf') else 'nan')
        return -value if neg else value
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    value = ftype(int(s[i:j] or '0'))
    i = j
    if s[i:i + 1] == '.':
        j = i = i + 1
        while j < len(s) and s[j].isdigit():
            j += 1
        digits = s[i:j][:19]          # kStrtofMaxDigits
        if digits:
            value = ftype(value + ftype(int(digits) / float(10 ** len(digits))))
        i = j
    if s[i:i + 1] in ('e', 'E'):
        i += 1
        frac = s[i:i + 1] == '-'
        if s[i:i + 1] in ('+', '-'):
            i += 1
        j = i
        while j < len(s) and s[j].isdigit():
            j += 1
        expon = min(int(s[i:j] or '0'), 38 if ftype is _f32 else 308)
        scale = ftype(1.0)
        while expon >= 8:
            scale, expon = ftype(scale * ftype(1e8)), expon - 8
        while expon > 0:
            scale, expon = ftype(scale * ftype(10.0)), expon - 1
        value = ftype(value / scale) if frac else ftype(value * scale)
    return -value if neg else value


def _op_f32(value: Any) -> np.float32:
    """A `float` field of an optimizer op's dmlc::Parameter (lr, wd, rescale_grad, ...). The compiled parser
    (_fast.c parse_float32, the same steps) takes str(float)'s text: Adam's lr is a new value every update; the
    other fields are the same every update, so each text's value is kept (a bounded table)."""
    text = str(value)
    known = _OP_F32.get(text)
    if known is None:
        parsed = _parse_float32(text)
        known = _dmlc_parse(text, _f32) if parsed is None else _f32(parsed)
        if len(_OP_F32) >= 1024:
            _OP_F32.clear()
        _OP_F32[text] = known
    return known


_OP_F32: dict[str, np.float32] = {}


def _scalar_f32(value: Any) -> np.float32:
    """The scalar of an NDArray-scalar op (``x * 0.5``): a parsed double cast to float32."""
    return _f32(_dmlc_parse(str(float(value)), float))


def _tuple_f32(value: Any) -> np.float32:
    """An element of a Tuple<float> field (multi_sgd lrs/wds): std::istream, i.e. strtof."""
    return _f32(float(value))


def _clip(x: np.ndarray, bound: np.float32) -> np.ndarray:
    return np.clip(x, -bound, bound)


def _sign(x: np.ndarray) -> np.ndarray:
    return (x > 0).astype(_f32) - (x < 0).astype(_f32)


class _Scratch:
    """Reusable float32 work buffers for the in-place update paths.

    ``get(shape, k)`` returns k distinct float32 arrays of ``shape``. They are views of
    flat buffers that grow to the largest size requested, so memory stays bounded by
    k times the largest key. A copy (deepcopy, pickle) starts empty.
    """
    __slots__ = ('bufs',)

    def __init__(self) -> None:
        self.bufs: list[np.ndarray] = []

    def get(self, shape: tuple[int, ...], k: int) -> list[np.ndarray]:
        size = math.prod(shape)
        bufs, out = self.bufs, []
        for i in range(k):
            if i == len(bufs):
                bufs.append(np.empty(size, dtype=_f32))
            elif bufs[i].size < size:
                bufs[i] = np.empty(size, dtype=_f32)
            out.append(bufs[i][:size].reshape(shape))
        return out

    def __deepcopy__(self, memo: dict) -> _Scratch:
        return _Scratch()

    def __reduce__(self) -> tuple:
        return (_Scratch, ())


# --------------------------------------------------------------------------------------
# Field rules (validate): each returns None, or what the value must be.
# --------------------------------------------------------------------------------------
Rule = Callable[[Any], 'str | None']
_MISSING = object()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + '...'


def _finite(value: Any) -> str | None:
    if isinstance(value, (int, float)):
        try:
            if math.isfinite(value):
                return None
        except OverflowError:   # an int beyond float64
            pass
    return 'must be a finite number'


def _between(low: float, high: float, high_open: bool = False) -> Rule:
    def rule(value: Any) -> str | None:
        if _finite(value) is None and low <= value and (value < high if high_open else value <= high):
            return None
        return f"must be a number in [{low:g}, {high:g}{')' if high_open else ']'}"
    return rule


def _count_from(low: int, high: int = MAX_COUNT) -> Rule:
    def rule(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and low <= value < high:
            return None
        return f'must be an integer in [{low}, {high if high != MAX_COUNT else "2**53"})'
    return rule


_count = _count_from(0)


def _one_of(*choices: Any) -> Rule:
    def rule(value: Any) -> str | None:
        if any(type(value) is type(c) and value == c for c in choices):
            return None
        return f"must be one of {', '.join(map(repr, choices))}"
    return rule


def _optional(inner: Rule) -> Rule:
    def rule(value: Any) -> str | None:
        return None if value is None else inner(value)
    return rule


def _check(obj: object, name: str, rule: Rule) -> None:
    value = getattr(obj, name, _MISSING)
    why = 'is missing' if value is _MISSING else rule(value)
    if why is not None:
        shown = '' if value is _MISSING else f' = {_show(value)}'
        raise UnusableOptimizerError(f'{type(obj).__name__}.{name}{shown}: {why}')


def _check_mapping(obj: object, name: str, rule: Rule) -> None:
    """A dict of parameter index (int) or name (str) -> value."""
    mapping = getattr(obj, name, _MISSING)
    if not isinstance(mapping, dict):
        raise UnusableOptimizerError(f'{type(obj).__name__}.{name} = {_show(mapping)}: must be a dict')
    for key, value in mapping.items():
        why = None if isinstance(key, (int, str)) else 'keys must be parameter indices or names'
        why = why or rule(value)
        if why is not None:
            raise UnusableOptimizerError(f'{type(obj).__name__}.{name}[{_show(key)}] = {_show(value)}: {why}')


def _check_max_steps(scheduler: LRScheduler) -> None:
    """PolyScheduler / CosineScheduler: max_update >= 1 and max_steps = max_update - warmup_steps >= 1 (it
    divides)."""
    _check(scheduler, 'max_update', _count_from(1))
    _check(scheduler, 'max_steps', _count_from(1))
    _check(scheduler, 'final_lr', _finite)
    _check(scheduler, 'base_lr_orig', _finite)
    if scheduler.max_steps != scheduler.max_update - scheduler.warmup_steps:
        raise UnusableOptimizerError(f'{type(scheduler).__name__}.max_steps = {scheduler.max_steps}: must be '
                                     f'max_update - warmup_steps = {scheduler.max_update - scheduler.warmup_steps}')


# --------------------------------------------------------------------------------------
# lr schedulers: the __call__ logic of mxnet/lr_scheduler.py (they are stateful).
# --------------------------------------------------------------------------------------
class LRScheduler:
    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError('lr_scheduler state is not a dict')
        self.__dict__.update(state)

    def validate(self) -> None:
        """LRScheduler.__init__'s rules for the warm-up fields (UnusableOptimizerError)."""
        _check(self, 'base_lr', _finite)
        _check(self, 'warmup_steps', _count)
        _check(self, 'warmup_begin_lr', _finite)
        _check(self, 'warmup_final_lr', _finite)
        _check(self, 'warmup_mode', _one_of('linear', 'constant'))

    def get_warmup_lr(self, num_update: int) -> float:
        if self.warmup_mode == 'linear':
            increase = (self.warmup_final_lr - self.warmup_begin_lr) \
                * float(num_update) / float(self.warmup_steps)
            return self.warmup_begin_lr + increase
        return self.warmup_begin_lr


class FactorScheduler(LRScheduler):
    def validate(self) -> None:
        super().validate()
        _check(self, 'step', _count_from(1))              # FactorScheduler.__init__: step >= 1
        _check(self, 'factor', _between(0.0, 1.0))       # ... and factor <= 1
        _check(self, 'stop_factor_lr', _finite)
        _check(self, 'count', _count)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        steps = -(-(num_update - self.count) // self.step) - 1    # iterations of the loop below
        if steps > MAX_SCHEDULER_STEPS:
            raise UnusableOptimizerError(f'FactorScheduler: update {num_update} is {steps} steps of {self.step} '
                                         f'past count {self.count} (more than {MAX_SCHEDULER_STEPS})')
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop_factor_lr:
                self.base_lr = self.stop_factor_lr
        return self.base_lr


class MultiFactorScheduler(LRScheduler):
    def validate(self) -> None:
        super().validate()
        steps = getattr(self, 'step', None)
        if not isinstance(steps, list) or not steps or not all(_count_from(1)(s) is None for s in steps) \
                or any(b <= a for a, b in zip(steps, steps[1:])):
            raise UnusableOptimizerError(f'MultiFactorScheduler.step = {_show(steps)}: must be a non-empty list of '
                                         f'increasing integers >= 1 (MultiFactorScheduler.__init__)')
        _check(self, 'factor', _between(0.0, 1.0))
        _check(self, 'cur_step_ind', _count_from(0, len(steps) + 1))
        _check(self, 'count', _count)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while self.cur_step_ind <= len(self.step) - 1:   # at most len(step) iterations
            if num_update > self.step[self.cur_step_ind]:
                self.count = self.step[self.cur_step_ind]
                self.cur_step_ind += 1
                self.base_lr *= self.factor
            else:
                return self.base_lr
        return self.base_lr


class PolyScheduler(LRScheduler):
    def validate(self) -> None:
        super().validate()
        _check_max_steps(self)
        _check(self, 'power', _between(0.0, math.inf))    # pow(0, negative) divides by zero at max_update

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * \
                pow(1 - float(num_update - self.warmup_steps) / float(self.max_steps), self.power)
        return self.base_lr


class CosineScheduler(LRScheduler):
    def validate(self) -> None:
        super().validate()
        _check_max_steps(self)

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * \
                (1 + math.cos(math.pi * (num_update - self.warmup_steps) / self.max_steps)) / 2
        return self.base_lr


# --------------------------------------------------------------------------------------
# Optimizers. Instances are only created by unpickling; the state is mxnet's __dict__.
# --------------------------------------------------------------------------------------
_BASE_RULES: dict[str, Rule] = {
    'rescale_grad': _finite, 'wd': _finite, 'clip_gradient': _optional(_finite),
    'begin_num_update': _count, 'num_update': _count,
}
_MOMENTUM: dict[str, Rule] = {'momentum': _finite}


class Optimizer:
    """The base class. Subclasses implement num_states() and _step()."""
    name = 'optimizer'
    _required = ('rescale_grad', 'lr_scheduler', 'lr', 'wd', 'lr_mult', 'wd_mult', 'idx2name',
                 'begin_num_update', 'num_update', '_all_index_update_counts', 'clip_gradient')
    _extra = ()   # the attributes each subclass's __init__ sets

    _rules: dict[str, Rule] = {}   # each subclass's own fields (validate)

    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError('optimizer state is not a dict')
        missing = [k for k in self._required + self._extra if k not in state]
        if missing:
            raise UnsafePickleError(f'{type(self).__name__} state lacks {missing}')
        self.__dict__.update(state)
        self.param_dict = {}
        self._scratch = _Scratch()
        # mxnet's Updater calls _set_current_context(weight.context.device_id); the server is cpu(0)
        self._index_update_count = self._all_index_update_counts.setdefault(0, {})

    def validate(self) -> None:
        """Refuse (UnusableOptimizerError) any field the updates compute with that could make them fail or loop:
        hyper-parameters must be finite numbers (and in range where MXNet's kernels need it), counts integers in
        [0, 2**53), the multiplier tables dicts of numbers, the scheduler one of the supported ones."""
        for name, rule in {**_BASE_RULES, **self._rules}.items():
            _check(self, name, rule)
        # Optimizer.__init__ leaves lr None when a scheduler gives it
        _check(self, 'lr', _finite if getattr(self, 'lr_scheduler', None) is None else _optional(_finite))
        _check_mapping(self, 'lr_mult', _finite)
        _check_mapping(self, 'wd_mult', _finite)
        _check_mapping(self, 'idx2name', lambda v: None if isinstance(v, str) else 'must be a parameter name')
        _check_mapping(self, '_all_index_update_counts',
                       lambda v: None if isinstance(v, dict) else 'must be a dict of update counts')
        for device, counts in self._all_index_update_counts.items():
            for key, count in counts.items():
                why = None if isinstance(key, (int, str)) else 'keys must be parameter indices or names'
                why = why or _count(count)
                if why is not None:
                    raise UnusableOptimizerError(f'{type(self).__name__}._all_index_update_counts[{_show(device)}]'
                                                 f'[{_show(key)}] = {_show(count)}: {why}')
        scheduler = self.lr_scheduler
        if scheduler is not None:
            if not isinstance(scheduler, LRScheduler):
                raise UnusableOptimizerError(f'{type(self).__name__}.lr_scheduler = {_show(scheduler)}: must be '
                                             f'None or an mxnet.lr_scheduler scheduler')
            scheduler.validate()
            # the first update asks it about the largest count so far: it must answer in bounded time
            counts = [c for per_device in self._all_index_update_counts.values() for c in per_device.values()]
            copy.deepcopy(scheduler)(max([self.num_update, self.begin_num_update] + counts) + 1)

    def restore_count(self, key: int, count: int, num_update: int) -> None:
        """LAZY_SET_COUNTS: the update count of `key` (if > 0) and num_update (if larger) as a checkpoint had them.
        UnusableOptimizerError, changing nothing, for counts outside [0, 2**53) or one that would make the lr
        scheduler's next call loop too long (a FactorScheduler steps from its count up to num_update)."""
        for name, value in (('count', count), ('num_update', num_update)):
            why = _count(value)
            if why is not None:
                raise UnusableOptimizerError(f'update counts of key {key}: {name} = {_show(value)} {why}')
        new_num_update = max(int(self.num_update), num_update)
        if self.lr_scheduler is not None:   # what the next update of the key will ask it
            copy.deepcopy(self.lr_scheduler)(max(new_num_update, count + 1))
        if count > 0:
            self._index_update_count[key] = count
        self.num_update = new_num_update

    # -- the interface the server uses --
    def num_states(self) -> int:
        return 0

    def init_states(self, weight: np.ndarray) -> list[np.ndarray]:
        return [np.zeros(weight.shape, dtype=np.float32) for _ in range(self.num_states())]

    def update_rows(self, key: int, weight: np.ndarray, states: list[np.ndarray], slots: np.ndarray,
                    grad: np.ndarray) -> bool:
        """Update rows ``slots`` of ``weight`` and ``states`` (whole row tables) in place with the gradient rows
        ``grad`` (one per slot), as :meth:`update` would on the gathered rows with ``row_sparse=True``.

        Returns False, changing nothing, when there is no compiled kernel for this optimizer or these arrays: the
        caller then gathers the rows and calls :meth:`update`.
        """
        return False

    def update(self, key: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray], *,
               row_sparse: bool = False) -> None:
        """Apply one optimizer step to `weight` and `states`, in place.

        Set `row_sparse=True` when `weight`/`grad`/`states` are the gathered rows of a
        row_sparse key. MXNet's row_sparse path rounds differently from its dense path for
        SGD without momentum but with wd, for Adam with clip_gradient, and for AdaGrad.
        Setting the flag copies the row_sparse rounding bit for bit.
        """
        w = weight if weight.dtype == np.float32 else weight.astype(np.float32)
        g = np.asarray(grad, dtype=np.float32)
        self._step(key, w, g, states, row_sparse)
        if w is not weight:
            weight[...] = w

    def update_uncounted(self, key: int, weight: np.ndarray, states: list[np.ndarray], grad: np.ndarray) -> None:
        """Update the gathered rows `weight` and `states` (one gradient row each) as :meth:`update` with
        ``row_sparse=True`` would, with the step count of `key`'s next update, but without counting one: rows of a
        round updated apart from the rest of it (a disk tier's, in place), whose one count comes with the others."""
        counts = self._index_update_count
        had, count, num = key in counts, counts.get(key), self.num_update
        try:
            if not self.update_rows(key, weight, states, np.arange(len(grad), dtype=np.int64), grad):
                self.update(key, weight, grad, states, row_sparse=True)
        finally:
            if had:
                counts[key] = count
            else:
                counts.pop(key, None)
            self.num_update = num

    def update_count(self, key) -> int:
        """How many updates of `key` this optimizer counted (0 if none)."""
        return int(self._index_update_count.get(key, 0))

    def update_counts(self) -> dict:
        """Every key's update count (a copy), for snapshots."""
        return {k: int(v) for k, v in self._index_update_count.items()}

    def set_update_count(self, key, count: int) -> None:
        """Restore `key`'s update count (a snapshot or a worker checkpoint); ``num_update`` is restored apart."""
        self._index_update_count[key] = int(count)

    # -- mxnet.optimizer.Optimizer bookkeeping --
    def _update_count(self, index: int) -> None:
        if index not in self._index_update_count:
            self._index_update_count[index] = self.begin_num_update
        self._index_update_count[index] += 1
        self.num_update = max(self._index_update_count[index], self.num_update)

    def _get_lr(self, index: int) -> float:
        lr = self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr
        if index in self.lr_mult:
            lr *= self.lr_mult[index]
        elif index in self.idx2name:
            lr *= self.lr_mult.get(self.idx2name[index], 1.0)
        return lr

    def _get_wd(self, index: int) -> float:
        wd = self.wd
        if index in self.wd_mult:
            wd *= self.wd_mult[index]
        elif index in self.idx2name:
            wd *= self.wd_mult.get(self.idx2name[index], 1.0)
        return wd

    def _buffers(self, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
                 k: int) -> list[np.ndarray] | None:
        """k scratch buffers shaped like `weight` for the in-place path, or None.

        The in-place path runs only when grad and every state are float32 and shaped like the
        (float32) weight. Anything else (e.g. float16 row tables) takes the allocating path,
        whose dtype promotion it must keep.
        """
        shape = weight.shape
        if grad.shape != shape:
            return None
        for s in states:
            if not isinstance(s, np.ndarray) or s.dtype != _f32 or s.shape != shape:
                return None
        return self._scratch.get(shape, k)

    def _clip_param(self) -> np.float32:
        """The clip_gradient kernel argument (-1 = off; mxnet passes it only when truthy)."""
        return _op_f32(self.clip_gradient) if self.clip_gradient else _NO_CLIP

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        raise NotImplementedError


_ROW0 = np.zeros(1, np.int64)


def _as_one_row(weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray]) -> tuple | None:
    """``(weight, states, slots, grad)`` as one-row 2-D views for the compiled kernels (``slots`` = row 0), or None
    when the kernels can't take them (e.g. float16: the numpy path keeps its dtype promotion). Only C-contiguous
    arrays are reshaped: a reshaped copy would be updated instead of the array."""
    arrays = [weight, grad, *states]
    if not all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.shape == weight.shape for a in arrays):
        return None
    w, g, *s = [a.reshape(1, -1) for a in arrays]
    return (w, s, _ROW0, g) if kernels.accepts(w, s, _ROW0, g) else None


def _sgd_step_term(lr: np.float32, rescale: np.float32, clip: np.float32, grad: np.ndarray) -> np.ndarray:
    """The `lr * clip(rescale * grad)` term shared by the SGD-family kernels."""
    if clip >= 0:
        return lr * _clip(rescale * grad, clip)
    return (lr * rescale) * grad


def _sgd_kernel(weight: np.ndarray, grad: np.ndarray, lr: np.float32, wd: np.float32, rescale: np.float32,
                clip: np.float32) -> None:
    """sgd_update (SGDKernel / SGDDnsRspKernel)."""
    weight[...] = (_ONE - lr * wd) * weight - _sgd_step_term(lr, rescale, clip, grad)


class SGD(Optimizer):
    name = 'sgd'
    _extra = ('momentum',)
    _rules = _MOMENTUM

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


class Adam(Optimizer):
    name = 'adam'
    _extra = ('beta1', 'beta2', 'epsilon')
    # the bias correction divides by 1 - beta1**t and takes sqrt(1 - beta2**t)
    _rules = {'beta1': _between(0.0, 1.0, high_open=True), 'beta2': _between(0.0, 1.0), 'epsilon': _finite}

    def num_states(self) -> int:
        return 2

    def _scalars(self, index: int) -> tuple:
        """Count the update; the float32 kernel arguments (lr, wd, beta1, beta2, epsilon, rescale, clip)."""
        self._update_count(index)
        lr, wd = self._get_lr(index), _op_f32(self._get_wd(index))
        t = self._index_update_count[index]
        lr = _op_f32(lr * (math.sqrt(1. - self.beta2 ** t) / (1. - self.beta1 ** t)))
        return (lr, wd, _op_f32(self.beta1), _op_f32(self.beta2), _op_f32(self.epsilon), _op_f32(self.rescale_grad),
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


class AdaGrad(Optimizer):
    name = 'adagrad'
    _extra = ('float_stable_eps',)
    _rules = {'float_stable_eps': _finite}

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


class Test(Optimizer):
    """mxnet's Test optimizer: weight += grad * rescale_grad; state = weight. It keeps no update count."""
    name = 'test'

    def num_states(self) -> int:
        return 1

    def _step(self, index: int, weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray],
              row_sparse: bool) -> None:
        weight += grad * _scalar_f32(self.rescale_grad)
        states[0][...] = weight


# --------------------------------------------------------------------------------------
# Restricted unpickling.
# --------------------------------------------------------------------------------------
_OPTIMIZER_MODULE = 'mxnet.optimizer.optimizer'
_SCHEDULER_MODULE = 'mxnet.lr_scheduler'
_CLASSES = {(_OPTIMIZER_MODULE, c.__name__): c
            for c in (SGD, NAG, Signum, Adam, AdaGrad, Ftrl, RMSProp, Test)}
_CLASSES.update({(_SCHEDULER_MODULE, c.__name__): c
                 for c in (FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler)})
# The other optimizer/scheduler classes in mxnet 1.9.1.
_KNOWN_UNSUPPORTED = {
    _OPTIMIZER_MODULE: {'Optimizer', 'FTML', 'LARS', 'LBSGD', 'LAMB', 'DCASGD', 'SGLD',
                        'ccSGD', 'AdaDelta', 'Adamax', 'Nadam'},
    'mxnet.optimizer.contrib': {'GroupAdaGrad'},
    _SCHEDULER_MODULE: {'LRScheduler'},
}


def _reconstruct(cls: type, base: type, state: Any) -> object:
    """A safe stand-in for copyreg._reconstructor, for the form protocol 0 emits for plain classes."""
    if cls not in _CLASSES.values() or base is not object or state is not None:
        raise UnsafePickleError('unexpected copy_reg._reconstructor arguments')
    return object.__new__(cls)


_GLOBALS = {
    ('copy_reg', '_reconstructor'): _reconstruct,
    ('copyreg', '_reconstructor'): _reconstruct,
    ('__builtin__', 'object'): object,
    ('builtins', 'object'): object,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _GLOBALS:
            return _GLOBALS[key]
        if key in _CLASSES:
            return _CLASSES[key]
        if name in _KNOWN_UNSUPPORTED.get(module, ()):
            raise UnsupportedOptimizerError(f'unsupported mxnet optimizer class {module}.{name}')
        raise UnsafePickleError(f'refusing to unpickle global {module}.{name}')

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError('persistent ids are not allowed')


def load_optimizer(body: bytes | str) -> Optimizer:
    """Rebuild the optimizer from the body of the kController command, `pickle.dumps(opt, 0)`, and validate every
    field the server computes with (UnusableOptimizerError)."""
    if isinstance(body, str):
        body = body.encode('latin-1')
    try:
        obj = _RestrictedUnpickler(io.BytesIO(bytes(body))).load()
    except (UnsafePickleError, UnsupportedOptimizerError):
        raise
    except Exception as exc:  # malformed pickle: any failure of the unpickler
        raise UnsafePickleError(f'malformed optimizer pickle: {exc!r}') from exc
    if not isinstance(obj, Optimizer):
        raise UnsafePickleError(f'pickle holds {type(obj).__name__}, not an mxnet optimizer')
    validate(obj)
    return obj


def check_runs(optimizer: Optimizer) -> None:
    """One dense and one row_sparse step on a copy: a pickle of a real optimizer class whose hyper-parameters cannot
    run (a string learning rate) is refused by kController instead of failing every later push."""
    trial = copy.deepcopy(optimizer)
    for row_sparse in (False, True):
        weight = np.zeros((1, 1), np.float32)
        try:
            with np.errstate(all="ignore"):   # zeros may make 0/0 for a valid optimizer: only exceptions count
                trial.update(0, weight, np.zeros((1, 1), np.float32), trial.init_states(weight),
                             row_sparse=row_sparse)
        except Exception as exc:
            raise ValueError(f"optimizer {optimizer.name} cannot run: {exc!r}") from None


def validate(optimizer: Optimizer) -> None:
    """Optimizer.validate, with the refusal said as such (UnusableOptimizerError)."""
    try:
        optimizer.validate()
    except UnusableOptimizerError as exc:
        raise UnusableOptimizerError(f'optimizer {optimizer.name} refused: {exc}') from None
