"""What the control channel's requests do to the job's server slots: the rules, one place.

The servers of a job are slots fixed at launch (``-s``). ``remove-server R`` retires a
running server (SIGUSR1: it hands its shard to its backup and exits 0), and only when the
servers keep backups (``PSKV_REPLICAS=1``), there are two or more, and no other slot is out
(one at a time); ``add-server R`` starts a retired server's command again. :func:`answer`
applies these rules to a :class:`Slots` (the supervisor, in its watch loop; a fake in the
tests) and says what it did, or why not, as the JSON reply (``_control.py``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Op", "Request", "Slot", "Slots", "answer", "refuse"]


class Op(enum.Enum):
    """The requests, by their word on the wire."""

    REMOVE_SERVER = "remove-server"
    ADD_SERVER = "add-server"
    STATUS = "status"


@dataclass(frozen=True, slots=True)
class Request:
    """One parsed request line: the op and, for add and remove, the server rank."""

    op: Op
    server: int | None = None

    @property
    def line(self) -> str:
        """The request as sent: ``remove-server 2``."""
        return self.op.value if self.server is None else f"{self.op.value} {self.server}"


@dataclass(frozen=True, slots=True)
class Slot:
    """A server rank as the control channel sees it.

    ``state``: ``running``, ``retiring`` (sent SIGUSR1, not yet exited), ``retired`` (exited
    0 after it; its backup serves its shard), ``restarting`` (dead, waiting out its
    back-off before a ``--max-restarts`` restart), ``exited`` (any other end).
    """

    server: int
    state: str
    pid: int
    returncode: int | None = None

    def as_json(self) -> dict[str, object]:
        return {"server": self.server, "state": self.state, "pid": self.pid,
                "returncode": self.returncode}


class Slots(Protocol):
    """What the supervisor lets the control channel see and do (called in its watch loop)."""

    def slots(self) -> list[Slot]:
        """Every server rank, in rank order."""

    def replicated(self) -> bool:
        """Whether the servers run with ``PSKV_REPLICAS=1`` (their own environment)."""

    def ending(self) -> str | None:
        """Why the job takes no change now (it is ending), or None."""

    def retire(self, server: int) -> Slot:
        """Send SIGUSR1 to running server `server`; its slot after."""

    def rejoin(self, server: int) -> Slot:
        """Start retired server `server`'s command again; its slot after."""


#: what to do before another server can be removed, by the state of the one that is out
_FIRST = {
    "retiring": "First wait until it has retired, then add it back (add-server {0}).",
    "retired": "First add it back (add-server {0}).",
    "restarting": "First wait until it runs again (status says so).",
    "exited": "Its shard is held by its backup alone now, so no other server may leave.",
}


def refuse(error: str, server: int | None = None) -> dict[str, object]:
    """The reply to a refused request: ``{"ok": false, "error": ..., "server": R}``."""
    reply: dict[str, object] = {"ok": False, "error": error}
    if server is not None:
        reply["server"] = server
    return reply


def answer(request: Request, slots: Slots) -> dict[str, object]:
    """Carry out `request` on `slots` and the JSON reply to it (one slot out at a time)."""
    current = slots.slots()
    if request.op is Op.STATUS:
        return {"ok": True, "servers": [s.as_json() for s in current],
                "ending": slots.ending() is not None}
    r = request.server
    assert r is not None, "parse_request gives add and remove a rank"
    by_rank = {s.server: s for s in current}
    if r not in by_rank:
        ranks = ", ".join(str(s.server) for s in current) or "none"
        return refuse(f"there is no server {r} in this job (its server ranks: {ranks}). "
                      "Pass one of those ranks; status lists them.", r)
    why = slots.ending()
    if why is not None:
        return refuse(f"the job takes no {request.op.value} now: {why}.", r)
    slot = by_rank[r]
    out = [s for s in current if s.server != r and s.state in ("retiring", "retired")]
    if request.op is Op.REMOVE_SERVER:
        if len(current) < 2:
            return refuse(f"the job has {len(current)} server; a server can be removed "
                          "only when another one takes its shard (start the job with "
                          "-s 2 or more and PSKV_REPLICAS=1).", r)
        if not slots.replicated():
            return refuse("the servers run without backups (PSKV_REPLICAS is not 1 in "
                          "their environment), so a removed server's shard would be lost. "
                          "Start the job with --env PSKV_REPLICAS:1 to remove servers.", r)
        down = [s for s in current if s.server != r and s.state != "running"]
        if down:
            first = down[0]
            return refuse(f"server {first.server} is {first.state}: one server slot is out "
                          f"at a time. {_FIRST[first.state].format(first.server)}", r)
        if slot.state != "running":
            return refuse(f"server {r} is {slot.state}, not running: only a running server "
                          "can be removed.", r)
        slot = slots.retire(r)
        return {"ok": True, "server": r, "state": slot.state, "pid": slot.pid}
    if slot.state == "retiring":
        return refuse(f"server {r} is still retiring: add it back once it has retired "
                      "(status says so).", r)
    if slot.state != "retired":
        if out:
            return refuse(f"server {r} is {slot.state}, not retired: only a server that "
                          f"retired after remove-server can be added back, and server "
                          f"{out[0].server} is the one {out[0].state}.", r)
        return refuse(f"server {r} is {slot.state}: every server slot of this job is in "
                      "use (the servers are slots fixed at launch, -s is the most a job "
                      "has). Only a server removed with remove-server can be added back.",
                      r)
    slot = slots.rejoin(r)
    return {"ok": True, "server": r, "state": "starting", "pid": slot.pid}
