"""kvstore_lazy/store/kernels: building the C library, and the kernels the other tests don't reach directly.

The optimizer kernels are pinned bit for bit against MXNet in test_optimizers.py (both server paths), the hash index
by test_rows.py's model tests; here: the build (fresh directory, failures with a clear error) and the sorted merge
against a plain numpy reference, float32 (C) and other dtypes (numpy fallback).
"""
import ctypes
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore_lazy.store import kernels


def test_build_compiles_a_fresh_copy_into_its_directory(tmp_path, monkeypatch):
    source = tmp_path / "kernels.c"
    shutil.copy(kernels.SOURCE, source)
    monkeypatch.setattr(kernels, "SOURCE", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = kernels.build()
    assert path.parent == tmp_path and path.name == kernels.library_name() and path.stat().st_size > 0
    assert path.stat().st_mode & 0o755 == 0o755          # other users of the install can load it
    assert kernels.build() == path                       # built once, then found
    lib = ctypes.CDLL(str(path))
    assert all(hasattr(lib, name) for name in kernels._SIGNATURES)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("_kernels")] == [path.name]  # no temp files left
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert kernels.library_name() != path.name           # another source is another library, never a stale one
    rebuilt = kernels.build()
    assert rebuilt != path and rebuilt.exists() and not path.exists()   # and the stale one is cleaned up


def test_build_in_the_shared_cache_leaves_other_installs_builds_alone(tmp_path, monkeypatch):
    source = tmp_path / "src" / "kernels.c"
    source.parent.mkdir()
    shutil.copy(kernels.SOURCE, source)
    monkeypatch.setattr(kernels, "SOURCE", source)
    cache = tmp_path / "cache"
    cache.mkdir()
    other = cache / "_kernels-0123456789abcdef.so"        # another version's build
    other.write_bytes(b"x")
    monkeypatch.setattr(kernels, "_candidates", lambda: [cache / kernels.library_name()])
    assert kernels.build().parent == cache
    assert other.exists()


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_build_without_a_working_compiler_says_so(tmp_path, monkeypatch, cc):
    source = tmp_path / "kernels.c"
    shutil.copy(kernels.SOURCE, source)
    monkeypatch.setattr(kernels, "SOURCE", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", cc)
    with pytest.raises(kernels.KernelBuildError, match="kernels.c"):
        kernels.build()
    assert not list(tmp_path.glob("_kernels*"))


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

    import mxnet as mx

    from kvstore_lazy.optimizers import load_optimizer
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
