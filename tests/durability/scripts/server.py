"""``pskv.server`` that SIGKILLs itself once, at a chosen moment (fault injection for tests).

Environment: DIE_SERVER (the server rank to kill), DIE_AFTER (seconds after it started),
DIE_MARK (a file it creates just before dying). Only the first start of that server dies;
a restart (PSKV_RESTART > 0) serves normally.
"""
from __future__ import annotations

import os
import signal
import threading

from pskv.server import main

if __name__ == "__main__":
    if os.environ.get("DMLC_ROLE") == "server" \
            and os.environ.get("DMLC_SERVER_ID") == os.environ.get("DIE_SERVER") \
            and os.environ.get("PSKV_RESTART", "0") == "0":
        delay = float(os.environ.get("DIE_AFTER", "1"))

        def die() -> None:
            with open(os.environ["DIE_MARK"], "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        timer = threading.Timer(delay, die)
        timer.daemon = True
        timer.start()
    raise SystemExit(main())
