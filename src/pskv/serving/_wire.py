"""A replica over the wire (V5): a length-prefixed JSON header and raw little-endian
arrays on TCP, a challenge-response proof of the job's secret, every message bounded."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
from typing import Any, Mapping

import numpy as np

from ..errors import ClusterError, ConfigError, KVStoreError, ProtocolError, StaleReadError

__all__ = ["ReplicaClient"]

#: the most IDs one lookup may ask for
MAX_IDS = 1 << 22
#: the largest JSON header a replica or a client reads
MAX_HEADER = 64 << 10
#: seconds a connection may stay silent before the replica closes it
IDLE = 60.0
#: connections served at once; more are refused
MAX_CLIENTS = 64
_LEN = struct.Struct(">I")


def _key(secret: bytes) -> bytes:
    return hmac.new(secret, b"pskv|replica", hashlib.sha256).digest()


def _proof(secret: bytes, nonce: str) -> str:
    return hmac.new(_key(secret), f"replica|{nonce}".encode(), hashlib.sha256).hexdigest()


# ---- the wire (V5) ------------------------------------------------------------------------
def _send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps({**header, "nbytes": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(head)) + head + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ProtocolError("the connection closed in the middle of a message")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, max_payload: int) -> tuple[dict[str, Any], bytes]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ProtocolError(f"a header of {n} bytes, over {MAX_HEADER}")
    try:
        header = json.loads(_recv_exact(sock, n))
    except ValueError as err:
        raise ProtocolError(f"a header that is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ProtocolError("a header that is not an object")
    nbytes = header.get("nbytes", 0)
    if type(nbytes) is not int or not 0 <= nbytes <= max_payload:
        raise ProtocolError(f"a payload of {nbytes!r} bytes (at most {max_payload})")
    return header, _recv_exact(sock, nbytes) if nbytes else b""


class _Server:
    """A thread per connection (at most MAX_CLIENTS), one accepting thread."""

    def __init__(self, replica: Any, host: str, port: int, secret: bytes | None) -> None:
        self._replica, self._secret = replica, secret
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.5)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self._conns: set[socket.socket] = set()
        self._mu = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="pskv-replica-serve",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        self._sock.close()
        with self._mu:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _addr = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            if not self._clients.acquire(blocking=False):
                conn.close()          # too many at once (V5)
                continue
            with self._mu:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IDLE)
            nonce = secrets.token_hex(16)
            _send(conn, {"hello": "pskv-replica", "nonce": nonce,
                         "secret": self._secret is not None})
            hello, _ = _recv(conn, 0)
            if self._secret is not None:
                got = hello.get("proof")
                if not isinstance(got, str) or not hmac.compare_digest(
                        got.encode(), _proof(self._secret, nonce).encode()):
                    _send(conn, {"error": "ProtocolError", "msg": "a wrong proof of the "
                                 "job's secret: not serving this connection"})
                    return
            _send(conn, {"ok": True})
            while not self._stop.is_set():
                header, payload = _recv(conn, 8 * MAX_IDS)
                try:
                    reply, data = self._answer(header, payload)
                except KVStoreError as err:
                    _send(conn, {"error": type(err).__name__, "msg": str(err)})
                    if isinstance(err, ProtocolError):
                        return
                    continue
                _send(conn, reply, data)
        except (ProtocolError, OSError, struct.error):
            pass                      # a bad or gone client: its connection only (V5)
        finally:
            with self._mu:
                self._conns.discard(conn)
            conn.close()
            self._clients.release()

    def _answer(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op, key = header.get("op"), header.get("key")
        if not (type(key) is int or (isinstance(key, str) and len(key) < 4096)):
            raise ProtocolError(f"a request without a table key (got {type(key).__name__})")
        if op == "versions":
            return {"versions": self._replica.versions(key)}, b""
        if op != "lookup":
            raise ProtocolError(f"an unknown op {str(op)[:40]!r} (lookup, versions)")
        if len(payload) % 8:
            raise ProtocolError("lookup IDs that are not whole int64s")
        mv, timeout = header.get("min_version"), header.get("timeout", 5.0)
        if mv is not None and not (type(mv) is int or (isinstance(mv, dict) and all(
                isinstance(s, str) and s.isdigit() and type(v) is int
                for s, v in mv.items()))):
            raise ProtocolError("min_version: an int, or {shard: int}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 <= timeout <= 60:
            raise ProtocolError("timeout: seconds in [0, 60]")
        ids = np.frombuffer(payload, "<i8")
        rows, found, at = self._replica.lookup(
            key, ids, {int(s): v for s, v in mv.items()} if isinstance(mv, dict) else mv,
            timeout)
        return ({"versions": {str(s): v for s, v in at.items()}, "dim": int(rows.shape[1]),
                 "dtype": rows.dtype.str, "n": int(ids.size)},
                np.ascontiguousarray(rows).tobytes() + found.tobytes())


class ReplicaClient:
    """A client of a :meth:`Replica.serve` ing replica (an eval or serving process).

    Parameters
    ----------
    address : (host, port)
    secret : str or bytes, optional
        The job's secret the replica was given (default: ``PSKV_SECRET``).
    timeout : float
        Seconds for each answer.
    """

    def __init__(self, address: tuple[str, int], secret: str | bytes | None = None,
                 timeout: float = 30.0) -> None:
        if secret is None:
            secret = os.environ.get("PSKV_SECRET") or None
        if isinstance(secret, str):
            secret = secret.encode()
        try:
            self._sock = socket.create_connection(tuple(address), timeout=timeout)
        except OSError as err:
            raise ClusterError(f"cannot reach the replica at {address}: {err}. Is it "
                               "serving (Replica.serve, python -m pskv.serving)?") from err
        try:
            hello, _ = _recv(self._sock, 0)
            nonce = hello.get("nonce")
            if hello.get("hello") != "pskv-replica" or not isinstance(nonce, str):
                raise ProtocolError(f"{address} is not a pskv replica")
            proof = {}
            if hello.get("secret"):
                if not secret:
                    raise ConfigError(f"the replica at {address} asks for the job's secret; "
                                      "pass secret= or set PSKV_SECRET.")
                proof = {"proof": _proof(secret, nonce)}
            _send(self._sock, proof)
            self._reply()
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> ReplicaClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def _reply(self) -> tuple[dict[str, Any], bytes]:
        header, payload = _recv(self._sock, 16 * MAX_IDS * 64)
        if "error" in header:
            msg = f"the replica: {header.get('msg')}"
            raise (StaleReadError(msg) if header["error"] == "StaleReadError"
                   else ProtocolError(msg) if header["error"] == "ProtocolError"
                   else KVStoreError(msg))
        return header, payload

    def versions(self, key: Any) -> dict[int, int]:
        """The version each shard of table ``key`` is held at on the replica."""
        _send(self._sock, {"op": "versions", "key": key})
        header, _ = self._reply()
        return {int(s): int(v) for s, v in header["versions"].items()}

    def lookup(self, key: Any, ids: Any, min_version: int | Mapping[int, int] | None = None,
               timeout: float = 5.0) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """``(rows, found, versions)`` of 1-d ``ids``, as :meth:`Replica.lookup`."""
        flat = np.ascontiguousarray(np.asarray(ids, "<i8").ravel())
        mv = {str(s): int(v) for s, v in min_version.items()} \
            if isinstance(min_version, Mapping) else min_version
        _send(self._sock, {"op": "lookup", "key": key, "min_version": mv,
                           "timeout": timeout}, flat.tobytes())
        header, payload = self._reply()
        n, dim, dtype = header["n"], header["dim"], np.dtype(header["dtype"])
        cut = n * dim * dtype.itemsize
        if n != flat.size or len(payload) != cut + n:
            raise ProtocolError(f"the replica answered {n} rows in {len(payload)} bytes for "
                                f"{flat.size} IDs")
        rows = np.frombuffer(payload[:cut], dtype).reshape(n, dim)
        found = np.frombuffer(payload[cut:], bool)
        return rows, found, {int(s): int(v) for s, v in header["versions"].items()}


