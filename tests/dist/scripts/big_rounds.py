"""A dist_sync worker pushing big arrays round after round, checking every round's sum.

Both workers' multi-MiB pushes reach the server at the same time, so their reads
interleave on the server: each round must still sum exactly. Prints one JSON line; exits 0
when every round is right.
"""
from __future__ import annotations

import json
import sys

import numpy as np

import pskv as mx

ROUNDS = 6
SIZE = 3 << 20          # 12 MiB of float32 per push


def main() -> int:
    kv = mx.kv.create("dist_sync")
    rank, n = kv.rank, kv.num_workers
    kv.init("big", mx.nd.zeros((SIZE,)))
    kv.init("list", mx.nd.zeros((SIZE // 4,)))
    out = mx.nd.zeros((SIZE,))
    bad = []
    for r in range(ROUNDS):
        value = mx.nd.ones((SIZE,)) * (rank + 1 + 10 * r)
        kv.push("big", value)
        kv.pull("big", out=out)
        want = sum(w + 1 + 10 * r for w in range(n))
        got = out.asnumpy()
        if not np.all(got == want):
            bad.append([r, float(got.min()), float(got.max()), want])
        small = mx.nd.zeros((SIZE // 4,))
        kv.pushpull("list", mx.nd.ones((SIZE // 4,)) * (rank + 1), out=small)
        if not np.all(small.asnumpy() == n * (n + 1) / 2):
            bad.append([r, "pushpull", float(small.asnumpy().min())])
    print(json.dumps({"rank": rank, "bad": bad, "ok": not bad}), flush=True)
    kv.close()
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
