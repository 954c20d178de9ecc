"""Compiled inner loops for the row store, the disk tier and the SGD/Adam updates: ``kernels.c`` and the units it
lists (``kernels_index.c``, ``kernels_rows.c``, ``kernels_optim.c``, ``kernels_normal.c``, ``kernels_io.c``,
``kernels_records.c``, ``kernels_catchup.c``, ``kernels_runs.c``, ``kernels.h``), compiled at install time into one
library called through ctypes.

Each kernel replaces a chain of whole-array numpy passes (and the temporaries between them) with one loop over the
rows a request touches: hash probing for :class:`~kvstore_lazy.store.rows.RowIndex`, the sorted merge of a
dist_sync round's row_sparse gradients, and the optimizer updates that read and write table rows in place. Float
arithmetic follows the numpy reference in :mod:`kvstore_lazy.numerics.optimizers` operation by operation, and the
library is built so that the compiler can't fuse or reorder it: results are bit-identical (the tests pin both paths
against MXNet).

Building. ``setup.py`` compiles the units into ``_kernels.so`` beside this file when the package is installed
(``pip install .``, ``pip wheel .``; in place for ``pip install -e .``, which ``make venv`` runs), so the server
runs from a read-only site-packages with no C compiler. Nothing is compiled at import: a missing library, or one
built from other sources (the library returns the SHA-256 of all its sources, :func:`sources_digest`, checked
against the files beside it: a change to any one unit or header refuses an older build), is a
:class:`KernelLoadError` saying how to rebuild. A C library loaded with ctypes costs the server no memory to speak
of (a JIT such as numba would add over 100 MB to every server's RSS).
"""
from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("kernels.c")     # the library's first unit (it lists the others)
# every source of the library, as setup.py names them: the digest the library records is theirs
SOURCES = tuple(SOURCE.with_name(name) for name in (
    "kernels.c", "kernels.h", "kernels_index.c", "kernels_rows.c", "kernels_optim.c", "kernels_normal.c",
    "kernels_io.c", "kernels_records.c", "kernels_catchup.c", "kernels_runs.c"))
LIBRARY = Path(__file__).with_name("_kernels.so")
REBUILD = "`pip install .` builds it (in a source checkout: `make venv`, or `pip install -e .`)"

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "index_lookup_i32": [_ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint, _ptr],
    "index_lookup_i64": [_ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint, _ptr],
    "index_place_i32": [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_uint],
    "index_place_i64": [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_uint],
    "index_remove_i32": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint],
    "index_remove_i64": [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_uint],
    "merge_rows_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr],
    "merge_round_f32": [_i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr],
    "merge_round_hashed_f32": [_i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64],
    "sgd_rows": [_ptr, _ptr, _i64, _ptr, _i64, _f32, _f32, _f32, _f32],
    "sgd_mom_rows": [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _f32, _f32, _f32, _f32, _f32],
    "adam_rows": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _f32, _f32, _f32, _f32, _f32, _f32, _f32, ctypes.c_int],
    "box_muller_f64": [_ptr, _i64, ctypes.c_double, _ptr],
    "log_unit_f64": [_ptr, _i64, _ptr],
    "sincos_f64": [_ptr, _i64, _ptr, _ptr],
    "pread_records": [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64],
    "pwrite_records": [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64],
    "uring_available": [],
    "record_checks": [_ptr, _i64, _i64, _ptr, _ptr, _ptr],
    "record_seal": [_ptr, _i64, _i64, _ptr, _ptr, _i64],
    "gather_fields": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64],
    "scatter_fields": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64],
    "move_rows": [_ptr, _i64, _ptr, _ptr, _i64],
    "count_values_i32": [_ptr, _i64, ctypes.c_int32, _i64, _ptr],
    "catchup_rows": [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64],
    "runs_bloom_add": [_ptr, _i64, ctypes.c_uint64, _ptr, _i64],
    "runs_bloom_test": [_ptr, _i64, ctypes.c_uint64, _ptr, _i64, _ptr],
    "runs_probe": [_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, ctypes.c_uint64, _ptr, _i64, _ptr, _ptr,
                   _ptr, _ptr, _ptr, _ptr],
    "runs_search": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr],
    "runs_verify": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr],
    "runs_cache_get": [_ptr, _ptr, ctypes.c_uint, _ptr, _i64, _ptr],
    "runs_read_search": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                         _ptr],
    "runs_cache_put": [_ptr, _ptr, ctypes.c_uint, _ptr, _ptr, _i64],
    "runs_merge": [_i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr],
    "live_bits_apply": [_ptr, _ptr, _i64, _ptr, _i64, ctypes.c_uint, ctypes.c_uint32, _i64],
    "live_bits_test": [_ptr, _ptr, _i64, _ptr, _i64, ctypes.c_uint, ctypes.c_uint32, _ptr],
    "kernels_digest": [],
}
_RESTYPES = {"merge_rows_f32": _i64, "catchup_rows": _i64, "merge_round_f32": _i64, "merge_round_hashed_f32": _i64,
             "count_values_i32": _i64, "kernels_digest": ctypes.c_char_p, "pread_records": _i64,
             "pwrite_records": _i64, "uring_available": _i64,
             "runs_probe": _i64, "runs_merge": _i64, "runs_verify": _i64, "runs_cache_get": _i64,
             "runs_read_search": _i64, "live_bits_apply": _i64}


class KernelLoadError(ImportError):
    """The compiled kernels are missing, cannot be loaded, or were built from other sources than those beside
    them."""


def sources_digest(sources: Iterable[Path]) -> str:
    """setup.py's digest of a library's sources: SHA-256 over the files in the order of their names, each as its
    name, a NUL, its length in decimal, a NUL and its bytes."""
    digest = hashlib.sha256()
    for path in sorted(sources, key=lambda p: p.name):
        data = path.read_bytes()
        digest.update(b"%s\0%d\0" % (path.name.encode(), len(data)) + data)
    return digest.hexdigest()


def load(library: Path = LIBRARY, sources: Sequence[Path] = SOURCES) -> ctypes.CDLL:
    """The compiled library with its function signatures set, after checking it was built from ``sources`` (when
    they exist: they are installed beside this module, and are there in a source checkout; one missing of several
    is a mismatch)."""
    if not library.exists():
        raise KernelLoadError(f"kvstore_lazy's compiled kernels {library} are missing: {REBUILD}")
    try:
        lib = ctypes.CDLL(str(library))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
    except (OSError, AttributeError) as exc:
        raise KernelLoadError(f"cannot load kvstore_lazy's compiled kernels {library} ({exc}): {REBUILD}") from None
    present = [path for path in sources if path.exists()]
    if present:
        built, want = lib.kernels_digest().decode(), sources_digest(present)
        if built != want or len(present) < len(sources):
            raise KernelLoadError(f"{library} was built from another kernels.c or another of its units "
                                  f"({', '.join(path.name for path in sources)}: sha256 {built[:12]}..., the "
                                  f"sources beside it are {want[:12]}...): rebuild it; {REBUILD}")
    return lib


_lib = load()
_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)


def address(name: str) -> int:
    """The address of the library's function `name` (the compiled fast path calls the update kernels with it)."""
    return ctypes.cast(getattr(_lib, name), ctypes.c_void_p).value or 0


def _addr(a: np.ndarray) -> int:
    # a ctypes view of a writable buffer costs a third of numpy's ``a.ctypes`` object; read-only or empty arrays
    # take that
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def accepts(weight: np.ndarray, tables: list, slots, grad: np.ndarray) -> bool:
    """Whether the update kernels take these arrays (they index raw memory): writable float32 C-contiguous 2-D tables
    of one shape, contiguous int64 slots, a float32 C-contiguous (len(slots), cols) gradient. (Every round asks:
    each array's flags are read once.)"""
    shape = getattr(weight, "shape", None)
    if shape is None or len(shape) != 2:
        return False
    for a in (weight, *tables):
        if not isinstance(a, np.ndarray) or a.dtype != _F32 or a.shape != shape:
            return False
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable):
            return False
    return (isinstance(slots, np.ndarray) and slots.dtype == _I64 and slots.ndim == 1 and slots.flags.c_contiguous
            and isinstance(grad, np.ndarray) and grad.dtype == _F32 and grad.flags.c_contiguous
            and grad.shape == (len(slots), shape[1]))


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


def merge_round(ids: Sequence[np.ndarray], vals: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """A dist_sync round's merged gradient from its pushes (push j: sorted unique int64 ``ids[j]``, float32 rows
    ``vals[j]``), in one pass over all their rows: what :func:`merge_rows` applied push after push gives, bit for bit
    (each row summed over the pushes that have it in push order, ``((p0 + p1) + p2) + ...``; a row push 0 does not
    have starts from ``0 + `` its first push's row). None unless every push's rows are float32 of one width (the
    caller merges push after push). The arrays are only read."""
    got = merge_round_slots(ids, vals, None)
    return None if got is None else got[:2]


def merge_round_slots(ids: Sequence[np.ndarray], vals: Sequence[np.ndarray],
                      slots: Sequence[np.ndarray | None] | None,
                      out: Callable[[int, int], tuple] | None = None,
                      hashed: Callable[[int], tuple] | None = None) -> tuple | None:
    """:func:`merge_round` and the merged rows' slots in the same pass: ``slots[j]`` (int64, one per row of push j,
    or None) the slots push j's rows had in the table when its worker pulled them (-1: absent then); each merged
    row gets the first that knows it (-1 if none does). (ids, vals, slots or None) or None as merge_round.
    ``out(rows, cols)``: the caller's (ids, vals, slots) arrays for up to that many rows to write them into (int64,
    float32 (rows, cols), int64; C-contiguous), instead of new ones. With ``hashed(entries)`` (the caller's int64 and
    int32 arrays of that many entries, a power of two), the merged rows come in the order each first came (push 0's,
    then the new ones of push 1, ...), not sorted by id, each the same bits: for an update that needs no order
    (``merge_round_hashed_f32``: a hash table of the ids instead of a tournament)."""
    if not vals:
        return None
    cols = vals[0].shape[1]
    if any(v.dtype != _F32 or v.ndim != 2 or v.shape[1] != cols for v in vals) or len(ids) != len(vals):
        return None
    ids = [np.ascontiguousarray(i, np.int64) for i in ids]
    vals = [np.ascontiguousarray(v) for v in vals]
    counts = np.array([len(i) for i in ids], np.int64)
    if any(len(v) != c for v, c in zip(vals, counts)):
        raise ValueError(f"pushes of {counts.tolist()} ids with {[len(v) for v in vals]} rows")
    k, room = len(ids), int(counts.sum())
    id_ptrs = (ctypes.c_void_p * k)(*(_addr(i) for i in ids))     # (the kernel's cursors: it moves them)
    val_ptrs = (ctypes.c_void_p * k)(*(_addr(v) for v in vals))
    if out is None:
        out_ids, out_vals, out_slots = np.empty(room, np.int64), np.empty((room, cols), np.float32), None
    else:
        out_ids, out_vals, out_slots = out(room, cols)
        if out_ids.shape != (room,) or out_vals.shape != (room, cols) or out_slots.shape != (room,):
            raise ValueError("merge_round: out gave arrays of other shapes")
    scratch = np.empty(12 * k, np.int64)
    slot_ptrs = None
    if slots is not None:
        if len(slots) != k or any(s is not None and (s.dtype != _I64 or s.shape != (c,) or not s.flags.c_contiguous)
                                  for s, c in zip(slots, counts)):
            raise ValueError("merge_round: slots are one contiguous int64 per row of each push, or None")
        slot_ptrs = (ctypes.c_void_p * k)(*(None if s is None else s.ctypes.data for s in slots))
        out_slots = np.empty(room, np.int64) if out_slots is None else out_slots
    else:
        out_slots = None
    if hashed is not None and room < 1 << 30:
        table, where = hashed(max(2, 1 << (2 * room - 1).bit_length()))
        if table.dtype != _I64 or where.dtype != np.int32 or len(where) != len(table) or len(table) < 2 * room:
            raise ValueError("merge_round: hashed gave arrays of other types or sizes")
        n = _lib.merge_round_hashed_f32(k, id_ptrs, val_ptrs, _addr(counts), cols, _addr(out_ids), _addr(out_vals),
                                        slot_ptrs, None if out_slots is None else _addr(out_slots), _addr(table),
                                        _addr(where), len(table) - 1)
        return out_ids[:n], out_vals[:n], None if out_slots is None else out_slots[:n]
    n = _lib.merge_round_f32(k, id_ptrs, val_ptrs, _addr(counts), cols, _addr(out_ids), _addr(out_vals),
                             _addr(scratch), slot_ptrs, None if out_slots is None else _addr(out_slots))
    return out_ids[:n], out_vals[:n], None if out_slots is None else out_slots[:n]


CATCHUP_RULES = ("sgd", "sgd_mom", "nag", "signum", "signsgd", "rmsprop", "rmsprop_centered", "adam")


def catchup_rows(rule: str, weight: np.ndarray, states: Sequence[np.ndarray], last: np.ndarray, upto: int,
                 starts: np.ndarray, values: np.ndarray, log_last: int) -> int | None:
    """``kernels_catchup.c``: rows ``weight`` (n x d float32, C-contiguous) and their ``states`` (the rule's, same
    layout), last updated at steps ``last``, brought in place to step ``upto`` over a log's runs (``starts``:
    int64 first step of each run, ascending; ``values``: float32 runs x width; the last run ends at ``log_last``;
    the caller checked it holds every step). The row-steps applied, or None (nothing changed) when the arrays or
    the rule are not the kernel's (the caller replays with numpy)."""
    if rule not in CATCHUP_RULES or len(states) > 3 or weight.ndim != 2 or not _f32_rows(weight, *states) \
            or any(s.shape != weight.shape for s in states):
        return None
    last = np.ascontiguousarray(last, np.int64)
    starts = np.ascontiguousarray(starts, np.int64)
    values = np.ascontiguousarray(values, np.float32)
    if len(last) != len(weight) or values.ndim != 2 or len(values) != len(starts):
        return None
    ptrs = [_addr(s) for s in states] + [None] * (3 - len(states))
    done = _lib.catchup_rows(CATCHUP_RULES.index(rule), len(weight), weight.shape[1], _addr(weight), *ptrs,
                             _addr(last), upto, len(starts), _addr(starts), _addr(values), values.shape[1],
                             log_last)
    return None if done < 0 else int(done)


def _f32_rows(*arrays: np.ndarray) -> bool:
    return all(a.dtype == _F32 and a.flags.c_contiguous and a.flags.writeable for a in arrays)


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


# ---------------------------------------------------------------------------------------------------------------
# Box-Muller with log/cos/sin of IEEE basic operations only (caller: initializers.NormalRows): the same bits on
# every machine and numpy version

def box_muller(u: np.ndarray, two_pi: float) -> np.ndarray:
    """For float64 uniforms ``u`` in [0, 1) taken in pairs along the (even) last axis: ``rad * cos(theta)``,
    ``rad * sin(theta)`` with ``rad = sqrt(-2 ln(1 - u[2i]))``, ``theta = u[2i + 1] * two_pi``."""
    u = np.ascontiguousarray(u, np.float64)
    if u.ndim == 0 or u.shape[-1] % 2 or not ((u >= 0) & (u < 1)).all():
        raise ValueError("box_muller takes uniforms in [0, 1) in pairs along the last axis")
    out = np.empty_like(u)
    _lib.box_muller_f64(_addr(u), u.size // 2, float(two_pi), _addr(out))
    return out


def log_unit(x: np.ndarray) -> np.ndarray:
    """The natural log box_muller uses, for float64 ``x`` in [2**-1022, 1]."""
    x = np.ascontiguousarray(x, np.float64)
    if not ((x >= 2.0 ** -1022) & (x <= 1)).all():
        raise ValueError("log_unit takes normal float64 values in (0, 1]")
    out = np.empty_like(x)
    _lib.log_unit_f64(_addr(x), x.size, _addr(out))
    return out


def sincos(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sine and cosine box_muller uses, for float64 ``theta`` in [0, 2 pi]."""
    theta = np.ascontiguousarray(theta, np.float64)
    if not ((theta >= 0) & (theta <= 6.283185307179586)).all():
        raise ValueError("sincos takes float64 values in [0, 2 pi]")
    sin, cos = np.empty_like(theta), np.empty_like(theta)
    _lib.sincos_f64(_addr(theta), theta.size, _addr(sin), _addr(cos))
    return sin, cos


# ---------------------------------------------------------------------------------------------------------------
# batched record reads (caller: segments.SegmentStore)

def pread_records(fds: np.ndarray, offsets: np.ndarray, size: int, out: np.ndarray,
                  ring: bool = True) -> tuple[int, int]:
    """Read ``size`` bytes at ``offsets[i]`` (int64) of file descriptor ``fds[i]`` (int32) into row i of ``out`` (a
    C-contiguous array of ``len(fds) * size`` bytes); records adjacent in one file are one read. With ``ring`` (and
    io_uring available: else it falls back by itself) the reads go through an io_uring, a ring of them a system
    call; else one ``pread`` each. Returns ``(0, -1)``, or ``(errno, row)`` of the first failed read (errno -1: the
    file ended early). Releases the GIL while it reads."""
    return _pio("pread_records", fds, offsets, size, out, ring)


def pwrite_records(fds: np.ndarray, offsets: np.ndarray, size: int, data: np.ndarray,
                   ring: bool = True) -> tuple[int, int]:
    """:func:`pread_records` the other way: row i of ``data`` written at ``offsets[i]`` of ``fds[i]`` (opened for
    writing); ``(0, -1)`` or ``(errno, row)`` of the first failed write."""
    return _pio("pwrite_records", fds, offsets, size, data, ring)


def _pio(name: str, fds, offsets, size: int, buf: np.ndarray, ring: bool) -> tuple[int, int]:
    fds, offsets = np.ascontiguousarray(fds, np.int32), np.ascontiguousarray(offsets, np.int64)
    if len(fds) != len(offsets) or not buf.flags.c_contiguous or buf.nbytes != len(fds) * size:
        raise ValueError(f"{name}: {len(fds)} fds, {len(offsets)} offsets, {buf.nbytes} bytes of records of "
                         f"{size} bytes")
    failed = np.full(1, -1, np.int64)
    err = getattr(_lib, name)(_addr(fds), _addr(offsets), len(fds), int(size), _addr(buf), _addr(failed), int(ring))
    return int(err), int(failed[0])


def uring_available() -> bool:
    """Whether pread_records can read through an io_uring here (else it reads with pread)."""
    return bool(_lib.uring_available())


def record_checks(words: np.ndarray, mult: np.ndarray, locs: np.ndarray) -> np.ndarray:
    """uint32 check of each row of ``words`` ((n, nwords) uint32, C-contiguous): see kernels_records.c."""
    words = np.ascontiguousarray(words, np.uint32)
    mult, locs = np.ascontiguousarray(mult, np.uint64), np.ascontiguousarray(locs, np.uint32)
    if words.ndim != 2 or mult.shape != (words.shape[1],) or locs.shape != (words.shape[0],):
        raise ValueError(f"record_checks: words {words.shape}, mult {mult.shape}, locs {locs.shape}")
    out = np.empty(len(words), np.uint32)
    _lib.record_checks(_addr(words), words.shape[0], words.shape[1], _addr(mult), _addr(locs), _addr(out))
    return out


def record_seal(words: np.ndarray, mult: np.ndarray, locs: np.ndarray, at: int) -> None:
    """Write :func:`record_checks` of each row of ``words`` ((n, nwords) uint32, C-contiguous, writable) into its
    word ``at`` (which the check itself skips: ``mult[at]`` is 0)."""
    mult, locs = np.ascontiguousarray(mult, np.uint64), np.ascontiguousarray(locs, np.uint32)
    if (words.dtype != np.uint32 or words.ndim != 2 or not words.flags.c_contiguous or not words.flags.writeable
            or mult.shape != (words.shape[1],) or locs.shape != (words.shape[0],) or not 0 <= at < words.shape[1]
            or mult[at] != 0):
        raise ValueError(f"record_seal: words {words.dtype} {words.shape}, mult {mult.shape}, locs {locs.shape}, "
                         f"check word {at}")
    _lib.record_seal(_addr(words), words.shape[0], words.shape[1], _addr(mult), _addr(locs), int(at))


def _field_plan(records: np.ndarray, slots, fields: list, write_arrays: bool) -> tuple:
    """Checked arguments of gather_fields/scatter_fields: ``fields`` is ``[(array, offset)]``, each array a
    C-contiguous array whose first axis is slots (its rows ``array[s]`` of ``strides[0]`` bytes), ``offset`` where
    that row sits in a record."""
    slots = np.ascontiguousarray(slots, np.int64)
    if records.ndim != 1 or not records.flags.c_contiguous or len(records) != len(slots) \
            or (not write_arrays and not records.flags.writeable):
        raise ValueError(f"records of shape {records.shape} for {len(slots)} slots (want a C-contiguous, "
                         f"{'readable' if write_arrays else 'writable'} 1-D array)")
    stride = records.dtype.itemsize
    addrs, sizes, offs = (np.empty(len(fields), t) for t in (np.uint64, np.int64, np.int64))
    low = int(slots.min()) if len(slots) else 0
    high = int(slots.max()) if len(slots) else -1
    for f, (array, offset) in enumerate(fields):
        size = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        if not array.flags.c_contiguous or (write_arrays and not array.flags.writeable) or array.ndim < 1:
            raise ValueError(f"field {f}: the array must be C-contiguous{' and writable' if write_arrays else ''}")
        if not 0 <= offset <= stride - size:
            raise ValueError(f"field {f}: {size} bytes at offset {offset} do not fit a record of {stride}")
        if low < 0 or high >= len(array):
            raise IndexError(f"field {f}: slot out of range [0, {len(array)})")
        addrs[f], sizes[f], offs[f] = _addr(array), size, offset
    return slots, addrs, sizes, offs, stride


def gather_fields(records: np.ndarray, slots, fields: list) -> None:
    """``records[i]`` = the rows ``array[slots[i]]`` of each ``(array, offset)`` of ``fields`` at their offsets in
    it, every other byte of it zero: a record packed from row arrays in one pass (no structured field copies)."""
    slots, addrs, sizes, offs, stride = _field_plan(records, slots, fields, False)
    _lib.gather_fields(_addr(slots), len(slots), len(fields), _addr(addrs), _addr(sizes), _addr(offs),
                       _addr(records), stride)


def scatter_fields(records: np.ndarray, slots, fields: list) -> None:
    """The reverse of :func:`gather_fields`: ``array[slots[i]]`` = the bytes of ``records[i]`` at its offset, for each
    ``(array, offset)`` of ``fields``."""
    slots, addrs, sizes, offs, stride = _field_plan(records, slots, fields, True)
    _lib.scatter_fields(_addr(slots), len(slots), len(fields), _addr(addrs), _addr(sizes), _addr(offs),
                        _addr(records), stride)


def count_values(values: np.ndarray, low: int, high: int) -> np.ndarray:
    """How many of the int32 ``values`` (all within [low, high]) equal each of low .. high (int64 counts)."""
    values = np.ascontiguousarray(values, np.int32)
    span = high - low + 1
    counts = np.zeros((4, span), np.int64)
    if len(values) and _lib.count_values_i32(_addr(values), len(values), int(low), span, _addr(counts)):
        raise ValueError(f"count_values: values outside [{low}, {high}]")
    return counts.sum(axis=0)


def move_rows(array: np.ndarray, dst, src) -> None:
    """``array[dst[i]] = array[src[i]]`` for whole rows (first axis) of a C-contiguous array, no slot both a source
    and a destination (a table's removal moving its last rows into the holes)."""
    dst, src = np.ascontiguousarray(dst, np.int64), np.ascontiguousarray(src, np.int64)
    if len(dst) != len(src) or not array.flags.c_contiguous or not array.flags.writeable or array.ndim < 1:
        raise ValueError(f"move_rows: {len(dst)} destinations for {len(src)} sources in a writable C-contiguous array")
    if len(dst) and (min(dst.min(), src.min()) < 0 or max(dst.max(), src.max()) >= len(array)):
        raise IndexError(f"move_rows: slot out of range [0, {len(array)})")
    if len(dst):
        _lib.move_rows(_addr(array), array.strides[0] if array.ndim else array.itemsize, _addr(dst), _addr(src),
                       len(dst))


if __name__ == "__main__":
    print(f"kvstore_lazy kernels: {LIBRARY} (built from kernels.c and its units, sha256 "
          f"{_lib.kernels_digest().decode()[:12]}...)")
