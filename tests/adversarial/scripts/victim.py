"""A dist_sync worker for the fault tests; prints JSON lines the test reads.

``worker-dies``: rank 1 says it is ready (with the server table) and sleeps (the test kills it); rank 0 pushes and
pulls in a loop (its round needs rank 1) until an error. ``scheduler-dies``: both ranks push
and pull in a loop until an error (the test kills the scheduler).
Reports ``{"rank", "event": "ready"}``, then ``{"rank", "error", "msg", "time"}``; exits 3
after a KVStoreError, 0 if none came within 40 s.
"""
from __future__ import annotations

import json
import sys
import time

import pskv as mx
from pskv.errors import KVStoreError


def say(**fields: object) -> None:
    # one write with its newline: stderr shares the file, and print() writes the end apart
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(mode: str) -> int:
    kv = mx.kv.create("dist_sync")
    rank = kv.rank
    kv.init("w", mx.nd.zeros((8,)))
    kv.push("w", mx.nd.ones((8,)))
    kv.pull("w")                                   # one good round first
    say(rank=rank, event="ready", servers=[dict(s) for s in kv._po.servers])
    try:
        if mode == "worker-dies" and rank == 1:
            time.sleep(40)
            return 0
        end = time.monotonic() + 40
        while time.monotonic() < end:
            kv.push("w", mx.nd.ones((8,)))
            kv.pull("w")
            time.sleep(0.02)
        return 0
    except KVStoreError as err:
        say(rank=rank, error=type(err).__name__, msg=str(err), time=time.time())
        return 3
    finally:
        kv.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
