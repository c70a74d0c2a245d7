"""The wire format: one JSON header frame, then one raw frame per array.

Header: ``{"c": cmd, "t": ts, "k": [ps_key, ...], "a": [[dtype, shape], ...], "b": body}``.
Arrays travel as their raw bytes (zero-copy where ZeroMQ allows); nothing is pickled.
``decode`` trusts nothing: it checks the command, each dtype against an allowlist and each
frame's length against its declared shape, and raises ProtocolError on any mismatch.
"""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import KVStoreError, ProtocolError, error_from_kind, error_kind

__all__ = ["ALLOWED_DTYPES", "Command", "MAX_DEPTH", "MAX_HEADER", "Meta", "decode", "encode",
           "error_body", "error_from_body", "loads", "parse_header", "short"]

#: dtypes a peer may send; anything else is a protocol error (no object arrays, ever)
ALLOWED_DTYPES = frozenset({
    "float16", "float32", "float64", "int8", "uint8", "int32", "int64", "uint32", "bool",
})
#: dtype -> name, without numpy's slow ``dtype.name`` on the hot path
_NAMES = {np.dtype(n): n for n in ALLOWED_DTYPES}
_DTYPES = {n: np.dtype(n) for n in ALLOWED_DTYPES}
#: largest header accepted, in bytes
MAX_HEADER = 16 << 20
#: deepest nesting of lists and objects a header may have
MAX_DEPTH = 32


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: what a peer sent is never echoed whole
    into a log line or an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: bytes) -> Any:
    """Parse JSON from a peer: no NaN or Infinity, nesting at most :data:`MAX_DEPTH`.

    Raises ProtocolError for anything else (Python's parser would raise RecursionError on a
    deeply nested header, which must not escape a node's loop).
    """
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ProtocolError(f"malformed header: nested deeper than {MAX_DEPTH}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"malformed header: {short(str(err), 120)}") from None
    # breadth-first, without recursion: each level's containers, until none are left
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise ProtocolError(f"malformed header: nested deeper than {MAX_DEPTH}")
        nxt: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                nxt.extend(v for v in item.values() if isinstance(v, dict | list))
            elif isinstance(item, list):
                nxt.extend(v for v in item if isinstance(v, dict | list))
        level = nxt
    return value


class Command(enum.IntEnum):
    """Message kinds. Requests carry a ``ts``; the reply echoes it."""

    HELLO = 1          # node -> scheduler / worker -> server: identity and proof of secret
    ADMIT = 2          # scheduler -> node: rank and cluster table
    BARRIER = 3        # node -> scheduler; reply BARRIER_DONE with every member's payload
    BARRIER_DONE = 4
    HEARTBEAT = 5
    HEARTBEAT_ACK = 6
    NODE_FAILED = 7    # scheduler -> nodes: a peer died
    GOODBYE = 8        # worker -> scheduler: closed; server -> scheduler: stopped
    SHUTDOWN = 9       # scheduler -> servers: every worker is gone
    CHALLENGE = 10     # acceptor -> node: answer with a HELLO proving this nonce (auth.py)
    PEER_LOST = 11     # node -> scheduler: my connection to this peer broke
    NODE_REJOINED = 12  # scheduler -> nodes: a restarted node took a dead one's rank
    INIT = 20
    PUSH = 21
    PULL = 22
    PUSHPULL = 23
    RSP_PULL = 24
    COMMAND = 25       # optimizer spec, compression params, states save/load
    FLUSH = 26         # reply ACK once every earlier push of this worker is applied
    ACK = 40           # a reply without arrays (pushes get none: their ts is negative,
                       # and only an ERROR answers one)
    DATA = 41          # a reply with arrays
    ERROR = 42         # a reply: body {"kind": error kind, "msg": text[, "key": key]}


@dataclass(frozen=True, slots=True)
class Meta:
    """A decoded header. ``keys`` are ps_keys; ``body`` is any JSON value."""

    cmd: Command
    ts: int = 0
    keys: tuple[int, ...] = ()
    body: Any = None


def error_body(err: BaseException) -> dict[str, Any]:
    """The body of an ERROR reply for ``err``: its registered kind, message and key."""
    body: dict[str, Any] = {"kind": error_kind(err), "msg": str(err)}
    key = getattr(err, "key", None)
    if type(key) is int or type(key) is str:
        body["key"] = key
    return body


def error_from_body(body: Any, where: str) -> KVStoreError:
    """The error an ERROR reply's body describes, of the class registered for its kind,
    its message marked ``(reported by <where>)``."""
    if not isinstance(body, dict):
        body = {}
    key = body.get("key")
    return error_from_kind(str(body.get("kind", "")), f"{body.get('msg', 'error')} "
                           f"(reported by {where})",
                           key if type(key) is int or type(key) is str else None)


def encode(cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
           arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """Frames for one message: the header, then each array's buffer (not copied)."""
    header: dict[str, Any] = {"c": int(cmd), "t": ts}
    if keys:
        header["k"] = list(keys)
    if body is not None:
        header["b"] = body
    frames: list[Any] = [b""]
    if arrays:
        header["a"] = [[_NAMES.get(a.dtype) or a.dtype.name, list(a.shape)] for a in arrays]
        for a in arrays:
            frames.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
    frames[0] = json.dumps(header, separators=(",", ":")).encode()
    return frames


def _bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    return memoryview(buf if buf is not None else frame)


def parse_header(raw: bytes | memoryview, nframes: int | None = None) \
        -> tuple[Meta, list[tuple[np.dtype[Any], tuple[int, ...], int]]]:
    """Check a header; return its Meta and, per array, (dtype, shape, nbytes)."""
    head = memoryview(raw)
    if head.nbytes > MAX_HEADER:
        raise ProtocolError(f"header of {head.nbytes} bytes exceeds {MAX_HEADER}")
    header = loads(head.tobytes())
    try:
        cmd = Command(header["c"])
        ts = header.get("t", 0)
        keys = header.get("k", ())
        specs_raw = header.get("a", ())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError) as err:
        raise ProtocolError(f"malformed header: {short(str(err))}") from None
    if type(ts) is not int or not -(1 << 62) < ts < 1 << 62 or \
            not isinstance(keys, list | tuple) or not all(type(k) is int for k in keys):
        raise ProtocolError("malformed header: ts and keys must be integers")
    if not isinstance(specs_raw, list | tuple) or \
            (nframes is not None and len(specs_raw) != nframes):
        raise ProtocolError(f"header declares {len(specs_raw) if isinstance(specs_raw, list) else '?'}"
                            f" arrays but {nframes} data frames arrived")
    if len(keys) > 1 << 24 or len(specs_raw) > 1 << 20:
        raise ProtocolError(f"header names {len(keys)} keys and {len(specs_raw)} arrays: too many")
    specs: list[tuple[np.dtype[Any], tuple[int, ...], int]] = []
    for i, spec in enumerate(specs_raw):
        try:
            dtype, shape = spec
            shape = tuple(shape)
        except (TypeError, ValueError):
            raise ProtocolError(f"array {i}: malformed spec {short(spec)}") from None
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {i}: dtype {short(dtype)} is not allowed")
        if len(shape) > 32 or not all(type(s) is int and 0 <= s < 1 << 40 for s in shape):
            raise ProtocolError(f"array {i}: bad shape {short(shape)}")
        dt = _DTYPES[dtype]
        specs.append((dt, shape, math.prod(shape) * dt.itemsize))
    meta = Meta(cmd, ts, tuple(keys), header.get("b"))
    return meta, specs


def decode(frames: Sequence[Any]) -> tuple[Meta, list[np.ndarray]]:
    """Parse and check one message's frames; arrays are read-only views of the frames."""
    if not frames:
        raise ProtocolError("empty message")
    meta, specs = parse_header(_bytes(frames[0]), len(frames) - 1)
    arrays: list[np.ndarray] = []
    for i, (dt, shape, want) in enumerate(specs):
        buf = _bytes(frames[i + 1])
        if buf.nbytes != want:
            raise ProtocolError(f"array {i}: {buf.nbytes} bytes for shape {shape} of {dt.name} "
                                f"({want} expected)")
        arrays.append(np.frombuffer(buf, dtype=dt).reshape(shape))
    return meta, arrays
