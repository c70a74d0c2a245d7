"""Counter-based hashing of int64 IDs: splitmix64 in vectorised uint64 NumPy.

Everything a table derives from an ID alone (its initial value, its server, its admission
draw, its hash-table cell) is a pure function of the ID and a salt, so it is the same in
every process, after a restart and after a reshard. No random-number generator object
exists per row or per table. Invariant: every function here takes and returns arrays
(uint64 arithmetic wraps silently on arrays; NumPy warns only on scalars).
"""
from __future__ import annotations

import numpy as np

__all__ = ["mix64", "salted", "shard_of", "uniform01"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)

#: one salt per use, so the streams are independent (routing must not correlate with the
#: index's cells: on a server all IDs share ``hash % S``)
SALT_INDEX = 0x5EED_0001
SALT_ROUTE = 0x5EED_0002
SALT_INIT = 0x5EED_0003
SALT_ADMIT = 0x5EED_0004
SALT_COUNT = 0x5EED_0005


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of ``x + golden`` (uint64 in, uint64 out, a new array)."""
    z = np.add(x, _GOLDEN, dtype=np.uint64)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def _u64(value: int) -> np.ndarray:
    return np.array([value & 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64)


def salted(ids: np.ndarray, *words: int) -> np.ndarray:
    """A uint64 hash of each int64 ID and the integers ``words`` (seed, salt, step...)."""
    z = mix64(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64))
    for w in words:
        z ^= mix64(_u64(w))
        z = mix64(z)
    return z


def uniform01(bits: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from the top 53 bits of uint64 hashes (float64)."""
    return (bits >> _S11).astype(np.float64) * (1.0 / 9007199254740992.0)


def shard_of(ids: object, num_servers: int) -> np.ndarray:
    """The server (0 to ``num_servers - 1``) that owns each ID: a hash, never ``id % S``.

    Parameters
    ----------
    ids : array_like of int
        Raw int64 IDs, any values.
    num_servers : int
        Servers the table is spread over.

    Returns
    -------
    numpy.ndarray of int64, the shape of ``ids``.

    Examples
    --------
    >>> from pskv.table import shard_of
    >>> shard_of([0, 1, 2, 3, -1, 2**62], 4).tolist()
    [0, 3, 0, 2, 2, 1]
    """
    from ..errors import ConfigError
    if isinstance(num_servers, bool) or not isinstance(num_servers, (int, np.integer)) \
            or num_servers < 1:
        raise ConfigError(f"shard_of needs num_servers >= 1, got {num_servers!r}.")
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        from ..errors import TableIdError
        raise TableIdError(f"shard_of got IDs of dtype {arr.dtype}; IDs are integers. Pass "
                           "an int64 array.")
    h = salted(arr.astype(np.int64).ravel(), SALT_ROUTE)
    return (h % np.uint64(num_servers)).astype(np.int64).reshape(arr.shape)
