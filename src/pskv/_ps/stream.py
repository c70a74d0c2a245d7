"""Stream connections: pskv messages over a Unix socket (within a host) or TCP (between).

The default data path between workers and servers (:class:`StreamConn`, the stream
implementation of :class:`.transport.Connection`), and the listeners a server accepts them
on (:class:`StreamListener`).

ZeroMQ hands every message to its I/O threads, which costs several thread wake-ups per
message (about 100 us a round trip on a small VM); a Unix socket read and written by the
application threads themselves costs about 15 us. A small message is written as one
buffer with one ``send`` and read with one ``recv`` into the connection's read buffer, where
it is parsed in place (several small messages often come in one ``recv``); big arrays are
written straight from their buffers (``sendmsg``) and read straight into buffers the caller
chooses (``recv_into``), so they are neither copied in user space nor faulted into fresh
pages.

Framing: ``b"PSKV"``, the header length (u32, little-endian), the header of
:mod:`.message` (binary or JSON), then each array's bytes. Invariants: a reader checks the magic, the header
and every length before it reads data, and gives up (ProtocolError, the connection is
closed) at the first inconsistency. Sockets are non-blocking: reads are incremental (a
peer that stops half-way through a message stalls nobody but itself, and is dropped after
the timeout). Writes wait for room at most the timeout, except on a connection in *queued*
mode (a node's loop: :class:`.serve.ServeLoop`), whose writes wait only a bounded moment:
while the output queue is empty, a reply to an admitted peer is written straight from the
caller's arrays as the peer reads (no copy: pull replies are most of a training step's
bytes), waiting for room at most :data:`SEND_PATIENCE` at a time and that plus its size at
:data:`SEND_MIN_RATE` in all; what is left (everything the kernel does not take at once,
for a stranger or a peer with output queued) is copied to the connection's output queue,
written when the socket is writable (:meth:`StreamConn.flush`), and the loop reads nothing
more from that peer until the queue is empty. So a peer that does not read costs its node's
loop, per draining of its queue, at most one reply's bound (in practice one
:data:`SEND_PATIENCE`: a socket nobody reads offers no room) and the replies to what it had
sent, and stalls nobody but itself.

Over 500 lines because the stream transport's framing, queued mode and non-blocking writes
are one connection object whose invariants (what is in flight, what is queued) span its
methods.
"""
from __future__ import annotations

import errno
import itertools
import math
import os
import select
import secrets
import socket
import ssl
import struct
import sys
import tempfile
import time
from collections import deque
from typing import Any, Callable, MutableSequence, Sequence

import numpy as np

from ..errors import ClusterTimeoutError, NodeFailedError, ProtocolError
from .message import MAX_HEADER, Command, Meta, encode, parse_header
from .shm import FdInbox, fd_message, supported as shm_supported

__all__ = ["Alloc", "SEND_MIN_RATE", "SEND_PATIENCE", "StreamConn", "StreamListener",
           "drop_sent", "ipc_path"]

_MAGIC = b"PSKV"
_PREFIX = struct.Struct("<4sI")
_IOV_MAX = 512
#: socket buffer size asked for (the kernel caps it at net.core.wmem_max / rmem_max)
SOCKET_BUFFER = 4 << 20
#: receive buffers of at least this size are reused between messages
REUSE_MIN = 1 << 16
#: messages of at most this many arrays and bytes of arrays are copied into one buffer and
#: written with one ``send`` (cheaper than a scatter list for small ones)
_JOIN_ARRAYS = 9
_JOIN_BYTES = 1 << 14
#: bytes one ``recv`` asks for: small messages (often several) arrive in one system call
#: and are parsed out of this buffer; a bigger rest of an array is read straight into place
READ_BUFFER = 1 << 16

#: a queued-mode send to an admitted peer whose output queue is empty writes straight from
#: the caller's arrays while the peer reads: it waits for room in the socket (poll,
#: POLLOUT) at most this many seconds at a time, and at most this plus the message's bytes
#: at :data:`SEND_MIN_RATE` in all, then copies the rest to the queue. A peer that reads
#: keeps its big replies uncopied; one that stops reading costs its node's loop about
#: this once per draining of its queue (a peer with output queued gets copies at once)
SEND_PATIENCE = 0.01
#: bytes per second a peer must read on average to keep a reply uncopied (see above)
SEND_MIN_RATE = 256 << 20

#: ``alloc(index, dtype, shape)``: where array ``index`` of a message should land (None:
#: in the connection's own reused buffer)
Alloc = Callable[[int, np.dtype[Any], tuple[int, ...]], "np.ndarray | None"]


#: Linux has abstract Unix sockets: names, not files, gone with the last process holding
#: them, so a SIGKILLed server leaves nothing behind. "@name" is how pskv writes one.
ABSTRACT = sys.platform.startswith("linux")


def drop_sent(bufs: MutableSequence[memoryview], first: int, sent: int) -> int:
    """``sent`` bytes of ``bufs[first:]`` were written: the index of the first buffer not
    written whole, whose unwritten rest replaces it (earlier buffers are left as they
    are: a caller pops them, or keeps the index)."""
    while sent and first < len(bufs):
        size = bufs[first].nbytes
        if sent >= size:
            sent -= size
            first += 1
        else:
            bufs[first] = bufs[first][sent:]
            sent = 0
    return first


def ipc_path(tag: str) -> str:
    """A fresh address for a Unix socket: ``@pskv-TAG-RANDOM`` (abstract, Linux), else a
    path in the temp directory."""
    if ABSTRACT:
        return f"@pskv-{tag}-{secrets.token_hex(8)}"
    fd, path = tempfile.mkstemp(prefix=f"pskv-{tag}-", suffix=".sock")
    os.close(fd)
    os.unlink(path)
    return path


def _unix_address(path: str) -> str:
    """The address to bind or connect to for ``path`` (``@name``: the abstract name)."""
    return "\0" + path[1:] if path.startswith("@") else path


def _same_user(sock: socket.socket) -> bool:
    """Whether the peer of an accepted Unix connection runs as this user (SO_PEERCRED):
    an abstract socket has no file mode, so this is the check a 0600 file made."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                struct.calcsize("3i"))
    except (OSError, AttributeError):
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


class StreamConn:
    """One connected stream socket (Unix or TCP) carrying pskv messages.

    Parameters
    ----------
    sock : socket.socket
        Connected; switched to non-blocking mode.
    timeout : float
        Seconds a write may wait for room, and a half-read message may wait for the rest.
    peer : str
        A name for error messages.
    """

    def __init__(self, sock: socket.socket, timeout: float, peer: str,
                 handshaken: bool = True) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        #: a TLS link (:mod:`.tls`): written buffer by buffer, its handshake done on reads
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._handshaken = handshaken
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:    # small requests go out at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        #: bytes one message may carry; a server keeps it small until the peer is admitted
        self.max_bytes: int | None = None
        #: where the peer connected from, for refusal logs ("" when unknown)
        self.address = ""
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:    # room for a few MiB in flight: fewer stalls of sender and receiver
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
            except OSError:  # pragma: no cover - capped by the system, keep its default
                pass
        #: queued mode (a node's loop): ``send`` never waits; ``on_queued()`` is called when
        #: output starts to wait in the queue (the loop then polls for writability)
        self.queued = False
        self.on_queued: Callable[[], None] | None = None
        #: queued mode: seconds a send may wait at a time for room while the queue is
        #: empty, before it copies the rest (0: never waits; a loop sets
        #: :data:`SEND_PATIENCE` once the peer is admitted, so a stranger never holds it)
        self.patience = 0.0
        self._out: deque[memoryview] = deque()   # owned copies, written in order
        self._out_bytes = 0
        self._out_since = 0.0                  # when the queue last moved
        #: bytes received so far (a stranger's budget is counted in them)
        self.received = 0
        #: how bytes are read: ``reader(view, nbytes) -> count`` (the socket's ``recv_into``,
        #: or :attr:`fds`' once :meth:`keep_fds` was called)
        self.reader: Callable[[memoryview, int], int] = sock.recv_into
        #: the descriptors the peer passed with its messages (SCM_RIGHTS), oldest first;
        #: None until :meth:`keep_fds` (the kernel then closes any a peer passes)
        self.fds: FdInbox | None = None
        self._bufs: dict[int, np.ndarray] = {}
        # bytes received but not parsed yet: _rbuf[_rstart:_rend]
        self._rbuf = bytearray(READ_BUFFER)
        self._rview = memoryview(self._rbuf)
        self._rstart = self._rend = 0
        self._prefix = memoryview(bytearray(_PREFIX.size))
        # the last recv got less than it asked for: the socket was empty then, so the next
        # read that finds nothing buffered returns at once instead of asking the kernel
        # again (one system call and one exception less per message). Callers poll before
        # reading again (poll is level-triggered), so nothing that arrives is missed; only
        # that one read is skipped. Never for TLS: it may hold bytes poll does not see.
        self._drained = False
        self._reset()

    def _reset(self) -> None:
        self._phase = 0                     # 0 prefix, 1 header, 2 arrays
        self._target: memoryview = self._prefix
        self._pos = 0
        self._meta: Meta | None = None
        self._specs: list[tuple[np.dtype[Any], tuple[int, ...], int]] = []
        self._arrays: list[np.ndarray] = []
        self._alloc: Alloc = self.reuse
        self._since = 0.0                   # when the message in progress last moved

    @classmethod
    def connect(cls, path: str, timeout: float, peer: str,
                tls: ssl.SSLContext | None = None) -> StreamConn:
        """Connect to a server's Unix socket at ``path``, or TCP ``host:port`` (over TLS
        with ``tls``)."""
        addr: str | tuple[str, int] = _unix_address(path)
        family = socket.AF_UNIX
        if path.startswith("tcp:"):
            host, _, port = path[4:].rpartition(":")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            addr = (host.strip("[]"), int(port))
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
        except OSError as err:
            sock.close()
            raise NodeFailedError(f"cannot connect to {peer} at {path}: {err}") from err
        if tls is not None and family != socket.AF_UNIX:
            try:
                sock = tls.wrap_socket(sock, server_side=False)
            except (ssl.SSLError, OSError) as err:
                sock.close()
                raise NodeFailedError(f"the TLS handshake with {peer} at {path} failed: "
                                      f"{err}. Check PSKV_TLS_CERT/KEY/CA on both sides.") \
                    from err
        return cls(sock, timeout, peer)

    def buffered(self) -> int:
        """Bytes received but not handed out yet (poll does not see them): in this
        connection's read buffer, and decrypted by TLS."""
        held = self._rend - self._rstart
        return held + (self.sock.pending() if self.tls else 0)  # type: ignore[attr-defined]

    def fileno(self) -> int:
        """The socket's file descriptor (for poll)."""
        return self.sock.fileno()

    def pollable(self) -> int:
        """What a zmq.Poller polls for incoming bytes: the file descriptor."""
        return self.sock.fileno()

    def keep_fds(self) -> FdInbox | None:
        """Keep the descriptors the peer passes along its messages (:attr:`fds`, taken by
        whatever message announces them): the one way shared memory reaches another process
        (a collective segment, a backup's ring; :mod:`.shm`). Only a plain Unix-socket
        link carries descriptors: None for TCP and TLS links, and where the platform has
        no sealed memfds. Call it before the first byte the peer may send with one."""
        if self.fds is None and self.sock.family == socket.AF_UNIX and not self.tls and \
                shm_supported():
            self.fds = FdInbox(self.sock)
            self.reader = self.fds.recv_into
        return self.fds

    def close(self) -> None:
        """Close the socket (what waits in the output queue is dropped) and any descriptor
        received and not taken; idempotent."""
        self._out.clear()
        self._out_bytes = 0
        if self.fds is not None:
            self.fds.close()
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass

    # ---- writing ----------------------------------------------------------------------------
    def send(self, cmd: Command, ts: int = 0, keys: Sequence[int] = (), body: Any = None,
             arrays: Sequence[np.ndarray] = (), fds: Sequence[int] = ()) -> None:
        """Write one whole message; wait for room at most ``timeout`` at a time.

        ``fds``: descriptors passed along (SCM_RIGHTS) with the message's first bytes, for
        the peer's :meth:`keep_fds`; only on a plain Unix-socket link that is not in
        queued mode (ValueError otherwise). The peer gets its own descriptors of the same
        files; the caller keeps and closes its own."""
        frames = encode(cmd, ts, keys, body, arrays)
        header = frames[0]
        prefix = _PREFIX.pack(_MAGIC, len(header))
        bufs: list[memoryview]
        ancillary: list[tuple[int, int, bytes]] = []
        if fds:
            if self.sock.family != socket.AF_UNIX or self.tls or self.queued:
                raise ValueError(f"descriptors go only over a plain Unix-socket link that "
                                 f"is not queued, not to {self.peer}")
            ancillary = fd_message(fds)
        if not fds and len(frames) <= _JOIN_ARRAYS and \
                sum(a.nbytes for a in frames[1:]) <= _JOIN_BYTES:
            # a small message: one copy into one buffer, one send (the usual case: whole)
            data = b"".join([prefix, header, *frames[1:]])
            if self._out:                    # queued mode, output waiting: after it
                self._send_queued([memoryview(data)])
                return
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                sent = 0
            except OSError as err:
                raise NodeFailedError(f"the connection to {self.peer} broke: {err}") from err
            if sent == len(data):
                return
            bufs = [memoryview(data)[sent:]]
        else:
            bufs = [memoryview(prefix), memoryview(header)]
            bufs += [memoryview(a).cast("B") for a in frames[1:] if a.nbytes]
        if self.queued:
            self._send_queued(bufs)
            return
        first = 0                   # bufs[:first] are sent (no pop(0): a message of many
        try:                        # frames would cost quadratic time)
            while first < len(bufs):
                try:
                    # TLS sockets have no sendmsg: one buffer (at most 1 MiB) at a time
                    sent = self.sock.send(bufs[first][:1 << 20]) if self.tls else \
                        self.sock.sendmsg(bufs[first:first + _IOV_MAX], ancillary)
                    ancillary = []      # passed with the first bytes that went
                except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    if not self._wait_writable(self.timeout):
                        raise ClusterTimeoutError(
                            f"sending to {self.peer} waited over {self.timeout:g} s: it is "
                            "not reading. Raise PSKV_REQUEST_TIMEOUT if it is just slow.") \
                            from None
                    continue
                first = drop_sent(bufs, first, sent)
        except OSError as err:
            raise NodeFailedError(f"the connection to {self.peer} broke: {err}") from err

    def _write_some(self, bufs: Sequence[memoryview]) -> int:
        """Write what the socket takes now of ``bufs``, without waiting; bytes written."""
        try:
            # TLS sockets have no sendmsg: one buffer (at most 1 MiB) at a time
            return self.sock.send(bufs[0][:1 << 20]) if self.tls else \
                self.sock.sendmsg(bufs[:_IOV_MAX])
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0
        except OSError as err:
            raise NodeFailedError(f"the connection to {self.peer} broke: {err}") from err

    def _send_queued(self, bufs: list[memoryview]) -> None:
        """Queued mode: write what goes now, straight from the caller's buffers; when the
        queue was empty, wait for room while the peer reads (at most :attr:`patience` at a
        time, and :data:`SEND_MIN_RATE` bounds the total); copy what is left to the queue."""
        first = 0
        if not self._out:
            deadline, woke = 0.0, False
            while first < len(bufs):
                sent = self._write_some(bufs[first:first + _IOV_MAX])
                if sent:
                    first, woke = drop_sent(bufs, first, sent), False
                    continue
                if self.patience <= 0 or woke:   # woke: writable, yet nothing went (TLS
                    break                        # wants to read first): no spinning
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.patience + \
                        sum(b.nbytes for b in bufs[first:]) / SEND_MIN_RATE
                left = min(self.patience, deadline - now)
                if left <= 0 or not self._wait_writable(left):
                    break
                woke = True
            if first == len(bufs):
                return
            self._out_since = time.monotonic()
        # the caller may change its arrays once this returns: queue copies, joined when small
        rest = bufs[first:]
        if sum(b.nbytes for b in rest) <= _JOIN_BYTES:
            rest = [memoryview(b"".join(rest))]
        else:
            rest = [memoryview(bytes(b)) for b in rest]
        was_empty = not self._out
        for b in rest:
            self._out.append(b)
            self._out_bytes += b.nbytes
        if was_empty and self.on_queued is not None:
            self.on_queued()

    def queued_bytes(self) -> int:
        """Bytes waiting in the output queue (queued mode)."""
        return self._out_bytes

    def flush(self) -> bool:
        """Write what the socket takes of the output queue, without waiting; True when the
        queue is empty. Raises NodeFailedError for a broken link."""
        out = self._out
        while out:
            sent = self._write_some(list(itertools.islice(out, 0, _IOV_MAX)))
            if not sent:
                return False
            self._out_since = time.monotonic()
            self._out_bytes -= sent
            for _ in range(drop_sent(out, 0, sent)):
                out.popleft()
        return True

    def _wait_writable(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for room in the socket (or an error, which the
        next write raises); whether there is. poll, not select: any descriptor number."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLOUT)
        return bool(poller.poll(max(1, math.ceil(timeout * 1000))))

    def write_stalled(self, now: float) -> bool:
        """Whether output has waited in the queue, unmoved, for longer than ``timeout``."""
        return bool(self._out) and now - self._out_since > self.timeout

    # ---- reading ----------------------------------------------------------------------------
    def reuse(self, index: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """An Alloc that reuses one buffer per array position for big arrays.

        The caller must be done with a message's arrays before it reads the next one.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < REUSE_MIN:
            return np.empty(shape, dtype)
        buf = self._bufs.get(index)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[index] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def stalled(self, now: float) -> bool:
        """Whether a message has been half-read for longer than ``timeout`` (in queued mode
        the loop reads nothing while output waits: that time is not the peer's)."""
        return bool(self._phase or self._pos) and not self._out and \
            now - max(self._since, self._out_since) > self.timeout

    def _next_array(self) -> bool:
        """Point the target at the next array with bytes; True when the message is done."""
        while len(self._arrays) < len(self._specs):
            dt, shape, nbytes = self._specs[len(self._arrays)]
            try:
                got = self._alloc(len(self._arrays), dt, shape)
                arr = got if got is not None else self.reuse(len(self._arrays), dt, shape)
            except (MemoryError, ValueError) as err:
                raise ProtocolError(f"{self.peer} announced an array of shape {shape} that "
                                    f"cannot be held: {err}") from None
            self._arrays.append(arr)
            if nbytes:
                target = memoryview(arr).cast("B")  # type: ignore[arg-type]
                start = self._rstart
                if self._rend - start >= nbytes:  # all buffered: copy it, go on to the next
                    target[:] = self._rview[start:start + nbytes]
                    self._rstart = start + nbytes
                    continue
                self._target, self._pos = target, 0
                return False
        return True

    def _advance(self, alloc_for: Callable[[Meta], Alloc | None] | None) -> bool:
        """The target is full: move to the next part; True when a message is complete."""
        if self._phase == 0:
            magic, hlen = _PREFIX.unpack(self._target)
            self._check_prefix(magic, hlen)
            start = self._rstart
            if self._rend - start >= hlen:   # the whole header is buffered: parse it there
                self._rstart = start + hlen
                return self._header(self._rview[start:start + hlen], alloc_for)
            self._phase, self._target, self._pos = 1, memoryview(bytearray(hlen)), 0
            return False
        if self._phase == 1:
            return self._header(self._target, alloc_for)
        return self._next_array()

    def _check_prefix(self, magic: bytes, hlen: int) -> None:
        limit = MAX_HEADER if self.max_bytes is None else min(MAX_HEADER, self.max_bytes)
        if magic != _MAGIC or not 0 < hlen <= limit:
            raise ProtocolError(f"{self.peer} sent bytes that are not a pskv message")

    def _header(self, raw: memoryview, alloc_for: Callable[[Meta], Alloc | None] | None) \
            -> bool:
        """Check a message's header; True when the message is complete (no array bytes)."""
        self._meta, self._specs = parse_header(raw)
        if self.max_bytes is not None and \
                sum(n for _, _, n in self._specs) > self.max_bytes:
            raise ProtocolError(f"{self.peer} sent a message of over the {self.max_bytes} "
                                "bytes it may send (before admission: 64 KiB)")
        self._alloc = (alloc_for(self._meta) if alloc_for is not None else None) or \
            self.reuse
        self._phase = 2
        return self._next_array()

    def _fill(self) -> bool:
        """Move buffered bytes into the target, or receive more; False when nothing more
        can be had without waiting."""
        target, pos = self._target, self._pos
        need = target.nbytes - pos
        start, avail = self._rstart, self._rend - self._rstart
        if avail:
            n = need if need < avail else avail
            target[pos:pos + n] = self._rview[start:start + n]
            self._pos = pos + n
            self._rstart = start + n
            if self._rstart == self._rend:
                self._rstart = self._rend = 0
            return True
        if self._drained:
            self._drained = False
            return False
        try:
            if need >= READ_BUFFER:          # a big array's rest: straight into place
                k = self.reader(target[pos:], need)
                self._drained = k < need and not self.tls
            else:
                k = self.reader(self._rview, READ_BUFFER)
                self._drained = k < READ_BUFFER and not self.tls
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        except OSError as err:
            raise NodeFailedError(f"the connection to {self.peer} broke: {err}") from err
        if k == 0:
            raise NodeFailedError(f"{self.peer} closed the connection")
        self._since = time.monotonic()
        self.received += k
        if need >= READ_BUFFER:
            self._pos = pos + k
        else:
            self._rstart, self._rend = 0, k
        return True

    def read_available(self, alloc_for: Callable[[Meta], Alloc | None] | None = None,
                       limit: int = 64) -> list[tuple[Meta, list[np.ndarray]]]:
        """Read what has arrived, without waiting; return the messages it completed.

        Arrays land in the buffers ``alloc_for(meta)`` gives (when it gives an Alloc), else
        in buffers reused between messages (:meth:`reuse`). Messages beyond ``limit``
        stay buffered for the next call (:meth:`buffered` counts them).
        """
        done: list[tuple[Meta, list[np.ndarray]]] = []
        if not self._handshaken:
            try:
                self.sock.do_handshake()  # type: ignore[attr-defined]
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return done
            except (ssl.SSLError, OSError) as err:
                raise ProtocolError(f"the TLS handshake with {self.peer} failed: "
                                    f"{err}") from None
            self._handshaken = True
        while len(done) < limit:
            if self._phase == 0 and self._pos == 0:
                held = self._rend - self._rstart
                if held >= _PREFIX.size:
                    # the common case: read the message in place (all of it, when it is
                    # all there; else the state machine below goes on with its rest)
                    self._buffered_message(alloc_for, done)
                    if self._rstart == self._rend:
                        self._rstart = self._rend = 0
                    continue
                if not held:                 # nothing buffered: one recv, as much as fits
                    if self._drained:        # the last recv emptied the socket: see above
                        self._drained = False
                        break
                    try:
                        k = self.reader(self._rview, READ_BUFFER)
                    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        break
                    except OSError as err:
                        raise NodeFailedError(f"the connection to {self.peer} broke: "
                                              f"{err}") from err
                    if k == 0:
                        raise NodeFailedError(f"{self.peer} closed the connection")
                    self.received += k
                    self._rstart, self._rend = 0, k
                    self._since = time.monotonic()
                    self._drained = k < READ_BUFFER and not self.tls
                    continue
            if not self._fill():
                break
            if self._pos == self._target.nbytes and self._advance(alloc_for):
                assert self._meta is not None
                done.append((self._meta, self._arrays))
                self._reset()
        return done

    def _buffered_message(self, alloc_for: Callable[[Meta], Alloc | None] | None,
                          done: list[tuple[Meta, list[np.ndarray]]]) -> None:
        """Parse a message that starts in the read buffer: append it to ``done`` when it is
        all there, else leave the state machine to read its rest."""
        start, end = self._rstart, self._rend
        magic, hlen = _PREFIX.unpack_from(self._rbuf, start)
        self._check_prefix(magic, hlen)
        start += _PREFIX.size
        if end - start < hlen:
            self._rstart = start
            self._phase, self._target, self._pos = 1, memoryview(bytearray(hlen)), 0
            self._since = time.monotonic()
            return
        meta, specs = parse_header(self._rview[start:start + hlen])
        start += hlen
        total = 0
        for spec in specs:
            total += spec[2]
        if self.max_bytes is not None and total > self.max_bytes:
            raise ProtocolError(f"{self.peer} sent a message of over the {self.max_bytes} "
                                "bytes it may send (before admission: 64 KiB)")
        alloc = alloc_for(meta) if alloc_for is not None else None
        if end - start < total:              # the arrays are still on their way
            self._rstart = start
            self._meta, self._specs, self._alloc = meta, specs, alloc or self.reuse
            self._phase = 2
            self._since = time.monotonic()
            self._next_array()               # False: an array has bytes (total > 0)
            return
        arrays: list[np.ndarray] = []
        view = self._rview
        for i, (dt, shape, nbytes) in enumerate(specs):
            arr = alloc(i, dt, shape) if alloc is not None else None
            if arr is None:
                arr = np.empty(shape, dt)
            if nbytes:
                memoryview(arr).cast("B")[:] = view[start:start + nbytes]  # type: ignore[arg-type]
                start += nbytes
            arrays.append(arr)
        self._rstart = start
        done.append((meta, arrays))

    receive = read_available


class StreamListener:
    """A listening stream socket: Unix (``path``) or TCP (``host``, a port from the OS).

    ``endpoint`` is what a worker passes to :meth:`StreamConn.connect`. A Unix socket is
    created so that only this user can connect, and its file is removed on close.
    """

    def __init__(self, *, path: str | None = None, host: str | None = None,
                 advertise: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self._path = path
        self._tls = tls if path is None else None
        if path is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(_unix_address(path))
            if not path.startswith("@"):
                os.chmod(path, 0o600)
            self.endpoint = path
        else:
            assert host is not None
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.bind((host, 0))
            self.endpoint = f"tcp:{advertise or host}:{self.sock.getsockname()[1]}"
        self.sock.listen(64)
        self.sock.setblocking(False)
        #: set when accept() ran out of file descriptors (the caller rests, then clears it)
        self.exhausted = False
        #: what an accepted socket becomes: ``make_conn(sock, timeout, name, handshaken)``
        #: (a :class:`.sealed.SealedConn` factory with PSKV_ENCRYPT=1)
        self.make_conn: Callable[..., StreamConn] = StreamConn

    def pollable(self) -> int:
        """The listening socket's file descriptor."""
        return self.sock.fileno()

    def accept(self, timeout: float, limit: int = 64) -> list[StreamConn]:
        """The connections waiting to be accepted, at most ``limit`` (none blocks).

        Out of file descriptors (or buffers), it returns what it got and sets
        :attr:`exhausted` instead of raising.
        """
        conns: list[StreamConn] = []
        while len(conns) < limit:
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return conns
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.exhausted = True
                    return conns
                continue                 # that one connection went away (ECONNABORTED)
            if self._path is not None and self._path.startswith("@") \
                    and not _same_user(sock):
                sock.close()             # another user's process: an abstract socket's mode
                continue
            name = f"a worker (fd {sock.fileno()})"
            if self._tls is not None:     # the handshake runs on the loop's reads
                sock.setblocking(False)
                conn = self.make_conn(self._tls.wrap_socket(sock, server_side=True,
                                                            do_handshake_on_connect=False),
                                      timeout, name, False)
            else:
                conn = self.make_conn(sock, timeout, name, True)
            conn.address = f"{addr[0]}" if isinstance(addr, tuple) else "the Unix socket"
            conns.append(conn)
        return conns

    def close(self) -> None:
        """Stop listening (and remove a Unix socket's file)."""
        self.sock.close()
        if self._path is not None and not self._path.startswith("@"):
            try:
                os.unlink(self._path)
            except OSError:
                pass
