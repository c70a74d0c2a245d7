"""What a node knows of its cluster: an immutable membership, and the events that change it.

The Postoffice (the scheduler link) publishes a :class:`Membership` at admission and
replaces it, never mutates it, when the scheduler says a server moved (a restart);
readers on any thread take the current one and see a consistent whole. Changes other
components act on arrive as typed events on the Postoffice's one queue:
:class:`ServerLost` (a dead or removed server whose backup takes its shards over),
:class:`ServerRejoined` (a restarted or added server, at the endpoints of the new
membership) and :class:`ShardMoved` (a shard handed back to the server added into its
slot: docs/durability.md, "Adding and removing servers").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

__all__ = ["Event", "Membership", "ServerLost", "ServerRejoined", "ShardMoved",
           "frozen_servers"]


@dataclass(frozen=True, slots=True)
class ServerLost:
    """Server ``rank`` died (its link broke, or the scheduler reported it): its shards go
    to their backups (``PSKV_REPLICAS=1``)."""

    rank: int


@dataclass(frozen=True, slots=True)
class ServerRejoined:
    """Server ``rank`` was restarted (or added into its removed slot); the membership
    holds its new endpoints. ``handback``: told to the server that serves the slot's shard
    when the new process was *added*: it hands the shard back once its copy is there."""

    rank: int
    handback: bool = False
    #: added into its removed slot (not restarted after a death): the servers whose shards
    #: it backs send it their copies once its own shard is handed back to it, so that no
    #: two whole copies are taken at once (``Shards.rejoined``)
    added: bool = False


@dataclass(frozen=True, slots=True)
class ShardMoved:
    """Shard ``shard`` is served by server ``host`` from now on: a planned move (the
    server that served it sent every change there first, then stopped serving it)."""

    shard: int
    host: int
    #: told to ``host`` only: the token of the copy the server that handed the shard
    #: kept as its backup (``Backups.adopt``), so that no whole copy goes back to it
    copy: str = ""


Event = ServerLost | ServerRejoined | ShardMoved


def frozen_servers(servers: Sequence[Mapping[str, str]]) -> tuple[Mapping[str, str], ...]:
    """Each server's endpoints as a read-only mapping, in rank order."""
    return tuple(MappingProxyType(dict(s)) for s in servers)


@dataclass(frozen=True)
class Membership:
    """A node's view of its cluster, from the scheduler's ADMIT.

    Attributes
    ----------
    rank : int
        This node's rank in its role (-1 before admission).
    num_workers, num_servers : int
    servers : tuple of mappings
        Each server's endpoints (``tcp``, ``uds``, ``zmq``, backups' ``r_*``, ``host``).
    job : str
        This job's id (bound into every proof).
    mode : str or None
        The store mode every worker agreed on (``sync`` / ``async``).
    keys : tuple of bytes
        A worker's pair key with each server (by server rank): it proves its rank to that
        server with it, and checks that server's proof of its own rank.
    worker_keys : tuple of bytes
        A server's pair key with each worker (by worker rank).
    server_key : bytes
        A server's key for the replication links between servers.
    rejoin : bool
        Whether this node is a restarted one that took a dead node's rank.
    hosts : tuple of int
        Which server serves each shard now (``hosts[shard]``; with replicas a shard whose
        server died is served by its backup): a restarted worker starts from it. Empty
        before admission and for servers.
    joined : mapping of int to int
        The workers that joined (``kv.join``: they count as pushing zeros), as the
        scheduler said (WORKER_LEFT): rank -> the join epoch (the number of joins every
        worker completed before); a join of an epoch that has ended counts no more.
    closed : frozenset of int
        The workers that closed their store (WORKER_LEFT): a round that needs the push of
        one that had not joined (in the epoch under way) fails.
    """

    rank: int = -1
    num_workers: int = 0
    num_servers: int = 0
    servers: tuple[Mapping[str, str], ...] = ()
    job: str = ""
    mode: str | None = None
    keys: tuple[bytes, ...] = field(default=(), repr=False)
    worker_keys: tuple[bytes, ...] = field(default=(), repr=False)
    server_key: bytes = field(default=b"", repr=False)
    #: a server's key for readers of the change stream (``READER``): they read, only
    reader_key: bytes = field(default=b"", repr=False)
    rejoin: bool = False
    hosts: tuple[int, ...] = ()
    joined: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    closed: frozenset[int] = frozenset()
