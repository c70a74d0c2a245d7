"""Proof of the cluster secret: HMAC-SHA256 over a fresh nonce, checked in constant time.

A verifier remembers the nonces it has accepted, so a recorded HELLO cannot be replayed.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["Verifier", "prove"]


def prove(secret: bytes | None, role: str, purpose: str) -> dict[str, str]:
    """The proof fields of a HELLO body (empty when the cluster has no secret)."""
    if secret is None:
        return {}
    nonce = secrets.token_hex(16)
    mac = hmac.new(secret, f"pskv|{purpose}|{role}|{nonce}".encode(), hashlib.sha256)
    return {"nonce": nonce, "proof": mac.hexdigest()}


class Verifier:
    """Checks HELLO proofs against ``secret``; with no secret, admits everyone."""

    def __init__(self, secret: bytes | None, purpose: str) -> None:
        self._secret = secret
        self._purpose = purpose
        self._seen: set[str] = set()

    def check(self, body: object) -> str | None:
        """None if the proof is good, else why it is not."""
        if self._secret is None:
            return None
        if not isinstance(body, dict):
            return "no proof of the cluster secret"
        nonce, proof, role = body.get("nonce"), body.get("proof"), body.get("role")
        if not (isinstance(nonce, str) and isinstance(proof, str) and isinstance(role, str)):
            return "no proof of the cluster secret"
        if nonce in self._seen:
            return "a replayed proof"
        want = hmac.new(self._secret, f"pskv|{self._purpose}|{role}|{nonce}".encode(),
                        hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, proof):
            return "a wrong proof of the cluster secret"
        self._seen.add(nonce)
        return None
