"""Admission: the accepting side chooses the challenge; the proof binds job, role and rank.

A node says HELLO (its role, and the rank it claims); the acceptor answers CHALLENGE with a
fresh random nonce of its own and its job id; the node answers with a second HELLO whose
``proof`` is HMAC-SHA256 under its key over ``pskv|purpose|job|role|rank|nonce``. The nonce
is used once and only on the connection it was given to, so a HELLO recorded anywhere (this
job or another one with the same secret) proves nothing. Keys: the cluster secret towards
the scheduler; towards a server, the per-rank key the scheduler gave that worker in its
ADMIT (the servers get the whole table), so a node that holds the cluster secret still
cannot claim another worker's rank to a server. With no key (a cluster without a secret,
towards the scheduler) a HELLO is admitted without a challenge.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from typing import Any, Callable

from ..errors import ProtocolError

__all__ = ["CHALLENGE", "Verifier", "check_server", "new_key", "prove", "server_proof",
           "warn_without_secret"]

log = logging.getLogger(__name__)

#: what :meth:`Verifier.check` returns when the peer must first answer a challenge
CHALLENGE = "challenge"


def warn_without_secret(who: str, secret: bytes | None, transport: str, where: str,
                        host: str) -> bool:
    """Log one WARNING (once per node: each node calls it once, as it starts) when ``who``
    runs without a cluster secret on a transport other processes can reach (not a thread
    cluster's ``inproc``): such a cluster admits any process that reaches ``where``,
    without a word otherwise. ``host``: the address it binds. Whether it warned.

    pskv-launch always gives a job a secret (``PSKV_SECRET``, else a new one per job), so
    this is a cluster started by hand (or by another tool) without one.
    """
    if secret or transport == "inproc":
        return False
    try:
        local = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        local = host.lower() == "localhost"
    reach = ("any program of any user of this machine" if local else
             f"anyone who can reach {host} over the network")
    log.warning("%s: PSKV_SECRET is not set, so this cluster admits any process that reaches "
                "%s, with no proof asked: %s can join it, read and change its values. Set "
                "PSKV_SECRET to one random value on every node (python -c 'import secrets; "
                "print(secrets.token_hex(32))'), or start the job with pskv-launch, which "
                "makes one per job (docs/security.md).", who, where, reach)
    return True


def new_key() -> str:
    """A fresh random key or job id (hex)."""
    return secrets.token_hex(16)


def _mac(key: bytes, purpose: str, job: str, role: str, rank: int | None, nonce: str) -> str:
    msg = f"pskv|{purpose}|{job}|{role}|{'' if rank is None else rank}|{nonce}"
    return hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()


def prove(key: bytes, purpose: str, challenge: Any, role: str, rank: int | None) \
        -> dict[str, str]:
    """The proof fields of the HELLO that answers ``challenge`` (a CHALLENGE body)."""
    if not isinstance(challenge, dict) or not isinstance(challenge.get("nonce"), str) or \
            not isinstance(challenge.get("job"), str):
        raise ProtocolError("a CHALLENGE without a nonce and a job id")
    nonce, job = challenge["nonce"], challenge["job"]
    return {"nonce": nonce, "proof": _mac(key, purpose, job, role, rank, nonce)}


def server_proof(key: bytes, job: str, server: int, worker: int, nonce: str,
                 wnonce: str) -> str:
    """What server ``server`` answers worker ``worker``'s admission with: HMAC under the
    key only that worker and that server hold (the scheduler's pair key for this
    incarnation of the server), over both nonces of the handshake."""
    return _mac(key, "server-proof", job, "server", server, f"{worker}|{nonce}|{wnonce}")


def check_server(key: bytes, job: str, server: int, worker: int, nonce: str | None,
                 wnonce: str, body: Any) -> None:
    """Raise ProtocolError unless ``body`` (a server's answer to this worker's proof) proves
    that it is this job's server ``server`` as the scheduler admitted it."""
    got = body.get("proof") if isinstance(body, dict) else None
    if nonce is None or not isinstance(got, str) or not hmac.compare_digest(
            server_proof(key, job, server, worker, nonce, wnonce).encode(), got.encode()):
        raise ProtocolError(f"the node at server {server}'s address did not prove that it is "
                            f"server {server} of this job (no challenge, or a wrong proof): "
                            "not talking to it")


class Verifier:
    """Checks HELLOs for one acceptor.

    Parameters
    ----------
    purpose : str
        ``"scheduler"`` or ``"server"``: a proof made for one is worthless to the other.
    job : str
        This job's id (the scheduler's, chosen at random when it starts).
    key_for : callable
        ``key_for(role, rank)``: the key a peer of that role and rank proves, None when
        none is needed; raises ProtocolError when no such peer may connect.
    """

    def __init__(self, purpose: str, job: str,
                 key_for: Callable[[str, int | None], bytes | None]) -> None:
        self.purpose = purpose
        self.job = job
        self._key_for = key_for
        self._nonces: dict[Any, str] = {}    # conn -> the nonce it was challenged with

    def challenge(self, conn: Any) -> dict[str, str]:
        """A CHALLENGE body for ``conn`` (a fresh nonce replaces any earlier one)."""
        nonce = secrets.token_hex(16)
        self._nonces[conn] = nonce
        return {"nonce": nonce, "job": self.job}

    def forget(self, conn: Any) -> None:
        """``conn`` is gone: its challenge can no longer be answered."""
        self._nonces.pop(conn, None)

    def pending(self) -> int:
        """Challenges issued and not yet answered."""
        return len(self._nonces)

    def check(self, conn: Any, body: dict[str, Any]) -> str | None:
        """None: admit; :data:`CHALLENGE`: send one; else why the HELLO is refused.

        ``body`` was checked by :func:`.validate.request` (role a known role, rank an int).
        """
        role, rank = str(body.get("role")), body.get("rank")
        try:
            key = self._key_for(role, rank)
        except ProtocolError as err:
            return str(err)
        if key is None:
            return None
        proof, nonce = body.get("proof"), body.get("nonce")
        if proof is None:
            return CHALLENGE
        want = self._nonces.pop(conn, None)
        if want is None or not isinstance(nonce, str) or \
                not hmac.compare_digest(nonce.encode(), want.encode()):
            return "a proof for a challenge this node did not give to this connection"
        if not isinstance(proof, str) or not hmac.compare_digest(
                _mac(key, self.purpose, self.job, role, rank, want).encode(), proof.encode()):
            return "a wrong proof of the cluster secret"
        return None
