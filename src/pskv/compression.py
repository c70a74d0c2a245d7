"""Gradient compression: MXNet's 2bit (1.9.1) and 1bit (2.0 line) codecs, in NumPy.

A compressor turns a float32 gradient into packed float32 words and keeps the
quantization error in a ``residual`` that is added to the next gradient (error
feedback), exactly as MXNet's ``GradientCompression::Quantize`` does:

- **2bit** (``src/kvstore/gradient_compression-inl.h`` in 1.9.1):
  ``residual += grad``; where ``residual >= t`` the value is sent as ``+t`` (code
  ``11``) and ``t`` is subtracted; where ``residual <= -t`` it is sent as ``-t``
  (code ``10``) and ``t`` is added back; otherwise it is sent as ``0`` (code ``00``).
  16 values per 32-bit word.
- **1bit** (MXNet 2.0): ``residual += grad``; where ``residual > t`` the value is
  sent as ``+1`` (bit ``1``) and ``1`` is subtracted, otherwise it is sent as ``-1``
  (bit ``0``) and ``1`` is added. The threshold only decides the sign: the
  dequantized values are always ``+1`` and ``-1``. 32 values per word.

Layout (both codecs): the packed words, read as bytes in memory order, are one bit
stream in which value ``i`` sits in byte ``i // 4`` (2bit) or ``i // 8`` (1bit),
first value in the most significant bits. Bits past the last value are zero, and the
last word is padded, so a gradient of ``n`` values takes ``ceil(n / 16)`` (2bit) or
``ceil(n / 32)`` (1bit) words. Any word-aligned slice of the packed array is the
packing of the matching slice of the gradient (MXNet's dist worker splits the packed
words across servers that way).

Every operation works in float32 in the order MXNet does, so packed words, residuals
and dequantized values are bit-for-bit MXNet's.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ._compression_params import DEFAULT_THRESHOLD, CompressionType, normalize_params
from .errors import ConfigError, ShapeMismatchError, ValueTypeError

__all__ = [
    "GradientCompression",
    "OneBitCompression",
    "TwoBitCompression",
    "create",
    "normalize_params",
]

# elements per chunk: a multiple of 32 small enough that every temporary stays in cache
_CHUNK = 1 << 16


def _build(normal: Mapping[str, object]) -> GradientCompression | None:
    """The compressor for normalized parameters (see :func:`normalize_params`)."""
    kind, threshold = normal["type"], normal.get("threshold")
    if kind == "none" or not isinstance(threshold, float):
        return None
    return TwoBitCompression(threshold) if kind == "2bit" else OneBitCompression(threshold)


def create(params: Mapping[str, object]) -> GradientCompression | None:
    """Create the compressor that ``kv.set_gradient_compression(params)`` asks for.

    Parameters
    ----------
    params : dict
        ``{'type': '2bit' | '1bit' | 'none', 'threshold': float}`` (see
        :func:`normalize_params`).

    Returns
    -------
    GradientCompression or None
        A :class:`TwoBitCompression` or :class:`OneBitCompression`; ``None`` for
        ``{'type': 'none'}`` (no compression).

    Raises
    ------
    ConfigError
        If the parameters are invalid.

    Examples
    --------
    >>> gc = create({'type': '2bit', 'threshold': 0.5})
    >>> gc
    TwoBitCompression(threshold=0.5)
    >>> create(gc.params) == gc
    True
    >>> create({'type': 'none'}) is None
    True
    """
    return _build(normalize_params(params))


def _as_float32(array: object, what: str) -> np.ndarray:
    """``array`` as a float32 ndarray without copying, or ShapeMismatchError."""
    arr = np.asarray(array)
    if arr.dtype != np.float32:
        raise ShapeMismatchError(
            f"gradient compression works on float32 arrays only (as in MXNet), but the "
            f"{what} has dtype {arr.dtype}. Use float32 parameters, or disable compression.",
            shape=arr.shape)
    return arr


def _flat_out(out: np.ndarray, size: int, what: str) -> np.ndarray:
    """A flat, writable float32 view of ``out``, which must hold ``size`` values."""
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.size != size:
        raise ShapeMismatchError(
            f"the {what} must be a float32 ndarray of {size} values, got "
            f"{getattr(out, 'dtype', type(out).__name__)} of shape "
            f"{getattr(out, 'shape', None)}. Pass out=None to get a new array.",
            shape=getattr(out, "shape", None))
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ShapeMismatchError(
            f"the {what} must be a writable C-contiguous array (it is filled in place).",
            shape=out.shape)
    return out.reshape(-1)


class GradientCompression:
    """Base of the MXNet gradient compressors (2bit and 1bit).

    Use :func:`create`. Subclasses set ``type``, ``factor`` (values per 32-bit word)
    and the byte tables; everything else is shared.

    Parameters
    ----------
    threshold : float
        The quantization threshold; it is rounded to float32 as MXNet stores it.
    """

    type: CompressionType
    factor: int
    _per_byte: int          # values per byte (4 or 8)
    _table: np.ndarray      # (256, _per_byte) float32: byte -> dequantized values

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        self._t = np.float32(threshold)
        self._table = self._make_table()

    def _make_table(self) -> np.ndarray:
        raise NotImplementedError

    def _encode(self, flat_r: np.ndarray, codes: np.ndarray, scratch: dict[str, np.ndarray]
                ) -> None:
        raise NotImplementedError

    @property
    def threshold(self) -> float:
        """The threshold, as the float32 value MXNet uses."""
        return float(self._t)

    @property
    def params(self) -> dict[str, object]:
        """The normalized parameters: ``create(gc.params) == gc``; JSON-able."""
        return {"type": self.type, "threshold": self.threshold}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GradientCompression):
            return NotImplemented
        return self.type == other.type and self.threshold == other.threshold

    def __hash__(self) -> int:
        return hash((self.type, self.threshold))

    def packed_size(self, size: int) -> int:
        """Number of float32 words the packing of ``size`` values takes (last one padded).

        Examples
        --------
        >>> TwoBitCompression().packed_size(17), OneBitCompression().packed_size(32)
        (2, 1)
        """
        return -(-int(size) // self.factor)

    # -- the codec ----------------------------------------------------------------
    def _run(self, grad: object, residual: np.ndarray, packed: np.ndarray | None,
             dequantized: np.ndarray | None) -> None:
        """Quantize ``grad`` with error feedback; fill ``packed`` bytes and/or values.

        Invariant: works chunk by chunk in element order; within a chunk the gradient
        is read before ``dequantized`` is written, so ``dequantized`` may alias ``grad``.
        """
        g = _as_float32(grad, "gradient").reshape(-1)
        if not isinstance(residual, np.ndarray):
            raise ValueTypeError(
                f"the residual must be a NumPy float32 array (it is updated in place), got "
                f"{type(residual).__name__}. Pass np.zeros(grad.size, np.float32).")
        r = _as_float32(residual, "residual")
        if r.size != g.size:
            raise ShapeMismatchError(
                f"the residual has {r.size} values but the gradient has {g.size}. "
                f"Keep one residual of the gradient's size per key (and per device).",
                shape=r.shape)
        r = _flat_out(r, g.size, "residual")
        per_byte = self._per_byte
        chunk = min(_CHUNK, g.size)
        scratch: dict[str, np.ndarray] = {
            "codes": np.empty(chunk + 8, np.uint8),
            "bytes": np.empty(chunk // per_byte + 1, np.uint8),
            "q": np.empty((chunk // per_byte + 1, per_byte), np.float32),
            "mask_a": np.empty(chunk, np.bool_),
            "mask_b": np.empty(chunk, np.bool_),
            "w_a": np.empty(chunk // 4 + 1, np.uint32),
            "w_b": np.empty(chunk // 4 + 1, np.uint32),
        }
        for start in range(0, g.size, _CHUNK):
            stop = min(start + _CHUNK, g.size)
            m = stop - start
            nbytes = -(-m // per_byte)
            rr = r[start:stop]
            np.add(rr, g[start:stop], out=rr)  # residual[i] += grad[i]
            codes = scratch["bytes"][:nbytes] if packed is None else \
                packed[start // per_byte:start // per_byte + nbytes]
            self._encode(rr, codes, scratch)
            full = m % per_byte == 0
            if dequantized is not None and full:
                q = dequantized[start:stop].reshape(-1, per_byte)
            else:
                q = scratch["q"][:nbytes]
            np.take(self._table, codes, axis=0, out=q)
            qf = q.reshape(-1)[:m]
            np.subtract(rr, qf, out=rr)  # residual -= dequantized value
            if dequantized is not None and not full:
                dequantized[start:stop] = qf

    def compress(self, grad: np.ndarray, residual: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
        """Quantize ``grad + residual`` into packed words; update ``residual`` in place.

        Parameters
        ----------
        grad : ndarray
            float32 gradient, any shape (read in C order).
        residual : ndarray
            float32, C-contiguous, ``grad.size`` values (starts as zeros); updated in
            place with the quantization error, as MXNet does.
        out : ndarray, optional
            float32, C-contiguous, ``packed_size(grad.size)`` words to fill.

        Returns
        -------
        ndarray
            ``out``, or a new 1-D float32 array of ``packed_size(grad.size)`` words.

        Raises
        ------
        ShapeMismatchError
            If an array is not float32 or has the wrong size or layout.
        """
        g = _as_float32(grad, "gradient")
        words = self.packed_size(g.size)
        if out is None:
            out = np.empty(words, np.float32)
        flat = _flat_out(out, words, "packed output")
        raw = flat.view(np.uint8)
        used = -(-g.size // self._per_byte)
        raw[used:] = 0  # MXNet leaves the padding bits of the last word zero
        self._run(g, residual, raw[:used], None)
        return out

    def roundtrip(self, grad: np.ndarray, residual: np.ndarray,
                  out: np.ndarray | None = None) -> np.ndarray:
        """``decompress(compress(grad, residual), grad.size)`` in one pass.

        What MXNet's ``device`` store does per source device: quantize with the
        device's residual, then dequantize. ``out`` may be ``grad`` itself.

        Parameters
        ----------
        grad, residual : ndarray
            As in :meth:`compress`; ``residual`` is updated in place.
        out : ndarray, optional
            float32, C-contiguous, ``grad.size`` values; ``grad``'s shape is kept.

        Returns
        -------
        ndarray
            The dequantized values (``out``, or a new array shaped like ``grad``).

        Examples
        --------
        >>> import numpy as np
        >>> gc = create({'type': '2bit', 'threshold': 0.5})
        >>> residual = np.zeros(4, np.float32)
        >>> gc.roundtrip(np.array([0.7, -0.2, -0.6, 0.3], np.float32), residual)
        array([ 0.5,  0. , -0.5,  0. ], dtype=float32)
        >>> residual
        array([ 0.19999999, -0.2       , -0.10000002,  0.3       ], dtype=float32)
        """
        g = _as_float32(grad, "gradient")
        if out is None:
            out = np.empty(g.shape, np.float32)
        flat = _flat_out(out, g.size, "output")
        self._run(g, residual, None, flat)
        return out

    def decompress(self, packed: np.ndarray, size: int,
                   out: np.ndarray | None = None) -> np.ndarray:
        """Dequantize the first ``size`` values of ``packed``.

        Parameters
        ----------
        packed : ndarray
            ``packed_size(size)`` float32 words, as :meth:`compress` returns (any
            C-contiguous array of the same bytes is accepted, for example uint8).
        size : int
            Number of values.
        out : ndarray, optional
            float32, C-contiguous, ``size`` values to fill.

        Returns
        -------
        ndarray
            ``out``, or a new 1-D float32 array of ``size`` values.

        Raises
        ------
        ShapeMismatchError
            If ``packed`` does not hold exactly ``packed_size(size)`` words.
        """
        size = int(size)
        arr = np.asarray(packed)
        words = self.packed_size(size)
        if arr.nbytes != 4 * words or not arr.flags.c_contiguous:
            raise ShapeMismatchError(
                f"{self.type} packing of {size} values takes {words} float32 words "
                f"({4 * words} bytes), but the packed array has {arr.nbytes} bytes"
                f"{'' if arr.flags.c_contiguous else ' and is not contiguous'}. "
                f"Pass the output of compress() for the same number of values.",
                shape=arr.shape)
        if out is None:
            out = np.empty(size, np.float32)
        flat = _flat_out(out, size, "output")
        raw = arr.reshape(-1).view(np.uint8)
        per_byte = self._per_byte
        step = _CHUNK // per_byte
        full_bytes = size // per_byte
        body = flat[:full_bytes * per_byte].reshape(-1, per_byte)
        for start in range(0, full_bytes, step):
            stop = min(start + step, full_bytes)
            np.take(self._table, raw[start:stop], axis=0, out=body[start:stop])
        tail = size - full_bytes * per_byte
        if tail:
            flat[full_bytes * per_byte:] = self._table[raw[full_bytes]][:tail]
        return out


class TwoBitCompression(GradientCompression):
    """MXNet 1.9.1's 2bit compression: values ``+t``, ``0``, ``-t``; 16 per word.

    Examples
    --------
    >>> import numpy as np
    >>> gc = TwoBitCompression(0.5)
    >>> packed = gc.compress(np.array([1, -1, 0, 0.5], np.float32), np.zeros(4, np.float32))
    >>> hex(packed.view(np.uint32)[0])  # byte 0 = 0b11_10_00_11
    '0xe3'
    >>> gc.decompress(packed, 4)
    array([ 0.5, -0.5,  0. ,  0.5], dtype=float32)
    """

    type: CompressionType = "2bit"
    factor = 16
    _per_byte = 4

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not np.float32(threshold) > 0:
            raise ConfigError(
                f"2bit gradient compression needs a threshold greater than 0, got "
                f"{threshold!r}. Pass a positive threshold such as 0.5.")
        super().__init__(threshold)

    def _make_table(self) -> np.ndarray:
        # code per 2 bits, first value in the high bits: 11 -> +t, 10 -> -t, else 0
        values = np.array([0, 0, -self._t, self._t], np.float32)
        byte = np.arange(256)
        shifts = np.array([6, 4, 2, 0])
        table: np.ndarray = values[(byte[:, None] >> shifts) & 3]
        return table

    def _encode(self, flat_r: np.ndarray, codes: np.ndarray, scratch: dict[str, np.ndarray]
                ) -> None:
        m = flat_r.size
        pos = scratch["mask_a"][:m]
        neg = scratch["mask_b"][:m]
        np.greater_equal(flat_r, self._t, out=pos)   # residual >= pos_threshold
        np.less_equal(flat_r, -self._t, out=neg)     # residual <= neg_threshold
        padded = -(-m // 4) * 4
        code = scratch["codes"][:padded]
        np.multiply(pos.view(np.uint8), np.uint8(3), out=code[:m])  # 11
        code[m:] = 0
        code_m = code[:m]
        np.add(code_m, neg.view(np.uint8), out=code_m)
        np.add(code_m, neg.view(np.uint8), out=code_m)             # 10
        # 4 codes c0..c3 in one little-endian uint32 at bits 0, 8, 16, 24 become
        # the byte c0 << 6 | c1 << 4 | c2 << 2 | c3
        words = code.view(np.uint32)
        acc = scratch["w_a"][:words.size]
        tmp = scratch["w_b"][:words.size]
        np.left_shift(words, 6, out=acc)
        for shift in (4, 14, 24):
            np.right_shift(words, shift, out=tmp)
            np.bitwise_or(acc, tmp, out=acc)
        np.copyto(codes, acc, casting="unsafe")  # keeps the low byte


class OneBitCompression(GradientCompression):
    """MXNet 2.0's 1bit compression: values ``+1`` and ``-1``; 32 per word.

    The threshold only decides the sign (``residual > threshold`` gives ``+1``); the
    dequantized values are ``+1`` and ``-1`` whatever the threshold, as in MXNet.

    Examples
    --------
    >>> import numpy as np
    >>> gc = OneBitCompression(0.0)
    >>> residual = np.zeros(3, np.float32)
    >>> gc.roundtrip(np.array([0.25, -0.5, 0.0], np.float32), residual)
    array([ 1., -1., -1.], dtype=float32)
    >>> residual
    array([-0.75,  0.5 ,  1.  ], dtype=float32)
    """

    type: CompressionType = "1bit"
    factor = 32
    _per_byte = 8

    def _make_table(self) -> np.ndarray:
        byte = np.arange(256)
        bits = (byte[:, None] >> np.arange(7, -1, -1)) & 1
        return np.where(bits == 1, np.float32(1), np.float32(-1)).astype(np.float32)

    def _encode(self, flat_r: np.ndarray, codes: np.ndarray, scratch: dict[str, np.ndarray]
                ) -> None:
        m = flat_r.size
        bits = scratch["mask_a"][:m]
        np.greater(flat_r, self._t, out=bits)  # residual > threshold -> 1
        codes[:] = np.packbits(bits)  # MSB first, zero padding
