"""``pskv.server`` that SIGKILLs itself once, at a chosen moment (fault injection for tests).

Environment: DIE_SERVER (server ranks to kill, comma-separated), DIE_AFTER (for each, the
seconds after it started, or ``copies:N+D``: D seconds after restarted servers have
installed N whole shard copies as backups, so that a second death comes only once the first
one's server is a backup again), DIE_MARK (a file each creates, suffixed with its rank, just
before dying; a restarted server creates ``DIE_MARK-copy-I`` for each whole copy it
installs; or ``hellos``: when the last worker's first HELLO arrives, before answering it,
so that the workers are still connecting; or ``batch:N``: right after it sent its backup
its N-th batch of rounds (``r_rounds``), before the backup's acknowledgment is read; or
``rounds:N``: once it has applied N rounds (sync) or pushes (async) of the keys it serves,
before anyone is answered: a kill tied to the job's progress, not to the clock, so that a
slow start on a busy machine cannot move it before the workers connected; or
``pushes:N``: when its N-th push message arrives, before reading it (that push is lost,
its worker must send it again from its log); or
``first-copy``: once admitted, before the first copy of its shard goes to its backup,
while the workers connect). Only the first start of a server dies; a restart
(PSKV_RESTART > 0) serves.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pskv.server import main


def _count_copies() -> None:
    """On a restarted server: mark each whole shard copy installed (DIE_MARK-copy-I)."""
    from pskv.kvstore.durable import _backups
    real = _backups.install_copy
    made = [0]

    def install_copy(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        made[0] += 1
        Path(f"{os.environ['DIE_MARK']}-copy-{made[0]}").touch()
    _backups.install_copy = install_copy


def _wait_copies(n: int, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not Path(f"{os.environ['DIE_MARK']}-copy-{n}").exists() and time.monotonic() < end:
        time.sleep(0.05)


def _die_at_last_hello(me: str) -> None:
    from pskv._ps import serve
    real = serve.ServeLoop._hello
    seen: set[Any] = set()

    def hello(self: Any, conn: Any, meta: Any) -> None:
        body = meta.body if isinstance(meta.body, dict) else {}
        if body.get("role") == "worker":
            seen.add(body.get("rank"))
            if len(seen) == int(os.environ["DMLC_NUM_WORKER"]):
                Path(f"{os.environ['DIE_MARK']}-{me}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        real(self, conn, meta)
    serve.ServeLoop._hello = hello  # type: ignore[method-assign]


def _die_after_batch(me: str, n: int) -> None:
    from pskv._ps.ops import ReplOp
    from pskv.kvstore.durable import _replica
    real = _replica.Replicator.send
    sent = [0]

    def send(self: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        real(self, op, *args, **kwargs)
        if op is ReplOp.ROUNDS:
            sent[0] += 1
            if sent[0] == n:
                Path(f"{os.environ['DIE_MARK']}-{me}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
    _replica.Replicator.send = send  # type: ignore[method-assign]


def _die_after_rounds(me: str, n: int) -> None:
    from pskv.kvstore.durable import _shards
    real = _shards.Shard.round_applied
    applied = [0]

    def round_applied(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        applied[0] += 1
        if applied[0] == n:
            Path(f"{os.environ['DIE_MARK']}-{me}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
    _shards.Shard.round_applied = round_applied  # type: ignore[method-assign]


def _die_at_push(me: str, n: int) -> None:
    from pskv._ps.message import Command
    from pskv.kvstore.server._core import KVServer
    real = KVServer._handlers[Command.PUSH]
    seen = [0]

    def on_push(self: Any, *args: Any, **kwargs: Any) -> None:
        seen[0] += 1
        if seen[0] == n:
            Path(f"{os.environ['DIE_MARK']}-{me}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, *args, **kwargs)
    KVServer._handlers = {**KVServer._handlers, Command.PUSH: on_push}


def _die_before_first_copy(me: str) -> None:
    from pskv.kvstore.durable import _shards
    real = _shards.Shards.serve

    def serve(self: Any, index: int, engine: Any) -> Any:
        if index == int(me):
            Path(f"{os.environ['DIE_MARK']}-{me}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, index, engine)
    _shards.Shards.serve = serve  # type: ignore[method-assign]


def _arm() -> None:
    if os.environ.get("DMLC_ROLE") != "server":
        return
    if os.environ.get("PSKV_RESTART", "0") != "0":
        if "DIE_MARK" in os.environ:
            _count_copies()
        return
    ranks = os.environ.get("DIE_SERVER", "").split(",")
    delays = os.environ.get("DIE_AFTER", "").split(",")
    me = os.environ.get("DMLC_SERVER_ID")
    if me not in ranks:
        return
    when = delays[ranks.index(me)]
    if when == "hellos":
        _die_at_last_hello(me)
        return
    if when.startswith("batch:"):
        _die_after_batch(me, int(when[len("batch:"):]))
        return
    if when == "first-copy":
        _die_before_first_copy(me)
        return
    if when.startswith("rounds:"):
        _die_after_rounds(me, int(when[len("rounds:"):]))
        return
    if when.startswith("pushes:"):
        _die_at_push(me, int(when[len("pushes:"):]))
        return
    copies = 0
    if when.startswith("copies:"):
        copies_text, _, when = when[len("copies:"):].partition("+")
        copies = int(copies_text)
    delay = float(when or 0)

    def die() -> None:
        if copies:
            _wait_copies(copies)
            time.sleep(delay)
        with open(f"{os.environ['DIE_MARK']}-{me}", "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(0.0 if copies else delay, die)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    _arm()
    raise SystemExit(main())
