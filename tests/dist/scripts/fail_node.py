"""A dist_sync worker for the failure tests; prints JSON lines the test reads.

``worker-dies``: rank 1 inits and waits to be killed; rank 0 pushes, then pulls (its round
can only close with rank 1's push) and reports the error it gets.
``async-worker-dies``: the same in ``dist_async`` (the test sets a global staleness bound
of 0, so rank 0's pull waits on the server for rank 1's next push).
``server-dies``: both ranks push and pull a key split over every server, in a loop, until
an error (the test kills a server); each reports its error.
Reports: ``{"rank", "event": "ready", "servers", "shm"}`` (the server table, the workers
it shares memory with on the collective path), then ``{"rank", "error", "mro", "msg", "time"}``.
Exits 3 after a KVStoreError, 0 if no error came within 30 s.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import pskv as mx
from pskv.errors import KVStoreError


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def shm_peers(kv: Any) -> list[int]:
    """The workers this one shares memory with on the collective path."""
    coll = kv._peers.path
    return sorted(coll._shm) if coll is not None else []


def main(mode: str) -> int:
    kv = mx.kv.create("dist_async" if mode.startswith("async") else "dist_sync")
    rank = kv.rank
    kv.init("w", mx.nd.zeros((64,)))
    kv.push("w", mx.nd.ones((64,)))
    kv.pull("w")                                   # one good round first
    try:
        if mode.endswith("worker-dies") and rank == 1:
            say(rank=rank, event="ready", servers=[dict(s) for s in kv._po.servers],
                shm=shm_peers(kv))
            time.sleep(30)
            return 0
        say(rank=rank, event="ready", servers=[dict(s) for s in kv._po.servers],
            shm=shm_peers(kv))
        end = time.monotonic() + 30
        while time.monotonic() < end:
            kv.push("w", mx.nd.ones((64,)))
            kv.pull("w")
            time.sleep(0.05)
        return 0
    except KVStoreError as err:
        say(rank=rank, error=type(err).__name__, mro=[c.__name__ for c in type(err).__mro__],
            msg=str(err), time=time.time())
        return 3
    finally:
        kv.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
