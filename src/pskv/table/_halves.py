"""A table's storage dtypes and the conversions between a stored row and its compute dtype.

A table stores its rows in ``TableSpec.dtype`` and computes in ``TableSpec.state_dtype``
(docs/embeddings.md R17). float32 and float64 are NumPy's own; float16 is NumPy's
``float16``; bfloat16, which NumPy lacks, is stored as ``uint16`` bit patterns: the high 16
bits of a float32. :func:`widen` is exact; :func:`narrow` rounds to nearest, ties to even,
as IEEE 754 does: a NaN stays a NaN, an infinity stays one, a finite value past the largest
finite half value rounds to infinity. No third-party dtype package is used.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["HALVES", "STORAGE", "bf16_narrow", "bf16_widen", "narrow", "storage_dtype",
           "widen"]

#: the storage dtypes kept in 2 bytes, computed in float32 or float64
HALVES = ("float16", "bfloat16")
#: storage dtype name -> the NumPy dtype of the array that holds it
STORAGE: dict[str, np.dtype[Any]] = {
    "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}


def storage_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype of the arrays holding rows stored as ``name``."""
    return STORAGE[name]


def bf16_widen(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (uint16): exact."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _to_odd32(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` rounded to float32 *to odd* (toward zero, the last bit set when
    inexact): rounding that to bfloat16 gives the single rounding of ``x``, since float32
    keeps more than two bits beyond bfloat16's (Boldo and Melquiond, round-to-odd)."""
    with np.errstate(over="ignore", invalid="ignore"):
        r = x.astype(np.float32)
        over = np.abs(r.astype(np.float64)) > np.abs(x)       # rounded away from zero
        r = np.where(over, np.nextafter(r, np.float32(0)), r)
        inexact = (r.astype(np.float64) != x) & ~np.isnan(x)
    bits = r.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32)


def bf16_narrow(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of ``values`` (float32 or float64), rounded to
    nearest even; NaN stays NaN (its sign kept, made quiet), +-inf stays +-inf, overflow
    rounds to +-inf."""
    x = np.asarray(values)
    if x.dtype == np.float64:
        x = _to_odd32(x)
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    # add 0x7FFF plus the bit that becomes the last kept one: ties go to even; a carry
    # into the exponent is the correct rounding up (to infinity past the largest finite)
    rounded = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1)))
               >> np.uint64(16)).astype(np.uint16)
    nan = (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    if nan.any():   # truncate, and set the quiet bit: a NaN must not round to infinity
        rounded[nan] = ((u[nan] >> np.uint64(16)) | np.uint64(0x0040)).astype(np.uint16)
    return rounded


def widen(stored: np.ndarray, name: str, to: Any) -> np.ndarray:
    """Rows stored as ``name`` in dtype ``to`` (the compute dtype): exact."""
    if name == "bfloat16":
        out = bf16_widen(stored)
        return out if np.dtype(to) == np.float32 else out.astype(to)
    return np.asarray(stored).astype(to, copy=False)


def narrow(values: np.ndarray, name: str) -> np.ndarray:
    """``values`` (any real dtype) as rows stored as ``name``, rounded to nearest even."""
    v = np.asarray(values)
    if name == "bfloat16":
        if v.dtype not in (np.float32, np.float64):
            v = v.astype(np.float64)
        return bf16_narrow(v)
    with np.errstate(over="ignore"):       # past float16's range: inf, as IEEE rounds
        return v.astype(STORAGE[name], copy=False)
