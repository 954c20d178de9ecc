"""What a refusal is, and the field rules that decide one.

Owns: the three errors a worker's optimizer can be refused with (:class:`UnsafePickleError`: not a pickle we
unpickle; :class:`UnsupportedOptimizerError`: a real mxnet class we do not implement;
:class:`UnusableOptimizerError`: a supported class whose fields we cannot compute with), the count limits, and the
small rules ``validate()`` checks every field with (each rule returns None, or what the value must be).
Does not own: which field gets which rule (each optimizer and scheduler class lists its own), the unpickler.

Why: the pickle's state never went through ``__init__`` on the server, so a value that would make an update loop
without end or fail later (a FactorScheduler ``step`` of 0, NaN or a string where a number goes, an update count of
2**60) is refused when it arrives (issue 11), naming the field, instead of failing every later push.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


class UnsafePickleError(ValueError):
    """The optimizer pickle references a global outside the allow-list, or is malformed."""


class UnsupportedOptimizerError(ValueError):
    """The pickle holds a genuine mxnet optimizer/scheduler class that is not implemented here."""


class UnusableOptimizerError(ValueError):
    """A supported optimizer or scheduler class whose fields the server cannot compute with (the message names the
    field, its value and the rule)."""


MAX_COUNT = 2 ** 53              # update counts and scheduler steps: integers float64 holds exactly
MAX_SCHEDULER_STEPS = 10 ** 7    # loop iterations one FactorScheduler call may make (about a second)

# Field rules (validate): each returns None, or what the value must be.
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
