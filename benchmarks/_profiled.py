"""Run a Python program under cProfile in every thread, one dump per thread.

    python _profiled.py OUT_DIR -m pskv.server
    python _profiled.py OUT_DIR script.py ARGS...

Times are CPU seconds of the thread (``time.thread_time``), not wall time: waits count
nothing. ``cProfile`` alone sees only the main thread; a pskv server keeps its backups on a thread
of their own (``kvstore/durable/_replica.py``), so each thread started here gets its own profiler,
and writes ``OUT_DIR/<pid>-<thread name>.prof`` when it ends (the main thread's at exit,
also when the launcher stops the process with SIGTERM). Merge them with ``pstats``.
"""
from __future__ import annotations

import atexit
import cProfile
import os
import runpy
import signal
import sys
import threading
import time
from typing import Any


def _dump(prof: cProfile.Profile, out: str, name: str) -> None:
    prof.disable()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    prof.dump_stats(os.path.join(out, f"{os.getpid()}-{safe}.prof"))


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            run(self)
        finally:
            _dump(prof, out, self.name)

    threading.Thread.run = profiled_run     # type: ignore[method-assign]
    prof = cProfile.Profile(time.thread_time)
    atexit.register(_dump, prof, out, "main")

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    prof.enable()
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3], *sys.argv[4:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
