"""Compiled inner loops for the row store and the SGD/Adam updates: ``kernels.c``, built with the C compiler and
called through ctypes.

Each kernel replaces a chain of whole-array numpy passes (and the temporaries between them) with one loop over the
rows a request touches: hash probing for :class:`~kvstore_lazy.store.rows.RowIndex`, the sorted merge of two
workers' row_sparse gradients, and the optimizer updates that read and write table rows in place. Float arithmetic
follows the numpy reference in :mod:`kvstore_lazy.optimizers` operation by operation, and the library is built so
that the compiler can't fuse or reorder it: results are bit-identical (the tests pin both paths against MXNet).

Building. ``make venv`` (and the Docker image) runs ``python -m kvstore_lazy.store.kernels``, which compiles
``kernels.c`` into ``_kernels-<hash of source and flags>.so`` beside it; a changed source gets a new name, so a
stale library is never loaded. If that file is missing the first import builds it (next to the source if that
directory is writable, else under ``$XDG_CACHE_HOME/kvstore_lazy``), with ``$CC`` or ``cc``. Concurrent builders
each write a temporary file and rename it into place. A C library loaded with ctypes costs the server no memory to
speak of (a JIT such as numba would add over 100 MB to every server's RSS).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("kernels.c")
CFLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "index_lookup_i32": [_ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint, _ptr],
    "index_lookup_i64": [_ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint, _ptr],
    "index_place_i32": [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_uint],
    "index_place_i64": [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_uint],
    "index_remove_i32": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint],
    "index_remove_i64": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint],
    "merge_rows_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr],
    "sgd_rows": [_ptr, _ptr, _i64, _ptr, _i64, _f32, _f32, _f32, _f32],
    "sgd_mom_rows": [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _f32, _f32, _f32, _f32, _f32],
    "adam_rows": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _f32, _f32, _f32, _f32, _f32, _f32, _f32, ctypes.c_int],
}
_RESTYPES = {"merge_rows_f32": _i64}


class KernelBuildError(ImportError):
    """The C kernels could not be built (no C compiler?)."""


def library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return f"_kernels-{digest}.so"


def _candidates() -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore_lazy"
    return [SOURCE.parent / library_name(), cache / library_name()]


def build() -> Path:
    """The compiled library: an existing one, else built now (next to the source if writable, else in the cache)."""
    for path in _candidates():
        if path.exists():
            return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelBuildError(f"kvstore_lazy needs a C compiler (cc or gcc, or $CC) once, to build {SOURCE}")
    errors = []
    for path in _candidates():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{path.parent}: {exc}")
            continue
        try:
            try:
                proc = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                                      text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelBuildError(f"could not run the C compiler {compiler!r} to build {SOURCE}: {exc}") from None
            if proc.returncode:
                raise KernelBuildError(f"building {SOURCE} failed ({compiler}):\n{proc.stderr.strip()}")
            os.chmod(tmp, 0o755)    # mkstemp made it 0600: other users of this install must be able to load it
            os.replace(tmp, path)   # atomic: a concurrent builder's identical file may win, either is fine
            if path.parent == SOURCE.parent:   # builds of earlier sources beside this one (not in the shared cache,
                for stale in path.parent.glob("_kernels-*.so"):   # which other installs use; unlinking is safe
                    if stale.name != path.name:                   # even if a running process has one loaded)
                        stale.unlink(missing_ok=True)
            return path
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise KernelBuildError(f"no writable place for the compiled kernels: {'; '.join(errors)}")


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
    return lib


_lib = _load()


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def accepts(weight: np.ndarray, tables: list, slots, grad: np.ndarray) -> bool:
    """Whether the update kernels take these arrays (they index raw memory): writable float32 C-contiguous 2-D tables
    of one shape, contiguous int64 slots, a float32 C-contiguous (len(slots), cols) gradient."""
    return (all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2 and a.flags.c_contiguous
                and a.flags.writeable and a.shape == weight.shape for a in (weight, *tables))
            and isinstance(slots, np.ndarray) and slots.dtype == np.int64 and slots.ndim == 1
            and slots.flags.c_contiguous
            and isinstance(grad, np.ndarray) and grad.dtype == np.float32 and grad.flags.c_contiguous
            and grad.shape == (len(slots), weight.shape[1]))


def _checked(weight: np.ndarray, tables: list, slots, grad: np.ndarray) -> np.ndarray:
    """The slots as contiguous int64, after checking what :func:`accepts` checks and that every slot is a row."""
    slots = np.ascontiguousarray(slots, np.int64)
    if not accepts(weight, tables, slots, grad):
        raise ValueError(f"the update kernels take writable float32 C-contiguous tables of one shape and a float32 "
                         f"C-contiguous gradient of shape {(len(slots), weight.shape[1])}")
    if len(slots) and (slots.min() < 0 or slots.max() >= len(weight)):
        raise IndexError(f"slot out of range [0, {len(weight)})")
    return slots


# ---------------------------------------------------------------------------------------------------------------
# hash index (callers: RowIndex, which keeps table/keys/ids in the types below)

def index_lookup(table: np.ndarray, keys: np.ndarray, ids: np.ndarray, shift: int, out: np.ndarray) -> None:
    """``out[i]`` = slot of ``ids[i]`` (uint64) in ``table`` (int32/int64, power-of-two long, -1 empty), or -1;
    ``keys[slot]`` (uint64) is the id of a slot; ``out`` int64."""
    ids = np.ascontiguousarray(ids, np.uint64)
    fn = _lib.index_lookup_i32 if table.dtype == np.int32 else _lib.index_lookup_i64
    fn(_addr(table), len(table) - 1, _addr(keys), _addr(ids), len(ids), int(shift), _addr(out))


def index_place(table: np.ndarray, ids: np.ndarray, first_slot: int, shift: int) -> None:
    """Put slots ``first_slot + i`` for ``ids[i]`` (absent, unique) into the first empty bucket of each probe run."""
    ids = np.ascontiguousarray(ids, np.uint64)
    fn = _lib.index_place_i32 if table.dtype == np.int32 else _lib.index_place_i64
    fn(_addr(table), len(table) - 1, _addr(ids), len(ids), int(first_slot), int(shift))


def index_remove(table: np.ndarray, keys: np.ndarray, slots: np.ndarray, holes: np.ndarray, movers: np.ndarray,
                 shift: int) -> None:
    """Empty the buckets of ``slots`` (present, unique; int64), then move the rows at ``movers`` to ``holes`` (pairs,
    int64): their buckets and ``keys`` entries follow. The caller (RowIndex.remove) checks every slot is in use."""
    slots, holes, movers = (np.ascontiguousarray(a, np.int64) for a in (slots, holes, movers))
    if len(holes) != len(movers):
        raise ValueError(f"{len(holes)} holes for {len(movers)} moving rows")
    fn = _lib.index_remove_i32 if table.dtype == np.int32 else _lib.index_remove_i64
    fn(_addr(table), len(table) - 1, _addr(keys), _addr(slots), len(slots), _addr(holes), _addr(movers),
       len(movers), int(shift))


# ---------------------------------------------------------------------------------------------------------------
# row_sparse merge (caller: the server's dist_sync rounds)

def merge_rows(ids_a: np.ndarray, vals_a: np.ndarray, ids_b: np.ndarray,
               vals_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of two sorted unique int64 id lists with their rows; rows in both are summed as ``a + b``."""
    ids_a, ids_b = np.ascontiguousarray(ids_a, np.int64), np.ascontiguousarray(ids_b, np.int64)
    cols = vals_a.shape[1]
    if vals_a.dtype != np.float32 or vals_b.dtype != np.float32 or vals_b.shape[1] != cols:
        return _merge_rows_numpy(ids_a, vals_a, ids_b, vals_b)
    vals_a, vals_b = np.ascontiguousarray(vals_a), np.ascontiguousarray(vals_b)
    room = len(ids_a) + len(ids_b)
    ids, vals = np.empty(room, np.int64), np.empty((room, cols), np.float32)
    n = _lib.merge_rows_f32(_addr(ids_a), _addr(vals_a), len(ids_a), _addr(ids_b), _addr(vals_b), len(ids_b), cols,
                            _addr(ids), _addr(vals))
    return ids[:n], vals[:n]


def _merge_rows_numpy(ids_a, vals_a, ids_b, vals_b):
    ids = np.union1d(ids_a, ids_b)
    out = np.zeros((len(ids), vals_b.shape[1]), np.result_type(vals_a, vals_b))
    out[np.searchsorted(ids, ids_a)] = vals_a
    out[np.searchsorted(ids, ids_b)] += vals_b
    return ids, out


# ---------------------------------------------------------------------------------------------------------------
# optimizer updates on table rows in place (callers: optimizers.SGD / Adam, which check float32 C-contiguous tables
# and a (len(slots), cols) float32 gradient; scalars are the float32 kernel arguments)

def sgd_rows(weight, slots, grad, lr, wd, rescale, clip) -> None:
    """SGD without momentum (sgd_update, SGDDnsRspKernel) on rows ``slots`` of ``weight``; grad row i -> slots[i]."""
    slots = _checked(weight, [], slots, grad)
    _lib.sgd_rows(_addr(weight), _addr(slots), len(slots), _addr(grad), weight.shape[1], lr, wd, rescale, clip)


def sgd_mom_rows(weight, mom, slots, grad, lr, wd, rescale, clip, momentum, has_mom) -> None:
    """SGD with momentum (SGDMomKernel / MultiSGD[Mom]Kernel); without ``has_mom`` the previous momentum is 0 and
    ``mom`` is not used (multi_sgd_update)."""
    slots = _checked(weight, [mom] if has_mom else [], slots, grad)
    _lib.sgd_mom_rows(_addr(weight), _addr(mom) if has_mom else None, _addr(slots), len(slots), _addr(grad),
                      weight.shape[1], lr, wd, rescale, clip, momentum)


def adam_rows(weight, mean, var, slots, grad, lr, wd, beta1, beta2, eps, rescale, clip, square_first) -> None:
    """Adam (AdamUpdateKernel / AdamDnsRspDnsKernel); ``square_first``: (1 - b2) (g g), else ((1 - b2) g) g."""
    slots = _checked(weight, [mean, var], slots, grad)
    _lib.adam_rows(_addr(weight), _addr(mean), _addr(var), _addr(slots), len(slots), _addr(grad), weight.shape[1],
                   lr, wd, beta1, beta2, eps, rescale, clip, int(bool(square_first)))


if __name__ == "__main__":
    print(f"kvstore_lazy kernels: {build()}")
