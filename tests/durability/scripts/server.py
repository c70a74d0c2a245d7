"""``pskv.server`` that SIGKILLs itself once, at a chosen moment (fault injection for tests).

Environment: DIE_SERVER (server ranks to kill, comma-separated), DIE_AFTER (for each, the
seconds after it started), DIE_MARK (a file each creates, suffixed with its rank, just
before dying). Only the first start of a server dies; a restart (PSKV_RESTART > 0) serves.
"""
from __future__ import annotations

import os
import signal
import threading

from pskv.server import main


def _arm() -> None:
    if os.environ.get("DMLC_ROLE") != "server" or os.environ.get("PSKV_RESTART", "0") != "0":
        return
    ranks = os.environ.get("DIE_SERVER", "").split(",")
    delays = os.environ.get("DIE_AFTER", "").split(",")
    me = os.environ.get("DMLC_SERVER_ID")
    if me not in ranks:
        return
    delay = float(delays[ranks.index(me)])

    def die() -> None:
        with open(f"{os.environ['DIE_MARK']}-{me}", "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(delay, die)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    _arm()
    raise SystemExit(main())
