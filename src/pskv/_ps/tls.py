"""TLS for the TCP links between workers and servers (Python's ``ssl``), as an option.

With ``PSKV_TLS_CERT``, ``PSKV_TLS_KEY`` and ``PSKV_TLS_CA`` set on every node, each TCP
stream link between a worker and a server is mutual TLS: both sides present a certificate
signed by the job's CA and check the other's against it (not against a host name: nodes are
addressed by IP). Unix sockets within a host and the scheduler's ZeroMQ link stay as they
are (``docs/security.md``). Invariant: a context is built once per node, from files.
"""
from __future__ import annotations

import ssl

from ..errors import ConfigError

__all__ = ["client_context", "server_context"]


def _context(purpose: ssl.Purpose, cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False          # the job's CA vouches for its nodes, by certificate
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"cannot load the TLS certificate {cert!r} with key {key!r}: {err}. "
                          "Set PSKV_TLS_CERT and PSKV_TLS_KEY to a PEM certificate signed by "
                          "PSKV_TLS_CA and its key.") from None
    return ctx


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The context a server accepts TCP links with (client certificates required)."""
    return _context(ssl.Purpose.CLIENT_AUTH, cert, key, ca)


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The context a worker connects to servers with."""
    return _context(ssl.Purpose.SERVER_AUTH, cert, key, ca)
