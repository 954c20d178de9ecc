"""The four stock lr schedulers of mxnet 1.9.1: the ``__call__`` logic of mxnet/lr_scheduler.py, and the rules
their pickled fields must meet.

Owns: FactorScheduler, MultiFactorScheduler, PolyScheduler and CosineScheduler as the optimizer calls them (they
are stateful: a call moves ``base_lr`` and ``count`` on, as in mxnet), and each one's ``validate``.
Does not own: when they are called (``Optimizer._get_lr``), how they are unpickled (``loader.py``).

Instances are only made by unpickling: their state is mxnet's ``__dict__``, whose fields the annotations below
name. The rules are ``LRScheduler.__init__``'s and each subclass's own ``__init__`` checks, plus "finite" for every
number, and a bound on the work one FactorScheduler call may do (it loops once per step it passes).
"""
from __future__ import annotations

import math

from kvstore_lazy.numerics.optimizers.rules import (MAX_SCHEDULER_STEPS, UnsafePickleError, UnusableOptimizerError,
                                                    _between, _check, _count, _count_from, _finite, _one_of, _show)


class LRScheduler:
    # the fields of mxnet's pickled __dict__ every scheduler has (LRScheduler.__init__)
    base_lr: float
    warmup_steps: int
    warmup_begin_lr: float
    warmup_final_lr: float
    warmup_mode: str

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

    def __call__(self, num_update: int) -> float:
        """The learning rate for update `num_update` (each subclass's own; mxnet's LRScheduler is not accepted)."""
        raise NotImplementedError


class FactorScheduler(LRScheduler):
    step: int
    factor: float
    stop_factor_lr: float
    count: int

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
    step: list[int]
    factor: float
    cur_step_ind: int
    count: int

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


def _check_max_steps(scheduler: PolyScheduler | CosineScheduler) -> None:
    """PolyScheduler / CosineScheduler: max_update >= 1 and max_steps = max_update - warmup_steps >= 1 (it
    divides)."""
    _check(scheduler, 'max_update', _count_from(1))
    _check(scheduler, 'max_steps', _count_from(1))
    _check(scheduler, 'final_lr', _finite)
    _check(scheduler, 'base_lr_orig', _finite)
    if scheduler.max_steps != scheduler.max_update - scheduler.warmup_steps:
        raise UnusableOptimizerError(f'{type(scheduler).__name__}.max_steps = {scheduler.max_steps}: must be '
                                     f'max_update - warmup_steps = {scheduler.max_update - scheduler.warmup_steps}')


class PolyScheduler(LRScheduler):
    max_update: int
    max_steps: int
    final_lr: float
    base_lr_orig: float
    power: float

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
    max_update: int
    max_steps: int
    final_lr: float
    base_lr_orig: float

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
