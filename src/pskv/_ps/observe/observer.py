"""One question to a running job's scheduler: where do its nodes serve ``/metrics``?

``pskv-top --scheduler HOST:PORT`` asks it (``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``), so an
operator needs the address every node of the job already knows, not the metrics port each
node happened to find free. The question is a HELLO naming the role
:data:`.validate.OBSERVER`: the scheduler challenges it like any node's (a stranger
without ``PSKV_SECRET`` is refused, as for any other message), answers once with the
job's listing and joins it to nothing. Under ``PSKV_ENCRYPT=1`` the link is CURVE, as a
node's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from ...errors import ConfigError, ProtocolError
from ..auth import prove
from ..crypt import curve_keys
from ..message import Command, decode, short
from ..validate import OBSERVER
from ..zeromq import ZmqContext, curve_client, recv_message, send_message

__all__ = ["Listing", "ask_scheduler"]


@dataclass(frozen=True, slots=True)
class Listing:
    """What a scheduler answers an observer.

    ``nodes``: ``(role, rank, state, host, metrics port)`` of each admitted node (port 0:
    it serves no metrics); ``metrics``: where the scheduler serves its own (None: it
    does not).
    """

    job: str
    nodes: tuple[tuple[str, int, str, str, int], ...]
    metrics: tuple[str, int] | None


def _listing(body: Any) -> Listing:
    """The scheduler's answer checked field by field (ProtocolError if malformed)."""
    if not isinstance(body, dict) or not isinstance(body.get("job"), str) or \
            not isinstance(body.get("nodes"), list) or len(body["nodes"]) > 1 << 16:
        raise ProtocolError(f"not a listing: {short(body)}")
    nodes = []
    for n in body["nodes"]:
        if not (isinstance(n, list) and len(n) == 5 and isinstance(n[0], str)
                and type(n[1]) is int and isinstance(n[2], str) and isinstance(n[3], str)
                and type(n[4]) is int and 0 <= n[4] < 65536):
            raise ProtocolError(f"not a node of a listing: {short(n)}")
        nodes.append((n[0], n[1], n[2], n[3], n[4]))
    own = body.get("metrics")
    if own is not None and not (isinstance(own, list) and len(own) == 2 and
                                isinstance(own[0], str) and type(own[1]) is int and
                                0 < own[1] < 65536):
        raise ProtocolError(f"not a metrics address: {short(own)}")
    return Listing(body["job"], tuple(sorted(nodes)),
                   None if own is None else (own[0], own[1]))


def ask_scheduler(address: str, secret: bytes | None, encrypt: bool = False,
                  timeout: float = 5.0) -> Listing:
    """Ask the scheduler at ``address`` (``tcp://HOST:PORT``) where the job's nodes serve
    metrics, proving ``secret`` (``PSKV_SECRET``) if it asks.

    Raises
    ------
    ConfigError
        Nothing answered within ``timeout`` seconds, the scheduler refused (no or another
        secret), or what answered is not a pskv scheduler.
    """
    if encrypt and not secret:
        raise ConfigError("PSKV_ENCRYPT=1 needs the job's PSKV_SECRET to reach its "
                          "scheduler. Set it, or unset PSKV_ENCRYPT.")
    zctx = ZmqContext()
    try:
        sock = zctx.socket(zmq.DEALER)
        if encrypt and secret:
            curve_client(sock, curve_keys(secret, "scheduler")[0])
        sock.connect(address)
        hello: dict[str, Any] = {"role": OBSERVER}
        send_message(sock, Command.HELLO, 1, body=hello, copy=True)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise ConfigError(
                    f"the scheduler at {address} did not answer within {timeout:g} s. Give "
                    "pskv-top --scheduler the job's DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT (the "
                    "scheduler's own port, not a metrics port).")
            _, frames = recv_message(sock)
            try:
                meta, _ = decode(frames)
                if meta.cmd == Command.ACK:
                    return _listing(meta.body)
            except ProtocolError as err:
                raise ConfigError(f"{address} is not a pskv scheduler: {err}.") from None
            if meta.cmd == Command.CHALLENGE:
                if not secret:
                    raise ConfigError(
                        f"the scheduler at {address} asks for proof of the job's secret and "
                        "PSKV_SECRET is not set. Set it to the job's secret (pskv-launch "
                        "takes it from PSKV_SECRET or --env PSKV_SECRET:...).")
                try:
                    proof = prove(secret, "scheduler", meta.body, OBSERVER, None)
                except ProtocolError as err:
                    raise ConfigError(f"{address} is not a pskv scheduler: {err}.") from None
                send_message(sock, Command.HELLO, 2, body={**hello, **proof}, copy=True)
                continue
            msg = meta.body.get("msg") if isinstance(meta.body, dict) else meta.body
            raise ConfigError(f"the scheduler at {address} refused pskv-top: "
                              f"{short(msg, 500)}. Set PSKV_SECRET to the job's secret.")
    finally:
        zctx.close()
