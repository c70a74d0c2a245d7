"""A node's HTTP endpoints (``/metrics``), bounded, and HTTP requests bounded in total time.

:class:`BoundedHTTPServer` serves small GET requests from one thread with a selector, so
whatever its clients do, a node pays at most one thread and ``1 + max_connections``
descriptors for it (issue #34: a thread per connection and no read timeout let 1,014
half-sent requests hold a server at its descriptor limit, and its data ports then took no
new connection):

* at most ``max_connections`` are open; one more evicts the oldest that has not finished
  sending its request (a client that sends at once, as Prometheus does, gets served);
* a connection has ``timeout`` seconds in all to send its request head (at most
  :data:`MAX_HEAD` bytes) and read the reply, then it is closed: slow clients are dropped;
* one request per connection (``Connection: close``).

:func:`deadline_handler` is a ``prometheus_client`` push handler whose whole exchange
(connect, send, every read of the answer) ends within its deadline: the library's own
applies its timeout per read, so a gateway that answered a byte every 2 s kept a node's
``close()`` alive for over 60 s.
"""
from __future__ import annotations

import errno
import http.client
import logging
import selectors
import socket
import threading
import time
import urllib.parse
from typing import Callable

__all__ = ["App", "BoundedHTTPServer", "MAX_HEAD", "deadline_handler"]

log = logging.getLogger(__name__)

#: bytes a request head may have (request line and headers)
MAX_HEAD = 8192
#: ``(method, target, headers) -> (status, headers, body)``; header names lower-case
App = Callable[[str, str, "dict[str, str]"], "tuple[int, list[tuple[str, str]], bytes]"]
#: connections accepted in one go before the others get a turn
_ACCEPT_BURST = 64


class _Conn:
    """One client: what it sent so far, or what is left to send it; its deadline."""

    __slots__ = ("deadline", "head", "out", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.head = bytearray()
        self.out: memoryview | None = None   # set once the request is answered


class BoundedHTTPServer:
    """Serve ``app`` on ``host:port``: one thread, at most ``max_connections`` clients,
    ``timeout`` seconds each (see the module's docstring).

    The socketserver interface its owner uses: :meth:`serve_forever` (in a thread),
    :meth:`shutdown`, :meth:`server_close`. Binding raises OSError (port in use).
    """

    def __init__(self, host: str, port: int, app: App, *, max_connections: int = 16,
                 timeout: float = 5.0, reuse_address: bool = False) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            if reuse_address:
                self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(128)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self.app = app
        self.max_connections = max_connections
        self.timeout = timeout
        self._conns: dict[int, _Conn] = {}      # by descriptor, oldest first
        self._stop = threading.Event()
        self._done = threading.Event()
        self._done.set()
        self._sel = selectors.DefaultSelector()

    # ---- the loop ------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Serve until :meth:`shutdown`; every open connection is closed on the way out."""
        self._done.clear()
        try:
            self._sel.register(self.socket, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, mask in self._sel.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._serve(key.data, mask)
                now = time.monotonic()
                for conn in [c for c in self._conns.values() if c.deadline <= now]:
                    self._close(conn)       # too slow: dropped
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            try:
                self._sel.unregister(self.socket)
            except (KeyError, ValueError):
                pass
            self._done.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop :meth:`serve_forever` and wait (at most ``timeout`` s) until it returns."""
        self._stop.set()
        self._done.wait(timeout)

    def server_close(self) -> None:
        """Close the listening socket."""
        self._sel.close()
        self.socket.close()

    @property
    def open_connections(self) -> int:
        """Clients connected now."""
        return len(self._conns)

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, _addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                # out of descriptors (EMFILE, ENFILE) or a connection reset while queued:
                # the others are served, and the listener is tried again next turn
                if err.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("metrics endpoint: cannot accept a connection: %s", err)
                return
            if len(self._conns) >= self.max_connections:
                self._evict()
            if len(self._conns) >= self.max_connections:
                sock.close()          # every slot is sending a reply: this one waits no turn
                continue
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self.timeout)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict(self) -> None:
        """Close the oldest connection that has not sent its whole request yet."""
        for conn in self._conns.values():
            if conn.out is None:
                self._close(conn)
                return

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _serve(self, conn: _Conn, mask: int) -> None:
        try:
            if conn.out is None:
                data = conn.sock.recv(4096)
                if not data:
                    self._close(conn)
                    return
                conn.head += data
                end = conn.head.find(b"\r\n\r\n")
                if end < 0:
                    if len(conn.head) > MAX_HEAD:
                        self._answer(conn, 431, [], b"request head too long\n")
                    return
                self._respond(conn, bytes(conn.head[:end]))
            else:
                sent = conn.sock.send(conn.out)
                conn.out = conn.out[sent:]
            if conn.out is not None and not conn.out:
                self._close(conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)

    def _respond(self, conn: _Conn, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._answer(conn, 400, [], b"bad request line\n")
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            status, extra, body = self.app(parts[0], parts[1], headers)
        except Exception:  # noqa: BLE001 - a scrape never fails the node
            log.warning("metrics endpoint: the request %r failed", lines[0][:200],
                        exc_info=True)
            status, extra, body = 500, [], b"internal error\n"
        self._answer(conn, status, extra, body)

    def _answer(self, conn: _Conn, status: int, headers: list[tuple[str, str]],
                body: bytes) -> None:
        reason = http.client.responses.get(status, "")
        head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}",
                "Connection: close"]
        if not any(name.lower() == "content-type" for name, _ in headers):
            head.append("Content-Type: text/plain; charset=utf-8")
        head += [f"{name}: {value}" for name, value in headers]
        conn.out = memoryview(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)


def deadline_handler(seconds: float) -> Callable[..., Callable[[], None]]:
    """A ``prometheus_client`` push handler (``push_to_gateway(handler=...)``) that ends
    the whole exchange within ``seconds``: the connection is shut down at the deadline,
    whatever read it is in. Raises OSError for a status of 400 or more, or when cut off."""
    def handler(url: str, method: str, timeout: float | None,
                headers: list[tuple[str, str]], data: bytes) -> Callable[[], None]:
        def send() -> None:
            _exchange(url, method, headers, data, time.monotonic() + seconds)
        return send
    return handler


def _exchange(url: str, method: str, headers: list[tuple[str, str]], data: bytes,
              end: float) -> None:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=max(0.001, end - time.monotonic()))
    cut = threading.Event()

    def cut_off() -> None:   # unblocks whatever read or write the exchange is in
        cut.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    timer = threading.Timer(max(0.0, end - time.monotonic()), cut_off)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if cut.is_set():       # the deadline passed before there was a socket to shut
            raise TimeoutError("no connection before the deadline")
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path or "/", body=data, headers=dict(headers))
        resp = conn.getresponse()
        resp.read()
        if cut.is_set():
            raise TimeoutError("the exchange was cut off at its deadline")
        if resp.status >= 400:
            raise OSError(f"error talking to the Pushgateway: {resp.status} {resp.reason}")
    except (OSError, http.client.HTTPException) as err:
        if cut.is_set() and not isinstance(err, TimeoutError):
            raise TimeoutError("no complete answer before the deadline "
                               f"({type(err).__name__}: {err})") from err
        raise
    finally:
        timer.cancel()
        conn.close()
