"""Data-parallel SGD on a parameter server. Run it with the launcher:

    pskv-launch -n 2 -s 1 python examples/dist_sync_sgd.py

Every worker pushes its gradient; the servers sum them (dist_sync), apply SGD, and every
worker pulls the same new weight.
"""
from __future__ import annotations

import numpy as np

import pskv as mx


def main() -> int:
    """Fit y = 3x with one weight, each worker on its own half of the data."""
    kv = mx.kv.create("dist_sync")
    rng = np.random.default_rng(kv.rank)
    x = rng.normal(size=256).astype(np.float32)
    y = 3.0 * x
    kv.init("w", mx.nd.zeros((1,)))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, rescale_grad=1.0 / kv.num_workers))
    w = mx.nd.zeros((1,))
    for _ in range(50):
        kv.pull("w", out=w)
        grad = np.mean(2 * (w.asscalar() * x - y) * x, keepdims=True)
        kv.push("w", mx.nd.array(grad))
    kv.pull("w", out=w)
    print(f"worker {kv.rank}/{kv.num_workers}: w = {w.asscalar():.4f}")
    kv.close()
    return 0 if abs(w.asscalar() - 3.0) < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
