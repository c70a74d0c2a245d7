"""What an on-path observer sees and what an on-path attacker can change, with and without
``PSKV_ENCRYPT=1``.

The observer is a packet capture of the loopback interface (an ``AF_PACKET`` socket: root
only, else the capture tests skip) while a job runs over TCP; the attacker a TCP proxy
inserted between a worker and a server that flips one byte of a push on its way.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import KVStoreError

from .conftest import assert_unharmed


class Capture:
    """Every frame on the loopback interface while it runs (root only)."""

    def __init__(self) -> None:
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
        except (PermissionError, AttributeError, OSError) as err:
            pytest.skip(f"no packet capture here ({err}): needs root on Linux")
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.05)
        self.frames: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.frames.append(self.sock.recv(1 << 17))
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return

    def close(self) -> bytes:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        return b"\n".join(self.frames)


def _job(thread_cluster: Any, encrypt: bool, transport: str = "tcp") \
        -> tuple[bytes, list[bytes], bytes]:
    """A job over TCP (or ZeroMQ) with a backup per shard, captured: (what crossed the
    loopback, every pair key the workers hold, the bytes of the array worker 0 pushed)."""
    pushed = np.random.default_rng(7).random(4096).astype(np.float32)
    cluster = thread_cluster(2, 2, transport=transport, replicas=1, encrypt=encrypt)
    keys: list[bytes] = []
    cap = Capture()
    try:
        def fn(kv: Any) -> Any:
            keys.extend(kv._po.membership.keys)
            kv.init(9, mx.nd.zeros(pushed.shape))
            kv.push(9, mx.nd.array(pushed if kv.rank == 0 else np.zeros_like(pushed)))
            return kv.pull(9).asnumpy()

        res = cluster.run(fn)
        time.sleep(0.3)
    finally:
        wire = cap.close()
    assert_unharmed(cluster, res, pushed)
    assert len(keys) == 4 and all(len(k) == 64 for k in keys), keys
    return wire, keys, pushed.tobytes()


def _pieces(data: bytes) -> list[bytes]:
    return [data[i:i + 48] for i in range(0, len(data) - 48, 1024)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_without_the_switch_no_key_material_crosses_in_clear(transport: str,
                                                             thread_cluster: Any) -> None:
    wire, keys, pushed = _job(thread_cluster, encrypt=False, transport=transport)
    # the capture works: the pushed array is there, in clear
    assert any(p in wire for p in _pieces(pushed))
    # the scheduler's ADMIT sealed every pair key: none crossed the link readable
    for key in keys:
        assert key not in wire and bytes.fromhex(key.decode()) not in wire


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_with_the_switch_neither_keys_nor_arrays_cross_in_clear(transport: str,
                                                                thread_cluster: Any) -> None:
    wire, keys, pushed = _job(thread_cluster, encrypt=True, transport=transport)
    assert len(wire) > 40_000, len(wire)          # the job's traffic was captured
    for key in keys:
        assert key not in wire and bytes.fromhex(key.decode()) not in wire
    assert not any(p in wire for p in _pieces(pushed))


ONES = np.ones(8, np.float32).tobytes()


class Flipper:
    """A TCP proxy to ``target``; once armed, it flips one byte of the next big chunk a
    worker sends (an on-path attacker changing a push)."""

    def __init__(self, target: str) -> None:
        host, _, port = target[4:].rpartition(":")
        self.target = (host, int(port))
        self.lis = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp:127.0.0.1:{self.lis.getsockname()[1]}"
        self.armed = threading.Event()
        self.flipped = threading.Event()
        self.socks: list[socket.socket] = [self.lis]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self.lis.accept()
        except OSError:
            return
        server = socket.create_connection(self.target, 5)
        self.socks += [client, server]
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if upstream and self.armed.is_set() and len(data) >= 8192 \
                        and not self.flipped.is_set():
                    # in clear: inside the pushed ones (1.0 becomes 3.0); sealed: anywhere
                    at = data.find(ONES)
                    at = at + 3 if at >= 0 else len(data) // 2
                    data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
                    self.flipped.set()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("encrypt", [False, True])
def test_a_byte_changed_on_the_wire(encrypt: bool, thread_cluster: Any) -> None:
    """Without the switch the attacker's change is applied unnoticed; with it the server
    refuses the message and drops the link: the worker's next call fails, the tampered
    gradient is never applied, nothing hangs."""
    cluster = thread_cluster(1, 1, transport="tcp", encrypt=encrypt)
    grad = np.ones(4096, np.float32)
    out: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(5, mx.nd.zeros(grad.shape))
        w = kv._kv
        proxy = Flipper(kv._po.servers[0]["tcp"])
        try:
            w.drop(0)
            w._conns[0] = w._connect(0, {"tcp": proxy.endpoint})
            w.hello(0)
            proxy.armed.set()
            try:
                kv.push(5, mx.nd.array(grad))
                out["pulled"] = kv.pull(5).asnumpy()
            except KVStoreError as err:
                out["error"] = err
            out["flipped"] = proxy.flipped.is_set()
        finally:
            proxy.close()
        return None

    cluster.run(fn)
    assert out["flipped"], out
    if not encrypt:
        pulled = out["pulled"]
        assert not np.array_equal(pulled, grad)          # the attack works in clear
        assert np.count_nonzero(pulled != grad) == 1
    else:
        assert "pulled" not in out, out                  # nothing tampered was applied
        assert isinstance(out["error"], KVStoreError), out
    cluster.stop.set()
    cluster.join(20)


@pytest.mark.timeout(60)
def test_with_the_switch_a_peer_in_clear_gets_nothing(thread_cluster: Any) -> None:
    """The scheduler's port speaks CURVE only (a plain ZeroMQ peer gets no answer), and a
    server's stream ports take sealed messages only (a HELLO in clear closes the link)."""
    from pskv._ps.message import Command, encode
    from .conftest import Stranger, frame, hello_body, stream_exchange
    cluster = thread_cluster(1, 1, transport="tcp", encrypt=True)
    got: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        s = Stranger(cluster.cfg.root_address)
        try:
            got["scheduler"] = s.ask(encode(Command.HELLO, 1, body=hello_body()), timeout=2)
        finally:
            s.close()
        head = encode(Command.HELLO, 1, body=hello_body(rank=0))[0]
        got["server"] = stream_exchange(kv._po.servers[0]["tcp"], frame(head))
        kv.push(1, mx.nd.ones((3,)))
        return kv.pull(1).asnumpy()

    res = cluster.run(fn)
    assert got["scheduler"] is None, got
    assert b"CHALLENGE" not in got["server"] and b'"nonce"' not in got["server"], got
    assert not got["server"].endswith(b"<open>"), got
    assert_unharmed(cluster, res, np.ones(3, np.float32))


def test_the_switch_needs_the_secret() -> None:
    from pskv._ps.config import ClusterConfig, Role
    from pskv.errors import ConfigError
    with pytest.raises(ConfigError, match="PSKV_SECRET"):
        ClusterConfig(role=Role.WORKER, encrypt=True)
    with pytest.raises(ConfigError, match="PSKV_ENCRYPT='yes'"):
        ClusterConfig.from_env({"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_SERVER": "1",
                                "DMLC_NUM_WORKER": "1", "PSKV_ENCRYPT": "yes"})
