"""ClusterConfig: the only reader of the DMLC_* / PSKV_* variables.

Invariant: a ClusterConfig is frozen and validated; everything else receives one, and tests
build it directly.

Over 500 lines because it is the one reader of every environment variable (docs/env.md),
each with its parse and its error message.
"""
from __future__ import annotations

import difflib
import enum
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field, replace
from typing import Mapping

from ..errors import ConfigError, StalenessError

__all__ = [
    "ClusterConfig", "ENV_BIGARRAY_BOUND", "ENV_CHECKPOINT_DIR", "ENV_CHECKPOINT_EVERY",
    "ENV_CHECKPOINT_KEEP", "ENV_ENCRYPT", "ENV_JOIN_STATUS", "ENV_MAX_RESTARTS", "ENV_REPLICAS", "ENV_RESTART", "ENV_BACKUP_RING_BYTES", "ENV_COALESCE_BYTES", "ENV_COLLECTIVE_BYTES", "ENV_COLLECTIVE_SHM", "ENV_CONNECT_TIMEOUT", "ENV_HEARTBEAT_INTERVAL",
    "ENV_HEARTBEAT_TIMEOUT", "ENV_NODE_HOST", "ENV_NUM_SERVER", "ENV_NUM_WORKER",
    "ENV_REDUCE_THREADS", "ENV_REQUEST_TIMEOUT", "ENV_ROLE", "ENV_ROOT_PORT", "ENV_ROOT_URI", "ENV_ROUND_TIMEOUT",
    "ENV_HANDSHAKE_TIMEOUT", "ENV_LOG_LEVEL", "ENV_MAX_KEY_BYTES", "ENV_MAX_KEYS_PER_MESSAGE",
    "ENV_MAX_MESSAGE_BYTES", "ENV_MAX_REPLY_BYTES", "ENV_MAX_UNADMITTED", "ENV_METRICS_PORT",
    "ENV_METRICS_CONNECTIONS", "ENV_METRICS_HOST", "ENV_METRICS_KEYS",
    "ENV_METRICS_PUSHGATEWAY", "ENV_METRICS_TOKEN", "ENV_METRICS_TOP_KEYS",
    "ENV_SECRET", "ENV_TLS_CA", "ENV_TLS_CERT", "ENV_TLS_KEY",
    "ENV_SCHEDULER_PORT", "ENV_SERVER_ID", "ENV_SERVERS_PER_NODE", "LOG_LEVELS", "log_level",
    "ENV_SHUTDOWN_TIMEOUT", "ENV_STRAGGLER_SECONDS", "ENV_JOIN_TIMEOUT",
    "ENV_TRANSPORT", "ENV_WORKER_ID", "ENV_STALENESS", "ENV_GLOBAL_STALENESS", "staleness_bounds",
    "ENV_MXNET_PYTHON", "ENV_MXNET_SRC", "ENV_PREFIX", "KNOWN_ENV",
    "Role", "advertised_host", "loopback_address", "max_key_bytes", "reduce_threads",
    "replicas_setting",
    "unknown_env",
    "warn_unknown_env",
]

log = logging.getLogger(__name__)

ENV_ROLE = "DMLC_ROLE"
ENV_ROOT_URI = "DMLC_PS_ROOT_URI"
ENV_ROOT_PORT = "DMLC_PS_ROOT_PORT"
ENV_NUM_SERVER = "DMLC_NUM_SERVER"
ENV_NUM_WORKER = "DMLC_NUM_WORKER"
ENV_NODE_HOST = "DMLC_NODE_HOST"
#: the rank a worker / server asks for (BytePS's DMLC_WORKER_ID); pskv-launch sets them
ENV_WORKER_ID = "DMLC_WORKER_ID"
ENV_SERVER_ID = "DMLC_SERVER_ID"
ENV_BIGARRAY_BOUND = "MXNET_KVSTORE_BIGARRAY_BOUND"
ENV_SECRET = "PSKV_SECRET"
ENV_CONNECT_TIMEOUT = "PSKV_CONNECT_TIMEOUT"
ENV_REQUEST_TIMEOUT = "PSKV_REQUEST_TIMEOUT"
ENV_ROUND_TIMEOUT = "PSKV_ROUND_TIMEOUT"
#: seconds a sync round waits before a server names the workers it waits for
ENV_STRAGGLER_SECONDS = "PSKV_STRAGGLER_SECONDS"
ENV_HEARTBEAT_INTERVAL = "PSKV_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_TIMEOUT = "PSKV_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "PSKV_SHUTDOWN_TIMEOUT"
#: seconds kv.join() waits for the other workers to join (uneven data)
ENV_JOIN_TIMEOUT = "PSKV_JOIN_TIMEOUT"
ENV_TRANSPORT = "PSKV_TRANSPORT"
ENV_COALESCE_BYTES = "PSKV_COALESCE_BYTES"
#: bytes of the shared-memory ring beside each link to a backup on the same host (_ps/ring.py)
ENV_BACKUP_RING_BYTES = "PSKV_BACKUP_RING_BYTES"
#: dense dist_sync keys of at least this many bytes are summed among the workers
#: (docs/collective.md); 0: none
ENV_COLLECTIVE_BYTES = "PSKV_COLLECTIVE_BYTES"
#: its default: from this size up the collective path costs less CPU and time per round
#: than the servers on this kind of host (benchmarks/bench_route.py, its results
#: benchmarks/results/bench_route.md)
DEFAULT_COLLECTIVE_BYTES = 262144
#: 0: the collective path's workers on one host exchange their chunks over the Unix socket
#: instead of shared memory (_ps/shm.py; default 1)
ENV_COLLECTIVE_SHM = "PSKV_COLLECTIVE_SHM"
#: seconds a connection may take to be admitted; then it is closed
ENV_HANDSHAKE_TIMEOUT = "PSKV_HANDSHAKE_TIMEOUT"
#: connections not admitted yet that a node keeps at once; more are refused
ENV_MAX_UNADMITTED = "PSKV_MAX_UNADMITTED"
#: the largest message an admitted peer may send (and ZMQ_MAXMSGSIZE of a ZeroMQ data port)
ENV_MAX_MESSAGE_BYTES = "PSKV_MAX_MESSAGE_BYTES"
#: what one request may make a server hold or send (docs/security.md): the bytes of one key
#: as declared (its whole shape; row ids included), keys in one message, one reply's bytes
ENV_MAX_KEY_BYTES = "PSKV_MAX_KEY_BYTES"
ENV_MAX_KEYS_PER_MESSAGE = "PSKV_MAX_KEYS_PER_MESSAGE"
ENV_MAX_REPLY_BYTES = "PSKV_MAX_REPLY_BYTES"
#: TLS for TCP links between workers and servers: a PEM certificate, its key, the job's CA
ENV_TLS_CERT = "PSKV_TLS_CERT"
ENV_TLS_KEY = "PSKV_TLS_KEY"
ENV_TLS_CA = "PSKV_TLS_CA"
#: 1: every link of the job encrypted and authenticated per message, keys derived from
#: PSKV_SECRET (ZeroMQ: CURVE; stream links: AES-256-GCM; docs/security.md)
ENV_ENCRYPT = "PSKV_ENCRYPT"
#: periodic checkpoints (docs/durability.md): where, every how many rounds, how many kept
ENV_CHECKPOINT_DIR = "PSKV_CHECKPOINT_DIR"
ENV_CHECKPOINT_EVERY = "PSKV_CHECKPOINT_EVERY"
ENV_CHECKPOINT_KEEP = "PSKV_CHECKPOINT_KEEP"
#: set by pskv-launch --max-restarts in every process, and the restart count of this one
ENV_MAX_RESTARTS = "PSKV_MAX_RESTARTS"
ENV_RESTART = "PSKV_RESTART"
#: 1: every shard also lives on the next server (primary-backup, docs/durability.md)
ENV_REPLICAS = "PSKV_REPLICAS"
#: set by pskv-launch for a scheduler on its machine: a file the scheduler writes
#: "waiting" to when the first worker says HELLO and "joined" to before it admits the job,
#: so the launcher can name a worker that exited 0 without joining while others wait
ENV_JOIN_STATUS = "PSKV_JOIN_STATUS"
#: the level of pskv's loggers in every process of a job (pskv-launch --log-level)
ENV_LOG_LEVEL = "PSKV_LOG_LEVEL"
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: each node serves Prometheus /metrics on the first free port from this one upward
ENV_METRICS_PORT = "PSKV_METRICS_PORT"
#: a Prometheus Pushgateway (host:port) each node pushes its metrics to when it ends
ENV_METRICS_PUSHGATEWAY = "PSKV_METRICS_PUSHGATEWAY"
#: clients each node's /metrics endpoint holds at once (one more evicts the oldest)
ENV_METRICS_CONNECTIONS = "PSKV_METRICS_CONNECTIONS"
#: the address each node serves /metrics on (default: its listeners' own)
ENV_METRICS_HOST = "PSKV_METRICS_HOST"
#: a bearer token each node's /metrics endpoint then requires (Authorization: Bearer ...)
ENV_METRICS_TOKEN = "PSKV_METRICS_TOKEN"
#: the default staleness bounds of a store (kv.set_staleness; docs/embeddings.md): unacked
#: push calls a read may run ahead of, and pushes a worker may be ahead of the slowest one
ENV_STALENESS = "PSKV_STALENESS"
ENV_GLOBAL_STALENESS = "PSKV_GLOBAL_STALENESS"
#: how many keys (those that moved most bytes) each server exports per-key series for
ENV_METRICS_TOP_KEYS = "PSKV_METRICS_TOP_KEYS"
#: keys (comma-separated) each server exports per-key series for, besides the top ones
ENV_METRICS_KEYS = "PSKV_METRICS_KEYS"
#: threads a store's Reducer sums and copies big arrays with (local and dist stores)
ENV_REDUCE_THREADS = "PSKV_REDUCE_THREADS"
#: the test suite's (docs/env.md, "Tests"): an MXNet 1.9.1 python and source checkout
ENV_MXNET_PYTHON = "PSKV_MXNET_PYTHON"
ENV_MXNET_SRC = "PSKV_MXNET_SRC"
#: a job started by torchrun (kvstore/dist/_torchrun.py): servers each node's local rank 0
#: starts (default 1), and the scheduler's port (default MASTER_PORT + 1)
ENV_SERVERS_PER_NODE = "PSKV_SERVERS_PER_NODE"
ENV_SCHEDULER_PORT = "PSKV_SCHEDULER_PORT"
ENV_PREFIX = "PSKV_"
#: every PSKV_* variable pskv reads: the ENV_* constants above, so the list is kept once
KNOWN_ENV: frozenset[str] = frozenset(
    value for name, value in list(globals().items())
    if name.startswith("ENV_") and isinstance(value, str) and value.startswith(ENV_PREFIX)
    and value != ENV_PREFIX)
#: the unknown names already warned about in this process (once each, as warnings' registry)
_WARNED: set[str] = set()


def unknown_env(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``PSKV_*`` names in `environ` that pskv does not read, with the nearest known one.

    Examples
    --------
    >>> unknown_env({'PSKV_CHEKPOINT_DIR': '/c', 'PSKV_SECRET': 's', 'HOME': '/root'})
    [('PSKV_CHEKPOINT_DIR', 'PSKV_CHECKPOINT_DIR')]
    """
    out = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in KNOWN_ENV:
            near = difflib.get_close_matches(name, sorted(KNOWN_ENV), n=1)
            out.append((name, near[0] if near else None))
    return out


def warn_unknown_env(environ: Mapping[str, str] | None = None, who: str = "pskv") -> None:
    """Log one warning per unknown ``PSKV_*`` name (once per process), naming the nearest
    known one: a misspelt setting is otherwise ignored without a word."""
    for name, near in unknown_env(os.environ if environ is None else environ):
        if name in _WARNED:
            continue
        _WARNED.add(name)
        hint = f"Did you mean {near}? " if near else ""
        log.warning("%s: %s is set, but pskv reads no such variable, so it is ignored. "
                    "%s(docs/env.md lists them.)", who, name, hint)


def log_level(environ: Mapping[str, str] | None = None) -> str | None:
    """PSKV_LOG_LEVEL as a `logging` level name, or None when unset.

    Examples
    --------
    >>> log_level({'PSKV_LOG_LEVEL': 'debug'})
    'DEBUG'
    """
    raw = (os.environ if environ is None else environ).get(ENV_LOG_LEVEL, "")
    if not raw:
        return None
    if raw.upper() not in LOG_LEVELS:
        raise ConfigError(f"{ENV_LOG_LEVEL}={raw!r} is not a log level. Set it to one of "
                          f"{', '.join(n.lower() for n in LOG_LEVELS)}.")
    return raw.upper()


def reduce_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """PSKV_REDUCE_THREADS as a thread count, or None when unset or 0 (the default size).

    Examples
    --------
    >>> reduce_threads({'PSKV_REDUCE_THREADS': '2'}), reduce_threads({})
    (2, None)
    """
    env = os.environ if environ is None else environ
    return _int(env, ENV_REDUCE_THREADS, 0, "Set it to the number of threads a store sums "
                "big arrays with (1: no pool), or unset it.") or None


class Role(str, enum.Enum):
    """A node's role; the values are the DMLC_ROLE strings."""

    SCHEDULER = "scheduler"
    SERVER = "server"
    WORKER = "worker"


def _int(env: Mapping[str, str], name: str, default: int | None, hint: str,
         minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{name} is not set. {hint}")
        return default
    try:
        value = int(float(raw)) if "e" in raw.lower() else int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer. {hint}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}. {hint}")
    return value


def max_key_bytes(env: Mapping[str, str]) -> int:
    """``PSKV_MAX_KEY_BYTES`` of ``env`` (64 GiB unset); ConfigError when not a positive
    integer. A dist node reads it into :class:`ClusterConfig`; a local store's tables here."""
    return _int(env, ENV_MAX_KEY_BYTES, 1 << 36, "Set it to a number of bytes, e.g. "
                "68719476736.", 1)


def staleness_bounds(env: Mapping[str, str], store_type: str) -> tuple[int | None, int | None]:
    """The default staleness bounds of every store this process creates, from
    ``PSKV_STALENESS`` and ``PSKV_GLOBAL_STALENESS`` of ``env`` (unset or empty: none); StalenessError for a value that is not a whole number of at least 0."""
    out: list[int | None] = []
    for name in (ENV_STALENESS, ENV_GLOBAL_STALENESS):
        raw = env.get(name, "").strip()
        if not raw:
            out.append(None)
            continue
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise StalenessError(f"{name}={raw!r} is not a whole number of pushes of at least "
                                 "0. Set it to e.g. 2, or unset it.", store_type=store_type)
        out.append(value)
    return out[0], out[1]


_REPLICAS_HINT = "Set it to 1 (a backup of every shard) or 0 (none)."


def replicas_setting(env: Mapping[str, str]) -> int:
    """``PSKV_REPLICAS`` of ``env``: 0 or 1 (unset: 0); ConfigError for anything else.

    The servers and pskv-launch both read it here, so the launcher never announces
    backups the servers will not keep (``yes`` is refused by both, at launch).

    Examples
    --------
    >>> replicas_setting({}), replicas_setting({"PSKV_REPLICAS": "1"})
    (0, 1)
    """
    value = _int(env, ENV_REPLICAS, 0, _REPLICAS_HINT)
    if value not in (0, 1):
        raise ConfigError(f"{ENV_REPLICAS}={env.get(ENV_REPLICAS)!r}: pskv keeps at most one "
                          f"backup of each shard. {_REPLICAS_HINT}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds. Set it to e.g. "
                          f"{default:g}.") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive, finite number of seconds.")
    return value


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Everything a node needs to know about its cluster.

    Attributes
    ----------
    role : Role
    root_uri, root_port : where the scheduler listens (DMLC_PS_ROOT_URI / _PORT)
    num_servers, num_workers : DMLC_NUM_SERVER / DMLC_NUM_WORKER
    node_host : the address this node binds to and advertises (DMLC_NODE_HOST, default
        the scheduler's address when it is a loopback address, else all interfaces)
    secret : the cluster secret (PSKV_SECRET); None runs unauthenticated
    bigarray_bound : arrays with at least this many elements are split across servers
    connect_timeout : seconds to reach the scheduler and be admitted
    request_timeout : seconds any single reply may take
    round_timeout : seconds a sync round may wait for the slowest worker
    straggler_seconds : seconds a sync round waits before its server logs which workers
        it waits for on which keys, then again every as many seconds (PSKV_STRAGGLER_SECONDS)
    heartbeat_interval, heartbeat_timeout : liveness probing of every node
    shutdown_timeout : seconds servers wait for the final goodbye
    join_timeout : seconds ``kv.join()`` waits for the other workers to join
    transport : data path to the servers: 'auto' (Unix sockets within a host, TCP between
        hosts), 'tcp' (TCP always), 'ipc' (Unix sockets always), 'zmq' (ZeroMQ always), or
        'inproc' (ZeroMQ inproc: every node a thread of one process sharing one ZeroMQ
        context, no sockets; set only by :class:`pskv.testing.InprocCluster`)
    coalesce_bytes : a dist_sync push of at most this many bytes waits for the store's next
        call, so that a pull of the same keys right after it travels with it (0: never)
    backup_ring_bytes : with replicas, a primary whose backup is on the same host writes the
        rounds it streams there into a shared-memory ring of this many bytes instead of the
        Unix socket (PSKV_BACKUP_RING_BYTES, docs/durability.md); 0: the socket always
    collective_bytes : dense ``dist_sync`` keys of at least this many bytes are summed among
        the workers instead of on the servers (PSKV_COLLECTIVE_BYTES, docs/collective.md;
        default :data:`DEFAULT_COLLECTIVE_BYTES`); 0: no key
    collective_shm : on the collective path, workers on one host move a round's data through
        shared memory, and only small messages through their Unix socket (PSKV_COLLECTIVE_SHM,
        docs/collective.md); False: through the socket
    rank : the rank this worker or server asks the scheduler for (DMLC_WORKER_ID /
        DMLC_SERVER_ID); None takes the next free rank in arrival order
    handshake_timeout : seconds a connection may take to be admitted before it is closed
    max_unadmitted : connections not yet admitted that a node keeps at once
    max_message_bytes : the largest message an admitted peer may send
    max_key_bytes : the most bytes one key may declare (its whole shape, with 8 bytes of row
        id per row of a row_sparse key); checked on every init, placement and checkpoint
    max_keys_per_message : the most keys one request may name
    max_reply_bytes : the most bytes one pull's reply from one server may carry (row ids
        asked for included)
    tls : (certificate, key, CA) PEM files for mutual TLS on TCP links between workers and
        servers (PSKV_TLS_CERT / _KEY / _CA); None: plain TCP
    encrypt : every link encrypted and authenticated per message, with keys derived from
        the secret (PSKV_ENCRYPT=1; needs ``secret``)
    checkpoint_dir : where servers write periodic checkpoints and where a restarted server
        reloads its shard from (PSKV_CHECKPOINT_DIR); None: no periodic checkpoints
    checkpoint_every : rounds between periodic checkpoints (PSKV_CHECKPOINT_EVERY)
    checkpoint_keep : how many complete periodic checkpoints are kept (PSKV_CHECKPOINT_KEEP)
    max_restarts : how often pskv-launch restarts a dead node (PSKV_MAX_RESTARTS): the
        scheduler then waits for a dead server's replacement instead of ending the job
    restart : this process's restart count (PSKV_RESTART; 0: its first start)
    metrics_port : each node serves Prometheus ``/metrics`` on the first free port from
        this one upward (PSKV_METRICS_PORT; docs/observability.md); 0: no metrics
    metrics_pushgateway : a Pushgateway (``host:port``) each node pushes its metrics to
        when it ends, for short jobs (PSKV_METRICS_PUSHGATEWAY); None: no push
    metrics_top_keys : each server exports per-key series for this many of its keys, those
        that moved most bytes (PSKV_METRICS_TOP_KEYS; at most 1000)
    metrics_keys : keys each server exports per-key series for besides the top ones, as
        ``str(key)`` (PSKV_METRICS_KEYS, comma-separated; at most 100)
    metrics_connections : clients a node's ``/metrics`` endpoint holds at once, one more
        evicting the oldest that has not sent its request (PSKV_METRICS_CONNECTIONS)
    metrics_host : the address ``/metrics`` is served on (PSKV_METRICS_HOST); None: the
        node's listeners' own
    metrics_token : the bearer token ``/metrics`` requires (PSKV_METRICS_TOKEN); None:
        none
    join_status : the file the scheduler writes how far the job joined to (PSKV_JOIN_STATUS,
        set by pskv-launch); None: none
    replicas : 1 keeps a copy of every shard on the next server, which takes over when its
        primary dies (PSKV_REPLICAS); 0: none
    """

    role: Role
    root_uri: str = "127.0.0.1"
    root_port: int = 9091
    num_servers: int = 1
    num_workers: int = 1
    node_host: str = "127.0.0.1"
    secret: bytes | None = None
    bigarray_bound: int = 1_000_000
    connect_timeout: float = 60.0
    request_timeout: float = 300.0
    round_timeout: float = 300.0
    straggler_seconds: float = 10.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 15.0
    shutdown_timeout: float = 30.0
    join_timeout: float = 3600.0
    transport: str = "auto"
    coalesce_bytes: int = 65536
    backup_ring_bytes: int = 128 << 20
    collective_bytes: int = DEFAULT_COLLECTIVE_BYTES
    collective_shm: bool = True
    rank: int | None = None
    handshake_timeout: float = 10.0
    max_unadmitted: int = 64
    max_message_bytes: int = 4 << 30
    max_key_bytes: int = 1 << 36
    max_keys_per_message: int = 1 << 16
    max_reply_bytes: int = 4 << 30
    tls: tuple[str, str, str] | None = None
    encrypt: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    max_restarts: int = 0
    restart: int = 0
    replicas: int = 0
    metrics_port: int = 0
    metrics_pushgateway: str | None = None
    metrics_top_keys: int = 10
    metrics_keys: tuple[str, ...] = ()
    metrics_connections: int = 16
    metrics_host: str | None = None
    metrics_token: str | None = field(default=None, repr=False)
    join_status: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ConfigError(f"role {self.role!r} is not a Role.")
        if self.num_servers < 1 or self.num_workers < 1:
            raise ConfigError(
                f"a cluster needs at least one server and one worker, got "
                f"{self.num_servers} servers and {self.num_workers} workers. Set "
                f"{ENV_NUM_SERVER} and {ENV_NUM_WORKER}, or start with pskv-launch -n W -s S.")
        if not 0 < self.root_port < 65536:
            raise ConfigError(f"{ENV_ROOT_PORT}={self.root_port} is not a TCP port (1-65535).")
        if self.encrypt and not self.secret:
            raise ConfigError(f"{ENV_ENCRYPT}=1 derives every link's keys from the cluster "
                              f"secret, and {ENV_SECRET} is not set. Set it (pskv-launch sets "
                              f"one per job), or unset {ENV_ENCRYPT}.")
        if self.replicas not in (0, 1):
            raise ConfigError(f"{ENV_REPLICAS}={self.replicas}: pskv keeps at most one backup "
                              f"of each shard. {_REPLICAS_HINT}")
        if self.replicas and self.num_servers < 2:
            raise ConfigError(f"{ENV_REPLICAS}=1 needs at least 2 servers (a shard's backup "
                              f"lives on another server); this cluster has {self.num_servers}. "
                              "Start with pskv-launch -s 2 or more.")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"{ENV_METRICS_PORT}={self.metrics_port} is not a TCP port "
                              "(1-65535). Set it to the first port nodes may serve /metrics "
                              "on, e.g. 9400, or unset it.")
        if not 1 <= self.metrics_connections <= 1024:
            raise ConfigError(f"{ENV_METRICS_CONNECTIONS}={self.metrics_connections}: from 1 "
                              "to 1024 clients at once. Set it to e.g. 16 (each costs the "
                              "node a descriptor).")
        if not 0 <= self.metrics_top_keys <= 1000:
            raise ConfigError(f"{ENV_METRICS_TOP_KEYS}={self.metrics_top_keys}: at most 1000 "
                              "keys per server get per-key series (each is a series per "
                              "key). Set it to e.g. 10, or 0 for none.")
        if len(self.metrics_keys) > 100:
            raise ConfigError(f"{ENV_METRICS_KEYS} names {len(self.metrics_keys)} keys: at "
                              "most 100 get per-key series. Name fewer (the busiest are "
                              f"shown anyway, see {ENV_METRICS_TOP_KEYS}).")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(f"{ENV_CHECKPOINT_EVERY}={self.checkpoint_every} needs "
                              f"{ENV_CHECKPOINT_DIR}: set it to a directory every server can "
                              "write (a shared file system across hosts).")
        if self.transport not in ("auto", "tcp", "ipc", "zmq", "inproc"):
            raise ConfigError(f"{ENV_TRANSPORT}={self.transport!r}: use auto, tcp, ipc or zmq.")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"{ENV_HEARTBEAT_TIMEOUT} ({self.heartbeat_timeout:g} s) must exceed "
                f"{ENV_HEARTBEAT_INTERVAL} ({self.heartbeat_interval:g} s).")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 role: Role | str | None = None) -> ClusterConfig:
        """Read and validate the cluster variables (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        raw_role = role.value if isinstance(role, Role) else (role or env.get(ENV_ROLE, ""))
        if not raw_role:
            raise ConfigError(f"{ENV_ROLE} is not set. Set it to scheduler, server or worker, "
                              "or start the job with pskv-launch.")
        try:
            the_role = Role(str(raw_role).lower())
        except ValueError:
            raise ConfigError(
                f"{ENV_ROLE}={raw_role!r} is not a role. Set it to scheduler, server or "
                "worker, or start the job with pskv-launch.") from None
        uri = env.get(ENV_ROOT_URI, "")
        if not uri:
            raise ConfigError(f"{ENV_ROOT_URI} is not set. Set it to the scheduler's address "
                              "(e.g. 127.0.0.1), or start the job with pskv-launch.")
        port = _int(env, ENV_ROOT_PORT, None, "Set it to the scheduler's port, or start the "
                    "job with pskv-launch.", 1)
        nserv = _int(env, ENV_NUM_SERVER, None, "Set it to the number of server processes, "
                     "or start with pskv-launch -s 2.", 1)
        nwork = _int(env, ENV_NUM_WORKER, None, "Set it to the number of worker processes, "
                     "or start with pskv-launch -n 2.", 1)
        host = env.get(ENV_NODE_HOST) or _default_host(uri)
        secret = env.get(ENV_SECRET)
        level = log_level(env)
        if level is not None:
            # the one place every node reads its settings, workers included
            logging.getLogger("pskv").setLevel(level)
        warn_unknown_env(env, f"{the_role.value}")
        rank_var = {Role.WORKER: ENV_WORKER_ID, Role.SERVER: ENV_SERVER_ID}.get(the_role)
        rank = None
        if rank_var is not None and env.get(rank_var):
            rank = _int(env, rank_var, None, f"Set it to this {the_role.value}'s rank "
                        f"(0 to {ENV_NUM_WORKER if the_role is Role.WORKER else ENV_NUM_SERVER}"
                        " - 1), or leave it unset to take the next free rank.")
        return cls(
            role=the_role, root_uri=uri, root_port=port, num_servers=nserv,
            num_workers=nwork, node_host=host,
            secret=secret.encode() if secret else None,
            bigarray_bound=_int(env, ENV_BIGARRAY_BOUND, 1_000_000,
                                "Set it to a number of elements, e.g. 1000000.", 1),
            connect_timeout=_seconds(env, ENV_CONNECT_TIMEOUT, 60.0),
            request_timeout=_seconds(env, ENV_REQUEST_TIMEOUT, 300.0),
            round_timeout=_seconds(env, ENV_ROUND_TIMEOUT, 300.0),
            straggler_seconds=_seconds(env, ENV_STRAGGLER_SECONDS, 10.0),
            heartbeat_interval=_seconds(env, ENV_HEARTBEAT_INTERVAL, 1.0),
            heartbeat_timeout=_seconds(env, ENV_HEARTBEAT_TIMEOUT, 15.0),
            shutdown_timeout=_seconds(env, ENV_SHUTDOWN_TIMEOUT, 30.0),
            join_timeout=_seconds(env, ENV_JOIN_TIMEOUT, 3600.0),
            transport=_transport(env.get(ENV_TRANSPORT, "auto") or "auto"),
            coalesce_bytes=_int(env, ENV_COALESCE_BYTES, 65536,
                                "Set it to a number of bytes (0 sends every push at once)."),
            backup_ring_bytes=-(-_int(env, ENV_BACKUP_RING_BYTES, 128 << 20,
                                      "Set it to a number of bytes (0: no ring).") // 64) * 64,
            collective_bytes=_int(env, ENV_COLLECTIVE_BYTES, DEFAULT_COLLECTIVE_BYTES,
                                  "Set it to a number of bytes "
                                  "(e.g. 4194304: keys of 4 MiB and more are summed among "
                                  "the workers), or 0 to keep every key on the servers."),
            collective_shm=_switch(env, ENV_COLLECTIVE_SHM, True),
            rank=rank,
            handshake_timeout=_seconds(env, ENV_HANDSHAKE_TIMEOUT, 10.0),
            max_unadmitted=_int(env, ENV_MAX_UNADMITTED, 64, "Set it to a number of "
                                "connections, e.g. 64.", 1),
            max_message_bytes=_int(env, ENV_MAX_MESSAGE_BYTES, 4 << 30, "Set it to a number "
                                   "of bytes, e.g. 4294967296.", 1 << 20),
            max_key_bytes=max_key_bytes(env),
            max_keys_per_message=_int(env, ENV_MAX_KEYS_PER_MESSAGE, 1 << 16, "Set it to a "
                                      "number of keys, e.g. 65536.", 1),
            max_reply_bytes=_int(env, ENV_MAX_REPLY_BYTES, 4 << 30, "Set it to a number of "
                                 "bytes, e.g. 4294967296.", 1),
            tls=_tls(env),
            encrypt=_switch(env, ENV_ENCRYPT),
            checkpoint_dir=env.get(ENV_CHECKPOINT_DIR) or None,
            checkpoint_every=_int(env, ENV_CHECKPOINT_EVERY, 0, "Set it to a number of rounds "
                                  f"between checkpoints (with {ENV_CHECKPOINT_DIR}), or 0."),
            checkpoint_keep=_int(env, ENV_CHECKPOINT_KEEP, 3, "Set it to how many checkpoints "
                                 "to keep, e.g. 3.", 1),
            max_restarts=_int(env, ENV_MAX_RESTARTS, 0, "Set it with pskv-launch "
                              "--max-restarts N."),
            restart=_int(env, ENV_RESTART, 0, "pskv-launch sets it; leave it unset."),
            replicas=replicas_setting(env),
            join_status=env.get(ENV_JOIN_STATUS) or None,
            metrics_port=_int(env, ENV_METRICS_PORT, 0, "Set it to the first port nodes may "
                              "serve Prometheus /metrics on, e.g. 9400, or unset it."),
            metrics_pushgateway=env.get(ENV_METRICS_PUSHGATEWAY) or None,
            metrics_top_keys=_int(env, ENV_METRICS_TOP_KEYS, 10, "Set it to how many keys "
                                  "per server get per-key series, e.g. 10, or 0 for none."),
            metrics_keys=tuple(k.strip() for k in env.get(ENV_METRICS_KEYS, "").split(",")
                               if k.strip()),
            metrics_connections=_int(env, ENV_METRICS_CONNECTIONS, 16, "Set it to how many "
                                     "clients a /metrics endpoint holds at once, e.g. 16.", 1),
            metrics_host=env.get(ENV_METRICS_HOST) or None,
            metrics_token=env.get(ENV_METRICS_TOKEN) or None,
        )

    def with_role(self, role: Role) -> ClusterConfig:
        """A copy with another role (tests start a whole cluster from one config)."""
        return replace(self, role=role)

    @property
    def root_address(self) -> str:
        """The scheduler's ZeroMQ endpoint."""
        if self.transport == "inproc":
            return f"inproc://pskv-scheduler-{self.root_port}"
        return f"tcp://{_bracket(self.root_uri)}:{self.root_port}"


def _tls(env: Mapping[str, str]) -> tuple[str, str, str] | None:
    files = [env.get(name, "") for name in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA)]
    if not any(files):
        return None
    if not all(files):
        raise ConfigError(f"{ENV_TLS_CERT}, {ENV_TLS_KEY} and {ENV_TLS_CA} go together: set "
                          "all three (PEM files) for TLS between workers and servers, or none.")
    return files[0], files[1], files[2]


def _switch(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if raw == "0":
        return False
    if raw == "1":
        return True
    raise ConfigError(f"{name}={raw!r} is not 0 or 1. Set it to 1 to switch it on, 0 to switch "
                      f"it off, or unset it (default {int(default)}).")


def _transport(raw: str) -> str:
    if raw == "inproc":
        raise ConfigError(f"{ENV_TRANSPORT}=inproc works only for a cluster inside one process "
                          "(pskv.testing.InprocCluster). Use auto, tcp, ipc or zmq.")
    return raw


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _default_host(uri: str) -> str:
    """Where a node binds by default: the loopback address ``uri`` names in any spelling
    (an address, ``localhost`` in any case, a name that resolves only to loopback, such as
    this machine's hostname on many distributions), else all interfaces."""
    try:
        return uri if ipaddress.ip_address(uri).is_loopback else "0.0.0.0"
    except ValueError:
        pass
    loopback = loopback_address(uri)
    return loopback if loopback is not None else "0.0.0.0"


def loopback_address(name: str) -> str | None:
    """The loopback address ``name`` resolves to when it resolves to loopback only, else
    None (a name that does not resolve is not loopback)."""
    if name.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    addrs = [str(info[4][0]).split("%")[0] for info in infos]
    try:
        if not addrs or not all(ipaddress.ip_address(a).is_loopback for a in addrs):
            return None
    except ValueError:
        return None
    v4 = [a for a in addrs if "." in a]
    return v4[0] if v4 else addrs[0]


def advertised_host(node_host: str, root_uri: str) -> str:
    """The address a node announces for its listeners: ``node_host`` (``DMLC_NODE_HOST``)
    unless it binds every interface (``0.0.0.0``), else the local address that routes to
    the scheduler at ``root_uri`` (no packet is sent), else 127.0.0.1.

    Examples
    --------
    >>> advertised_host('10.0.0.7', 'sched'), advertised_host('0.0.0.0', '127.0.0.1')
    ('10.0.0.7', '127.0.0.1')
    """
    if node_host != "0.0.0.0":
        return node_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((root_uri, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
