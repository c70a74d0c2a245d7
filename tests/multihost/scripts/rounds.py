"""A dist_sync worker for the multi-host tests: reports where it runs, then sums rounds.

Prints JSON lines: first ``{"rank", "num_workers", "address"}`` (``address`` is the local
address this host uses to reach the scheduler, so the test sees which host it ran on), then
``{"rank", "round", "sum"}`` after each round, and at the end ``{"rank", "ok"}``. A
``KVStoreError`` is printed as ``{"rank", "error", "msg", "at"}`` (``at``: ``time.time()``)
and the exit status is 3. ``--rounds N`` rounds (default 3), ``--pause S`` seconds between.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import pskv as mx
from pskv.errors import KVStoreError


def local_address() -> str:
    """The source address towards the scheduler (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((os.environ["DMLC_PS_ROOT_URI"], 9))
        address: str = sock.getsockname()[0]
    return address


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pause", type=float, default=0.0)
    args = p.parse_args(argv)
    rank = -1
    try:
        with mx.kv.create("dist_sync") as kv:
            rank, n = kv.rank, kv.num_workers
            say(rank=rank, num_workers=n, address=local_address())
            kv.init("w", mx.nd.zeros((8,)))
            kv.init("big", mx.nd.zeros((40, 50)))  # split across the servers (bound < 2000)
            ok = True
            for r in range(args.rounds):
                kv.push("w", mx.nd.ones((8,)) * (rank + 1 + 10 * r))
                big = mx.nd.zeros((40, 50))
                kv.pushpull("big", mx.nd.ones((40, 50)) * (rank + 1), out=big)
                got = kv.pull("w").asnumpy()
                want = float(sum(w + 1 + 10 * r for w in range(n)))
                ok = ok and bool((got == want).all()) \
                    and bool((big.asnumpy() == n * (n + 1) / 2).all())
                say(rank=rank, round=r, sum=float(got[0]))
                time.sleep(args.pause)
            say(rank=rank, ok=ok)
            return 0 if ok else 1
    except KVStoreError as err:
        say(rank=rank, error=type(err).__name__, msg=str(err), at=time.time())
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
