"""MXNet's 2-bit gradient compression, server side: parse the settings command and dequantize pushes (numpy).

Matches src/kvstore/gradient_compression-inl.h ``dequantize_2bit``: value j lives in float word ``j >> 4``, byte
``(j & 15) >> 2`` of that word, bit pair ``j & 3`` counted from the most significant end. Both bits set means
``+threshold``, only the high bit ``-threshold``, anything else 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TWO_BIT = 1


class CompressionError(ValueError):
    """Unusable compression settings or payload."""


@dataclass(frozen=True)
class Compression:
    kind: int = 0           # 0 none, 1 2bit (CompressionType)
    threshold: np.float32 = np.float32(0.5)

    @classmethod
    def parse(cls, body: bytes) -> "Compression":
        """Parse the kSetGradientCompression body ``"<type>,<threshold>"`` (GradientCompression::DecodeParams)."""
        try:
            parts = body.decode("ascii").split(",")
            kind = int(parts[0])
            value = float(parts[1]) if len(parts) > 1 and parts[1] else 0.5
        except (UnicodeDecodeError, ValueError) as exc:
            raise CompressionError(f"bad gradient compression settings {body[:64]!r}") from exc
        if math.isfinite(value) and abs(value) > float(np.finfo(np.float32).max):
            # std::stof throws out_of_range here; np.float32() would give inf with an overflow warning
            raise CompressionError(f"gradient compression threshold {parts[1][:64]!r} is out of float32 range")
        threshold = np.float32(value)
        if kind not in (0, TWO_BIT):
            raise CompressionError(f"unsupported gradient compression type {kind}")
        return cls(kind, threshold)


def compressed_words(original_size: int) -> int:
    return -(-original_size // 16)


def dequantize_2bit(compressed: bytes, original_size: int, threshold: np.float32) -> np.ndarray:
    """float32 array of `original_size` values from the 2-bit payload (``ceil(n/16)`` float32 words)."""
    if original_size < 0:
        raise CompressionError(f"negative original size {original_size}")
    raw = np.frombuffer(compressed, dtype=np.uint8)
    if len(raw) != 4 * compressed_words(original_size):
        raise CompressionError(
            f"{len(raw)} compressed bytes cannot hold {original_size} values "
            f"(need {4 * compressed_words(original_size)})")
    j = np.arange(original_size, dtype=np.int64)
    byte = raw[(j >> 4) * 4 + ((j & 15) >> 2)]
    pair = (byte >> (6 - 2 * (j & 3)).astype(np.uint8)) & 3
    out = np.zeros(original_size, dtype=np.float32)
    out[pair == 3] = threshold
    out[pair == 2] = -threshold
    return out
