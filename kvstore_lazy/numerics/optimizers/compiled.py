"""The bridge to the compiled update kernels: hands their addresses over once, and the one-call entries.

Owns: the one ``native.set_update_kernels`` call (importing this package is what gives ``_fast.c`` the addresses
of store/kernels.c's ``sgd_rows``, ``sgd_mom_rows``, ``adam_rows`` and ``merge_rows_f32``; server/keys.py's round
merges rely on it too), the one-call entries ``_sgd``, ``_sgd_mom``, ``_adam``, and ``_as_one_row``, which views a
dense array as the one-row table the row kernels take.
Does not own: the kernels (store/kernels.c, store/kernels.py, protocol/fast), when an update may take them (SGD and
Adam decide: float32 C-contiguous arrays only; everything else keeps the numpy expressions).
"""
from __future__ import annotations

import numpy as np

from kvstore_lazy.protocol.fast import native
import kvstore_lazy.store.kernels as kernels

# updates (and keys.py's round merges) in one compiled call: _fast.c calls store/kernels.c's own kernels, without
# ctypes' per-call set-up
native.set_update_kernels(*(kernels.address(name) for name in ('sgd_rows', 'sgd_mom_rows', 'adam_rows',
                                                                 'merge_rows_f32')))
_sgd, _sgd_mom, _adam = native.sgd, native.sgd_mom, native.adam

_ROW0 = np.zeros(1, np.int64)

OneRow = tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]   # (weight, states, slots, grad)


def _as_one_row(weight: np.ndarray, grad: np.ndarray, states: list[np.ndarray]) -> OneRow | None:
    """``(weight, states, slots, grad)`` as one-row 2-D views for the compiled kernels (``slots`` = row 0), or None
    when the kernels can't take them (e.g. float16: the numpy path keeps its dtype promotion). Only C-contiguous
    arrays are reshaped: a reshaped copy would be updated instead of the array."""
    arrays = [weight, grad, *states]
    if not all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.shape == weight.shape for a in arrays):
        return None
    w, g, *s = [a.reshape(1, -1) for a in arrays]
    return (w, s, _ROW0, g) if kernels.accepts(w, s, _ROW0, g) else None
