"""``python -m pskv.serving``: a replica beside a job, serving lookups until SIGTERM."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import signal
from typing import Sequence

from ..errors import KVStoreError
from ._replica import Replica

__all__ = ["main"]


# ---- the command ----------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pskv.serving``: follow a job's tables and serve lookups until SIGTERM.
    Returns 0, or 2 for bad arguments or a job that cannot be read."""
    p = argparse.ArgumentParser(prog="python -m pskv.serving", description=(
        "Serve lookups of a pskv job's tables from a replica that follows their change "
        "streams (the job from the environment: pskv.stream.Reader.from_env)."))
    p.add_argument("--keys", required=True, help="the table keys, comma-separated")
    p.add_argument("--port", type=int, default=0, help="the TCP port (0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind")
    p.add_argument("--interval", type=float, default=0.05, help="seconds between polls")
    args = p.parse_args(argv)
    keys: list[int | str] = [int(k) if k.lstrip("-").isdigit() else k
                             for k in args.keys.split(",") if k]
    if not keys:
        p.error("--keys is empty: give the table keys, e.g. --keys emb")
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port}: give a TCP port")
    stop = threading.Event()
    try:
        from ..stream import Reader
        reader = Reader.from_env()
        replica = Replica(reader, keys, interval=args.interval)
        host, port = replica.serve(args.host, args.port, os.environ.get("PSKV_SECRET"))
    except KVStoreError as err:
        print(f"python -m pskv.serving: {err}", file=sys.stderr)
        return 2
    print(f"pskv.serving: tables {keys} at {host}:{port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        replica.close()
        reader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
