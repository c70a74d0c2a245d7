"""A minimal Redis client (RESP2 over a socket) for :class:`~pskv.sinks.RedisSink`, so
pskv needs no ``redis`` package: connect with a timeout, AUTH, SELECT, pipelined commands,
replies parsed (errors included). Every read and write is bounded by the timeout."""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Sequence, Union
from urllib.parse import unquote, urlsplit

from ..errors import ClusterError, ClusterTimeoutError, ConfigError, ProtocolError

__all__ = ["Arg", "ErrorReply", "RedisURL", "Reply", "RespClient", "parse_url"]

Arg = Union[bytes, str, int, float]
#: commands sent per write in a pipeline (the replies are read after each chunk)
CHUNK = 512


class ErrorReply(str):
    """An error reply from Redis (``-ERR ...``), its text: a value in a pipeline's
    replies, raised as :class:`~pskv.errors.ClusterError` by :meth:`RespClient.call`."""


#: what a reply is: bytes (bulk or status), an int, None (nil), a list, or an ErrorReply
Reply = Union[bytes, int, None, "list[Any]", ErrorReply]


@dataclass(frozen=True)
class RedisURL:
    """A parsed ``redis://[[user]:password@]host[:port][/db]`` URL."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None = field(repr=False)

    def __str__(self) -> str:     # never the password (logs, error messages)
        return f"redis://{self.host}:{self.port}/{self.db}"


def parse_url(url: str) -> RedisURL:
    """The parts of ``url``; ConfigError saying what is wrong with it."""
    how = "Write redis://[:password@]host[:port][/db], e.g. redis://127.0.0.1:6379/0."
    if not isinstance(url, str):
        raise ConfigError(f"a Redis URL is a str, got {url!r}. {how}")
    parts = urlsplit(url)
    if parts.scheme != "redis":
        extra = " (TLS is not supported: use a local stunnel or a plain port)" \
            if parts.scheme == "rediss" else ""
        raise ConfigError(f"{url!r} is not a redis:// URL{extra}. {how}")
    try:
        port = parts.port if parts.port is not None else 6379
    except ValueError as err:
        raise ConfigError(f"{url!r} has a bad port ({err}). {how}") from err
    if not parts.hostname:
        raise ConfigError(f"{url!r} names no host. {how}")
    path = parts.path.strip("/")
    if path and (not path.isdigit() or parts.query or parts.fragment):
        raise ConfigError(f"{url!r}: the database is a number after the port (/0 to /15), "
                          f"got {path!r}. {how}")
    return RedisURL(parts.hostname, port, int(path or 0),
                    unquote(parts.username) if parts.username else None,
                    unquote(parts.password) if parts.password is not None else None)


def _encode(args: Sequence[Arg]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, bytes):
            b = a
        elif isinstance(a, str):
            b = a.encode()
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            b = repr(a).encode()
        else:
            raise TypeError(f"a Redis argument is bytes, str or a number, not {a!r}")
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RespClient:
    """One connection to Redis at ``url``: ``call(*args)`` one command,
    ``pipeline(commands)`` many in one round trip. Error replies raise ClusterError (from
    ``call``) or come back in place as :class:`ErrorReply` (from ``pipeline``)."""

    def __init__(self, url: str | RedisURL, timeout: float = 10.0) -> None:
        self.url = url if isinstance(url, RedisURL) else parse_url(url)
        if not timeout > 0:
            raise ConfigError(f"a Redis timeout is seconds > 0, got {timeout!r}.")
        self.timeout = float(timeout)
        try:
            self._sock = socket.create_connection((self.url.host, self.url.port), timeout)
        except socket.timeout as err:
            raise ClusterTimeoutError(f"no answer from {self.url} within {timeout:g} s. Is "
                                      "redis-server running there?") from err
        except OSError as err:
            raise ClusterError(f"cannot connect to {self.url}: {err}. Is redis-server "
                               "running there, and is the URL right?") from err
        self._sock.settimeout(timeout)
        self._buf = bytearray()
        try:
            if self.url.password is not None:
                auth: list[Arg] = ["AUTH", self.url.password] if self.url.username is None \
                    else ["AUTH", self.url.username, self.url.password]
                try:
                    self.call(*auth)
                except ClusterError as err:
                    raise ClusterError(f"{self.url} refused the password ({err}). Check the "
                                       "password in the URL (redis://:PASSWORD@host:port/db)."
                                       ) from err
            if self.url.db:
                self.call("SELECT", self.url.db)
        except BaseException:
            self.close()
            raise

    # ---- the wire -----------------------------------------------------------------------
    def _fill(self) -> None:
        try:
            got = self._sock.recv(1 << 16)
        except socket.timeout as err:
            raise ClusterTimeoutError(f"{self.url} did not answer within {self.timeout:g} s."
                                      " Is it overloaded, or was a reply lost?") from err
        except OSError as err:
            raise ClusterError(f"the connection to {self.url} broke: {err}.") from err
        if not got:
            raise ClusterError(f"{self.url} closed the connection. Was redis-server stopped, "
                               "or did it drop this client (maxclients, a timeout)?")
        self._buf += got

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[:end + 2]
                return line
            self._fill()

    def _exact(self, n: int) -> bytes:
        while len(self._buf) < n + 2:
            self._fill()
        if self._buf[n:n + 2] != b"\r\n":
            raise ProtocolError(f"{self.url} sent a bulk reply that does not end in CRLF.")
        data = bytes(self._buf[:n])
        del self._buf[:n + 2]
        return data

    def _reply(self) -> Reply:
        line = self._line()
        if not line:
            raise ProtocolError(f"{self.url} sent an empty reply line.")
        tag, rest = line[:1], line[1:]
        try:
            if tag == b"+":
                return rest
            if tag == b"-":
                return ErrorReply(rest.decode(errors="replace"))
            if tag == b":":
                return int(rest)
            if tag == b"$":
                n = int(rest)
                return None if n < 0 else self._exact(n)
            if tag == b"*":
                n = int(rest)
                return None if n < 0 else [self._reply() for _ in range(n)]
        except ValueError as err:
            raise ProtocolError(f"{self.url} sent a malformed reply {line[:60]!r}.") from err
        raise ProtocolError(f"{self.url} sent a reply of unknown type {line[:60]!r}: is it a "
                            "Redis server (RESP2)?")

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except socket.timeout as err:
            raise ClusterTimeoutError(f"{self.url} took no data for {self.timeout:g} s.") \
                from err
        except OSError as err:
            raise ClusterError(f"the connection to {self.url} broke: {err}.") from err

    # ---- commands -----------------------------------------------------------------------
    def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Reply]:
        """Send ``commands`` and read their replies, :data:`CHUNK` commands a round trip;
        an error reply is an :class:`ErrorReply` in its place."""
        out: list[Reply] = []
        for i in range(0, len(commands), CHUNK):
            part = commands[i:i + CHUNK]
            self._send(b"".join(_encode(c) for c in part))
            out.extend(self._reply() for _ in part)
        return out

    def call(self, *args: Arg) -> Reply:
        """One command's reply; an error reply raises :class:`~pskv.errors.ClusterError`."""
        got = self.pipeline([args])[0]
        if isinstance(got, ErrorReply):
            raise ClusterError(f"{self.url} answered {str(args[0])!r} with: {got}")
        return got

    def close(self) -> None:
        """Close the connection."""
        try:
            self._sock.close()
        except OSError:
            pass
