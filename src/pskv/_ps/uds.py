"""The same-host fast path: messages over a Unix domain stream socket, no broker threads.

ZeroMQ hands every message to its I/O threads, which costs several thread wake-ups per
message (about 100 us a round trip on a small VM); a Unix socket read and written by the
application threads themselves costs about 15 us. Arrays are written straight from their
buffers (``sendmsg``) and read straight into buffers the caller chooses (``recv_into``), so
big arrays are neither copied in user space nor faulted into fresh pages.

Framing: ``b"PSKV"``, the header length (u32, little-endian), the JSON header of
:mod:`.message`, then each array's bytes. Invariants: a reader checks the magic, the header
and every length before it reads data, and gives up (ProtocolError, the connection is
closed) at the first inconsistency; every blocking call has a timeout.
"""
from __future__ import annotations

import socket
import struct
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ClusterTimeoutError, NodeFailedError, ProtocolError
from .message import MAX_HEADER, Command, Meta, encode, parse_header

__all__ = ["Alloc", "UdsConn", "fresh"]

_MAGIC = b"PSKV"
_PREFIX = struct.Struct("<4sI")
_IOV_MAX = 512
#: receive buffers of at least this size are reused between messages
REUSE_MIN = 1 << 16

Alloc = Callable[[int, np.dtype[Any], tuple[int, ...]], np.ndarray]


def fresh(index: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    """An Alloc that makes a new array every time."""
    return np.empty(shape, dtype)


class UdsConn:
    """One connected Unix stream socket carrying pskv messages.

    Parameters
    ----------
    sock : socket.socket
        Connected; switched to blocking mode with ``timeout`` per call.
    timeout : float
        Seconds any single send or receive may block.
    peer : str
        A name for error messages.
    """

    def __init__(self, sock: socket.socket, timeout: float, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        sock.settimeout(timeout)
        self._bufs: dict[int, np.ndarray] = {}

    @classmethod
    def connect(cls, path: str, timeout: float, peer: str) -> UdsConn:
        """Connect to a server's socket at ``path``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as err:
            sock.close()
            raise NodeFailedError(f"cannot connect to {peer} at {path}: {err}") from err
        return cls(sock, timeout, peer)

    def fileno(self) -> int:
        """The socket's file descriptor (for poll)."""
        return self.sock.fileno()

    def close(self) -> None:
        """Close the socket; idempotent."""
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass

    # ---- writing ----------------------------------------------------------------------------
    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = ()) -> None:
        """Write one whole message (blocking, at most ``timeout`` per chunk)."""
        frames = encode(cmd, ts, keys, body, arrays)
        header = frames[0]
        bufs = [memoryview(_PREFIX.pack(_MAGIC, len(header))), memoryview(header)]
        bufs += [memoryview(a).cast("B") for a in frames[1:] if a.nbytes]
        try:
            while bufs:
                sent = self.sock.sendmsg(bufs[:_IOV_MAX])
                while sent and bufs:
                    if sent >= bufs[0].nbytes:
                        sent -= bufs[0].nbytes
                        bufs.pop(0)
                    else:
                        bufs[0] = bufs[0][sent:]
                        sent = 0
        except TimeoutError:
            raise ClusterTimeoutError(f"sending to {self.peer} took over {self.timeout:g} s: it "
                                      "is not reading. Raise PSKV_REQUEST_TIMEOUT if it is "
                                      "just slow.") from None
        except OSError as err:
            raise NodeFailedError(f"the connection to {self.peer} broke: {err}") from err

    # ---- reading ----------------------------------------------------------------------------
    def _read_into(self, view: memoryview) -> None:
        got = 0
        n = view.nbytes
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except TimeoutError:
                raise ProtocolError(f"{self.peer} sent part of a message, then nothing for "
                                    f"{self.timeout:g} s") from None
            except OSError as err:
                raise NodeFailedError(f"the connection to {self.peer} broke: {err}") from err
            if k == 0:
                raise NodeFailedError(f"{self.peer} closed the connection")
            got += k

    def reuse(self, index: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """An Alloc that reuses one buffer per array position for big arrays.

        The caller must be done with a message's arrays before it reads the next one.
        """
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < REUSE_MIN:
            return np.empty(shape, dtype)
        buf = self._bufs.get(index)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[index] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def recv(self, alloc_for: Callable[[Meta], Alloc | None] | None = None) \
            -> tuple[Meta, list[np.ndarray]]:
        """Read one whole message.

        Arrays land in the buffers ``alloc_for(meta)`` gives (when it gives an Alloc), else
        in buffers reused between messages (:meth:`reuse`).
        """
        prefix = bytearray(_PREFIX.size)
        self._read_into(memoryview(prefix))
        magic, hlen = _PREFIX.unpack(prefix)
        if magic != _MAGIC or hlen > MAX_HEADER:
            raise ProtocolError(f"{self.peer} sent bytes that are not a pskv message")
        header = bytearray(hlen)
        self._read_into(memoryview(header))
        meta, specs = parse_header(header)
        get = (alloc_for(meta) if alloc_for is not None else None) or self.reuse
        arrays = []
        for i, (dt, shape, nbytes) in enumerate(specs):
            arr = get(i, dt, shape)
            if nbytes:
                self._read_into(memoryview(arr).cast("B"))
            arrays.append(arr)
        return meta, arrays
