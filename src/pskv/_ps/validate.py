"""What each message type must carry: one checker per command, before any handler runs.

:func:`request` is called by the server loop on every message a scheduler or a server
receives, and :func:`admit_reply` by a node on the scheduler's ADMIT: each checks every
field of the body (type, range, length) and raises ProtocolError naming the field, so a
handler only ever sees a body of the right shape. What a field means for the cluster (a rank
beyond the expected count, a key never initialized) is the handler's to check; what a field
is (an int, a short string, a list of one spec per key) is checked here, once.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ProtocolError
from .message import PUSH_KINDS, Command, Meta, kind_arrays, short
from .ops import Op, ReplOp, parse

__all__ = ["OBSERVER", "READER", "ROLES", "admit_reply", "reader_reply", "request"]

#: the roles of a job's nodes
ROLES = ("server", "worker")
#: a HELLO's role that asks the scheduler where the nodes serve metrics and joins nothing
#: (pskv-top --scheduler; ``_ps/observe/observer.py``): it proves the secret like any node
OBSERVER = "observer"
#: a HELLO's role that reads tables' change streams and joins nothing (``pskv.stream``):
#: it proves the secret to the scheduler, which answers with the servers and a key for
#: each that lets it read (Op.CHANGES) and nothing else (docs/security.md)
READER = "reader"
_MAX_STR = 4096
_MAX_RANK = 1 << 20
_STORE_MODES = ("sync", "async")


def _fail(meta: Meta, field: str, want: str, got: Any) -> ProtocolError:
    return ProtocolError(f"{meta.cmd.name}: field {field!r} must be {want}, got {short(got)}")


def _body(meta: Meta, required: bool = True) -> dict[str, Any]:
    if meta.body is None and not required:
        return {}
    if not isinstance(meta.body, dict):
        raise _fail(meta, "b", "an object", meta.body)
    return meta.body


def _str(meta: Meta, body: dict[str, Any], field: str, choices: tuple[str, ...] = (),
         optional: bool = False) -> None:
    value = body.get(field)
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > _MAX_STR or (choices and value not in choices):
        raise _fail(meta, field, f"one of {choices}" if choices else "a string", value)


def _int(meta: Meta, body: dict[str, Any], field: str, lo: int, hi: int,
         optional: bool = False) -> None:
    value = body.get(field)
    if value is None and optional:
        return
    if type(value) is not int or not lo <= value < hi:
        raise _fail(meta, field, f"an integer in [{lo}, {hi})", value)


def _hello(meta: Meta, arrays: list[np.ndarray]) -> None:
    body = _body(meta)
    _str(meta, body, "role", (*ROLES, OBSERVER, READER))
    _int(meta, body, "rank", 0, _MAX_RANK, optional=True)
    for field in ("host", "proof", "nonce", "wnonce"):
        _str(meta, body, field, optional=True)
    _str(meta, body, "mode", _STORE_MODES, optional=True)
    _int(meta, body, "pid", 0, 1 << 31, optional=True)
    _endpoints(meta, body)


def _endpoints(meta: Meta, body: dict[str, Any]) -> None:
    eps = body.get("endpoints", {})
    if not isinstance(eps, dict) or len(eps) > 8 or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= _MAX_STR
            for k, v in eps.items()):
        raise _fail(meta, "endpoints", "an object of a few strings", eps)


def _barrier(meta: Meta, arrays: list[np.ndarray]) -> None:
    body = _body(meta)
    _str(meta, body, "group", ("worker", "server", "all", "join"))


def _shard_moved(meta: Meta, arrays: list[np.ndarray]) -> None:  # server/_moves.py
    [_int(meta, _body(meta), f, 0, _MAX_RANK) for f in ("shard", "host")]


def _peer_lost(meta: Meta, arrays: list[np.ndarray]) -> None:
    body = _body(meta)
    _str(meta, body, "role", ROLES)
    _int(meta, body, "rank", 0, _MAX_RANK)
    _endpoints(meta, body)          # where the reporter knew it (optional)


def _none(meta: Meta, arrays: list[np.ndarray]) -> None:
    """No body needed (anything given is ignored), no arrays."""
    if arrays:
        raise ProtocolError(f"{meta.cmd.name} carries no arrays, got {len(arrays)}")


def _init(meta: Meta, arrays: list[np.ndarray]) -> None:
    body = _body(meta)
    entries = body.get("entries")
    if not isinstance(entries, list) or len(entries) != len(meta.keys) or \
            len(arrays) != len(meta.keys):
        raise ProtocolError("INIT needs one entry spec and one array per key")
    if len(set(meta.keys)) != len(meta.keys):
        raise ProtocolError("an INIT names a key twice")
    for spec, arr in zip(entries, arrays, strict=True):
        if not isinstance(spec, dict):
            raise _fail(meta, "entries", "a list of objects", spec)
        key, shape = spec.get("key"), spec.get("shape")
        if not (type(key) is int or (isinstance(key, str) and len(key) <= _MAX_STR)):
            raise _fail(meta, "key", "an int or a string", key)
        if not isinstance(shape, list) or tuple(shape) != arr.shape:
            raise ProtocolError(f"INIT of key {short(key)}: shape {arr.shape} != declared "
                                f"{short(shape)}")
        _str(meta, spec, "stype", ("default", "row_sparse", "table"), optional=True)
        if spec.get("stype") == "table":
            _table_entry(meta, spec, arr)


def _table_entry(meta: Meta, spec: dict[str, Any], arr: np.ndarray) -> None:
    """A table key's INIT entry: its TableSpec as JSON, its shard [i, n], an empty
    (0, dim) array (the spec itself is checked by TableSpec.from_json on the server)."""
    if not isinstance(spec.get("table"), dict):
        raise _fail(meta, "table", "an object (a TableSpec as JSON)", spec.get("table"))
    shard = spec.get("shard")
    if not isinstance(shard, list) or len(shard) != 2 or not all(
            type(x) is int for x in shard) or not 0 <= shard[0] < shard[1] <= _MAX_RANK:
        raise _fail(meta, "shard", "[i, n] with 0 <= i < n", shard)
    lineage = spec.get("lineage")
    if lineage is not None and (not isinstance(lineage, str) or not 0 < len(lineage) <= 64):
        raise _fail(meta, "lineage", "a string of 1 to 64 characters, or null", lineage)
    if arr.ndim != 2 or arr.shape[0] != 0:
        raise ProtocolError(f"INIT of table key {short(spec.get('key'))}: the array must be "
                            f"empty (0, dim), got shape {arr.shape}")


def _push(meta: Meta, arrays: list[np.ndarray]) -> None:
    body = _body(meta)
    kinds = body.get("kinds")
    if not isinstance(kinds, str) or len(kinds) != len(meta.keys) or \
            not set(kinds) <= set(PUSH_KINDS):
        raise ProtocolError("a push needs one kind letter (d, c, r or t) per key")
    if len(set(meta.keys)) != len(meta.keys):
        raise ProtocolError("a push names a key twice")
    if len(arrays) != sum(kind_arrays(k) for k in kinds):
        raise ProtocolError("push arrays do not match their kinds")
    # the step of a worker training through a data position (docs/data.md)
    _int(meta, body, "step", 0, 1 << 62, optional=True)


def _pull(meta: Meta, arrays: list[np.ndarray]) -> None:
    if arrays:
        raise ProtocolError(f"PULL carries no arrays, got {len(arrays)}")
    _now(meta)


def _now(meta: Meta) -> None:
    """A pull's ``now`` (docs/data.md D4): true, false, or the keys of the message that
    a restarted worker reads as they are."""
    now = meta.body.get("now", False) if isinstance(meta.body, dict) else False
    if not isinstance(now, bool) and not (
            isinstance(now, list) and len(set(now)) == len(now) and
            all(type(k) is int and k in meta.keys for k in now)):
        raise _fail(meta, "now", "true, false or a list of the message's keys", now)


def _rsp_pull(meta: Meta, arrays: list[np.ndarray]) -> None:
    if len(arrays) != len(meta.keys) or not all(
            a.ndim == 1 and a.dtype.kind in "iu" for a in arrays):
        raise ProtocolError("row_sparse pull needs one 1-d integer row-id array per key")
    _now(meta)


def _pairs(meta: Meta, body: dict[str, Any], field: str) -> None:
    value = body.get(field, [])
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
            for p in value):
        raise _fail(meta, field, "a list of [int, int] pairs", value)


def _state_bytes(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    if len(arrays) != 1 or arrays[0].dtype != np.uint8 or arrays[0].ndim != 1:
        raise ProtocolError(f"{body['op']} needs one 1-d array of state bytes")


def _spec(field: str, nullable: bool) -> Callable[[Meta, dict[str, Any], list[np.ndarray]], None]:
    def check(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
        if not isinstance(body.get(field), dict | None if nullable else dict):
            raise _fail(meta, field, "an object or null" if nullable else "an object",
                        body.get(field))
    return check


def _path(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    _str(meta, body, "path")


def _checkpoint(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A checkpoint's path, and the keys whose value the workers send (the collective
    path)."""
    _path(meta, body, arrays)
    _held(meta, body, arrays)


def _held(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """The keys whose value the workers send (the collective path): distinct ps_keys, one
    array each."""
    held = body.get("values", [])
    ok = isinstance(held, list) and len(held) == len(arrays) and \
        all(type(k) is int and -(1 << 63) <= k < 1 << 64 for k in held)
    if not ok or len(set(held)) != len(held):
        raise _fail(meta, "values", f"a list of distinct int keys, one per array sent "
                    f"({len(arrays)})", held)


def _dump(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    if not isinstance(body.get("dump", False), bool):
        raise _fail(meta, "dump", "a bool", body.get("dump"))


def _lookup(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    _int(meta, body, "key", -(1 << 63), 1 << 63)
    if not isinstance(body.get("train"), bool):
        raise _fail(meta, "train", "true or false", body.get("train"))
    if not isinstance(body.get("now", False), bool):      # as a pull's (docs/data.md D4)
        raise _fail(meta, "now", "true or false", body.get("now"))
    if len(arrays) != 1 or arrays[0].ndim != 1 or arrays[0].dtype.kind not in "iu":
        raise ProtocolError("a table lookup carries one 1-d integer array of IDs")


def _table_key(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    _int(meta, body, "key", -(1 << 63), 1 << 63)
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


def _changes(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A read of a table shard's change stream: key, since (>= -1), lineage (a short
    string or null), cursor (>= 0), upto (>= 0 or null), max_rows (>= 1), raw."""
    _int(meta, body, "key", -(1 << 63), 1 << 63)
    _int(meta, body, "since", -1, 1 << 62)
    _int(meta, body, "cursor", 0, 1 << 62)
    _int(meta, body, "upto", 0, 1 << 62, optional=True)
    _int(meta, body, "max_rows", 1, 1 << 31)
    lineage = body.get("lineage")
    if lineage is not None and (not isinstance(lineage, str) or len(lineage) > 64):
        raise _fail(meta, "lineage", "a string of at most 64 characters, or null", lineage)
    if not isinstance(body.get("raw"), bool):
        raise _fail(meta, "raw", "true or false", body.get("raw"))
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


def _explain(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """``kv.explain``: a table key and one int64 ID."""
    _int(meta, body, "key", -(1 << 63), 1 << 63)
    _int(meta, body, "id", -(1 << 63), 1 << 63)
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


def _hot_ids(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """``kv.hot_ids``: a table key and how many (1 to 256)."""
    _int(meta, body, "key", -(1 << 63), 1 << 63)
    _int(meta, body, "k", 1, 257)
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


def _clock(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A worker's clock (``_ps/staleness.py``): ``clock``, ``bound`` (null: none) and
    ``leave``, each optional."""
    _int(meta, body, "clock", 0, 1 << 62, optional=True)
    _int(meta, body, "bound", 0, 1 << 62, optional=True)
    if not isinstance(body.get("leave", False), bool):
        raise _fail(meta, "leave", "true or false", body.get("leave"))
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


def _nothing(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """No field beyond the op."""


def _one_round(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """One round of an ``r_rounds`` message: key, round, kind, the workers' applied counts,
    the optimizer's counts, and its arrays."""
    _int(meta, body, "key", -(1 << 63), 1 << 63)
    _int(meta, body, "round", 0, 1 << 62)
    _str(meta, body, "kind", ("d", "r", "t", "l", "f"))
    _pairs(meta, body, "applied")
    _marks(meta, body, "marks")
    # the optimizer's counts of a dense round (kvstore/durable/_backup_log.py): both or neither
    _int(meta, body, "count", 0, 1 << 62, optional=True)
    _int(meta, body, "nu", 0, 1 << 62, optional=True)
    if ("count" in body) != ("nu" in body) or body["kind"] in "lf" and "count" not in body:
        raise ProtocolError("a replicated round carries both update counts or neither "
                            "(a logged round or a whole state: both)")
    if body["kind"] == "f":     # a key's value, then its state's arrays
        if not _state_shape(body.get("state"), 0) or not arrays:
            raise ProtocolError("a whole key's state is described by null, \"a\" or a "
                                "list of those (at most 4 deep, 16 wide) and carries its "
                                "value")
        return
    if body["kind"] == "t":     # a table shard's changed rows: one array per named field
        fields = body.get("fields")
        if not isinstance(fields, list) or len(fields) != len(arrays) or not all(
                isinstance(f, str) and len(f) <= 32 for f in fields) or \
                not isinstance(body.get("table"), dict):
            raise ProtocolError("a replicated table round names one field per array")
        return
    if len(arrays) != (2 if body["kind"] == "r" else 1):
        raise ProtocolError("a replicated round carries its merged value's arrays")


def _r_rounds(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """Applied rounds, as one message: ``rounds`` (each :func:`_one_round`) and ``arrays``,
    how many of the message's arrays each carries, in order, all of them. With ``ring``
    (``_ps/ring.py``) the arrays are in the link's shared memory, one entry each, and the
    message carries none (the entries themselves are checked as they are read)."""
    rounds, counts, ring = body.get("rounds"), body.get("arrays"), body.get("ring")
    carried: list[Any] = arrays if ring is None else ring
    if not isinstance(rounds, list) or not rounds or not isinstance(counts, list) or \
            len(counts) != len(rounds) or not all(isinstance(r, dict) for r in rounds) or \
            not all(type(n) is int and n >= 0 for n in counts) or \
            not isinstance(carried, list) or sum(counts) != len(carried) or \
            ring is not None and arrays:
        raise ProtocolError("r_rounds carries a list of rounds and, for each, how many of "
                            "its arrays the round has (all of them, in order; in the "
                            "message, or one ring entry each and none in the message)")
    pos = 0
    for one, n in zip(rounds, counts):
        _one_round(meta, one, carried[pos:pos + n])
        pos += n


def _r_ring(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A primary's ring: its data bytes (the descriptor goes along: ``_ps/ring.py``)."""
    _int(meta, body, "bytes", 1, 1 << 40)
    if arrays:
        raise ProtocolError(f"r_ring carries no arrays, got {len(arrays)}")


def _state_shape(desc: Any, depth: int) -> bool:
    """Whether ``desc`` describes an optimizer state as ``durable._backup_log`` writes it."""
    if desc is None or desc == "a":
        return True
    return isinstance(desc, list) and depth < 4 and len(desc) <= 16 and \
        all(_state_shape(d, depth + 1) for d in desc)


def _r_entries(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    entries = body.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries) \
            or len(arrays) < len(entries):
        raise _fail(meta, "entries", "a list of objects, one array each", entries)


def _r_init(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    _r_entries(meta, body, arrays)
    keys = body.get("keys")
    if not isinstance(keys, list) or len(keys) != len(body["entries"]) or \
            len(arrays) != len(keys):
        raise _fail(meta, "keys", "one key per entry and array", keys)


def _seal(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A worker's seal of its steps (docs/data.md): ``step`` (>= 0) and ``commit``."""
    _int(meta, body, "step", 0, 1 << 62)
    if not isinstance(body.get("commit"), bool):
        raise _fail(meta, "commit", "true or false", body.get("commit"))
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


def _marks(meta: Meta, body: dict[str, Any], field: str) -> None:
    value = body.get(field, [])
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 3 and all(type(x) is int for x in p)
            and 0 <= p[1] < 1 << 62 and 0 <= p[2] < 1 << 62 for p in value):
        raise _fail(meta, field, "a list of [worker, step, base] integers", value)


def _joined(meta: Meta, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """The end of a join (``kv.join``): the scheduler's join ``epoch`` that begins."""
    _int(meta, body, "epoch", 1, 1 << 62)
    if arrays:
        raise ProtocolError(f"{body['op']} carries no arrays, got {len(arrays)}")


#: what each op's body must carry, beyond its name (and, for replication, its shard)
_OPS: dict[Op | ReplOp, Callable[[Meta, dict[str, Any], list[np.ndarray]], None]] = {
    Op.OPTIMIZER: _spec("spec", nullable=False), Op.COMPRESSION: _spec("params", True),
    Op.SAVE: _dump, Op.LOAD: _state_bytes, Op.CHECKPOINT: _checkpoint, Op.RESTORE: _path,
    Op.APPLIED: _nothing, Op.INITIAL: _nothing, Op.LOOKUP: _lookup, Op.TABLE_STATS: _table_key,
    Op.CLOCK: _clock, Op.JOINED: _joined, Op.ADOPT: _held, Op.CHANGES: _changes,
    Op.EXPLAIN: _explain, Op.HOT_IDS: _hot_ids, Op.SEAL: _seal, Op.POSITION: _nothing,
    ReplOp.STATE: _r_entries, ReplOp.ROUNDS: _r_rounds,
    ReplOp.INIT: _r_init,
    ReplOp.OPTIMIZER: _spec("spec", nullable=True), ReplOp.COMPRESSION: _spec("params", True),
    ReplOp.LOAD: _state_bytes, ReplOp.RESTORE: _path, ReplOp.NOOP: _nothing,
    ReplOp.RING: _r_ring,
}


def _command(meta: Meta, arrays: list[np.ndarray]) -> None:
    body = _body(meta)
    op = parse(body)
    if op is None:
        raise _fail(meta, "op", f"one of {tuple(o.value for o in _OPS)}", body.get("op"))
    if isinstance(op, ReplOp):
        # a primary's change of a shard its backup keeps (only servers are admitted there)
        _int(meta, body, "shard", 0, _MAX_RANK)
    _OPS[op](meta, body, arrays)


_CHECKS: dict[Command, Callable[[Meta, list[np.ndarray]], None]] = {
    Command.HELLO: _hello, Command.BARRIER: _barrier, Command.HEARTBEAT: _none,
    Command.GOODBYE: _none, Command.PEER_LOST: _peer_lost, Command.SHARD_MOVED: _shard_moved,
    Command.INIT: _init, Command.PUSH: _push, Command.PUSHPULL: _push, Command.PULL: _pull,
    Command.RSP_PULL: _rsp_pull, Command.COMMAND: _command, Command.FLUSH: _none,
}


def request(meta: Meta, arrays: list[np.ndarray]) -> None:
    """Check a request a node received; raise ProtocolError saying which field is wrong.

    Replies (ACK, DATA, ERROR, ...) are not requests: a node that serves is never sent one.
    """
    check = _CHECKS.get(meta.cmd)
    if check is None:
        raise ProtocolError(f"{meta.cmd.name} is not a request")
    check(meta, arrays)
    if isinstance(meta.body, dict):
        # which shard a request is for, when a server serves another's (PSKV_REPLICAS=1)
        _int(meta, meta.body, "shard", 0, _MAX_RANK, optional=True)
        if not isinstance(meta.body.get("again", False), bool):
            raise _fail(meta, "again", "true or false", meta.body.get("again"))


def reader_reply(body: Any) -> dict[str, Any]:
    """Check the scheduler's answer to a reader (its sealed keys opened): the job, the
    servers' endpoints, which server serves each shard, a key per server; return it."""
    meta = Meta(Command.ACK, body=body)
    got = _body(meta)
    _str(meta, got, "job")
    _int(meta, got, "num_servers", 1, _MAX_RANK)
    n = got["num_servers"]
    servers = got.get("servers")
    if not isinstance(servers, list) or len(servers) != n or not all(
            isinstance(s, dict) and all(isinstance(v, str) for v in s.values())
            for s in servers):
        raise _fail(meta, "servers", "one table of endpoints per server", servers)
    hosts, keys = got.get("hosts"), got.get("reader_keys")
    if not isinstance(hosts, list) or len(hosts) != n or not all(
            type(h) is int and 0 <= h < n for h in hosts):
        raise _fail(meta, "hosts", "one server rank per shard", hosts)
    if not isinstance(keys, list) or len(keys) != n or not all(isinstance(k, str)
                                                                for k in keys):
        raise _fail(meta, "reader_keys", "one key per server", keys)
    return got


def admit_reply(body: Any) -> dict[str, Any]:
    """Check the scheduler's ADMIT body (the fields a node goes on with); return it."""
    meta = Meta(Command.ADMIT, body=body)
    got = _body(meta)
    _str(meta, got, "role", ROLES)
    _str(meta, got, "job")
    _int(meta, got, "num_workers", 1, _MAX_RANK)
    _int(meta, got, "num_servers", 1, _MAX_RANK)
    _int(meta, got, "rank", 0, _MAX_RANK)
    servers = got.get("servers")
    if not isinstance(servers, list) or len(servers) != got["num_servers"] or not all(
            isinstance(s, dict) and all(isinstance(v, str) for v in s.values())
            for s in servers):
        raise _fail(meta, "servers", "one table of endpoints per server", servers)
    for field in ("key", "mode", "server_key", "reader_key"):
        _str(meta, got, field, optional=True)
    for field in ("worker_keys", "keys"):
        keys = got.get(field, [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _fail(meta, field, "a list of strings", keys)
    if not isinstance(got.get("rejoin", False), bool):
        raise _fail(meta, "rejoin", "true or false", got.get("rejoin"))
    hosts = got.get("hosts", [])
    if not isinstance(hosts, list) or (hosts and len(hosts) != got["num_servers"]) or not all(
            type(h) is int and 0 <= h < got["num_servers"] for h in hosts):
        raise _fail(meta, "hosts", "one server rank per shard", hosts)
    return got
