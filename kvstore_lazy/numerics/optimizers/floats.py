"""How MXNet turns Python hyper-parameters into the float32 arguments of its kernels, and the small float32 helpers
every update rule shares.

Owns: ``_dmlc_parse`` (dmlc-core's inexact ``ParseFloat``, step by step: the reference the compiled parser in
``_fast.c`` is tested against), the three conversions (``_op_f32`` for an op's dmlc::Parameter field,
``_scalar_f32`` for an NDArray-scalar op, ``_tuple_f32`` for a Tuple<float> element), the float32 literals and
``_clip`` / ``_sign``.
Does not own: which conversion an optimizer uses where (each update rule says so), the compiled update kernels
(``compiled.py``).

Why not just ``np.float32(value)``: MXNet's ops receive scalars as ``str(value)`` and parse them with dmlc-core's
``ParseFloat``, which is not correctly rounded; copying it is what makes the updates bit-identical to MXNet's.
The names keep their leading underscore: they are the package's own, not part of its interface.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from kvstore_lazy.protocol.fast import native

_f32 = np.float32
_ONE = _f32(1)   # np.float32(1) + 1 would be float64 in numpy 1.23; keep literals float32
_NO_CLIP = _f32(-1)
_parse_float32 = native.parse_float32


@functools.lru_cache(maxsize=4096)
def _dmlc_parse(text: str, ftype: type) -> Any:
    """dmlc::ParseFloat<ftype> (dmlc-core strtonum.h), step by step.

    It is not correctly rounded. About 14% of random values parse 1 ulp away
    from np.float32(value).
    """
    s, i, neg = text.strip(), 0, False
    if s[:1] in ('+', '-'):
        neg, i = s[0] == '-', 1
    low = s[i:].lower()
    if low.startswith('inf') or low.startswith('nan'):
        value = ftype('inf' if low.startswith('inf') else 'nan')
        return -value if neg else value
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    value = ftype(int(s[i:j] or '0'))
    i = j
    if s[i:i + 1] == '.':
        j = i = i + 1
        while j < len(s) and s[j].isdigit():
            j += 1
        digits = s[i:j][:19]          # kStrtofMaxDigits
        if digits:
            value = ftype(value + ftype(int(digits) / float(10 ** len(digits))))
        i = j
    if s[i:i + 1] in ('e', 'E'):
        i += 1
        frac = s[i:i + 1] == '-'
        if s[i:i + 1] in ('+', '-'):
            i += 1
        j = i
        while j < len(s) and s[j].isdigit():
            j += 1
        expon = min(int(s[i:j] or '0'), 38 if ftype is _f32 else 308)
        scale = ftype(1.0)
        while expon >= 8:
            scale, expon = ftype(scale * ftype(1e8)), expon - 8
        while expon > 0:
            scale, expon = ftype(scale * ftype(10.0)), expon - 1
        value = ftype(value / scale) if frac else ftype(value * scale)
    return -value if neg else value


def _op_f32(value: Any) -> np.float32:
    """A `float` field of an optimizer op's dmlc::Parameter (lr, wd, rescale_grad, ...). The compiled parser
    (_fast.c parse_float32, the same steps) takes str(float)'s text: Adam's lr is a new value every update; the
    other fields are the same every update, so each text's value is kept (a bounded table)."""
    text = str(value)
    known = _OP_F32.get(text)
    if known is None:
        parsed = _parse_float32(text)
        known = _dmlc_parse(text, _f32) if parsed is None else _f32(parsed)
        if len(_OP_F32) >= 1024:
            _OP_F32.clear()
        _OP_F32[text] = known
    return known


_OP_F32: dict[str, np.float32] = {}


def _scalar_f32(value: Any) -> np.float32:
    """The scalar of an NDArray-scalar op (``x * 0.5``): a parsed double cast to float32."""
    return _f32(_dmlc_parse(str(float(value)), float))


def _tuple_f32(value: Any) -> np.float32:
    """An element of a Tuple<float> field (multi_sgd lrs/wds): std::istream, i.e. strtof."""
    return _f32(float(value))


def _clip(x: np.ndarray, bound: np.float32) -> np.ndarray:
    return np.clip(x, -bound, bound)


def _sign(x: np.ndarray) -> np.ndarray:
    return (x > 0).astype(_f32) - (x < 0).astype(_f32)
