"""Compiled inner loops (numba) for the row store and the row_sparse update path.

Each kernel replaces a chain of whole-array numpy passes (and the temporaries between them) with one loop over the
rows a request touches: hash probing for :class:`~kvstore_lazy.store.rows.RowIndex`, the sorted merge of two
workers' row_sparse gradients, and the optimizer updates that read and write table rows in place.

Float arithmetic: every scalar comes in as ``float32`` and every operation is written in the order of the numpy
reference in :mod:`kvstore_lazy.optimizers` (itself the order of MXNet's kernels), without ``fastmath``, so LLVM
neither reassociates nor fuses multiply-adds: results are bit-identical to the numpy path (tests pin this).

Compiled on first use and cached on disk next to this file (``__pycache__``), or under ``NUMBA_CACHE_DIR``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_FOLD = np.uint64(31)
_MULT = np.uint64(0xBF58476D1CE4E5B9)


@njit(cache=True, nogil=True)
def index_lookup(table, keys, ids, shift, out):
    """``out[i]`` = slot of ``ids[i]`` in the linear-probing ``table`` (slots, -1 empty; ``keys[slot]`` its id)."""
    mask = len(table) - 1
    for i in range(len(ids)):
        x = ids[i]
        pos = np.intp(((x >> _FOLD) ^ x) * _MULT >> shift)
        while True:
            slot = table[pos]
            if slot < 0:
                out[i] = -1
                break
            if keys[slot] == x:
                out[i] = slot
                break
            pos = (pos + 1) & mask


@njit(cache=True, nogil=True)
def index_place(table, ids, first_slot, shift):
    """Put slots ``first_slot + i`` for ``ids[i]`` (absent, unique) into the first empty bucket of each probe run."""
    mask = len(table) - 1
    for i in range(len(ids)):
        x = ids[i]
        pos = np.intp(((x >> _FOLD) ^ x) * _MULT >> shift)
        while table[pos] >= 0:
            pos = (pos + 1) & mask
        table[pos] = first_slot + i


@njit(cache=True, nogil=True)
def merge_rows(ids_a, vals_a, ids_b, vals_b):
    """Union of two sorted unique id lists; rows in both are summed as ``a + b``."""
    n = 0
    i = j = 0
    while i < len(ids_a) or j < len(ids_b):
        if j == len(ids_b) or (i < len(ids_a) and ids_a[i] < ids_b[j]):
            i += 1
        elif i == len(ids_a) or ids_b[j] < ids_a[i]:
            j += 1
        else:
            i += 1
            j += 1
        n += 1
    ids = np.empty(n, ids_a.dtype)
    vals = np.empty((n, vals_a.shape[1]), vals_a.dtype)
    i = j = k = 0
    while k < n:
        if j == len(ids_b) or (i < len(ids_a) and ids_a[i] < ids_b[j]):
            ids[k] = ids_a[i]
            vals[k] = vals_a[i]
            i += 1
        elif i == len(ids_a) or ids_b[j] < ids_a[i]:
            ids[k] = ids_b[j]
            vals[k] = vals_b[j]
            j += 1
        else:
            ids[k] = ids_a[i]
            for c in range(vals.shape[1]):
                vals[k, c] = vals_a[i, c] + vals_b[j, c]
            i += 1
            j += 1
        k += 1
    return ids, vals


@njit(cache=True, nogil=True)
def _step_term(g, lr, rescale, clip, lr_rescale):
    """``lr * clip(rescale * g)``, or ``(lr * rescale) * g`` without clipping (clip < 0)."""
    if clip >= 0:
        v = rescale * g
        if v > clip:
            v = clip
        elif v < -clip:
            v = -clip
        return lr * v
    return lr_rescale * g


@njit(cache=True, nogil=True)
def sgd_rows(weight, slots, grad, lr, wd, rescale, clip):
    """SGD without momentum on rows ``slots`` of ``weight`` (sgd_update, SGDDnsRspKernel): w = (1 - lr wd) w - step."""
    decay = np.float32(1) - lr * wd
    lr_rescale = lr * rescale
    for i in range(len(slots)):
        s = slots[i]
        for c in range(weight.shape[1]):
            weight[s, c] = decay * weight[s, c] - _step_term(grad[i, c], lr, rescale, clip, lr_rescale)


@njit(cache=True, nogil=True)
def sgd_mom_rows(weight, mom, slots, grad, lr, wd, rescale, clip, momentum, has_mom):
    """SGD with momentum (SGDMomKernel / MultiSGD[Mom]Kernel): mom = m mom - lr wd w - step; w = w + mom.

    Without ``has_mom`` (multi_sgd_update, dense SGD without momentum) the previous momentum is 0 and ``mom`` is
    neither read nor written (pass any array of the right type, e.g. ``weight``).
    """
    lr_wd = lr * wd
    lr_rescale = lr * rescale
    for i in range(len(slots)):
        s = slots[i]
        for c in range(weight.shape[1]):
            m = momentum * mom[s, c] if has_mom else np.float32(0)
            m = m - lr_wd * weight[s, c]
            m = m - _step_term(grad[i, c], lr, rescale, clip, lr_rescale)
            if has_mom:
                mom[s, c] = m
            weight[s, c] = weight[s, c] + m


@njit(cache=True, nogil=True)
def adam_rows(weight, mean, var, slots, grad, lr, wd, beta1, beta2, eps, rescale, clip, square_first):
    """Adam (AdamUpdateKernel / AdamDnsRspDnsKernel); ``square_first``: (1 - b2) (g g), else ((1 - b2) g) g."""
    one_m_beta1 = np.float32(1) - beta1
    one_m_beta2 = np.float32(1) - beta2
    for i in range(len(slots)):
        s = slots[i]
        for c in range(weight.shape[1]):
            w = weight[s, c]
            g = grad[i, c] * rescale + w * wd
            if clip >= 0:
                if g > clip:
                    g = clip
                elif g < -clip:
                    g = -clip
            m = beta1 * mean[s, c] + one_m_beta1 * g
            if square_first:
                v = beta2 * var[s, c] + one_m_beta2 * (g * g)
            else:
                v = beta2 * var[s, c] + (one_m_beta2 * g) * g
            mean[s, c] = m
            var[s, c] = v
            weight[s, c] = w - (lr * m) / (np.sqrt(v) + eps)


def warm_up() -> None:
    """Compile (or load from the cache) every kernel for the argument types the server passes: int32 and int64
    hash tables; gradients writable (merged) or read-only (straight from a message)."""
    f32 = np.float32
    ids = np.arange(1, 9, dtype=np.uint64)
    for table_dtype in (np.int32, np.int64):
        table = np.full(32, -1, table_dtype)
        index_place(table, ids, 0, np.uint64(60))
        index_lookup(table, ids.copy(), ids, np.uint64(60), np.empty(len(ids), np.int64))
    rows, slots = np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64)
    tables = [np.zeros((4, 2), f32) for _ in range(3)]
    grad = np.ones((4, 2), f32)
    readonly = np.frombuffer(grad.tobytes(), f32).reshape(4, 2)
    one = f32(1)
    for g in (grad, readonly):
        merge_rows(rows, grad, rows, g)
        sgd_rows(tables[0], slots, g, one, one, one, one)
        sgd_mom_rows(tables[0], tables[1], slots, g, one, one, one, one, one, True)
        adam_rows(tables[0], tables[1], tables[2], slots, g, one, one, one, one, one, one, one, True)


if __name__ == "__main__":
    import time

    start = time.perf_counter()
    warm_up()
    print(f"kvstore_lazy kernels compiled or loaded from the cache in {time.perf_counter() - start:.1f} s")
