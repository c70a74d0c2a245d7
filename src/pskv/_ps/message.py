"""The wire format: one header frame, then one raw frame per array.

Two header forms, told apart by their first byte:

* binary (first byte ``0xB1``), for every message whose body is empty or only a push's kind
  letters (push, pull, pushpull and their replies, acks, heartbeats: the hot path): the
  fixed part ``<BBBxqII`` (tag, cmd, flags, pad, ts, number of keys, number of arrays),
  then each key (int64), each array's dtype code (u8, an index into :data:`DTYPE_CODES`),
  each array's ndim (u8), every dimension (uint64, array after array) and, with flag 1,
  the kind letters (``{"kinds": letters}`` once decoded) as ASCII to the end;
* JSON (first byte ``{``), for everything else (control messages with a body):
  ``{"c": cmd, "t": ts, "k": [ps_key, ...], "a": [[dtype, shape], ...], "b": body}``.

Arrays travel as their raw bytes (zero-copy where ZeroMQ allows); nothing is pickled.
``decode`` trusts nothing: either form goes through the same checks (command, ts range,
counts, each dtype against an allowlist, each shape, each frame's length against its
declared shape) and raises ProtocolError on any mismatch.
"""
from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import KVStoreError, ProtocolError, error_from_kind, error_kind

__all__ = ["ALLOWED_DTYPES", "WIRE_DTYPES", "BINARY_TAG", "Command", "DTYPE_CODES", "MAX_DEPTH", "MAX_HEADER", "Meta",
           "PUSH_KINDS", "decode", "encode", "error_body", "error_from_body", "kind_arrays",
           "loads", "parse_header", "short"]

#: dtypes a peer may send; anything else is a protocol error (no object arrays, ever)
ALLOWED_DTYPES = frozenset({
    "float16", "float32", "float64", "int8", "uint8", "int32", "int64", "uint32", "bool",
})
#: dtypes a message may carry: the above (a key's values), and the other integer dtypes a
#: caller's IDs may come in (row ids, table IDs), which the server checks and converts or
#: refuses with an error reply; never a key's dtype (``bounds.check_init``)
WIRE_DTYPES = ALLOWED_DTYPES | {"int16", "uint16", "uint64"}
#: dtype -> name, without numpy's slow ``dtype.name`` on the hot path
_NAMES = {np.dtype(n): n for n in WIRE_DTYPES}
_DTYPES = {n: np.dtype(n) for n in WIRE_DTYPES}
#: dtype names by their code in a binary header (the order is part of the wire format:
#: new codes go at the end)
DTYPE_CODES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64", "uint32",
               "bool", "int16", "uint16", "uint64")
_CODE_OF = {np.dtype(n): i for i, n in enumerate(DTYPE_CODES)}
_BY_CODE = tuple((np.dtype(n), np.dtype(n).itemsize) for n in DTYPE_CODES)
#: a push's kind letters: dense, compressed, row_sparse (rows, data), table (ids, grads)
PUSH_KINDS = "dcrt"


def kind_arrays(kind: str) -> int:
    """How many arrays a pushed key of ``kind`` carries (two for ``r`` and ``t``)."""
    return 2 if kind in ("r", "t") else 1


#: first byte of a binary header (a JSON header starts with ``{``)
BINARY_TAG = 0xB1
_FIXED = struct.Struct("<BBBxqII")
_KINDS = 1                          # flag: the body is {"kinds": the ASCII tail}
_TS_LIMIT = 1 << 62
_MAX_KEYS = 1 << 24
_MAX_ARRAYS = 1 << 20
_MAX_NDIM = 32
_MAX_DIM = 1 << 40
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
    SEALED = 13        # PSKV_ENCRYPT=1 on a stream link: one encrypted message (sealed.py)
    SEGMENT = 14       # worker -> worker on one host: a key's shared memory, its descriptor
                       # passed with the message (collective path, shm.py)
    WORKER_LEFT = 15   # scheduler -> nodes: a worker joined (kv.join) or closed its store
    SHARD_MOVED = 16   # server -> scheduler -> nodes: a shard was handed to another server
                       # (a server added to a running job gets its slot's shard back)
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


_COMMANDS = {int(c): c for c in Command}


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
    """Frames for one message: the header, then each array's buffer (not copied).

    The header is binary when the body is None or ``{"kinds": str}`` (and every number
    fits), JSON otherwise.
    """
    frames: list[Any] = [b""]
    for a in arrays:
        frames.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
    head = _binary(cmd, ts, keys, body, frames)
    if head is None:
        header: dict[str, Any] = {"c": int(cmd), "t": ts}
        if keys:
            header["k"] = list(keys)
        if body is not None:
            header["b"] = body
        if arrays:
            header["a"] = [[_NAMES.get(a.dtype) or a.dtype.name, list(a.shape)]
                           for a in arrays]
        head = json.dumps(header, separators=(",", ":")).encode()
    frames[0] = head
    return frames


def _binary(cmd: Command, ts: int, keys: Sequence[int], body: Any,
            frames: list[Any]) -> bytes | None:
    """The binary header of a message, or None where only JSON can say it."""
    tail = b""
    flags = 0
    if body is not None:
        if type(body) is not dict or len(body) != 1 or type(body.get("kinds")) is not str:
            return None
        try:
            tail = body["kinds"].encode("ascii")
        except UnicodeEncodeError:
            return None
        flags = _KINDS
    n = len(frames) - 1
    codes = bytearray(n)
    ndims = bytearray(n)
    dims: list[int] = []
    for i in range(n):
        a = frames[i + 1]
        code = _CODE_OF.get(a.dtype)
        if code is None or a.ndim > _MAX_NDIM:
            return None                     # JSON names it; the peer refuses it
        codes[i] = code
        ndims[i] = a.ndim
        dims += a.shape
    try:
        return b"".join((_FIXED.pack(BINARY_TAG, int(cmd), flags, ts, len(keys), n),
                         struct.pack(f"<{len(keys)}q", *keys), codes, ndims,
                         struct.pack(f"<{len(dims)}Q", *dims), tail))
    except struct.error:                    # a number beyond 64 bits: JSON carries it
        return None


def _bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    return memoryview(buf if buf is not None else frame)


def parse_header(raw: bytes | memoryview, nframes: int | None = None) \
        -> tuple[Meta, list[tuple[np.dtype[Any], tuple[int, ...], int]]]:
    """Check a header (binary or JSON); return its Meta and, per array, (dtype, shape,
    nbytes). ``nframes``: the data frames that came with it, where the transport knows."""
    head = memoryview(raw)
    if head.nbytes > MAX_HEADER:
        raise ProtocolError(f"header of {head.nbytes} bytes exceeds {MAX_HEADER}")
    if head.nbytes and head[0] == BINARY_TAG:
        return _parse_binary(head, nframes)
    header = loads(head.tobytes())
    try:
        cmd = Command(header["c"])
        ts = header.get("t", 0)
        keys = header.get("k", ())
        specs_raw = header.get("a", ())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError) as err:
        raise ProtocolError(f"malformed header: {short(str(err))}") from None
    if type(ts) is not int or not -_TS_LIMIT < ts < _TS_LIMIT or \
            not isinstance(keys, list | tuple) or not all(type(k) is int for k in keys):
        raise ProtocolError("malformed header: ts and keys must be integers")
    if not isinstance(specs_raw, list | tuple) or \
            (nframes is not None and len(specs_raw) != nframes):
        raise ProtocolError(f"header declares {len(specs_raw) if isinstance(specs_raw, list) else '?'}"
                            f" arrays but {nframes} data frames arrived")
    _check_counts(len(keys), len(specs_raw))
    specs: list[tuple[np.dtype[Any], tuple[int, ...], int]] = []
    for i, spec in enumerate(specs_raw):
        try:
            dtype, shape = spec
            shape = tuple(shape)
        except (TypeError, ValueError):
            raise ProtocolError(f"array {i}: malformed spec {short(spec)}") from None
        if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise ProtocolError(f"array {i}: dtype {short(dtype)} is not allowed")
        if len(shape) > _MAX_NDIM or not all(type(s) is int and 0 <= s < _MAX_DIM
                                             for s in shape):
            raise ProtocolError(f"array {i}: bad shape {short(shape)}")
        dt = _DTYPES[dtype]
        specs.append((dt, shape, math.prod(shape) * dt.itemsize))
    meta = Meta(cmd, ts, tuple(keys), header.get("b"))
    return meta, specs


def _check_counts(nkeys: int, narrays: int) -> None:
    if nkeys > _MAX_KEYS or narrays > _MAX_ARRAYS:
        raise ProtocolError(f"header names {nkeys} keys and {narrays} arrays: too many")


def _parse_binary(head: memoryview, nframes: int | None) \
        -> tuple[Meta, list[tuple[np.dtype[Any], tuple[int, ...], int]]]:
    """A binary header (the module docstring has its layout), checked as a JSON one is."""
    size = head.nbytes
    if size < _FIXED.size:
        raise ProtocolError(f"malformed header: binary header of {size} bytes is truncated")
    _, c, flags, ts, nkeys, n = _FIXED.unpack_from(head)
    cmd = _COMMANDS.get(c)
    if cmd is None:
        raise ProtocolError(f"malformed header: {c} is not a valid Command")
    if flags & ~_KINDS:
        raise ProtocolError(f"malformed header: unknown flags {flags:#x}")
    if not -_TS_LIMIT < ts < _TS_LIMIT:
        raise ProtocolError("malformed header: ts out of range")
    if nkeys > _MAX_KEYS or n > _MAX_ARRAYS:
        _check_counts(nkeys, n)
    if nframes is not None and n != nframes:
        raise ProtocolError(f"header declares {n} arrays but {nframes} data frames arrived")
    pos = _FIXED.size
    end = pos + 8 * nkeys + 2 * n
    if end > size:
        raise ProtocolError(f"malformed header: {nkeys} keys and {n} arrays do not fit in "
                            f"{size} bytes")
    fields = struct.unpack_from(f"<{nkeys}q{2 * n}B", head, pos)   # keys, codes, ndims
    keys = fields[:nkeys]
    pos = end
    specs: list[tuple[np.dtype[Any], tuple[int, ...], int]] = []
    if n:
        codes = fields[nkeys:nkeys + n]
        ndims = fields[nkeys + n:]
        if max(codes) >= len(_BY_CODE):
            i = next(i for i, code in enumerate(codes) if code >= len(_BY_CODE))
            raise ProtocolError(f"array {i}: dtype code {codes[i]} is not allowed")
        if max(ndims) > _MAX_NDIM:
            i = next(i for i, nd in enumerate(ndims) if nd > _MAX_NDIM)
            raise ProtocolError(f"array {i}: bad shape ({ndims[i]} dimensions)")
        ndim_total = sum(ndims)
        if pos + 8 * ndim_total > size:
            raise ProtocolError(f"malformed header: the shapes of {n} arrays do not fit in "
                                f"{size} bytes")
        dims = struct.unpack_from(f"<{ndim_total}Q", head, pos) if ndim_total else ()
        pos += 8 * ndim_total
        if dims and max(dims) >= _MAX_DIM:
            raise ProtocolError(f"bad shape: a dimension of {max(dims)} is over {_MAX_DIM}")
        at = 0
        for code, nd in zip(codes, ndims, strict=True):
            shape = dims[at:at + nd]
            at += nd
            dt, itemsize = _BY_CODE[code]
            specs.append((dt, shape, math.prod(shape) * itemsize))
    body: Any = None
    if flags & _KINDS:
        try:
            body = {"kinds": bytes(head[pos:]).decode("ascii")}
        except UnicodeDecodeError:
            raise ProtocolError("malformed header: kind letters are not ASCII") from None
    elif pos != size:
        raise ProtocolError(f"malformed header: {size - pos} bytes after the binary header")
    return Meta(cmd, ts, keys, body), specs


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
