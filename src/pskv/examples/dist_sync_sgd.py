"""Data-parallel SGD on a parameter server, in a few lines. Run it with the launcher::

    pskv-launch -n 2 -s 1 python -m pskv.examples.dist_sync_sgd

Every worker pushes its gradient; the servers sum them (dist_sync), apply SGD, and every
worker pulls the same new weight.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import cast

import numpy as np

import pskv as mx

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Fit y = 3x with one weight, each worker on its own data; 0 if w ends near 3.

    ``argv`` is accepted for a uniform ``main(argv)`` and must be empty. Exits 2 with a
    message when started without ``pskv-launch``.
    """
    if argv:
        raise SystemExit(f"dist_sync_sgd takes no arguments, got {list(argv)!r}")
    try:
        # a DistKVStore: the worker side, a LocalKVStore subclass
        kv = cast(mx.kv.LocalKVStore, mx.kv.create("dist_sync"))
    except mx.KVStoreError as err:
        print(f"dist_sync_sgd: cannot create a 'dist_sync' store: {err}", file=sys.stderr)
        return 2
    with kv:
        rng = np.random.default_rng(kv.rank)
        x = rng.normal(size=256).astype(np.float32)
        y = 3.0 * x
        kv.init("w", mx.nd.zeros((1,)))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1,
                                          rescale_grad=1.0 / kv.num_workers))
        w = mx.nd.zeros((1,))
        for _ in range(50):
            kv.pull("w", out=w)
            grad = np.mean(2 * (w.asscalar() * x - y) * x, keepdims=True)
            kv.push("w", mx.nd.array(grad))
        kv.pull("w", out=w)
        print(f"worker {kv.rank} of {kv.num_workers}: w = {w.asscalar():.4f}")
    return 0 if abs(w.asscalar() - 3.0) < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
