"""2-bit gradient compression, server side: kvstore_lazy.numerics.compression against a pure-Python reference written
from the
facts sheet's bit layout, against real compressed pushes captured from a stock MXNet 1.9.1 worker, and against MXNet's
own dequantize (run in this process through a 'device' KVStore with 2-bit compression on a CPU context).
"""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore_lazy.numerics.compression import TWO_BIT, Compression, CompressionError, compressed_words, dequantize_2bit
from kvstore_lazy.protocol.message import Message, decode_kv
from wire_fixtures import load_fixture

PROFILE = settings(database=None, deadline=None)

# the gradient the captured worker pushed twice (see the header of worker_compressed_session.hex)
CAPTURED_N = 37
CAPTURED_THRESHOLD = np.float32(0.5)


def captured_gradient() -> np.ndarray:
    return np.random.RandomState(0).uniform(-1, 1, CAPTURED_N).astype(np.float32)


SESSION = load_fixture("worker_compressed_session.hex")


def captured_push(i: int) -> tuple[int, bytes]:
    """(original size, compressed payload) of the i-th captured compressed push."""
    kv = decode_kv(Message.from_frames(SESSION[f"compressed_push_{i}"]).data)
    return int(kv.keys[0]), bytes(kv.vals)  # S=1: key range begins at 0, keys[0] is the dummy carrying the size


# ---------------------------------------------------------------------------------------------------------------
# references


def reference_dequantize(compressed: bytes, n: int, threshold) -> list[float]:
    """pslite-wire.md (e): value j lives in word j>>4, byte (j&15)>>2 of that word; posbits {0xc0,0x30,0x0c,0x03}[j&3]
    -> +threshold, negbits {0x80,0x20,0x08,0x02}[j&3] -> -threshold, otherwise 0."""
    posbits, negbits = (0xC0, 0x30, 0x0C, 0x03), (0x80, 0x20, 0x08, 0x02)
    out = []
    for j in range(n):
        byte = compressed[4 * (j >> 4) + ((j & 15) >> 2)]
        masked = byte & posbits[j & 3]
        if masked == posbits[j & 3]:
            out.append(float(np.float32(threshold)))
        elif masked == negbits[j & 3]:
            out.append(-float(np.float32(threshold)))
        else:
            out.append(0.0)
    return out


def reference_quantize(grad: np.ndarray, residual: np.ndarray, threshold) -> bytes:
    """MXNet's quantize_2bit kernel (src/kvstore/gradient_compression-inl.h), in float32: residual += grad; if
    residual >= t: set posbits, residual -= t; elif residual <= -t: set negbits, residual += t. Updates residual."""
    t = np.float32(threshold)
    posbits, negbits = (0xC0, 0x30, 0x0C, 0x03), (0x80, 0x20, 0x08, 0x02)
    out = bytearray(4 * compressed_words(len(grad)))
    for i in range(len(grad)):
        residual[i] = np.float32(residual[i] + grad[i])
        byte = 4 * (i >> 4) + ((i & 15) >> 2)
        if residual[i] >= t:
            out[byte] |= posbits[i & 3]
            residual[i] = np.float32(residual[i] - t)
        elif residual[i] <= -t:
            out[byte] |= negbits[i & 3]
            residual[i] = np.float32(residual[i] + t)
    return bytes(out)


# ---------------------------------------------------------------------------------------------------------------
# against the pure-Python reference


@pytest.mark.parametrize("n", [0, 1, 3, 4, 15, 16, 17, 31, 32, 33, 100])
def test_dequantize_matches_reference_on_every_bit_pattern(n):
    rng = np.random.RandomState(n)
    payload = rng.randint(0, 256, 4 * compressed_words(n)).astype(np.uint8).tobytes()
    out = dequantize_2bit(payload, n, np.float32(0.25))
    assert out.dtype == np.float32 and out.shape == (n,)
    assert out.tolist() == reference_dequantize(payload, n, 0.25)


def test_bit_pairs_are_read_from_the_most_significant_end():
    # one byte = values 0..3: 0b11_10_01_00 -> +t, -t, 0, 0; byte 1 of word 0 holds values 4..7; word 1 holds 16..
    payload = bytes([0b11100100, 0b00001011, 0, 0, 0b01000011, 0, 0, 0])
    out = dequantize_2bit(payload, 20, np.float32(1.5))
    assert out.tolist() == [1.5, -1.5, 0, 0] + [0, 0, -1.5, 1.5] + [0] * 8 + [0, 0, 0, 1.5]


@settings(PROFILE, max_examples=200)
@given(st.integers(0, 80).flatmap(lambda n: st.tuples(st.just(n), st.binary(min_size=4 * compressed_words(n),
                                                                            max_size=4 * compressed_words(n)))),
       st.floats(min_value=2.0 ** -20, max_value=2.0 ** 20, width=32))
def test_dequantize_matches_reference_property(case, threshold):
    n, payload = case
    assert dequantize_2bit(payload, n, np.float32(threshold)).tolist() == reference_dequantize(payload, n, threshold)


@pytest.mark.parametrize("payload, n", [(b"", 1), (b"\x00" * 4, 17), (b"\x00" * 8, 16), (b"\x00" * 3, 1),
                                        (b"\x00" * 4, 0)])
def test_dequantize_rejects_wrong_payload_sizes(payload, n):
    with pytest.raises(CompressionError):
        dequantize_2bit(payload, n, np.float32(0.5))


def test_dequantize_rejects_a_negative_size():
    with pytest.raises(CompressionError):
        dequantize_2bit(b"", -5, np.float32(0.5))


def test_dequantize_empty():
    assert dequantize_2bit(b"", 0, np.float32(0.5)).shape == (0,)


# ---------------------------------------------------------------------------------------------------------------
# against real compressed pushes from a stock worker


def test_captured_pushes_are_mxnet_quantize_with_residual():
    """The bytes the stock worker sent are exactly MXNet's quantize kernel (as re-implemented above) applied to
    the gradient and the residual left by the previous push; this validates the reference quantizer."""
    g = captured_gradient()
    residual = np.zeros(CAPTURED_N, np.float32)
    for i in (1, 2):
        n, payload = captured_push(i)
        assert n == CAPTURED_N and len(payload) == 4 * compressed_words(CAPTURED_N) == 12
        assert reference_quantize(g, residual, CAPTURED_THRESHOLD) == payload


def test_captured_pushes_dequantize_like_the_reference():
    for i in (1, 2):
        n, payload = captured_push(i)
        out = dequantize_2bit(payload, n, CAPTURED_THRESHOLD)
        assert out.tolist() == reference_dequantize(payload, n, CAPTURED_THRESHOLD)
        assert set(out.tolist()) == {-0.5, 0.0, 0.5}  # all three codes occur


def test_captured_compression_settings_body():
    body = Message.from_frames(SESSION["set_gradient_compression"]).meta.body
    assert body == b"1,0.500000"  # std::to_string(float): 6 decimals
    assert Compression.parse(body) == Compression(TWO_BIT, np.float32(0.5))


# ---------------------------------------------------------------------------------------------------------------
# against MXNet itself


@pytest.fixture(scope="module")
def mxnet():
    import os
    assert os.environ.get("DMLC_ROLE") in (None, "worker")  # conftest removes DMLC_*; importing mxnet is harmless
    return pytest.importorskip("mxnet")


def mxnet_dequantized(mx, grad: np.ndarray, threshold: float, pushes: int) -> list[np.ndarray]:
    """What MXNet's own dequantize_2bit produces for `pushes` successive pushes of `grad` (with its residual).

    A 'device' KVStore with 2-bit compression quantizes every push (with a per-key residual) and dequantizes it
    into the merge buffer (CommDevice::ReduceCompressed), even for a single CPU context; with no updater the store
    takes that value, which a pull returns."""
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init(0, mx.nd.zeros(grad.shape))
    out = []
    for _ in range(pushes):
        kv.push(0, mx.nd.array(grad, dtype="float32"))
        result = mx.nd.zeros(grad.shape)
        kv.pull(0, out=result)
        out.append(result.asnumpy())
    return out


def test_captured_pushes_dequantize_like_mxnet(mxnet):
    """Our dequantize of the real bytes equals what MXNet's dequantize makes of the same quantization."""
    expected = mxnet_dequantized(mxnet, captured_gradient(), float(CAPTURED_THRESHOLD), 2)
    for i in (1, 2):
        n, payload = captured_push(i)
        ours = dequantize_2bit(payload, n, CAPTURED_THRESHOLD)
        assert ours.dtype == expected[i - 1].dtype == np.float32
        np.testing.assert_array_equal(ours, expected[i - 1])


@pytest.mark.parametrize("n, threshold, scale", [
    (1, 0.5, 1.0), (16, 0.5, 1.0), (17, 0.3, 1.0), (1000, 0.5, 1.0), (333, 2.0, 3.0), (64, 0.1, 0.05),
])
def test_dequantize_matches_mxnet(mxnet, n, threshold, scale):
    """Random gradients, several pushes (so the residual matters), thresholds that are not exact in float32."""
    grad = (np.random.RandomState(n).standard_normal(n) * scale).astype(np.float32)
    expected = mxnet_dequantized(mxnet, grad, threshold, 3)
    residual = np.zeros(n, np.float32)
    t = Compression.parse(b"1,%f" % threshold).threshold  # the body MXNet's worker would send
    for step in range(3):
        payload = reference_quantize(grad, residual, t)
        np.testing.assert_array_equal(dequantize_2bit(payload, n, t), expected[step])


# ---------------------------------------------------------------------------------------------------------------
# settings command


@pytest.mark.parametrize("body, kind, threshold", [
    (b"1,0.500000", 1, 0.5),
    (b"1,0.300000", 1, np.float32(0.3)),
    (b"1,2.000000", 1, 2.0),
    (b"1", 1, 0.5),          # DecodeParams keeps the default threshold when it is missing or empty
    (b"1,", 1, 0.5),
    (b"0,0.500000", 0, 0.5),  # kNone
    (b"1,1e-3", 1, np.float32(1e-3)),
])
def test_parse(body, kind, threshold):
    c = Compression.parse(body)
    assert c.kind == kind and c.threshold == np.float32(threshold) and isinstance(c.threshold, np.float32)


@pytest.mark.parametrize("body", [
    b"", b",0.5", b"2bit,0.5", b"1,abc", b"1,0.5x", b"\xff,0.5", b"2,0.5", b"-1,0.5", b"1,1e300", b"1,-1e39",
])
def test_parse_rejects_bad_bodies(body):
    with pytest.raises(CompressionError):
        Compression.parse(body)


def test_default_is_no_compression():
    assert Compression().kind == 0
