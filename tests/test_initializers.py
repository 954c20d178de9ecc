"""Tests for kvstore_lazy.numerics.initializers: distributions, determinism, parsing."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvstore_lazy.numerics.initializers as ki
from kvstore_lazy.numerics.initializers import InitializerError, parse_initializer

mx = pytest.importorskip("mxnet")

N = 200_000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(dumps, shape=(1 << 40, 100), n=N, seed=7, key=3, dtype=np.float64):
    """n values from rows 0..n/ncols-1 of a weight of full shape `shape`."""
    ncols = math.prod(shape[1:])
    ids = np.arange(n // ncols, dtype=np.uint64) * np.uint64(977) + np.uint64(12345)
    return parse_initializer(dumps).rows(seed, key, ids, shape, dtype).ravel()


def check_moments(x, mean, var, kurt):
    """Sample mean/variance within 5 standard errors of the theoretical ones."""
    n = x.size
    assert abs(x.mean() - mean) < 5 * math.sqrt(var / n)
    assert abs(x.var() - var) < 5 * var * math.sqrt((kurt - 1) / n)


def ks_stat(x, cdf):
    x = np.sort(x)
    f = cdf(x)
    n = x.size
    return max((np.arange(1, n + 1) / n - f).max(), (f - np.arange(n) / n).max())


KS_CRIT = 1.95 / math.sqrt(N)  # alpha ~ 0.001


def normal_cdf(x, sigma):
    return 0.5 * (1 + np.frompyfunc(math.erf, 1, 1)(x / (sigma * math.sqrt(2))).astype(float))


# ------------------------------------------------------------------ distributions
@pytest.mark.parametrize("scale", [0.07, 1.0, 3.5])
def test_uniform_distribution(scale):
    x = sample(mx.init.Uniform(scale).dumps())
    assert x.min() >= -scale and x.max() < scale
    assert x.min() < -scale * 0.999 and x.max() > scale * 0.999
    check_moments(x, 0.0, scale ** 2 / 3, 9 / 5)
    assert ks_stat(x, lambda v: (v + scale) / (2 * scale)) < KS_CRIT
    counts = np.histogram(x, bins=100, range=(-scale, scale))[0]
    chi2 = ((counts - N / 100) ** 2 / (N / 100)).sum()
    assert chi2 < 99 + 5 * math.sqrt(2 * 99)


def test_uniform_float32_bounds():
    x = sample(mx.init.Uniform(0.07).dumps(), dtype=np.float32)
    assert x.dtype == np.float32
    assert x.min() >= np.float32(-0.07) and x.max() <= np.float32(0.07)


def test_default_uniform_and_normal_match_mxnet_defaults():
    assert mx.init.Uniform().dumps() == '["uniform", {"scale": 0.07}]'
    assert mx.init.Normal().dumps() == '["normal", {"sigma": 0.01}]'
    assert parse_initializer('["uniform", {}]').low == -0.07
    assert parse_initializer('["normal", {}]').sigma == 0.01


@pytest.mark.parametrize("sigma", [0.01, 1.0, 2.5])
def test_normal_distribution(sigma):
    x = sample(mx.init.Normal(sigma).dumps())
    check_moments(x, 0.0, sigma ** 2, 3.0)
    z = x / sigma
    assert abs((z ** 4).mean() - 3.0) < 0.1                # kurtosis
    assert abs((z ** 3).mean()) < 0.05                     # skewness
    assert abs(np.mean(np.abs(z) < 1) - 0.682689) < 0.005
    assert ks_stat(x, lambda v: normal_cdf(v, sigma)) < KS_CRIT
    assert np.isfinite(x).all()


def test_normal_even_and_odd_columns_both_normal():
    x = parse_initializer('["normal", {"sigma": 1.0}]').rows(
        1, 2, np.arange(N // 2, dtype=np.uint64), (N, 2), np.float64)
    for col in (x[:, 0], x[:, 1]):
        check_moments(col, 0.0, 1.0, 3.0)
    assert abs(np.corrcoef(x[:, 0], x[:, 1])[0, 1]) < 5 / math.sqrt(N / 2)
    # an odd number of columns drops the last sine and keeps the rest identical
    y = parse_initializer('["normal", {"sigma": 1.0}]').rows(
        1, 2, np.arange(10, dtype=np.uint64), (N, 1), np.float64)
    np.testing.assert_array_equal(y[:, 0], x[:10, 0])


def mxnet_values(init, shape):
    arr = mx.nd.zeros(shape)
    init(mx.init.InitDesc("fc_weight"), arr)
    return arr.asnumpy().astype(np.float64).ravel()


XAVIER_CASES = [
    ((2000, 100), "uniform", "avg", 3),
    ((2000, 100), "gaussian", "in", 3),
    ((1000, 200), "uniform", "out", 2.34),
    ((256, 64, 3, 3), "gaussian", "avg", 3),
    ((256, 64, 3, 3), "uniform", "in", 1),
]


@pytest.mark.parametrize("shape,rnd_type,factor_type,magnitude", XAVIER_CASES)
def test_xavier_matches_mxnet_scale(shape, rnd_type, factor_type, magnitude):
    init = mx.init.Xavier(rnd_type, factor_type, magnitude)
    hw = math.prod(shape[2:])
    fan = {"avg": (shape[0] + shape[1]) * hw / 2, "in": shape[1] * hw, "out": shape[0] * hw}
    scale = math.sqrt(magnitude / fan[factor_type])
    ours = parse_initializer(init.dumps())
    assert math.isclose(ours.scale(shape), scale, rel_tol=1e-12)
    x = ours.rows(5, 9, np.arange(shape[0], dtype=np.uint64), shape, np.float32)
    assert x.shape == (shape[0], math.prod(shape[1:])) and x.dtype == np.float32
    x = x.astype(np.float64).ravel()
    ref = mxnet_values(init, shape)
    if rnd_type == "uniform":
        assert np.abs(x).max() <= np.float32(scale) and np.abs(x).max() > scale * 0.999
        check_moments(x, 0.0, scale ** 2 / 3, 9 / 5)
        assert ks_stat(x, lambda v: (v + scale) / (2 * scale)) < 1.95 / math.sqrt(x.size)
    else:
        check_moments(x, 0.0, scale ** 2, 3.0)
        assert ks_stat(x, lambda v: normal_cdf(v, scale)) < 1.95 / math.sqrt(x.size)
    # and mxnet's own sample agrees with ours
    assert abs(x.std() / ref.std() - 1) < 0.02
    if rnd_type == "uniform":
        assert abs(np.abs(x).max() / np.abs(ref).max() - 1) < 1e-3


@pytest.mark.parametrize("factor_type,slope", [("avg", 0.25), ("out", 0.1), ("in", 0.0)])
def test_msraprelu_is_gaussian_xavier(factor_type, slope):
    init = mx.init.MSRAPrelu(factor_type, slope)
    ours = parse_initializer(init.dumps())
    assert ours.rnd_type == "gaussian" and ours.factor_type == factor_type
    assert math.isclose(ours.magnitude, init.magnitude, rel_tol=1e-15)
    shape = (1000, 200)
    x = ours.rows(1, 1, np.arange(1000, dtype=np.uint64), shape, np.float64).ravel()
    check_moments(x, 0.0, ours.scale(shape) ** 2, 3.0)
    assert abs(x.std() / mxnet_values(init, shape).std() - 1) < 0.02


def test_xavier_rejects_vectors():
    with pytest.raises(InitializerError, match="at least 2D"):
        parse_initializer(mx.init.Xavier().dumps()).rows(0, 0, np.arange(3), (10,), np.float32)


@pytest.mark.parametrize("init,expected", [
    (mx.init.Zero(), 0.0), (mx.init.One(), 1.0),
    (mx.init.Constant(3.5), 3.5), (mx.init.Constant(-2), -2.0)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_constants_exact(init, expected, dtype):
    x = parse_initializer(init.dumps()).rows(1, 2, np.array([5, 2**40, 0], np.uint64),
                                             (2**41, 3, 2), dtype)
    assert x.dtype == dtype and x.shape == (3, 6)
    assert (x == expected).all()


def test_constant_array_value():
    ids = np.array([3, 1], np.uint64)
    per_row = mx.init.Constant(np.array([1.0, 2.0, 3.0])).dumps()
    x = parse_initializer(per_row).rows(0, 0, ids, (10, 3), np.float32)
    np.testing.assert_array_equal(x, [[1, 2, 3], [1, 2, 3]])
    full = np.arange(12.0).reshape(4, 3)
    x = parse_initializer(mx.init.Constant(full).dumps()).rows(0, 0, ids, (4, 3), np.float64)
    np.testing.assert_array_equal(x, full[[3, 1]])
    with pytest.raises(InitializerError, match="broadcast"):
        parse_initializer(per_row).rows(0, 0, ids, (10, 4), np.float32)


@pytest.mark.parametrize("dumps", ['["uniform", {"scale": 0.5}]', '["normal", {"sigma": 0.5}]'])
def test_dtypes_are_casts_of_float64(dumps):
    init = parse_initializer(dumps)
    ids = np.arange(1000, dtype=np.uint64)
    x64 = init.rows(4, 4, ids, (1000, 8), np.float64)
    for dt in (np.float16, np.float32):
        x = init.rows(4, 4, ids, (1000, 8), dt)
        assert x.dtype == dt
        np.testing.assert_array_equal(x, x64.astype(dt))
    with pytest.raises(InitializerError, match="dtype"):
        init.rows(4, 4, ids, (1000, 8), np.int32)


def test_rows_and_columns_uncorrelated():
    x = parse_initializer('["uniform", {"scale": 1.0}]').rows(
        0, 0, np.arange(2000, dtype=np.uint64), (2000, 100), np.float64)
    bound = 5 / math.sqrt(x.size)
    assert abs(np.mean(x[1:] * x[:-1]) * 3) < bound   # consecutive row ids
    assert abs(np.mean(x[:, 1:] * x[:, :-1]) * 3) < bound   # consecutive columns


# --------------------------------------------------------- generator definition
M64 = (1 << 64) - 1


def ref_mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_bits(seed, key, row, c):
    """Straight transcription of the module docstring, in Python ints."""
    absorb = lambda h, v: ref_mix64(((h ^ v) + 0x9E3779B97F4A7C15) & M64)  # noqa: E731
    state = absorb(absorb(absorb(0, seed & M64), key & M64), row)
    return ref_mix64((state + (c + 1) * 0x9E3779B97F4A7C15) & M64)


def test_splitmix64_known_values():
    # SplitMix64 seeded with 0 (reference C implementation): first outputs
    assert [ref_mix64(((i + 1) * 0x9E3779B97F4A7C15) & M64) for i in range(2)] == \
        [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    z = np.array([(i + 1) * 0x9E3779B97F4A7C15 & M64 for i in range(2)], np.uint64)
    assert ki._mix64_(z, np.empty_like(z)).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


@pytest.mark.parametrize("seed,key", [(0, 0), (1, 2), (2**64 - 1, 2**63 + 5), (-1, 7)])
def test_generator_matches_docstring(seed, key):
    rows = [0, 1, 2**40 - 1, 2**63, 2**64 - 1, 123456789]
    ids = np.array(rows, np.uint64)
    bits = ki.random_bits(seed, key, ids, 5)
    assert bits.tolist() == [[ref_bits(seed, key, r, c) for c in range(5)] for r in rows]
    u = [[(ref_bits(seed, key, r, c) >> 11) * 2.0 ** -53 for c in range(5)] for r in rows]
    assert ki.uniform01(seed, key, ids, 5).tolist() == u
    uni = parse_initializer('["uniform", {"scale": 0.3}]').rows(seed, key, ids, (2**64 - 1, 5),
                                                                np.float64)
    assert uni.tolist() == [[-0.3 + v * 0.6 for v in row] for row in u]
    nrm = parse_initializer('["normal", {"sigma": 0.3}]').rows(seed, key, ids, (2**64 - 1, 5),
                                                               np.float64)
    u6 = [[(ref_bits(seed, key, r, c) >> 11) * 2.0 ** -53 for c in range(6)] for r in rows]
    ref = [[0.3 * (math.sqrt(-2 * math.log(1 - ur[2 * (j // 2)])) *
                   (math.cos, math.sin)[j % 2](ur[2 * (j // 2) + 1] * 6.283185307179586))
            for j in range(5)] for ur in u6]
    np.testing.assert_allclose(nrm, ref, rtol=1e-13, atol=1e-300)


# ------------------------------------------------------------------ determinism
INITS = ['["uniform", {"scale": 0.07}]', '["normal", {"sigma": 1.0}]',
         mx.init.Xavier().dumps(), mx.init.Xavier("gaussian", "out", 2).dumps()]


@pytest.mark.parametrize("dumps", INITS)
def test_order_subset_and_call_independence(dumps):
    init = parse_initializer(dumps)
    rng = np.random.default_rng(1)
    ids = rng.choice(10**6, 3000, replace=False).astype(np.uint64)
    shape = (10**6, 4, 3)
    full = init.rows(11, 22, ids, shape, np.float32)
    perm = rng.permutation(len(ids))
    np.testing.assert_array_equal(init.rows(11, 22, ids[perm], shape, np.float32), full[perm])
    parts = [init.rows(11, 22, p, shape, np.float32) for p in np.split(ids, [1, 700, 2999])]
    np.testing.assert_array_equal(np.concatenate(parts), full)
    np.testing.assert_array_equal(parse_initializer(dumps).rows(11, 22, ids, shape, np.float32),
                                  full)
    sub = rng.choice(len(ids), 50, replace=False)
    np.testing.assert_array_equal(init.rows(11, 22, ids[sub], shape, np.float32), full[sub])
    # row ids given as signed ints or python lists are the same rows
    np.testing.assert_array_equal(init.rows(11, 22, ids.astype(np.int64), shape, np.float32), full)
    np.testing.assert_array_equal(init.rows(11, 22, ids[:3].tolist(), shape, np.float32),
                                  full[:3])


def test_chunking_does_not_change_values(monkeypatch):
    init = parse_initializer('["normal", {"sigma": 1.0}]')
    ids = np.arange(300, dtype=np.uint64)
    ref = init.rows(1, 2, ids, (300, 7, 5), np.float64)
    for block in (1, 7, 36, 1000):
        monkeypatch.setattr(ki, "_BLOCK", block)
        np.testing.assert_array_equal(init.rows(1, 2, ids, (300, 7, 5), np.float64), ref)


def test_seed_key_row_sensitivity():
    init = parse_initializer('["uniform", {"scale": 1.0}]')
    ids = np.arange(100, dtype=np.uint64)
    shape = (100, 16)
    base = init.rows(1, 1, ids, shape, np.float64)
    for other in (init.rows(2, 1, ids, shape, np.float64), init.rows(1, 2, ids, shape, np.float64),
                  init.rows(1, 1, ids + np.uint64(1), shape, np.float64)):
        assert (other != base).all()
    assert len(np.unique(base)) == base.size        # no repeated rows or columns


def test_huge_row_ids():
    init = parse_initializer('["uniform", {"scale": 1.0}]')
    ids = np.array([2**40 - 1, 2**40, 2**40 + 1, 2**63 - 1, 2**63, 2**64 - 1, 0], np.uint64)
    x = init.rows(3, 4, ids, (2**64 - 1, 8), np.float32)
    assert x.shape == (7, 8) and np.isfinite(x).all() and np.abs(x).max() <= 1
    assert len({r.tobytes() for r in x}) == 7
    np.testing.assert_array_equal(init.rows(3, 4, ids[::-1], (2**64 - 1, 8), np.float32), x[::-1])


def test_empty_and_degenerate_inputs():
    init = parse_initializer('["normal", {"sigma": 1.0}]')
    assert init.rows(0, 0, np.zeros(0, np.uint64), (10, 4), np.float32).shape == (0, 4)
    assert init.rows(0, 0, [], (10, 4), np.float32).shape == (0, 4)
    assert init.rows(0, 0, np.arange(3), (10, 0), np.float32).shape == (3, 0)
    assert init.rows(0, 0, np.arange(3), (10,), np.float32).shape == (3, 1)
    with pytest.raises(InitializerError):
        init.rows(0, 0, np.zeros((2, 2), np.uint64), (10, 4), np.float32)
    with pytest.raises(InitializerError):
        init.rows(0, 0, np.array([1.5]), (10, 4), np.float32)


@settings(max_examples=60, deadline=None)
@given(dumps=st.sampled_from(INITS),
       seed=st.integers(-2**63, 2**64 - 1), key=st.integers(0, 2**64 - 1),
       ids=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40),
       row_shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       data=st.data())
def test_property_order_and_subset_independence(dumps, seed, key, ids, row_shape, data):
    init = parse_initializer(dumps)
    shape = (2**64 - 1, *row_shape)
    ids = np.array(ids, np.uint64)
    full = init.rows(seed, key, ids, shape, np.float32)
    assert full.shape == (len(ids), math.prod(row_shape))
    order = data.draw(st.permutations(range(len(ids))))
    np.testing.assert_array_equal(init.rows(seed, key, ids[order], shape, np.float32), full[order])
    subset = data.draw(st.lists(st.integers(0, len(ids) - 1), min_size=1, max_size=len(ids)))
    np.testing.assert_array_equal(init.rows(seed, key, ids[subset], shape, np.float32),
                                  full[subset])
    for i in subset[:3]:
        np.testing.assert_array_equal(init.rows(seed, key, ids[i:i + 1], shape, np.float32),
                                      full[i:i + 1])


# ------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("init,cls", [
    (mx.init.Uniform(0.07), ki.UniformRows), (mx.init.Uniform(), ki.UniformRows),
    (mx.init.Normal(0.5), ki.NormalRows), (mx.init.Zero(), ki.ConstantRows),
    (mx.init.One(), ki.ConstantRows), (mx.init.Constant(2), ki.ConstantRows),
    (mx.init.Xavier(), ki.XavierRows), (mx.init.Xavier("gaussian", "in", 2.5), ki.XavierRows),
    (mx.init.Xavier(factor_type="out", magnitude=1), ki.XavierRows),
    (mx.init.MSRAPrelu(), ki.XavierRows)])
def test_parse_real_dumps(init, cls):
    parsed = parse_initializer(init.dumps())
    assert isinstance(parsed, cls)
    assert isinstance(parsed, ki.RowInitializer)


def test_parse_exact_strings():
    assert mx.init.Uniform(0.07).dumps() == '["uniform", {"scale": 0.07}]'
    u = parse_initializer('["uniform", {"scale": 0.07}]')
    assert (u.low, u.high) == (-0.07, 0.07)
    x = parse_initializer('["xavier", {"rnd_type": "gaussian", "factor_type": "in", '
                          '"magnitude": 3}]')
    assert (x.rnd_type, x.factor_type, x.magnitude) == ("gaussian", "in", 3.0)
    assert isinstance(parse_initializer('["Uniform", {"scale": 1}]'), ki.UniformRows)


@pytest.mark.parametrize("init,name", [
    (mx.init.Orthogonal(), "orthogonal"), (mx.init.Bilinear(), "bilinear"),
    (mx.init.LSTMBias(), "lstmbias"),
    (mx.init.FusedRNN(mx.init.Zero(), 1, 1, "lstm"), "fusedrnn")])
def test_parse_rejects_unsupported(init, name):
    with pytest.raises(InitializerError, match=name):
        parse_initializer(init.dumps())


@pytest.mark.parametrize("bad", [
    "", "not json", "[", "null", "42", '"uniform"', "[1, 2]", '{"scale": 1}', '["uniform"]',
    '["uniform", {}, 3]', '["uniform", [0.1]]', '["uniform", {"scale": "x"}]',
    '["uniform", {"scale": -1}]', '["uniform", {"scale": true}]', '["normal", {"sigma": NaN}]',
    '["uniform", {"bogus": 1}]', '["xavier", {"rnd_type": "foo"}]',
    '["xavier", {"factor_type": "sideways"}]', '["xavier", {"magnitude": null}]',
    '["constant", {}]', '["constant", {"value": "abc"}]', '["constant", {"value": [1, [2]]}]',
    '["msraprelu", {"slope": "x"}]', '["my_custom_init", {}]', None, 3])
def test_parse_rejects_garbage(bad):
    with pytest.raises(InitializerError):
        parse_initializer(bad)


def test_error_is_value_error():
    assert issubclass(InitializerError, ValueError)


def test_module_does_not_import_mxnet():
    code = ("import sys, kvstore_lazy.numerics.initializers as m; "
            "m.parse_initializer('[\"normal\", {\"sigma\": 1}]')"
            ".rows(1, 2, [3], (4, 5), 'float32'); "
            "assert 'mxnet' not in sys.modules, 'mxnet imported'")
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
