"""Which nodes share a host: the identity of this machine's network stack.

Two processes can reach each other's Unix sockets (and so share memory through the
descriptors those sockets pass) only when they share a kernel and a network namespace:
pskv's sockets are abstract (``@pskv-server-...``), and abstract names live in a network
namespace. Containers or ``ip netns`` namespaces often share one hostname, so the hostname
alone says nothing; the identity is the hostname, the boot id
(``/proc/sys/kernel/random/boot_id``) and the network namespace's inode
(``/proc/self/ns/net``). Where ``/proc`` is absent (macOS), the parts that cannot be read
are left out and the hostname decides, as before.

Invariant: two processes with the same :func:`host_id` are on one kernel in one network
namespace wherever ``/proc`` can be read; a node that announces no identity is on another
host (its peers use TCP).
"""
from __future__ import annotations

import functools
import os
import socket
from typing import Mapping

__all__ = ["host_id", "same_host"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NET_NS = "/proc/self/ns/net"


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This process's host identity: ``hostname``, ``boot=<boot id>`` and
    ``netns=<inode>``, joined by ``/`` (the parts ``/proc`` gives)."""
    parts = [socket.gethostname()]
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            parts.append("boot=" + f.read().strip())
    except OSError:
        pass
    try:
        parts.append(f"netns={os.stat(_NET_NS).st_ino}")
    except OSError:
        pass
    return "/".join(parts)


def same_host(endpoints: Mapping[str, str]) -> bool:
    """Whether the node announcing ``endpoints`` (their ``host``) shares this process's
    kernel and network namespace, so that its Unix socket can be reached."""
    return endpoints.get("host") == host_id()
