"""One dist_sync scenario that runs unchanged on MXNet 1.9.1 and on pskv.

``python mx_sync_sgd.py mxnet`` or ``python mx_sync_sgd.py pskv`` in a worker started with
ps-lite's DMLC_* variables: every worker sets the same optimizer (SGD with momentum and
weight decay), inits two keys, and for several rounds pushes a gradient that depends on its
rank and the round, then pulls. Prints one JSON line: ``{"rank", "values": [[...], ...]}``.
"""
from __future__ import annotations

import importlib
import json
import sys

import numpy as np

ROUNDS = 4
SHAPES = {3: (4, 5), 9: (10,)}


def grad(rank: int, step: int, key: int) -> np.ndarray:
    shape = SHAPES[key]
    base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return np.float32(0.01) * (base - step * 3 + key) * np.float32(rank + 1)


def main(module: str) -> int:
    mx = importlib.import_module(module)
    kv = mx.kv.create("dist_sync")
    rank = kv.rank
    kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, wd=0.01,
                                         rescale_grad=0.5))
    kv._barrier()                        # every worker's set_optimizer reached the server
    keys = sorted(SHAPES)
    kv.init(keys, [mx.nd.ones(SHAPES[k]) * (k / 10.0) for k in keys])
    values = []
    for step in range(ROUNDS):
        kv.push(keys, [mx.nd.array(grad(rank, step, k)) for k in keys])
        outs = [mx.nd.zeros(SHAPES[k]) for k in keys]
        kv.pull(keys, out=outs)
        values.append([o.asnumpy().ravel().tolist() for o in outs])
    print(json.dumps({"rank": rank, "num_workers": kv.num_workers, "values": values}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
