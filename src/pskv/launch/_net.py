"""Addresses and ports: the one `free_port` of pskv (tests and benchmarks use it too).

Invariant: nothing here keeps a socket open; a port `free_port` returns was free when it
was asked, and another process may take it before it is bound again.
"""
from __future__ import annotations

import ipaddress
import random
import socket

from ..errors import ConfigError

__all__ = ["free_port", "guess_host_ip"]


#: the lowest port `free_port` tries below the OS's ephemeral range
FIRST_PORT = 20000


def ephemeral_low() -> int:
    """The first port of the OS's ephemeral range (Linux: ip_local_port_range; else the
    IANA default 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, below the OS's ephemeral range when there is room.

    The OS hands ports of its ephemeral range to every program's ``bind(0)`` and outgoing
    connection (srun's I/O ports, for one), and may hand out the one just released again,
    so a port picked there can be taken before the scheduler binds it. Random ports from
    :data:`FIRST_PORT` up to that range are tried first; else the OS picks one.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = ephemeral_low()
    if low - FIRST_PORT >= 1000:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(FIRST_PORT, low)
            try:
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.bind((host, port))
            except OSError:      # in use (or in TIME_WAIT): another
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
    return chosen


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

