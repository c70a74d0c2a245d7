"""A pskv server under a profiler switched by signals, for ``bench_embeddings.py --profile``.

Run by the benchmark (never by hand) as ``python _emb_server_prof.py OUT.prof`` with a
server's ``DMLC_*`` variables: ``SIGUSR1`` starts a cProfile (CPU time of the thread) of the server's main thread
(where its engine applies pushes and answers lookups), ``SIGUSR2`` stops it and writes
``OUT.prof``; so a profile holds one timed phase, not the table's fill.
"""
from __future__ import annotations

import cProfile
import signal
import time
import sys
from types import FrameType


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _emb_server_prof.py OUT.prof", file=sys.stderr)
        return 2
    out = argv[0]
    prof = cProfile.Profile(time.thread_time)   # CPU, not wall: the box is shared

    def start(signum: int, frame: FrameType | None) -> None:
        prof.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from pskv.server import main as serve
    return serve([])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
