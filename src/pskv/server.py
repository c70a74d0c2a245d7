"""The node roles other than worker: ``python -m pskv.server`` and the server-role hook.

Everything that starts a scheduler or a server goes through :func:`run_node`; the one place
a ``dist_*`` store turns its process into a scheduler or server (MXNet's launchers start the
user's script in those roles too) is :func:`serve_unless_worker`. Both are defined in the
store layer (``pskv.kvstore.server._roles``, which ``create`` imports) and re-exported here.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from ._ps.config import ClusterConfig, Role
from .errors import KVStoreError
from .kvstore.server._roles import run_node, serve_unless_worker

__all__ = ["main", "run_node", "serve_unless_worker"]


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # unwinds through the node's finally blocks: sockets closed, Unix socket files removed.
    # Later signals are ignored so that they cannot cut that cleanup short: a SIGKILLed
    # launcher's threads die one by one, and each may deliver PR_SET_PDEATHSIG again
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Read the DMLC_* variables, run the node until the job ends, return its exit status.

    SIGTERM (from pskv-launch, or when the launcher dies) and SIGINT end the node quietly,
    with status 143 or 130, after it has closed its sockets and removed its socket files.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = ClusterConfig.from_env()
        if cfg.role == Role.WORKER:
            print("pskv.server runs the scheduler or a server; DMLC_ROLE=worker runs your "
                  "training script instead.", file=sys.stderr)
            return 2
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_on_signal)
        return run_node(cfg)
    except KVStoreError as err:
        print(f"pskv.server: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    raise SystemExit(main())
