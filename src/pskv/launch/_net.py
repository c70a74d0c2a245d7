"""Addresses and ports: the one `free_port` of pskv (tests and benchmarks use it too).

Invariant: nothing here keeps a socket open; a port `free_port` returns was free when it
was asked, and another process may take it before it is bound again.
"""
from __future__ import annotations

import ipaddress
import socket

from ..errors import ConfigError

__all__ = ["free_port", "guess_host_ip"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free on `host` now (as torch.distributed picks one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def guess_host_ip() -> str:
    """This machine's first non-loopback IPv4 address, for hosts to reach the scheduler.

    A UDP ``connect`` sends nothing; it only asks the kernel which source address it would
    use (dmlc_tracker's get_host_ip does the same).
    """
    candidates: list[str] = []
    for target in ("10.255.255.255", "192.0.2.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((target, 1))
                candidates.append(sock.getsockname()[0])
        except OSError:
            continue
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for ip in candidates:
        if not ipaddress.ip_address(ip).is_loopback and ip != "0.0.0.0":
            return ip
    raise ConfigError("cannot find a non-loopback address of this machine for the hosts to "
                      "reach the scheduler. Pass --host-ip ADDRESS.")

