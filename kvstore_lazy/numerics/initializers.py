"""Deterministic, lazily evaluated initial values for ``row_sparse`` weights.

This module owns two things:

* parsing the string produced by MXNet's ``Initializer.dumps()`` (for
  example ``'["uniform", {"scale": 0.07}]'``) into a :class:`RowInitializer`,
  without importing mxnet (the server process must never import it);
* the counter-based random generator that makes the initial value of row
  ``r`` of key ``k`` a pure function of ``(seed, key, r, column)``: it does
  not depend on the number of servers, on which other rows are requested in
  the same call, on their order, or on restarts.

Supported initializers (names are case-insensitive, arguments default as in
mxnet 1.9.1): ``zero``, ``one``, ``constant(value)``, ``uniform(scale=0.07)``,
``normal(sigma=0.01)``, ``xavier(rnd_type="uniform", factor_type="avg",
magnitude=3)`` and ``msraprelu(factor_type="avg", slope=0.25)`` (a Xavier
with ``rnd_type="gaussian"`` and ``magnitude=2 / (1 + slope**2)``).  Anything
else (orthogonal, bilinear, lstmbias, fusedrnn, custom ones...) raises
:class:`InitializerError`.

Generator (all integer arithmetic modulo 2**64, ``^`` is xor)
-------------------------------------------------------------

::

    GAMMA = 0x9E3779B97F4A7C15
    mix64(z):                       # the SplitMix64 / MurmurHash3-style finalizer
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)
    absorb(h, v) = mix64((h ^ v) + GAMMA)

    state(seed, key, r) = absorb(absorb(absorb(0, seed mod 2**64), key mod 2**64), r)
    bits(seed, key, r, c) = mix64(state(seed, key, r) + (c + 1) * GAMMA)

``bits(.., r, c)`` for ``c = 0, 1, 2...`` is exactly the SplitMix64 output
stream started from ``state(seed, key, r)``.  A row has ``D = prod(shape[1:])``
values; column ``j`` (row-major flattening of ``shape[1:]``) is derived from
counters as follows, in float64:

* uniform in [0, 1):  ``u(c) = (bits(c) >> 11) * 2**-53`` (exact);
* ``Uniform(low, high)``: column ``j`` is ``low + u(j) * (high - low)``
  (one float64 multiply, then one add; ``Uniform(scale)`` is
  ``low=-scale, high=scale``, so values lie in [-scale, scale], the upper end
  reachable only through rounding);
* ``Normal(sigma)`` (Box-Muller, both outputs used): for pair ``k = j // 2``,
  ``rad = sqrt(-2 * log(1 - u(2k)))`` (``1 - u`` is exact and in (0, 1], so
  no ``log(0)``), ``theta = u(2k + 1) * 6.283185307179586``; column ``j`` is
  ``sigma * rad * cos(theta)`` if ``j`` is even, ``sigma * rad * sin(theta)``
  if odd (``rad * cos`` first, then times ``sigma``); ``log``, ``cos`` and
  ``sin`` are kvstore_lazy's own (``store/kernels.c``: IEEE basic operations
  only, within 1 ulp of the correctly rounded value);
* ``Xavier``: ``scale`` exactly as ``mxnet.init.Xavier._init_weight`` computes
  it from the FULL weight shape, then ``Uniform(-scale, scale)`` or
  ``Normal(scale)``;
* the float64 result is cast to the requested dtype (round to nearest).

Uniform values (of ``Uniform``, of a uniform ``Xavier``, and the ``u`` of
``Normal``) for float32 and float64 rows come from one compiled loop
(``protocol/_fast.c`` ``uniform_rows``: the same float64 operations in the
same order, built without fused multiply-adds) instead of a dozen numpy
passes; float16 rows, and the tests' reference, take the numpy path.

Values are bit-exact on any IEEE platform and with any numpy: numpy's (or
libm's) ``log``/``cos``/``sin`` are not used, as they differ between numpy
versions and CPUs (numpy 1.23 and 2.x disagree on about half of all float64
Box-Muller values on AVX-512).
"""

import functools
import json
import math
import numbers
import operator

import numpy as np

from kvstore_lazy.protocol.fast import native
import kvstore_lazy.store.kernels as kernels

__all__ = ["InitializerError", "RowInitializer", "parse_initializer",
           "row_states", "random_bits", "uniform01"]


class InitializerError(ValueError):
    """Unsupported or malformed initializer, or an unusable weight shape/dtype."""


_MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_TWO_PI = 6.283185307179586
_BLOCK = 1 << 15                 # values per chunk: keeps temporaries in cache
_DTYPES = frozenset((np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)))

# The generator's constants as numpy scalars, made once: a server computes new rows on every request that touches
# some, a few hundred at a time, where building these per call is a good part of the cost.
_U_GAMMA, _U_M1, _U_M2 = np.uint64(GAMMA), np.uint64(_M1), np.uint64(_M2)
_U30, _U27, _U31, _U11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_COUNTERS_CACHED = 1 << 12       # column counters kept for rows up to this many values


# --------------------------------------------------------------------- generator
def _mix64_int(z):
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix64_(z, tmp):
    """In-place mix64 of the uint64 array ``z``; ``tmp`` is a same-shape buffer."""
    np.right_shift(z, _U30, out=tmp)
    z ^= tmp
    z *= _U_M1
    np.right_shift(z, _U27, out=tmp)
    z ^= tmp
    z *= _U_M2
    np.right_shift(z, _U31, out=tmp)
    z ^= tmp
    return z


@functools.lru_cache(maxsize=1024)
def _key_state(seed, key):
    """``absorb(absorb(0, seed), key)`` as a numpy scalar: the part of every row's state set by (seed, key) alone."""
    h = _mix64_int(((0 ^ (seed & _MASK)) + GAMMA) & _MASK)
    return np.uint64(_mix64_int(((h ^ (key & _MASK)) + GAMMA) & _MASK))


_native_uniform = native.uniform_rows


def _state_of(seed, key):
    """:func:`_key_state` as a Python int, for the compiled loop."""
    return int(_key_state(operator.index(seed), operator.index(key)))


def row_states(seed, key, row_ids):
    """``state(seed, key, r)`` for every r in ``row_ids`` (uint64 array)."""
    s = np.bitwise_xor(np.asarray(row_ids, dtype=np.uint64), _key_state(operator.index(seed), operator.index(key)))
    s += _U_GAMMA
    return _mix64_(s, np.empty_like(s))


@functools.lru_cache(maxsize=64)
def _cached_counters(ncols):
    z = np.multiply(np.arange(1, ncols + 1, dtype=np.uint64), _U_GAMMA)
    z.flags.writeable = False
    return z


def _counters(ncols):
    """``(c + 1) * GAMMA`` for c in range(ncols), read-only (cached for rows of up to _COUNTERS_CACHED values)."""
    if ncols <= _COUNTERS_CACHED:
        return _cached_counters(ncols)
    return np.multiply(np.arange(1, ncols + 1, dtype=np.uint64), _U_GAMMA)


def _bits(states, ncols):
    """``bits(r, c)`` for c in range(ncols): a (len(states), ncols) uint64 array."""
    z = np.add(states[:, None], _counters(ncols)[None, :])
    return _mix64_(z, np.empty_like(z))


def random_bits(seed, key, row_ids, ncols):
    """``bits(seed, key, r, c)`` for r in row_ids, c in range(ncols)."""
    return _bits(row_states(seed, key, row_ids), ncols)


def _uniform01(states, ncols):
    z = _bits(states, ncols)
    z >>= _U11
    # below 2**53 now: the int64 view holds the same integers, and numpy turns int64 into float64 faster
    return np.multiply(z.view(np.int64), 2.0 ** -53)


def uniform01(seed, key, row_ids, ncols):
    """``u(c)`` in [0, 1) for r in row_ids, c in range(ncols), float64."""
    return _uniform01(row_states(seed, key, row_ids), ncols)


# ------------------------------------------------------------------ initializers
class RowInitializer:
    """Produces the initial values of any subset of rows of a weight."""

    name = "?"

    def rows(self, seed, key, row_ids, shape, dtype):
        """Initial values of rows ``row_ids`` (1-D, global ids, any order) of a
        weight of full shape ``shape``: an array (len(row_ids), prod(shape[1:]))
        of ``dtype``.  Row r only depends on (seed, key, r, shape)."""
        row_ids = np.asarray(row_ids)
        if row_ids.ndim != 1 or not (row_ids.dtype.kind in "iu" or row_ids.size == 0):
            raise InitializerError("row_ids must be a 1-D integer array, got %s %r"
                                   % (row_ids.dtype, row_ids.shape))
        shape = tuple(map(operator.index, shape))
        if not shape or min(shape) < 0:
            raise InitializerError("bad weight shape %r" % (shape,))
        dtype = np.dtype(dtype)
        if dtype not in _DTYPES:
            raise InitializerError("unsupported dtype %s (float16/32/64 only)" % dtype)
        ncols = math.prod(shape[1:])
        out = np.empty((row_ids.size, ncols), dtype=dtype)
        self.fill(seed, key, row_ids.astype(np.uint64, copy=False), shape, out)
        return out

    def fill(self, seed, key, row_ids, shape, out):
        """:meth:`rows` written into ``out``, for a caller that checked the weight's shape and dtype once (a
        declared key): ``row_ids`` a 1-D uint64 array, ``out`` a (len(row_ids), prod(shape[1:])) array of a
        float dtype. The same values, without rows()'s checks on every call."""
        if out.size:
            self._fill(seed, key, row_ids, shape, out)

    def compiled_fill(self, seed, key):
        """``(key_state, span, low)`` when every row's float32 values are ``protocol/_fast.c``'s Uniform loop's
        with them (``uniform_rows``; the compiled pull path fills the rows of a pull that are not stored with it),
        else None."""
        return None

    def _fill(self, seed, key, row_ids, shape, out):
        """Fill ``out`` chunk by chunk with ``self._values(states, ncols, shape)``."""
        states = row_states(seed, key, row_ids)
        ncols = out.shape[1]
        step = max(1, _BLOCK // ncols)
        for i in range(0, len(states), step):
            out[i:i + step] = self._values(states[i:i + step], ncols, shape)

    def _values(self, states, ncols, shape):
        raise NotImplementedError

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%r" % kv for kv in sorted(vars(self).items())))


class ConstantRows(RowInitializer):
    """zero, one, constant(value): ``value`` broadcast onto each row (or, when it
    has the full weight shape, row r takes ``value[r]``)."""

    def __init__(self, value, name="constant"):
        self.name = name
        self.value = value

    def compiled_fill(self, seed, key):
        # a scalar c: the loop's u * 0.0 + c is c exactly (u >= 0), except for c = -0.0 (+0.0 + -0.0 is +0.0)
        v = np.asarray(self.value, dtype=np.float64)
        if v.ndim or (v == 0 and math.copysign(1.0, float(v)) < 0):
            return None
        return (0, 0.0, float(v))

    def _fill(self, seed, key, row_ids, shape, out):
        v = np.asarray(self.value, dtype=np.float64)
        if v.ndim == 0:        # zero, one, a scalar: the cast of the one value, everywhere
            out.fill(v)
            return
        if v.ndim == len(shape) and v.ndim and v.shape[0] == shape[0] != 1:
            if row_ids.size and int(row_ids.max()) >= shape[0]:
                raise InitializerError("row id beyond %d rows of constant value" % shape[0])
            v = v[row_ids.astype(np.intp)]
        elif v.ndim == len(shape) and v.ndim:
            v = v[0]
        try:
            out[...] = np.broadcast_to(v, (len(row_ids),) + shape[1:]).reshape(out.shape)
        except ValueError:
            raise InitializerError("constant value of shape %r does not broadcast to "
                                   "weight shape %r" % (v.shape, shape)) from None


class UniformRows(RowInitializer):
    """Uniform on [low, high)."""

    name = "uniform"

    def __init__(self, low, high):
        self.low, self.high = float(low), float(high)

    def _values(self, states, ncols, shape):
        u = _uniform01(states, ncols)
        u *= self.high - self.low
        u += self.low
        return u

    def compiled_fill(self, seed, key):
        return (_state_of(seed, key), self.high - self.low, self.low)

    def _fill(self, seed, key, row_ids, shape, out):
        if out.dtype.itemsize in (4, 8) and out.flags.c_contiguous:   # float32, float64: the compiled loop
            _native_uniform(out, np.ascontiguousarray(row_ids), _state_of(seed, key), self.high - self.low,
                            self.low, out.dtype.itemsize)
        else:
            self._fill_numpy(seed, key, row_ids, shape, out)

    def _fill_numpy(self, seed, key, row_ids, shape, out):
        """:meth:`_values` chunk by chunk, its final add writing ``out`` directly (float64 arithmetic, then the
        cast to out's dtype that assigning the chunk would do): one pass less."""
        states = row_states(seed, key, row_ids)
        ncols = out.shape[1]
        step = max(1, _BLOCK // ncols)
        span = self.high - self.low
        for i in range(0, len(states), step):
            u = _uniform01(states[i:i + step], ncols)
            u *= span
            np.add(u, self.low, out=out[i:i + step], dtype=np.float64)


class NormalRows(RowInitializer):
    """Normal(0, sigma) by Box-Muller."""

    name = "normal"

    def __init__(self, sigma):
        self.sigma = float(sigma)

    def _values(self, states, ncols, shape):
        # log, cos and sin of our own (store/kernels.c): numpy's differ between numpy versions and CPUs
        return self._normal(_uniform01(states, 2 * ((ncols + 1) // 2)), ncols)

    def _normal(self, u, ncols):
        out = kernels.box_muller(u, _TWO_PI)
        out *= self.sigma
        return out[:, :ncols]

    def _fill(self, seed, key, row_ids, shape, out):
        """:meth:`_values` chunk by chunk, its uniforms from the compiled loop (uniform01 is u * 1 + 0: the same
        bits)."""
        ncols = out.shape[1]
        pairs = 2 * ((ncols + 1) // 2)
        step = max(1, _BLOCK // ncols)
        row_ids = np.ascontiguousarray(row_ids)
        state = _state_of(seed, key)
        for i in range(0, len(row_ids), step):
            ids = row_ids[i:i + step]
            u = np.empty((len(ids), pairs))
            _native_uniform(u, ids, state, 1.0, 0.0, 8)
            out[i:i + step] = self._normal(u, ncols)

    def _fill_numpy(self, seed, key, row_ids, shape, out):
        RowInitializer._fill(self, seed, key, row_ids, shape, out)


class XavierRows(RowInitializer):
    """mxnet's Xavier (and MSRAPrelu): scale from the full weight shape."""

    name = "xavier"

    def __init__(self, rnd_type="uniform", factor_type="avg", magnitude=3.0, name="xavier"):
        if rnd_type not in ("uniform", "gaussian"):
            raise InitializerError("%s: unknown rnd_type %r" % (name, rnd_type))
        if factor_type not in ("avg", "in", "out"):
            raise InitializerError("%s: unknown factor_type %r" % (name, factor_type))
        self.rnd_type, self.factor_type = rnd_type, factor_type
        self.magnitude, self.name = float(magnitude), name

    def scale(self, shape):
        """The ``scale`` of ``mxnet.init.Xavier._init_weight`` for a weight ``shape``."""
        if len(shape) < 2:
            raise InitializerError("%s initializer cannot be applied to a vector of shape %r;"
                                   " it requires at least 2D" % (self.name, tuple(shape)))
        hw_scale = math.prod(shape[2:]) if len(shape) > 2 else 1.0
        fan_in, fan_out = shape[1] * hw_scale, shape[0] * hw_scale
        factor = {"avg": (fan_in + fan_out) / 2.0, "in": fan_in, "out": fan_out}[self.factor_type]
        if factor == 0:
            raise InitializerError("%s: zero fan for shape %r" % (self.name, tuple(shape)))
        return math.sqrt(self.magnitude / factor)

    def _fill(self, seed, key, row_ids, shape, out):
        s = self.scale(shape)
        inner = UniformRows(-s, s) if self.rnd_type == "uniform" else NormalRows(s)
        inner._fill(seed, key, row_ids, shape, out)


# ----------------------------------------------------------------------- parsing
def _number(name, kwargs, arg, default=None, nonneg=True):
    v = kwargs.pop(arg, default)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
            or (nonneg and v < 0):
        raise InitializerError("%s: %s must be a finite%s number, got %r"
                               % (name, arg, " non-negative" if nonneg else "", v))
    return float(v)


def _constant_value(name, v):
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        a = None
    if a is None or isinstance(v, bool) or not np.all(np.isfinite(a)):
        raise InitializerError("%s: value must be a finite number or nested list of "
                               "numbers, got %r" % (name, v))
    return float(a) if a.ndim == 0 else a


def _make_zero(kw):
    return ConstantRows(0.0, "zero")


def _make_one(kw):
    return ConstantRows(1.0, "one")


def _make_constant(kw):
    if "value" not in kw:
        raise InitializerError("constant: missing 'value'")
    return ConstantRows(_constant_value("constant", kw.pop("value")))


def _make_uniform(kw):
    s = _number("uniform", kw, "scale", 0.07)
    return UniformRows(-s, s)


def _make_normal(kw):
    return NormalRows(_number("normal", kw, "sigma", 0.01))


def _make_xavier(kw):
    return XavierRows(kw.pop("rnd_type", "uniform"), kw.pop("factor_type", "avg"),
                      _number("xavier", kw, "magnitude", 3))


def _make_msraprelu(kw):
    slope = _number("msraprelu", kw, "slope", 0.25, nonneg=False)
    return XavierRows("gaussian", kw.pop("factor_type", "avg"), 2.0 / (1 + slope ** 2),
                      name="msraprelu")


_FACTORIES = {"zero": _make_zero, "one": _make_one, "constant": _make_constant,
              "uniform": _make_uniform, "normal": _make_normal,
              "xavier": _make_xavier, "msraprelu": _make_msraprelu}


def parse_initializer(dumps):
    """Parse ``mxnet.init.X(...).dumps()`` (``'["name", {kwargs}]'``).

    Raises :class:`InitializerError` for malformed strings, unsupported
    initializers, and unknown or invalid arguments."""
    try:
        spec = json.loads(dumps)
    except (TypeError, ValueError) as e:
        raise InitializerError("malformed initializer string %r: %s" % (dumps, e)) from None
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
            and isinstance(spec[1], dict)):
        raise InitializerError("initializer string must be JSON '[\"name\", {kwargs}]' "
                               "as produced by Initializer.dumps(), got %r" % (dumps,))
    name, kwargs = spec[0].lower(), dict(spec[1])
    if name not in _FACTORIES:
        raise InitializerError("unsupported initializer %r for lazily initialised row_sparse "
                               "weights (supported: %s)" % (spec[0], ", ".join(sorted(_FACTORIES))))
    init = _FACTORIES[name](kwargs)
    if kwargs:
        raise InitializerError("%s: unexpected arguments %s" % (name, sorted(kwargs)))
    return init
