"""A dist_sync worker for the collective path's process tests; prints one JSON line.

Three keys (two big, one small), five rounds of rank-scaled pushes, and a SHA-256 of every
pulled value: a run with ``PSKV_COLLECTIVE_BYTES`` set must print the digest a run without
it prints. Report: ``{"rank", "digest", "collective": [keys on the collective path], "shm": [workers it
shares memory with]}``.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

import pskv as mx

SHAPES = {"big": (513, 133), "mid": (4099,), "small": (7,)}


def main() -> int:
    kv = mx.kv.create("dist_sync")
    keys = list(SHAPES)
    kv.init(keys, [np.zeros(SHAPES[k], np.float32) for k in keys])
    digest = hashlib.sha256()
    for step in range(5):
        rng = np.random.default_rng([kv.rank, step])
        kv.push(keys, [(rng.standard_normal(SHAPES[k]) * 10.0 ** kv.rank).astype(np.float32)
                       for k in keys])
        outs = [np.empty(SHAPES[k], np.float32) for k in keys]
        kv.pull(keys, out=outs)
        for o in outs:
            digest.update(o.tobytes())
    print(json.dumps({"rank": kv.rank, "digest": digest.hexdigest(),
                      "collective": sorted(k for k, r in kv._store.items() if r.collective),
                      "shm": sorted(kv._peers.path._shm) if kv._peers.path is not None else []}),
          flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
