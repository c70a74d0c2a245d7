"""Where each key lives: ps_keys and the split of big arrays across servers.

Invariants: a key's segments cover its elements (dense) or rows (row_sparse) exactly once,
in order; int and str keys never share a ps_key; a str key's ps_key is the same on every
worker whatever the order keys were created in.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Segment", "covers", "place", "ps_key"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements (dense) or rows (row_sparse) ``[start, stop)`` of a key, on ``server``."""

    server: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of elements or rows."""
        return self.stop - self.start


def ps_key(key: int | str) -> int:
    """The key on the wire: ``2*key`` for ints, an odd 64-bit hash for strs."""
    if isinstance(key, str):
        digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
        return 2 * (int.from_bytes(digest, "big") >> 2) + 1
    return 2 * key


def place(units: int, unit_bytes: int, num_servers: int, bound: int, elems_per_unit: int,
          loads: list[int], split_always: bool = False) -> list[Segment]:
    """Segments for a new key of ``units`` elements or rows.

    Parameters
    ----------
    units : int
        Elements (dense) or rows (row_sparse) of the key.
    unit_bytes : int
        Bytes per unit, for load balancing.
    num_servers : int
    bound : int
        Keys with at least this many elements are split evenly across every server
        (MXNET_KVSTORE_BIGARRAY_BOUND).
    elems_per_unit : int
        Elements per unit (1 for dense, the row size for row_sparse).
    loads : list of int
        Bytes already placed on each server; updated in place.
    split_always : bool
        Split even when small (row_sparse keys spread their rows over every server).

    Returns
    -------
    list of Segment
        In order of ``start``; one segment for small keys, on the least-loaded server.
    """
    if num_servers == 1 or units < 2 or (units * elems_per_unit < bound and not split_always):
        server = min(range(num_servers), key=lambda s: (loads[s], s))
        loads[server] += units * unit_bytes
        return [Segment(server, 0, units)]
    parts = min(num_servers, units)
    segs = []
    for i in range(parts):
        start, stop = units * i // parts, units * (i + 1) // parts
        loads[i] += (stop - start) * unit_bytes
        segs.append(Segment(i, start, stop))
    return segs


def covers(segments: Sequence[Segment], units: int) -> bool:
    """Whether ``segments`` tile ``[0, units)`` exactly (a check for tests and peers)."""
    pos = 0
    for seg in segments:
        if seg.start != pos or seg.stop <= seg.start:
            return False
        pos = seg.stop
    return pos == units
