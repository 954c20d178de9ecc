"""kvstore_lazy/store/kernels: loading the compiled library, and the kernels the other tests don't reach directly.

The optimizer kernels are pinned bit for bit against MXNet in test_optimizers.py (both server paths), the hash index
by test_rows.py's model tests; here: the library setup.py built (from this very kernels.c; missing, broken or stale
libraries refused with a clear error) and the sorted merge against a plain numpy reference, float32 (C) and other
dtypes (numpy fallback).
"""
import _ctypes
import decimal
import hashlib
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore_lazy.store import kernels


def sources_sha256(paths) -> str:
    """setup.py's digest, written out: SHA-256 over the files in name order, each as name NUL length NUL bytes."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


def test_the_library_was_built_from_the_sources_beside_it():
    assert kernels.LIBRARY.parent == kernels.SOURCE.parent and kernels.LIBRARY.name == "_kernels.so"
    assert kernels._lib.kernels_digest().decode() == sources_sha256(kernels.SOURCES)
    assert all(hasattr(kernels._lib, name) for name in kernels._SIGNATURES)
    # every C unit and header beside the loader is one of the library's sources (none left out of the digest)
    beside = {p.name for p in kernels.SOURCE.parent.glob("*.[ch]")}
    assert beside == {p.name for p in kernels.SOURCES} and kernels.SOURCE in kernels.SOURCES


def copy_sources(tmp_path):
    sources = [tmp_path / p.name for p in kernels.SOURCES]
    for original, copy in zip(kernels.SOURCES, sources):
        shutil.copy(original, copy)
    return sources


def test_missing_broken_or_stale_libraries_are_refused_saying_how_to_rebuild(tmp_path):
    library = tmp_path / "_kernels.so"
    shutil.copy(kernels.LIBRARY, library)
    sources = copy_sources(tmp_path)
    source = sources[0]
    assert kernels.load(library, sources).kernels_digest() == kernels._lib.kernels_digest()
    assert kernels.load(library, [tmp_path / "absent.c"])               # no source beside it: nothing to check
    source.write_text(source.read_text() + "\n/* changed */\n")
    with pytest.raises(kernels.KernelLoadError, match=r"built from another kernels\.c .*pip install"):
        kernels.load(library, sources)
    with pytest.raises(kernels.KernelLoadError, match=r"absent\.so are missing: .*pip install"):
        kernels.load(tmp_path / "absent.so", sources)
    (tmp_path / "junk.so").write_bytes(b"not a library")
    with pytest.raises(kernels.KernelLoadError, match=r"cannot load .*junk\.so"):
        kernels.load(tmp_path / "junk.so", sources)
    with pytest.raises(kernels.KernelLoadError, match="cannot load .*index_lookup_i32"):
        kernels.load(Path(_ctypes.__file__), sources)                   # a shared library, but not ours


@pytest.mark.parametrize("name", [p.name for p in kernels.SOURCES])
def test_a_build_older_than_any_one_of_its_sources_is_refused(tmp_path, name):
    library = tmp_path / "_kernels.so"
    shutil.copy(kernels.LIBRARY, library)
    sources = copy_sources(tmp_path)
    assert kernels.load(library, sources)
    changed = tmp_path / name
    changed.write_bytes(changed.read_bytes() + b"\n")
    with pytest.raises(kernels.KernelLoadError, match=r"built from another kernels\.c or another of its units"):
        kernels.load(library, sources)
    changed.unlink()                                                    # one of several missing: not the build
    with pytest.raises(kernels.KernelLoadError, match=r"built from another kernels\.c"):
        kernels.load(library, sources)


def reference_merge(ids_a, vals_a, ids_b, vals_b):
    """A dict of rows: a's rows as they are, b's added to them, or to zero where a has none (so -0.0 becomes +0.0,
    as the numpy merge (zeros, assign a, add b) always did)."""
    rows = {i: row.copy() for i, row in zip(ids_a.tolist(), vals_a)}
    for i, row in zip(ids_b.tolist(), vals_b):
        rows[i] = rows[i] + row if i in rows else row.dtype.type(0) + row
    ids = sorted(rows)
    return np.array(ids, np.int64), np.array([rows[i] for i in ids]).reshape(len(ids), vals_a.shape[1])


sorted_ids = st.lists(st.integers(0, 60), unique=True, max_size=25).map(lambda xs: np.array(sorted(xs), np.int64))
values = st.sampled_from([0.0, -0.0, 1.5, -2.25, 1e-40, float("inf")])   # signed zeros, a denormal, inf


@settings(max_examples=150, deadline=None)
@given(a=sorted_ids, b=sorted_ids, cols=st.integers(1, 5), dtype=st.sampled_from([np.float32, np.float64]),
       data=st.data())
def test_merge_rows_matches_a_dict_of_rows(a, b, cols, dtype, data):
    vals_a = np.array(data.draw(st.lists(values, min_size=len(a) * cols, max_size=len(a) * cols)), dtype)
    vals_b = np.array(data.draw(st.lists(values, min_size=len(b) * cols, max_size=len(b) * cols)), dtype)
    vals_a, vals_b = vals_a.reshape(len(a), cols), vals_b.reshape(len(b), cols)
    ids, vals = kernels.merge_rows(a, vals_a, b, vals_b)
    want_ids, want_vals = reference_merge(a, vals_a, b, vals_b)
    assert ids.tolist() == want_ids.tolist()
    assert vals.dtype == dtype and vals.shape == (len(want_ids), cols)
    want_vals = want_vals.astype(dtype)
    assert np.array_equal(vals, want_vals) and np.array_equal(np.signbit(vals), np.signbit(want_vals))


def test_update_kernels_refuse_what_would_touch_memory_outside_the_arrays():
    buf = np.zeros((10, 2), np.float32)
    weight, grad = buf[:4], np.ones((1, 2), np.float32)
    f = np.float32(0.1)
    for bad in ([4], [-1]):
        with pytest.raises(IndexError):
            kernels.sgd_rows(weight, np.array(bad, np.int64), grad, f, f, f, f)
    strided = np.array([0, 9, 1, 9], np.int64)[::2]      # values 0, 1; the memory behind them holds 9s
    kernels.sgd_rows(weight, strided, np.ones((2, 2), np.float32), f, f, f, f)
    assert buf[:2].any() and not buf[2:].any()           # rows 0 and 1 changed, nothing past the view
    with pytest.raises(ValueError):
        kernels.sgd_rows(weight, np.array([0, 1], np.int64), grad, f, f, f, f)        # 1 grad row for 2 slots
    with pytest.raises(ValueError):
        kernels.sgd_rows(weight, np.array([0], np.int64), np.ones((2, 2), np.float32)[:, :1], f, f, f, f)
    readonly = np.frombuffer(np.zeros(8, np.float32).tobytes(), np.float32).reshape(4, 2)
    with pytest.raises(ValueError):
        kernels.sgd_rows(readonly, np.array([0], np.int64), grad, f, f, f, f)
    mom = np.zeros((4, 2), np.float64)
    with pytest.raises(ValueError):
        kernels.sgd_mom_rows(weight, mom, np.array([0], np.int64), grad, f, f, f, f, f, True)


def test_update_rows_declines_arrays_the_kernels_cannot_take():
    """The server then gathers the rows and runs the numpy path; nothing is changed by the refusal."""
    import pickle

    mx = pytest.importorskip("mxnet")

    from kvstore_lazy.numerics.optimizers import load_optimizer
    for opt in (mx.optimizer.SGD(learning_rate=0.1, momentum=0.9), mx.optimizer.Adam()):
        ours = load_optimizer(pickle.dumps(opt, 0))
        weight = np.ones((4, 2), np.float32)
        states = ours.init_states(weight)
        slots, grad = np.array([0, 2], np.int64), np.ones((2, 2), np.float32)
        cases = [(weight, states, slots, np.ones((2, 4), np.float32)[:, ::2]),   # grad not contiguous
                 (weight, states, slots, np.ones((3, 2), np.float32)),           # grad rows != slots
                 (weight, states, np.array([0, 9, 2, 9], np.int64)[::2], grad),  # slots not contiguous
                 (weight.astype(np.float16), states, slots, grad),               # float16 table
                 (np.frombuffer(weight.tobytes(), np.float32).reshape(4, 2), states, slots, grad)]   # read-only
        for w, s, sl, g in cases:
            assert ours.update_rows(3, w, s, sl, g) is False
        assert (weight == 1).all() and not any(s.any() for s in states)
        assert ours.update_rows(3, weight, states, slots, grad) is True and not (weight[[0, 2]] == 1).any()


# ---------------------------------------------------------------------------------------------------------------
# Box-Muller (initializers.NormalRows) with log/cos/sin of IEEE basic operations only

def _correctly_rounded_sin_cos(x: float) -> tuple[float, float]:
    """Taylor series in 45-digit decimal arithmetic from the exact double x (in [0, 2 pi])."""
    with decimal.localcontext() as ctx:
        ctx.prec = 45
        x, tiny = decimal.Decimal(x), decimal.Decimal(10) ** -44
        sums = []
        for term, n in ((x, 1), (decimal.Decimal(1), 0)):
            total = term
            while abs(term) > tiny:
                term = -term * x * x / ((n + 1) * (n + 2))
                total, n = total + term, n + 2
            sums.append(float(total))
        return sums[0], sums[1]


def _ulps(got: float, want: float) -> float:
    if not want:
        return 0.0 if got == want else math.inf
    return abs(got - want) / math.ulp(want)


def test_log_sin_cos_are_within_one_ulp_of_the_correctly_rounded_values():
    rng = np.random.RandomState(9)
    x = np.concatenate([rng.rand(3000), 1 - rng.rand(300) * 1e-9, [1.0, 0.5, 2.0 ** -53, 2.0 ** -1022]])
    with decimal.localcontext() as ctx:
        ctx.prec = 45
        want = [float(decimal.Decimal(v).ln()) for v in x.tolist()]
    assert max(_ulps(g, w) for g, w in zip(kernels.log_unit(x).tolist(), want)) <= 1
    quarter = math.pi / 2
    theta = np.concatenate([rng.rand(3000) * 6.283185307179586, [0.0, 1e-300, 6.283185307179586],
                            [np.nextafter(k * quarter, d) for k in (1, 2, 3) for d in (0.0, 7.0)],
                            [np.nextafter(4 * quarter, 0.0)]])
    sin, cos = kernels.sincos(theta)
    for s, c, t in zip(sin.tolist(), cos.tolist(), theta.tolist()):
        want_s, want_c = _correctly_rounded_sin_cos(t)
        assert _ulps(s, want_s) <= 1 and _ulps(c, want_c) <= 1, t.hex()


def test_box_muller_is_those_functions_in_the_documented_order():
    rng = np.random.RandomState(3)
    u = np.concatenate([rng.rand(50, 6), [[0.0, 0.0, 1 - 2.0 ** -53, 0.999999, 0.5, 0.25]]])
    two_pi = 6.283185307179586
    sin, cos = kernels.sincos(u[:, 1::2] * two_pi)
    rad = np.sqrt(-2.0 * kernels.log_unit(1.0 - u[:, 0::2]))
    got = kernels.box_muller(u, two_pi)
    assert np.array_equal(got[:, 0::2], rad * cos) and np.array_equal(got[:, 1::2], rad * sin)
    assert np.array_equal(np.signbit(got[:, 0::2]), np.signbit(rad * cos))
    # the same bits on every platform and numpy version (these were computed on x86-64 with numpy 1.23)
    pinned = kernels.box_muller(np.array([0.25, 0.125, 0.9, 0.7, 1 - 2.0 ** -53, 0.5]), two_pi)
    assert [v.hex() for v in pinned.tolist()] == [
        '0x1.129dc7dcc0e5bp-1', '0x1.129dc7dcc0e5ap-1', '-0x1.538715144eeb6p-1', '-0x1.053d5b7141dc7p+1',
        '-0x1.124b2800eda48p+3', '0x1.2e90351e31b9ap-50']


@pytest.mark.parametrize("call", [
    lambda: kernels.box_muller(np.array([0.5, 0.5, 0.5]), 6.28),          # odd last axis
    lambda: kernels.box_muller(np.array([0.5, 1.0]), 6.28),               # 1 is not in [0, 1)
    lambda: kernels.box_muller(np.array([-0.5, 0.5]), 6.28),
    lambda: kernels.log_unit(np.array([0.0])),
    lambda: kernels.log_unit(np.array([1.5])),
    lambda: kernels.sincos(np.array([7.0])),
    lambda: kernels.sincos(np.array([np.nan])),
])
def test_box_muller_log_and_sincos_refuse_arguments_outside_their_domain(call):
    with pytest.raises(ValueError, match="takes"):
        call()


@settings(max_examples=60, deadline=None)
@given(st.integers(-2**31, 2**31 - 2**16), st.lists(st.integers(0, 2**16 - 1), max_size=300))
def test_count_values_is_a_histogram_and_refuses_values_out_of_range(base, offsets):
    values = (np.array(offsets, np.int64) + base).astype(np.int32)
    if len(values):
        low, high = int(values.min()), int(values.max())
        counts = kernels.count_values(values, low, high)
        assert counts.tolist() == np.bincount(values.astype(np.int64) - low, minlength=high - low + 1).tolist()
        with pytest.raises(ValueError, match="outside"):
            kernels.count_values(values, low + 1, max(high, low + 1))
    else:
        assert kernels.count_values(values, 0, 3).tolist() == [0, 0, 0, 0]
