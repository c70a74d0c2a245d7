"""Hosts: the hostfile, horovodrun's ``-H host1:slots,host2:slots`` list, and placement.

Invariant: every Host has a non-empty name, an ssh port in 1-65535 and at least one slot;
`place` puts each server and worker on a host without starting anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from .._ps.config import Role
from ..errors import ConfigError

__all__ = ["Host", "is_host_list", "parse_host_list", "parse_hostfile", "place",
           "read_hostfile"]


@dataclass(frozen=True, slots=True)
class Host:
    """A hostfile entry: ``name`` reached by ssh on ``port``; ``slots`` is for mpirun."""

    name: str
    port: int = 22
    slots: int = 1


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile lines: ``host``, ``host:port``, ``[v6addr]:port`` or ``host slots=N``.

    Blank lines and ``#`` comments are skipped.

    Examples
    --------
    >>> for host in parse_hostfile('a\\nb:2222  # comment\\n\\nc slots=4\\n'):
    ...     print(host)
    Host(name='a', port=22, slots=1)
    Host(name='b', port=2222, slots=1)
    Host(name='c', port=22, slots=4)
    """
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno} ({raw.strip()!r})"
        fields = line.split()
        addr, port, slots = fields[0], 22, 1
        for extra in fields[1:]:
            key, eq, value = extra.partition("=")
            if key in ("slots", "max_slots", "max-slots") and eq and value.isdigit() \
                    and int(value) > 0:
                if key == "slots":
                    slots = int(value)
            else:
                raise ConfigError(f"{where}: cannot read {extra!r}. Write host, host:port "
                                  "or host slots=N, one a line.")
        if addr.startswith("["):
            inner, close, rest = addr[1:].partition("]")
            if not close or (rest and not rest.startswith(":")):
                raise ConfigError(f"{where}: write an IPv6 host as [addr] or [addr]:port.")
            addr, port_text = inner, rest[1:]
        elif addr.count(":") == 1:
            addr, port_text = addr.split(":")
        else:
            port_text = ""  # a bare IPv6 address has no port
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ConfigError(f"{where}: {port_text!r} is not an ssh port (1-65535).")
            port = int(port_text)
        if not addr:
            raise ConfigError(f"{where}: the host name is empty.")
        hosts.append(Host(addr, port, slots))
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Read and parse a hostfile; an unreadable or empty one is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read hostfile {path!r}: {err.strerror}. Pass -H with a "
                          "readable file of one host a line.") from err
    hosts = parse_hostfile(text, path)
    if not hosts:
        raise ConfigError(f"hostfile {path!r} lists no hosts. Write one host[:port] a line.")
    return hosts


def is_host_list(value: str) -> bool:
    """Whether ``-H value`` is horovodrun's ``host:slots,...`` list rather than a hostfile.

    An existing file is always a hostfile; otherwise a value with a comma or a colon is a list.
    """
    return not os.path.exists(value) and ("," in value or ":" in value)


def parse_host_list(text: str) -> list[Host]:
    """Parse horovodrun's ``-H host1:slots,host2:slots`` (slots default to 1).

    Examples
    --------
    >>> parse_host_list('a:2,b')
    [Host(name='a', port=22, slots=2), Host(name='b', port=22, slots=1)]
    """
    hosts = []
    for item in text.split(","):
        name, sep, slots = item.strip().partition(":")
        if not name or (sep and not (slots.isdigit() and int(slots) > 0)):
            raise ConfigError(f"-H {text!r}: cannot read {item!r}. Write host:slots entries "
                              "separated by commas, e.g. -H node1:2,node2:2.")
        hosts.append(Host(name, slots=int(slots) if sep else 1))
    return hosts


def place(num_servers: int, num_workers: int,
          hosts: Sequence[Host]) -> list[tuple[Role, int, Host]]:
    """(role, rank, host) for every server and worker, round-robin as dmlc_tracker.

    A host with N slots stands N times in a row in the round, so ``-H a:2,b:1`` puts two
    of every three processes on ``a`` (with one slot each, this is dmlc_tracker's order).

    Examples
    --------
    >>> a, b = Host('a'), Host('b')
    >>> [(r.value, i, h.name) for r, i, h in place(1, 2, [a, b])]
    [('server', 0, 'a'), ('worker', 0, 'b'), ('worker', 1, 'a')]
    """
    if not hosts:
        raise ValueError("place() needs at least one host")
    slots = [h for h in hosts for _ in range(h.slots)]
    out: list[tuple[Role, int, Host]] = []
    for i in range(num_servers + num_workers):
        role, rank = (Role.SERVER, i) if i < num_servers else (Role.WORKER, i - num_servers)
        out.append((role, rank, slots[i % len(slots)]))
    return out
