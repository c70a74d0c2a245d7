"""A dist_sync worker: init, a few sync rounds of sums, a split key; prints one JSON line.

Run by ``pskv-launch -n 2 -s 2 --launcher local python tests/dist/scripts/sync_sum.py`` and
by the process tests. Exits 0 when every pulled value is the expected sum, else 1.
With ``--no-close`` the store is left to the interpreter's exit (atexit) to close.
"""
from __future__ import annotations

import json
import sys

import numpy as np

import pskv as mx

ROUNDS = 3


def main(argv: list[str]) -> int:
    kv = mx.kv.create("dist_sync")
    rank, n = kv.rank, kv.num_workers
    kv.init("w", mx.nd.zeros((4,)))
    kv.init("big", mx.nd.zeros((3, 50)))                 # bigger than the test's bound: split
    sums = []
    for r in range(ROUNDS):
        kv.push("w", mx.nd.ones((4,)) * (rank + 1 + 10 * r))
        sums.append(kv.pull("w").asnumpy().tolist())
    big = mx.nd.zeros((3, 50))
    kv.pushpull("big", mx.nd.ones((3, 50)) * (rank + 1), out=big)
    want = [[float(sum(w + 1 + 10 * r for w in range(n)))] * 4 for r in range(ROUNDS)]
    good = sums == want and bool(np.all(big.asnumpy() == n * (n + 1) / 2))
    print(json.dumps({"rank": rank, "num_workers": n, "sums": sums,
                      "big": float(big.asnumpy()[0, 0]), "ok": good}), flush=True)
    if "--no-close" not in argv:
        kv.close()
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
