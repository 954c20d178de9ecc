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
    assert kernels.build() == path                       # built once, then found
    lib = ctypes.CDLL(str(path))
    assert all(hasattr(lib, name) for name in kernels._SIGNATURES)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("_kernels")] == [path.name]  # no temp files left
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert kernels.library_name() != path.name           # another source is another library, never a stale one
    rebuilt = kernels.build()
    assert rebuilt != path and rebuilt.exists() and not path.exists()   # and the stale one is cleaned up


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
    rows = {}
    for ids, vals in ((ids_a, vals_a), (ids_b, vals_b)):
        for i, row in zip(ids.tolist(), vals):
            rows[i] = rows[i] + row if i in rows else row.copy()
    ids = sorted(rows)
    return np.array(ids, np.int64), np.array([rows[i] for i in ids]).reshape(len(ids), vals_a.shape[1])


sorted_ids = st.lists(st.integers(0, 60), unique=True, max_size=25).map(lambda xs: np.array(sorted(xs), np.int64))


@settings(max_examples=150, deadline=None)
@given(a=sorted_ids, b=sorted_ids, cols=st.integers(1, 5), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**32 - 1))
def test_merge_rows_matches_a_dict_of_rows(a, b, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    vals_a = rng.standard_normal((len(a), cols)).astype(dtype)
    vals_b = rng.standard_normal((len(b), cols)).astype(dtype)
    ids, vals = kernels.merge_rows(a, vals_a, b, vals_b)
    want_ids, want_vals = reference_merge(a, vals_a, b, vals_b)
    assert ids.tolist() == want_ids.tolist()
    assert vals.dtype == dtype and vals.shape == (len(want_ids), cols)
    assert np.array_equal(vals, want_vals.astype(dtype))   # a + b in float32/float64: the same rounding


def test_update_kernels_refuse_slots_out_of_range():
    weight, grad = np.zeros((4, 2), np.float32), np.ones((1, 2), np.float32)
    f = np.float32(0.1)
    for bad in ([4], [-1]):
        with pytest.raises(IndexError):
            kernels.sgd_rows(weight, np.array(bad, np.int64), grad, f, f, f, f)
    assert not weight.any()
