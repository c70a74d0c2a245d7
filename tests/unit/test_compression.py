"""Unit tests of pskv.compression: MXNet's 2bit/1bit packing, residuals and parameters."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pskv import compression
from pskv.compression import OneBitCompression, TwoBitCompression, create, normalize_params
from pskv.errors import ConfigError, ShapeMismatchError, ValueTypeError

F32 = np.float32


# -- a slow scalar oracle, written from MXNet's kernels (gradient_compression-inl.h) ---------
def oracle_quantize(kind: str, t: float, grad: np.ndarray, residual: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """quantize_2bit (1.9.1) / quantize_1bit (2.0) one element at a time; returns
    (packed bytes, dequantized values) and updates ``residual``."""
    t32 = F32(t)
    n = grad.size
    factor = 16 if kind == "2bit" else 32
    words = -(-n // factor)
    out = bytearray(4 * words)
    deq = np.zeros(n, F32)
    for i in range(n):
        residual[i] = F32(residual[i] + grad[i])
        if kind == "2bit":
            byte, col = i // 4, i % 4
            if residual[i] >= t32:
                out[byte] |= (0xC0, 0x30, 0x0C, 0x03)[col]
                residual[i] = F32(residual[i] - t32)
                deq[i] = t32
            elif residual[i] <= -t32:
                out[byte] |= (0x80, 0x20, 0x08, 0x02)[col]
                residual[i] = F32(residual[i] - (-t32))
                deq[i] = -t32
        else:
            byte, col = i // 8, i % 8
            if residual[i] > t32:
                out[byte] |= 0x80 >> col
                residual[i] = F32(residual[i] - F32(1))
                deq[i] = 1
            else:
                residual[i] = F32(residual[i] + F32(1))
                deq[i] = -1
    return np.frombuffer(bytes(out), np.uint8), deq


def words(packed: np.ndarray) -> list[int]:
    return [int(w) for w in packed.view(np.uint32)]


# -- packing of hand-made examples -------------------------------------------------------------
@pytest.mark.parametrize("values, expected", [
    ([0.5] * 16, [0xFFFFFFFF]),
    ([-0.5] * 16, [0xAAAAAAAA]),
    ([0.0] * 16, [0x0]),
    ([0.5] + [0.0] * 15, [0x000000C0]),       # value 0: top two bits of byte 0
    ([0.0] * 3 + [0.5] + [0.0] * 12, [0x03]),  # value 3: low two bits of byte 0
    ([0.0] * 4 + [-0.5] + [0.0] * 11, [0x8000]),  # value 4: byte 1 (little-endian word)
    ([0.0] * 15 + [0.5], [0x03000000]),      # value 15: low bits of byte 3
    ([1, -1, 0, 0.5], [0xE3]),               # 11 10 00 11
    ([0.0] * 16 + [-0.7], [0, 0x80]),          # 17 values: second word, padding zero
])
def test_2bit_bit_patterns(values: list[float], expected: list[int]) -> None:
    gc = TwoBitCompression(0.5)
    packed = gc.compress(np.array(values, F32), np.zeros(len(values), F32))
    assert packed.dtype == F32 and packed.shape == (len(expected),)
    assert words(packed) == expected


@pytest.mark.parametrize("values, threshold, expected", [
    ([1.0] * 32, 0.5, [0xFFFFFFFF]),
    ([0.0] * 32, 0.5, [0x0]),
    ([1.0] + [0.0] * 31, 0.5, [0x80]),          # value 0: top bit of byte 0
    ([0.0] * 7 + [1.0], 0.5, [0x01]),           # value 7: low bit of byte 0
    ([0.0] * 8 + [1.0], 0.5, [0x8000]),         # value 8: byte 1
    ([0.0] * 31 + [1.0], 0.5, [0x01000000]),
    ([0.0] * 5, -1.0, [0xF8]),                  # 0 > -1: five ones, padding bits stay zero
    ([0.0] * 33, -1.0, [0xFFFFFFFF, 0x80]),
])
def test_1bit_bit_patterns(values: list[float], threshold: float, expected: list[int]) -> None:
    gc = OneBitCompression(threshold)
    packed = gc.compress(np.array(values, F32), np.zeros(len(values), F32))
    assert words(packed) == expected


def test_2bit_code_01_dequantizes_to_zero() -> None:
    # MXNet never writes 01, and its dequantizer reads it as 0
    gc = TwoBitCompression(0.5)
    packed = np.array([0x40 | 0x0C | 0x02], np.uint32).view(F32)
    np.testing.assert_array_equal(gc.decompress(packed, 4), [0, 0, 0.5, -0.5])


def test_1bit_dequantizes_to_plus_minus_one_whatever_threshold() -> None:
    gc = OneBitCompression(3.0)
    packed = np.array([0x80], np.uint32).view(F32)
    np.testing.assert_array_equal(gc.decompress(packed, 3), [1, -1, -1])


# -- residuals and thresholds ------------------------------------------------------------------
def test_2bit_residual_over_several_pushes() -> None:
    gc = TwoBitCompression(0.5)
    residual = np.zeros(2, F32)
    grad = np.array([0.3, -0.3], F32)
    seen = [gc.roundtrip(grad, residual).tolist() for _ in range(4)]
    assert seen == [[0, 0], [0.5, -0.5], [0, 0], [0.5, -0.5]]
    want = F32(F32(F32(F32(F32(0.3) + F32(0.3)) - F32(0.5)) + F32(0.3)) + F32(0.3)) - F32(0.5)
    assert residual[0] == want and residual[1] == -want


def test_2bit_threshold_is_inclusive() -> None:
    gc = TwoBitCompression(0.25)
    residual = np.zeros(3, F32)
    q = gc.roundtrip(np.array([0.25, -0.25, np.nextafter(F32(0.25), F32(0))], F32), residual)
    np.testing.assert_array_equal(q, [0.25, -0.25, 0])
    np.testing.assert_array_equal(residual, [0, 0, np.nextafter(F32(0.25), F32(0))])


def test_1bit_threshold_is_strict_and_residual_moves_by_one() -> None:
    gc = OneBitCompression(0.5)
    residual = np.array([0.0, 0.0, 2.0], F32)
    q = gc.roundtrip(np.array([0.5, 0.75, 0.0], F32), residual)
    np.testing.assert_array_equal(q, [-1, 1, 1])
    np.testing.assert_array_equal(residual, [1.5, -0.25, 1.0])


def test_nan_and_inf_follow_mxnet() -> None:
    gc = TwoBitCompression(0.5)
    residual = np.zeros(3, F32)
    q = gc.roundtrip(np.array([np.nan, np.inf, -np.inf], F32), residual)
    np.testing.assert_array_equal(q, [0, 0.5, -0.5])
    np.testing.assert_array_equal(residual, [np.nan, np.inf, -np.inf])


@pytest.mark.parametrize("kind, threshold", [("2bit", 0.5), ("2bit", 0.1), ("1bit", 0.0),
                                             ("1bit", 0.3), ("1bit", -0.2)])
@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 100, 1000])
def test_matches_scalar_oracle(kind: str, threshold: float, size: int) -> None:
    rng = np.random.default_rng(size)
    gc = create({"type": kind, "threshold": threshold})
    assert gc is not None
    residual = rng.standard_normal(size).astype(F32) * F32(0.2)
    ref_residual = residual.copy()
    for step in range(3):
        grad = (rng.standard_normal(size) * 0.4).astype(F32)
        ref_bytes, ref_deq = oracle_quantize(kind, threshold, grad, ref_residual)
        res_before = residual.copy()
        packed = gc.compress(grad, residual)
        assert packed.shape == (gc.packed_size(size),)
        assert packed.view(np.uint8).tobytes() == ref_bytes.tobytes(), step
        np.testing.assert_array_equal(residual, ref_residual)
        np.testing.assert_array_equal(gc.decompress(packed, size), ref_deq)
        again = res_before.copy()
        np.testing.assert_array_equal(gc.roundtrip(grad, again), ref_deq)
        np.testing.assert_array_equal(again, ref_residual)


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
@pytest.mark.parametrize("size", [compression._CHUNK - 1, compression._CHUNK + 1,
                                  2 * compression._CHUNK + 37])
def test_chunk_boundaries(kind: str, size: int) -> None:
    rng = np.random.default_rng(7)
    gc = create({"type": kind, "threshold": 0.3})
    assert gc is not None
    grad = rng.standard_normal(size).astype(F32)
    residual = np.zeros(size, F32)
    ref_residual = residual.copy()
    ref_bytes, ref_deq = oracle_quantize(kind, 0.3, grad[:0], ref_residual[:0])  # warm-up
    # vectorized oracle for big sizes: residual + grad, then MXNet's comparisons
    s = ref_residual + grad
    if kind == "2bit":
        ref_deq = np.where(s >= F32(0.3), F32(0.3), np.where(s <= -F32(0.3), -F32(0.3), F32(0)))
    else:
        ref_deq = np.where(s > F32(0.3), F32(1), F32(-1))
    packed = gc.compress(grad, residual)
    np.testing.assert_array_equal(residual, s - ref_deq)
    np.testing.assert_array_equal(gc.decompress(packed, size), ref_deq)
    del ref_bytes


def test_roundtrip_in_place_and_shapes() -> None:
    gc = TwoBitCompression(0.5)
    grad = np.array([[0.6, -0.6, 0.1], [1.0, 0.0, -2.0]], F32)
    expected = gc.roundtrip(grad, np.zeros(6, F32))
    assert expected.shape == (2, 3)
    residual = np.zeros((2, 3), F32)
    out = gc.roundtrip(grad, residual, out=grad)
    assert out is grad
    np.testing.assert_array_equal(grad, expected)
    np.testing.assert_allclose(residual.ravel(), [0.1, -0.1, 0.1, 0.5, 0, -1.5], rtol=1e-6)


def test_compress_out_and_decompress_out() -> None:
    gc = OneBitCompression(0.0)
    grad = np.linspace(-1, 1, 40, dtype=F32)
    out = np.full(2, 123.0, F32)  # garbage must be overwritten, padding zeroed
    assert gc.compress(grad, np.zeros(40, F32), out=out) is out
    assert words(out)[1] & 0xFFFF0000 == 0
    dec = np.empty(40, F32)
    assert gc.decompress(out, 40, out=dec) is dec
    np.testing.assert_array_equal(dec, np.where(grad > 0, 1, -1))


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_word_aligned_slices_decompress_independently(kind: str) -> None:
    # MXNet's dist worker sends part_compr words with part_compr * factor values to
    # each server (kvstore_dist.h EncodeCompressedKey); each part must decode alone
    gc = create({"type": kind, "threshold": 0.2})
    assert gc is not None
    grad = np.random.default_rng(3).standard_normal(1000).astype(F32)
    packed = gc.compress(grad, np.zeros(1000, F32))
    whole = gc.decompress(packed, 1000)
    cut = 20 * gc.factor
    np.testing.assert_array_equal(gc.decompress(packed[:20], cut), whole[:cut])
    np.testing.assert_array_equal(gc.decompress(packed[20:], 1000 - cut), whole[cut:])


def test_empty() -> None:
    for gc in (TwoBitCompression(), OneBitCompression()):
        packed = gc.compress(np.zeros(0, F32), np.zeros(0, F32))
        assert packed.shape == (0,)
        assert gc.decompress(packed, 0).shape == (0,)
        assert gc.roundtrip(np.zeros((0, 3), F32), np.zeros(0, F32)).shape == (0, 3)


def test_packed_size() -> None:
    two, one = TwoBitCompression(), OneBitCompression()
    assert [two.packed_size(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert [one.packed_size(n) for n in (0, 1, 32, 33, 64, 65)] == [0, 1, 1, 2, 2, 3]
    assert (two.factor, one.factor) == (16, 32)


# -- parameters --------------------------------------------------------------------------------
def test_create_and_params() -> None:
    gc = create({"type": "2bit"})
    assert isinstance(gc, TwoBitCompression)
    assert gc.type == "2bit" and gc.threshold == 0.5
    assert gc.params == {"type": "2bit", "threshold": 0.5}
    assert json.loads(json.dumps(gc.params)) == gc.params
    one = create({"type": "1bit"})
    assert isinstance(one, OneBitCompression) and one.threshold == 0.5  # 2.0's default
    assert create({"type": "none"}) is None
    assert normalize_params({"type": "none"}) == {"type": "none"}
    assert create({"type": "1bit", "threshold": -0.5}) == OneBitCompression(-0.5)
    assert repr(create({"type": "1bit", "threshold": 0})) == "OneBitCompression(threshold=0.0)"


@pytest.mark.parametrize("threshold", [0.1, 1.1, "0.1", "1.8326419", "7.2e-1", 3e-7,
                                       np.float32(0.3), np.float64(0.7), 2, "2"])
def test_params_round_trip_exactly(threshold: object) -> None:
    gc = create({"type": "2bit", "threshold": threshold})
    assert gc is not None
    assert F32(gc.threshold) == gc.threshold  # a float32 value
    assert create(gc.params) == gc
    assert create(json.loads(json.dumps(gc.params))) == gc


@pytest.mark.parametrize("text, value", [
    # values MXNet 1.9.1 parsed (observed by pushing 1e30 and pulling the threshold back);
    # dmlc::stof is not correctly rounded, so these differ from float32(float(text))
    ("1.8326419", 1.832641839981079),
    ("7.2e-1", 0.7199999690055847),
    ("3.987116", 3.9871158599853516),
    ("6.85e-12", 6.849999734104273e-12),
    ("0.1f", 0.10000000149011612),
    (" 2.5", 2.5),
    ("3.3e+2", 330.0),
])
def test_threshold_strings_parse_as_dmlc(text: str, value: float) -> None:
    assert normalize_params({"type": "2bit", "threshold": text})["threshold"] == value


@pytest.mark.parametrize("params, fragment", [
    ({"type": "3bit"}, "unknown gradient compression type '3bit'"),
    ({"type": "2BIT"}, "unknown gradient compression type"),
    ({"threshold": 0.5}, "no 'type'"),
    ({"type": "2bit", "threshold": 0}, "greater than 0"),
    ({"type": "2bit", "threshold": -1.0}, "greater than 0"),
    ({"type": "2bit", "threshold": "-0.5"}, "greater than 0"),
    ({"type": "2bit", "threshold": 1e-50}, "not a finite float32 number"),  # dmlc: out of range
    ({"type": "2bit", "threshold": "abc"}, "not a finite float32 number"),
    ({"type": "2bit", "threshold": "0.5x"}, "not a finite float32 number"),
    ({"type": "2bit", "threshold": float("nan")}, "not a finite float32 number"),
    ({"type": "1bit", "threshold": "inf"}, "not a finite float32 number"),
    ({"type": "2bit", "threshold": True}, "not a finite float32 number"),
    ({"type": "2bit", "threshold": None}, "not a finite float32 number"),
    ({"type": "2bit", "thresh": 0.5}, "unknown gradient compression parameter(s) 'thresh'"),
])
def test_bad_params(params: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        create(params)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_params_must_be_a_dict() -> None:
    with pytest.raises(ConfigError, match="must be a dict"):
        create([("type", "2bit")])  # type: ignore[arg-type]


def test_2bit_constructor_rejects_non_positive() -> None:
    with pytest.raises(ConfigError):
        TwoBitCompression(0.0)


# -- bad arrays --------------------------------------------------------------------------------
def test_only_float32() -> None:
    gc = TwoBitCompression()
    with pytest.raises(ShapeMismatchError, match="float32 arrays only.*float64"):
        gc.compress(np.zeros(4), np.zeros(4, F32))
    with pytest.raises(ShapeMismatchError, match="residual has dtype float16"):
        gc.roundtrip(np.zeros(4, F32), np.zeros(4, np.float16))
    with pytest.raises(ShapeMismatchError):
        gc.compress(np.zeros(4, np.int32), np.zeros(4, F32))


def test_bad_residual_and_out() -> None:
    gc = TwoBitCompression()
    grad = np.zeros(20, F32)
    with pytest.raises(ShapeMismatchError, match="residual has 19 values"):
        gc.compress(grad, np.zeros(19, F32))
    with pytest.raises(ValueTypeError, match="NumPy float32 array"):
        gc.compress(grad, [0.0] * 20)  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match="C-contiguous"):
        gc.compress(grad, np.zeros(40, F32)[::2])
    frozen = np.zeros(20, F32)
    frozen.flags.writeable = False
    with pytest.raises(ShapeMismatchError, match="writable"):
        gc.compress(grad, frozen)
    with pytest.raises(ShapeMismatchError, match="2 values"):
        gc.compress(grad, np.zeros(20, F32), out=np.zeros(3, F32))
    with pytest.raises(ShapeMismatchError, match="20 values"):
        gc.roundtrip(grad, np.zeros(20, F32), out=np.zeros(21, F32))


def test_bad_packed() -> None:
    gc = TwoBitCompression()
    with pytest.raises(ShapeMismatchError, match="takes 2 float32 words"):
        gc.decompress(np.zeros(1, F32), 17)
    with pytest.raises(ShapeMismatchError, match="not contiguous"):
        gc.decompress(np.zeros(4, F32)[::2], 17)
    # the same bytes in another dtype are accepted
    packed = np.array([0xC0, 0, 0, 0], np.uint8)
    np.testing.assert_array_equal(gc.decompress(packed, 2), [0.5, 0])


def test_equality_and_hash() -> None:
    assert TwoBitCompression(0.5) == create({"type": "2bit", "threshold": "0.5"})
    assert TwoBitCompression(0.5) != OneBitCompression(0.5)
    assert len({TwoBitCompression(0.5), TwoBitCompression(0.5), OneBitCompression(0.5)}) == 2
    assert TwoBitCompression(0.5) != "2bit"
