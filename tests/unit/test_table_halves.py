"""The storage-dtype conversions of a half table (``pskv.table._halves``, R17 of
docs/embeddings.md): bfloat16 kept as uint16 bit patterns, widened exactly and narrowed to
nearest even, checked against every pattern and against a plain per-value reference on
random, tied, subnormal, infinite, NaN and overflowing values; float16 through NumPy."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from pskv.table._halves import bf16_narrow, bf16_widen, narrow, storage_dtype, widen

_BF16_MAX = float(bf16_widen(np.array([0x7F7F], np.uint16))[0])     # 3.3895e38


def _ref_value(bits: int) -> Fraction | None:
    """The exact value of a finite bfloat16 pattern (no sign); 2**128 for the infinity
    pattern (the next value IEEE rounding compares against)."""
    e, m = (bits >> 7) & 0xFF, bits & 0x7F
    if e == 0xFF:
        return Fraction(2) ** 128 if m == 0 else None
    if e == 0:
        return Fraction(m, 128) * Fraction(2) ** -126
    return (1 + Fraction(m, 128)) * Fraction(2) ** (e - 127)


def _reference(x: float) -> int:
    """bfloat16 bits of ``x`` by the book: the two neighbours, the nearer, ties to even."""
    if x != x:
        return -1                                     # any NaN will do
    sign = 0x8000 if np.signbit(x) else 0
    a = Fraction(abs(x)) if abs(x) != float("inf") else None
    if a is None:
        return sign | 0x7F80
    lo = 0
    for step in (1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1):
        while lo + step <= 0x7F80 and _ref_value(lo + step) <= a:     # type: ignore[operator]
            lo += step
    if lo == 0x7F80:
        return sign | 0x7F80
    vlo, vhi = _ref_value(lo), _ref_value(lo + 1)
    assert vlo is not None and vhi is not None
    d_lo, d_hi = a - vlo, vhi - a
    pick = lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else lo + 1
    return sign | pick


def _check(values: np.ndarray) -> None:
    got = bf16_narrow(values)
    for x, g in zip(values.tolist(), got.tolist()):
        want = _reference(x)
        if want < 0:
            assert (g & 0x7F80) == 0x7F80 and (g & 0x7F), (x, hex(g))   # still a NaN
        else:
            assert g == want, (x, hex(g), hex(want))


def test_every_bfloat16_pattern_widens_and_narrows_back_to_itself() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = bf16_widen(bits)
    assert wide.dtype == np.float32
    nan = np.isnan(wide)
    assert int(nan.sum()) == 2 * 127               # 0x7F81..0x7FFF and 0xFF81..0xFFFF
    back = bf16_narrow(wide)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    assert np.isnan(bf16_widen(back[nan])).all()    # a NaN stays a NaN
    with np.errstate(invalid="ignore"):           # signalling NaNs among the patterns
        wide64 = wide.astype(np.float64)
    np.testing.assert_array_equal(bf16_narrow(wide64)[~nan], bits[~nan])


def test_narrowing_float32_matches_the_reference() -> None:
    rng = np.random.default_rng(7)
    rand = rng.integers(0, 1 << 32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    halfway = (rng.integers(0, 1 << 16, 500, dtype=np.uint32) << 16 | 0x8000).astype(
        np.uint32).view(np.float32)                   # exact ties, odd and even alike
    sub = (rng.integers(0, 1 << 23, 500, dtype=np.uint32)).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan,
                      np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      _BF16_MAX, np.nextafter(np.float32(_BF16_MAX), np.float32(np.inf)),
                      np.finfo(np.float32).tiny, np.float32(1e-45), 1.0, 1.00390625,
                      1.0078125 + 2**-8, 1.0 + 2**-8], np.float32)
    _check(np.concatenate([rand, halfway, -halfway, sub, edges]))


def test_overflow_rounds_to_infinity_as_ieee() -> None:
    top = np.float32(_BF16_MAX)
    half_ulp = 2.0 ** (127 - 8)            # half of bfloat16's ulp at the top binade
    just_under = np.nextafter(np.float32(_BF16_MAX + half_ulp), np.float32(0))
    got = bf16_narrow(np.array([top, just_under, _BF16_MAX + half_ulp,
                                np.finfo(np.float32).max], np.float32))
    assert got.tolist() == [0x7F7F, 0x7F7F, 0x7F80, 0x7F80]


def test_narrowing_float64_rounds_once() -> None:
    """A float64 row (state_dtype='float64') is rounded once, not through float32 to
    nearest (round-to-odd in between)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(2000) * np.exp2(rng.integers(-140, 130, 2000))
    # just above a tie of bfloat16 (by less than float32 can tell): rounded to nearest
    # float32 first, it would become the tie and go to the even (lower) neighbour
    even = rng.integers(0x0080, 0x7F00, 300).astype(np.uint16) & np.uint16(0xFFFE)
    lo, hi = (bf16_widen(b).astype(np.float64) for b in (even, even + np.uint16(1)))
    nudged = (lo + hi) / 2 * (1 + 2.0 ** -40)
    assert (bf16_narrow(nudged.astype(np.float32)) == even).all()
    assert (bf16_narrow(nudged) == even + 1).all()
    _check(np.concatenate([x, nudged, -nudged, [1e39, -1e39, 1e-50, np.inf, np.nan]]))


def test_float16_goes_through_numpy_and_the_storage_dtypes() -> None:
    x = np.array([1.0, 65504.0, 65520.0, 1e9, -np.inf, np.nan, 2**-24, 2**-26], np.float32)
    got = narrow(x, "float16")
    assert got.dtype == np.float16
    assert got[:5].tolist() == [1.0, 65504.0, np.inf, np.inf, -np.inf]
    assert np.isnan(got[5]) and got[6] == 2**-24 and got[7] == 0
    assert widen(got, "float16", np.float32).dtype == np.float32
    assert [storage_dtype(n).name for n in ("float16", "bfloat16", "float32", "float64")] \
        == ["float16", "uint16", "float32", "float64"]
    bits = narrow(np.array([1.5], np.float32), "bfloat16")
    assert widen(bits, "bfloat16", np.float64).tolist() == [1.5]


@pytest.mark.parametrize("name", ["float32", "float64"])
def test_full_dtypes_pass_through(name: str) -> None:
    x = np.array([1.1, -2.2], name)
    assert narrow(x, name) is x and widen(x, name, name) is x
