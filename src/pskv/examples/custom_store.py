"""A custom store type: register a KVStoreBase subclass and create it by name.

    python -m pskv.examples.custom_store
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import pskv as mx

__all__ = ["AveragingStore", "main"]


class AveragingStore(mx.KVStoreBase):
    """pushpull returns the mean of the values (what an allreduce-style store does)."""

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Write the mean of ``value`` (one array or a list) into ``out`` (or ``value``)."""
        values = value if isinstance(value, list) else [value]
        mean = sum(v.asnumpy() for v in values) / len(values)
        outs = value if out is None else out
        for o in outs if isinstance(outs, list) else [outs]:
            o[:] = mean

    def is_capable(self, capability: str) -> bool:
        """No optional capability (no optimizer on the store)."""
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Register the store, create it by its lower-cased class name and use it.

    ``argv`` is accepted for a uniform ``main(argv)`` and must be empty.
    """
    if argv:
        raise SystemExit(f"custom_store takes no arguments, got {list(argv)!r}")
    # registered here, not at import: importing an example changes nothing
    if mx.KVStoreBase.kv_registry.get("averagingstore") is not AveragingStore:
        mx.KVStoreBase.register(AveragingStore)   # also usable as a class decorator
    kv = mx.kv.create("averagingstore")
    a, b = mx.nd.ones((2,)), mx.nd.ones((2,)) * 3
    kv.pushpull("g", [a, b])
    print(f"{kv.type}: {a.asnumpy()} {b.asnumpy()}")
    return 0 if np.allclose(a.asnumpy(), 2.0) and np.allclose(b.asnumpy(), 2.0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
