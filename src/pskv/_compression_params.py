"""The parameters of ``kv.set_gradient_compression``: checked and normalized as MXNet 1.9.1's
``GradientCompressionParam`` does (``type`` 2bit, 1bit or none; ``threshold`` parsed with
dmlc's float grammar, so ``'0.5'`` and ``0.5`` are alike and ``'abc'`` is refused).
:mod:`pskv.compression` builds the codecs from them.
"""
from __future__ import annotations

import math
import re
from typing import Literal, Mapping

import numpy as np

from .errors import ConfigError

__all__ = ["CompressionType", "DEFAULT_THRESHOLD", "normalize_params"]

CompressionType = Literal["2bit", "1bit"]

#: the threshold MXNet uses when none is given (GradientCompressionParam, 1.9.1 and 2.0)
DEFAULT_THRESHOLD = 0.5
_TYPES = ("2bit", "1bit", "none")
_KEYS = ("type", "threshold")
# dmlc::ParseFloat's grammar (dmlc-core strtonum.h), without inf/nan which pskv rejects
_FLOAT_RE = re.compile(r"\s*([+-]?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?)(\d*))?[fF]?")


def _dmlc_stof(text: str) -> float | None:
    """Parse ``text`` as dmlc::stof does (MXNet parses the threshold with it).

    Returns the float32 value as a Python float, or ``None`` when dmlc would reject
    the string (or when it is not finite). dmlc's parser is not correctly rounded:
    it adds ``float(integer part)`` and ``float(fraction as a double)`` in float32
    and scales by a float32 power of ten; this reproduces those steps.
    """
    match = _FLOAT_RE.fullmatch(text)
    if match is None:
        return None
    sign, predec, frac, exp_sign, exp = match.groups()
    if not predec and not frac:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        value = np.float32(int(predec or "0") % (1 << 64))
        if frac:
            digits = frac[:19]  # kStrtofMaxDigits: later digits are ignored
            part = float(int(digits)) / float(10 ** len(digits))
            value = np.float32(value + np.float32(part))
        if match.group(4) is not None or exp:
            expon = int(exp or "0")
            is_frac = exp_sign == "-"
            if expon > 38:
                return None  # dmlc: out of range
            if expon == 38 and ((not is_frac and value > np.float32(3.402823466))
                                or (is_frac and value < np.float32(1.175494351))):
                return None
            scale = np.float32(1.0)
            while expon >= 8:
                scale = np.float32(scale * np.float32(1e8))
                expon -= 8
            while expon > 0:
                scale = np.float32(scale * np.float32(10.0))
                expon -= 1
            value = np.float32(value / scale) if is_frac else np.float32(value * scale)
    result = -float(value) if sign == "-" else float(value)
    return result if math.isfinite(result) else None


def _parse_threshold(value: object) -> float:
    """The float32 threshold MXNet would use for ``value`` (a number or a string)."""
    if isinstance(value, (bool, np.bool_)):
        parsed = None
    elif isinstance(value, (int, float, np.integer, np.floating)):
        number = float(value)
        if math.isfinite(number) and float(np.float32(number)) == number:
            parsed = number  # exactly a float32 (as ``params`` gives): keep it as is
        else:
            parsed = _dmlc_stof(str(value))  # MXNet sends str(value) to dmlc
    elif isinstance(value, str):
        parsed = _dmlc_stof(value)
    else:
        parsed = None
    if parsed is None:
        raise ConfigError(
            f"gradient compression threshold {value!r} is not a finite float32 number. "
            f"Pass a positive float, for example {{'type': '2bit', 'threshold': 0.5}}.")
    return parsed


def normalize_params(params: Mapping[str, object]) -> dict[str, object]:
    """Check a ``set_gradient_compression`` dict and return its normalized form.

    Parameters
    ----------
    params : dict
        ``{'type': '2bit' | '1bit' | 'none', 'threshold': float}``; values may be
        strings, as MXNet passes them through its C API. ``threshold`` defaults to 0.5.

    Returns
    -------
    dict
        ``{'type': str, 'threshold': float}`` (JSON-able; the threshold is the float32
        value MXNet would use), or ``{'type': 'none'}``.

    Raises
    ------
    ConfigError
        If ``params`` is not a dict, a key is unknown, ``type`` is missing or unknown,
        or the threshold is not a number (or not positive, for 2bit).

    Examples
    --------
    >>> normalize_params({'type': '2bit', 'threshold': '0.25'})
    {'type': '2bit', 'threshold': 0.25}
    >>> normalize_params({'type': '1bit'})
    {'type': '1bit', 'threshold': 0.5}
    """
    if not isinstance(params, Mapping):
        raise ConfigError(
            f"gradient compression parameters must be a dict, got {type(params).__name__}. "
            f"Pass a dict such as {{'type': '2bit', 'threshold': 0.5}}.")
    unknown = sorted(str(k) for k in params if k not in _KEYS)
    if unknown:
        raise ConfigError(
            f"unknown gradient compression parameter(s) {', '.join(map(repr, unknown))}. "
            f"The known keys are 'type' and 'threshold', for example "
            f"{{'type': '2bit', 'threshold': 0.5}}.")
    if "type" not in params:
        raise ConfigError(
            "gradient compression parameters have no 'type'. "
            "Pass {'type': '2bit', 'threshold': 0.5} or {'type': '1bit'}.")
    kind = params["type"]
    if not isinstance(kind, str) or kind not in _TYPES:
        raise ConfigError(
            f"unknown gradient compression type {kind!r}. "
            f"Pass 'type' as one of {', '.join(map(repr, _TYPES))}.")
    if kind == "none":
        return {"type": "none"}
    threshold = _parse_threshold(params.get("threshold", DEFAULT_THRESHOLD))
    # MXNet 2.0 checks threshold > 0 for 2bit only (SetParams); 1bit accepts any value
    if kind == "2bit" and not threshold > 0:
        raise ConfigError(
            f"2bit gradient compression needs a threshold greater than 0, got "
            f"{params.get('threshold')!r}. Pass a positive threshold such as 0.5.")
    return {"type": kind, "threshold": threshold}
