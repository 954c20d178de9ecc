"""The safe loader: the worker's pickled optimizer in, a validated optimizer of ours out; nothing else is built.

Owns: :func:`load_optimizer` and its restricted unpickler, :func:`validate` (the refusal said as such) and
:func:`check_runs` (a trial step before kController accepts an optimizer).
Does not own: the field rules (``rules.py``, each class's ``validate``), the update rules.

What it accepts, and why: the body of ps-lite's kController command is ``pickle.dumps(optimizer, 0)`` of an
``mxnet.optimizer`` object, from the network. Unpickling runs whatever globals a pickle names, so ``find_class``
resolves only an allow-list: the eight supported optimizer classes and four lr schedulers (mapped to ours, by
mxnet's module and class name), ``object`` and ``copyreg._reconstructor`` (the form protocol 0 emits for plain
classes; ours checks its arguments and only makes an instance of an allowed class). mxnet's other optimizer and
scheduler classes are refused as unsupported, every other global and every persistent id as unsafe, and any other
failure of the unpickler as a malformed pickle. mxnet is never imported.
"""
from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import numpy as np

from kvstore_lazy.numerics.optimizers.adam import Adam
from kvstore_lazy.numerics.optimizers.adaptive import AdaGrad, Ftrl, RMSProp
from kvstore_lazy.numerics.optimizers.base import Optimizer
from kvstore_lazy.numerics.optimizers.rules import UnsafePickleError, UnsupportedOptimizerError, UnusableOptimizerError
from kvstore_lazy.numerics.optimizers.schedulers import (CosineScheduler, FactorScheduler, MultiFactorScheduler,
                                                         PolyScheduler)
from kvstore_lazy.numerics.optimizers.sgd import NAG, SGD, Signum, Test


_OPTIMIZER_MODULE = 'mxnet.optimizer.optimizer'
_SCHEDULER_MODULE = 'mxnet.lr_scheduler'
_CLASSES: dict[tuple[str, str], type] = {(_OPTIMIZER_MODULE, c.__name__): c
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
