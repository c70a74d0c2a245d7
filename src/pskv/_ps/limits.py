"""Limits on what a peer may cost a node before it is admitted, and quiet refusal logs.

Invariants: a refusal is logged at most once per peer per :data:`LOG_INTERVAL` seconds and
at most :data:`LOG_BURST` lines per interval in all (then one line counting the rest), and
never with what the peer sent.
"""
from __future__ import annotations

import logging
import time

__all__ = ["ADMISSION_BYTES", "ADMISSION_FRAMES", "CONTROL_BYTES", "CONTROL_FRAMES",
           "LOG_BURST", "LOG_INTERVAL", "RefusalLog", "UNADMITTED_BUDGET"]

#: the most a peer may send in one message before its HELLO is accepted (every transport)
ADMISSION_BYTES = 1 << 16
#: the most frames of one ZeroMQ message before admission (a HELLO has one)
ADMISSION_FRAMES = 4
#: the most bytes a connection may send in all before it is admitted (its HELLOs, and
#: whatever refused messages); then it is dropped
UNADMITTED_BUDGET = 4 * ADMISSION_BYTES
#: the largest message the scheduler's socket takes from anyone (ZMQ_MAXMSGSIZE): barrier
#: payloads of admitted nodes, never arrays
CONTROL_BYTES = 16 << 20
#: the most frames of one message to the scheduler (control messages have one)
CONTROL_FRAMES = 16
#: seconds between two log lines about the same peer's refusals
LOG_INTERVAL = 10.0
#: refusal lines per interval, over all peers
LOG_BURST = 20


class RefusalLog:
    """Logs refusals of strangers without letting them flood the log."""

    def __init__(self, logger: logging.Logger, name: str) -> None:
        self._log = logger
        self._name = name
        self._last: dict[str, float] = {}
        self._window = 0.0
        self._lines = 0
        self._quiet = 0

    def refused(self, peer: str, why: str, now: float | None = None) -> None:
        """Log that ``peer`` was refused for ``why`` (a short reason, no payload)."""
        now = time.monotonic() if now is None else now
        if now - self._window >= LOG_INTERVAL:
            if self._quiet:
                self._log.warning("%s: %d more refusals in the last %g s were not logged",
                                  self._name, self._quiet, LOG_INTERVAL)
            self._window, self._lines, self._quiet = now, 0, 0
            if len(self._last) > 4096:
                self._last = {p: t for p, t in self._last.items() if now - t < LOG_INTERVAL}
        last = self._last.get(peer)
        if (last is not None and now - last < LOG_INTERVAL) or self._lines >= LOG_BURST:
            self._quiet += 1
            return
        self._last[peer] = now
        self._lines += 1
        self._log.warning("%s: refused %s: %s", self._name, peer, why)
