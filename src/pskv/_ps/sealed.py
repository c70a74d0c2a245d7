"""``PSKV_ENCRYPT=1`` on stream links: every message encrypted and authenticated.

A :class:`SealedConn` is a :class:`.stream.StreamConn` whose every message travels as one
``SEALED`` message of the same framing, carrying one byte array: the real message (header
and arrays) encrypted with AES-256-GCM (:class:`.crypt.Aead`), its tag at the end. The
seam is the message: the framing, the reads and the writes below are the stream
connection's own.

Keys. The side that connects names itself (role, rank) and a fresh random salt in its
first message, in clear; both sides derive the link key from the key only the two of them
hold (a worker and a server: their pair key from the scheduler; a primary and a backup:
the servers' key) and the salt, then one key per direction. Message ``i`` of a direction
uses nonce ``i``: each side counts, so a message changed, replayed, dropped or reordered on
the way fails its tag, and the link is dropped (ProtocolError). A message in clear on a
sealed link is refused the same way. Invariant: nothing a peer sends is parsed before its
tag verified, except the outer framing and the first message's (role, rank, salt).
"""
from __future__ import annotations

import secrets
import socket
import ssl
import struct
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ProtocolError
from .crypt import TAG, Aead, derive
from .message import MAX_HEADER, Command, Meta, encode, parse_header
from .stream import Alloc, StreamConn

__all__ = ["OVERHEAD", "SealedConn"]

_LEN = struct.Struct("<I")
#: bytes a sealed message adds to the one it carries (beyond the outer header)
OVERHEAD = _LEN.size + TAG
_CLEAR = "a message in clear on an encrypted link (PSKV_ENCRYPT=1 on one side only?)"


class SealedConn(StreamConn):
    """A stream connection that seals every message (see the module).

    The connecting side calls :meth:`initiate` before its first send; the accepting side
    is made with ``key_for(role, rank)``, which gives the key a peer of that role and rank
    holds (and raises ProtocolError when no such peer may connect).
    """

    def __init__(self, sock: socket.socket | ssl.SSLSocket, timeout: float, peer: str,
                 handshaken: bool = True,
                 key_for: Callable[[str, int | None], bytes] | None = None) -> None:
        self._limit: int | None = None
        super().__init__(sock, timeout, peer, handshaken)
        self._key_for = key_for
        self._tx: Aead | None = None
        self._rx: Aead | None = None
        self._hello: dict[str, Any] | None = None   # the first message's clear fields
        self._lock = threading.Lock()

    @property
    def max_bytes(self) -> int | None:
        """Bytes one message may carry (the sealed one a little more)."""
        return None if self._limit is None else self._limit + OVERHEAD + 64

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        self._limit = value

    def initiate(self, key: bytes, role: str, rank: int) -> None:
        """Derive this link's keys from ``key`` and a fresh salt (the connecting side)."""
        salt = secrets.token_hex(16)
        self._keys(key, salt, initiator=True)
        self._hello = {"sealed": salt, "role": role, "rank": rank}

    def _keys(self, key: bytes, salt: str, initiator: bool) -> None:
        link = derive(key, "link", salt)
        out, back = Aead(derive(link, "c2s")), Aead(derive(link, "s2c"))
        self._tx, self._rx = (out, back) if initiator else (back, out)

    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Seal one message and write it (as the stream connection writes any)."""
        if self._tx is None:
            raise ProtocolError(f"the encrypted link to {self.peer} has no keys yet")
        frames = encode(cmd, ts, keys, body, arrays)
        header = frames[0]
        size = _LEN.size + len(header) + sum(a.nbytes for a in frames[1:])
        buf = np.empty(size + TAG, np.uint8)
        buf[:_LEN.size] = np.frombuffer(_LEN.pack(len(header)), np.uint8)
        pos = _LEN.size
        buf[pos:pos + len(header)] = np.frombuffer(header, np.uint8)
        pos += len(header)
        for a in frames[1:]:
            if a.nbytes:
                buf[pos:pos + a.nbytes] = np.frombuffer(memoryview(a).cast("B"), np.uint8)
                pos += a.nbytes
        with self._lock:        # nonces in the order the messages go out
            buf[size:] = np.frombuffer(self._tx.seal(buf.data[:size]), np.uint8)
            clear, self._hello = self._hello, None
            super().send(Command.SEALED, 0, (), clear, [buf])

    def read_available(self, alloc_for: Callable[[Meta], Alloc | None] | None = None,
                       limit: int = 64) -> list[tuple[Meta, list[np.ndarray]]]:
        """Read, verify and open what has arrived; ProtocolError for anything that does not
        verify (then drop the link)."""
        return [self._open(meta, arrays, alloc_for)
                for meta, arrays in super().read_available(None, limit)]

    receive = read_available

    def _open(self, meta: Meta, arrays: list[np.ndarray],
              alloc_for: Callable[[Meta], Alloc | None] | None) \
            -> tuple[Meta, list[np.ndarray]]:
        if meta.cmd != Command.SEALED or len(arrays) != 1 or arrays[0].dtype != np.uint8 \
                or arrays[0].ndim != 1 or arrays[0].nbytes < OVERHEAD:
            raise ProtocolError(_CLEAR)
        if self._rx is None:
            self._accept(meta.body)
        assert self._rx is not None
        sealed = arrays[0]
        buf = bytearray(sealed[:-TAG])          # its own buffer: the arrays are views of it
        self._rx.open(buf, bytes(sealed[-TAG:]))
        hlen = _LEN.unpack_from(buf, 0)[0]
        if not 0 < hlen <= min(MAX_HEADER, len(buf) - _LEN.size):
            raise ProtocolError(f"{self.peer} sealed a message with a bad header length")
        inner, specs = parse_header(memoryview(buf)[_LEN.size:_LEN.size + hlen])
        if inner.cmd == Command.SEALED:
            raise ProtocolError(f"{self.peer} sealed a sealed message")
        pos, total = _LEN.size + hlen, sum(n for _, _, n in specs)
        if pos + total != len(buf):
            raise ProtocolError(f"{self.peer} sealed a message whose arrays do not match "
                                "its header")
        if self._limit is not None and total > self._limit:
            raise ProtocolError(f"{self.peer} sent a message of over the {self._limit} "
                                "bytes it may send")
        alloc = alloc_for(inner) if alloc_for is not None else None
        out: list[np.ndarray] = []
        for i, (dt, shape, nbytes) in enumerate(specs):
            view = np.frombuffer(buf, dt, nbytes // dt.itemsize if dt.itemsize else 0,
                                 pos).reshape(shape)
            target = alloc(i, dt, shape) if alloc is not None else None
            if target is not None:
                target[...] = view
                view = target
            out.append(view)
            pos += nbytes
        return inner, out

    def _accept(self, clear: Any) -> None:
        """The first message: who the peer says it is, and its salt."""
        if self._key_for is None or not isinstance(clear, dict) or \
                not isinstance(clear.get("sealed"), str) or len(clear["sealed"]) > 64 or \
                not isinstance(clear.get("role"), str) or \
                type(clear.get("rank")) is not int:
            raise ProtocolError(_CLEAR)
        key = self._key_for(clear["role"], clear["rank"])
        self._keys(key, clear["sealed"], initiator=False)
