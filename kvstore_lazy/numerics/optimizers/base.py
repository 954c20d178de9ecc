"""The shared base of every optimizer: the state mxnet pickles, its checks, the update counts and the interface the
server calls.

Owns: :class:`Optimizer` (``__setstate__`` from the pickle, ``validate``, ``restore_count``, ``update`` /
``update_rows`` / ``update_uncounted``, the update counts, mxnet's lr/wd multiplier lookup) and ``_Scratch``, the
reusable buffers of the in-place update paths.
Does not own: any update rule (``sgd.py``, ``adam.py``, ``adaptive.py``: each subclass's ``_step``), which classes a
pickle may name (``loader.py``), the lr schedulers (``schedulers.py``).

Instances are only created by unpickling; their state is mxnet's ``__dict__``, never passed through ``__init__``
here, so ``validate`` checks every field an update computes with (issue 11). ``update`` works element by element:
the server calls it on a whole dense array, or on the gathered rows of a row_sparse key, which gives MXNet's
lazy_update semantics.
"""
from __future__ import annotations

import copy
import math

import numpy as np

from kvstore_lazy.numerics.optimizers.floats import _NO_CLIP, _f32, _op_f32
from kvstore_lazy.numerics.optimizers.rules import (Rule, UnsafePickleError, UnusableOptimizerError, _check,
                                                    _check_mapping, _count, _finite, _optional, _show)
from kvstore_lazy.numerics.optimizers.schedulers import LRScheduler


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


# the fields of every optimizer and their rules (each subclass adds its own _rules)
_BASE_RULES: dict[str, Rule] = {
    'rescale_grad': _finite, 'wd': _finite, 'clip_gradient': _optional(_finite),
    'begin_num_update': _count, 'num_update': _count,
}


class Optimizer:
    """The base class. Subclasses implement num_states() and _step()."""
    name = 'optimizer'
    _required: tuple[str, ...] = ('rescale_grad', 'lr_scheduler', 'lr', 'wd', 'lr_mult', 'wd_mult', 'idx2name',
                                  'begin_num_update', 'num_update', '_all_index_update_counts', 'clip_gradient')
    _extra: tuple[str, ...] = ()   # the attributes each subclass's __init__ sets
    # the _required fields as mxnet's Optimizer.__init__ leaves them (validate checks each)
    rescale_grad: float
    lr_scheduler: LRScheduler | None
    lr: float                       # None when lr_scheduler gives it
    wd: float
    lr_mult: dict[int | str, float]
    wd_mult: dict[int | str, float]
    idx2name: dict[int, str]
    begin_num_update: int
    num_update: int
    _all_index_update_counts: dict[int, dict[int | str, int]]
    clip_gradient: float | None

    _rules: dict[str, Rule] = {}   # each subclass's own fields (validate)

    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError('optimizer state is not a dict')
        missing = [k for k in self._required + self._extra if k not in state]
        if missing:
            raise UnsafePickleError(f'{type(self).__name__} state lacks {missing}')
        self.__dict__.update(state)
        self.param_dict: dict = {}
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
            every_count = [c for per_device in self._all_index_update_counts.values() for c in per_device.values()]
            copy.deepcopy(scheduler)(max([self.num_update, self.begin_num_update] + every_count) + 1)

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
        had, count, num = key in counts, counts.get(key, 0), self.num_update   # count: only restored if had
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
