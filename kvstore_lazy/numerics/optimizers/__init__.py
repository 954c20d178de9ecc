"""Optimizers for the kvstore server: safe loading and numpy updates, as MXNet 1.9.1 computes them.

This package owns two things:

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

The parts, each with a header saying what it owns:

  loader.py      load_optimizer (the restricted unpickler and its allow-list), validate, check_runs
  rules.py       the three refusal errors, the count limits, the field rules validate() applies
  floats.py      how MXNet turns hyper-parameters into float32 kernel arguments (dmlc ParseFloat)
  compiled.py    hands store/kernels.c's update kernels to the compiled fast path; the one-call entries
  base.py        Optimizer: the pickled state, its checks, update counts, lr/wd lookup, the server's interface
  schedulers.py  FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler
  sgd.py         SGD, NAG, Signum, Test
  adam.py        Adam
  adaptive.py    AdaGrad, RMSProp, Ftrl

Everything other code uses is importable from here; the modules are the package's own layout.
"""
from __future__ import annotations

from kvstore_lazy.numerics.optimizers.adam import Adam, adam_row_steps_update
from kvstore_lazy.numerics.optimizers.adaptive import AdaGrad, Ftrl, RMSProp
from kvstore_lazy.numerics.optimizers.base import Optimizer
# the store's kernels module, as before the split: tests swap kernels.accepts to send SGD / Adam down the numpy paths
from kvstore_lazy.numerics.optimizers.compiled import kernels as kernels
from kvstore_lazy.numerics.optimizers.floats import _dmlc_parse as _dmlc_parse   # the reference _fast.c is tested on
from kvstore_lazy.numerics.optimizers.loader import check_runs, load_optimizer, validate
from kvstore_lazy.numerics.optimizers.rules import (MAX_COUNT as MAX_COUNT, MAX_SCHEDULER_STEPS as MAX_SCHEDULER_STEPS,
                                                    UnsafePickleError, UnsupportedOptimizerError,
                                                    UnusableOptimizerError)
from kvstore_lazy.numerics.optimizers.schedulers import (CosineScheduler, FactorScheduler,
                                                         LRScheduler as LRScheduler, MultiFactorScheduler,
                                                         PolyScheduler)
from kvstore_lazy.numerics.optimizers.sgd import NAG, SGD, Signum, Test

__all__ = ['load_optimizer', 'validate', 'check_runs', 'Optimizer', 'UnsafePickleError', 'UnsupportedOptimizerError',
           'UnusableOptimizerError',
           'SGD', 'NAG', 'Signum', 'Adam', 'adam_row_steps_update', 'AdaGrad', 'Ftrl', 'RMSProp', 'Test',
           'FactorScheduler', 'MultiFactorScheduler', 'PolyScheduler', 'CosineScheduler']
