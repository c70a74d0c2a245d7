"""Quickstart: a local KVStore aggregating gradients from four devices, with SGD.

    python -m pskv.examples.quickstart_local
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pskv as mx

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Init a weight, push a gradient from four devices, let SGD update it, pull it back.

    ``argv`` is accepted for a uniform ``main(argv)`` and must be empty.
    """
    if argv:
        raise SystemExit(f"quickstart_local takes no arguments, got {list(argv)!r}")
    shape = (2, 3)
    with cast(mx.kv.LocalKVStore, mx.kv.create("local")) as kv:
        kv.init("weight", mx.nd.ones(shape))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        devices = [mx.gpu(i) for i in range(4)]          # tags: pskv computes on the host
        grads = [mx.nd.ones(shape, d) * 0.25 for d in devices]
        weights = [mx.nd.zeros(shape, d) for d in devices]
        for step in range(3):
            kv.push("weight", grads)                      # summed: 1.0 per element
            kv.pull("weight", out=weights)                # broadcast to every device
            print(f"step {step + 1}: weight[0, 0] = {weights[0][0, 0].asscalar():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
