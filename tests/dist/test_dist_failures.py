"""Failures: a node killed mid-round, strangers without the secret, garbage on the wire.

Kills use real processes (``local_cluster``, SIGKILL, heartbeats every 0.2 s with a 2 s
deadline); strangers and garbage are sent to thread clusters from a raw ZeroMQ DEALER.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq

import pskv as mx
from pskv._ps.auth import prove
from pskv._ps.message import Command, encode

HEARTBEAT_TIMEOUT = 2.0
#: the deadline for every other node to hear of a death: heartbeat timeout plus slack for
#: this small, busy machine
DEADLINE = HEARTBEAT_TIMEOUT + 10.0


# ---- a node killed mid-round (processes) --------------------------------------------------
def _wait_ready(cluster: Any, ranks: list[int], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready = {r["rank"] for p in cluster.workers for r in p.reports()
                 if r.get("event") == "ready"}
        if set(ranks) <= ready:
            return
        time.sleep(0.05)
    pytest.fail(f"workers {ranks} were not ready in {timeout} s:\n{cluster.dump()}")


def _errors(cluster: Any) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for p in cluster.workers for r in p.reports() if "error" in r}


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_worker_killed_mid_round(local_cluster: Any) -> None:
    cluster = local_cluster(2, 2, env={"MXNET_KVSTORE_BIGARRAY_BOUND": "16"})
    cluster.start("fail_node.py", "worker-dies")
    _wait_ready(cluster, [0, 1])
    victim = cluster.worker_by_rank(1)
    time.sleep(0.3)                        # rank 0 is now waiting for rank 1's push
    killed_at = time.time()
    victim.kill()
    codes = cluster.wait(30)
    err = _errors(cluster)[0]
    assert "ClusterError" in err["mro"] and err["error"] == "NodeFailedError", err
    assert "worker 1" in err["msg"], err
    assert err["time"] - killed_at < DEADLINE, (err["time"] - killed_at, err)
    survivor = cluster.worker_by_rank(0)
    assert codes[survivor.label] == 3
    # the servers heard too, and every node left by itself
    for label in ("server 0", "server 1"):
        assert "worker 1" in cluster.get(label).output(), cluster.dump()
        assert codes[label] == 0
    assert codes["scheduler"] == 1            # the job failed
    assert "worker 1" in cluster.get("scheduler").output()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_server_killed_mid_round(local_cluster: Any) -> None:
    cluster = local_cluster(2, 2, env={"MXNET_KVSTORE_BIGARRAY_BOUND": "16"})
    cluster.start("fail_node.py", "server-dies")
    _wait_ready(cluster, [0, 1])
    table = next(r["servers"] for p in cluster.workers for r in p.reports() if "servers" in r)
    victim = cluster.server_by_rank(1, table)
    survivor = cluster.server_by_rank(0, table)
    killed_at = time.time()
    victim.kill()
    codes = cluster.wait(30)
    errors = _errors(cluster)
    assert sorted(errors) == [0, 1], cluster.dump()
    for rank, err in errors.items():
        assert "ClusterError" in err["mro"], err
        assert "server 1" in err["msg"], err
        assert err["time"] - killed_at < DEADLINE, (rank, err["time"] - killed_at, err)
    # the scheduler reports the dead server; the surviving server may have been shut down
    # (every worker gone) before the heartbeat deadline, which is a clean exit
    assert "server 1" in cluster.get("scheduler").output(), cluster.dump()
    assert codes[survivor.label] == 0 and codes["scheduler"] == 1, codes
    assert all(codes[p.label] == 3 for p in cluster.workers), codes


# ---- strangers and garbage (threads) -------------------------------------------------------
class Stranger:
    """A raw DEALER socket that speaks (or mangles) the wire format."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frames: list[Any], timeout: float = 5.0) -> dict[str, Any]:
        """Send frames, return the reply's JSON header."""
        self.sock.send_multipart(frames)
        assert self.sock.poll(int(timeout * 1000)), f"no reply to {frames!r}"
        reply = self.sock.recv_multipart()
        header: dict[str, Any] = json.loads(reply[0])
        return header

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def hello(role: str, proof: dict[str, str], **extra: Any) -> list[Any]:
    return encode(Command.HELLO, 1, body={"role": role, "host": "x", "pid": 1, **proof,
                                          **extra})


def answer(stranger: Stranger, secret: bytes, purpose: str = "scheduler",
           role: str = "worker", rank: int | None = None) -> dict[str, Any]:
    """Ask ``stranger``'s acceptor for a challenge; the HELLO body proving it with ``secret``."""
    claim = {} if rank is None else {"rank": rank}
    challenge = stranger.ask(hello(role, {}, **claim))
    assert challenge["c"] == Command.CHALLENGE, challenge
    return {"role": role, "host": "x", "pid": 1, **claim,
            **prove(secret, purpose, challenge["b"], role, rank)}


def test_stranger_without_secret_is_refused(thread_cluster: Any,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cluster = thread_cluster(2, 1)
    root = cluster.cfg.root_address
    secret = cluster.cfg.secret
    # before the cluster forms: a wrong secret, a made-up nonce, a proof recorded on
    # another connection (the acceptor chose another nonce for this one)
    stranger, other = Stranger(root), Stranger(root)
    try:
        wrong = answer(stranger, b"wrong secret")
        made_up = {**answer(stranger, secret), "nonce": "00" * 16}
        recorded = answer(other, secret)
        answer(stranger, secret)           # stranger's own challenge is another nonce
        for body in (wrong, made_up, recorded):
            reply = stranger.ask(encode(Command.HELLO, 1, body=body))
            assert reply["c"] == Command.ERROR and "refused" in reply["b"]["msg"], reply
        # messages other than HELLO from an unadmitted node
        reply = stranger.ask(encode(Command.BARRIER, 5, body={"group": "worker"}))
        assert reply["c"] == Command.ERROR and reply["t"] == 5
    finally:
        stranger.close()
        other.close()
    results: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            results["servers"] = kv._po.servers
            # after: a stranger, with or without the secret, is beyond the expected workers
            s = Stranger(root)
            try:
                results["late"] = s.ask(encode(Command.HELLO, 1, body=answer(s, secret)))
                results["late_bad"] = s.ask(encode(Command.HELLO, 1,
                                                   body=answer(s, b"bad")))
            finally:
                s.close()
        kv.barrier()
        kv.push(1, mx.nd.ones((3,)))
        return kv.pull(1).asnumpy()

    res = cluster.run(fn)
    for rank in (0, 1):
        np.testing.assert_array_equal(res[rank], np.full(3, 2.0))
    for what in ("late", "late_bad"):
        assert results[what]["c"] == Command.ERROR, (what, results[what])
    assert "beyond" in results["late"]["b"]["msg"]
    assert cluster.join(10) == {"scheduler": 0, "server 0": 0}
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals, refusals


def test_stranger_and_garbage_to_a_server(thread_cluster: Any,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cluster = thread_cluster(2, 2, bigarray_bound=16, transport="zmq")  # a ZeroMQ data port
    replies: dict[str, dict[str, Any]] = {}
    go = threading.Event()

    def attack(address: str) -> None:
        s = Stranger(address)
        try:
            replies["no rank"] = s.ask(hello("worker", {}))
            replies["wrong proof"] = s.ask(encode(Command.HELLO, 1, body=answer(
                s, b"nope", "server", rank=1)))
            replies["scheduler proof"] = s.ask(encode(Command.HELLO, 1, body=answer(
                s, cluster.cfg.secret, "scheduler", rank=1)))     # the secret: not the key
            replies["push unadmitted"] = s.ask(encode(
                Command.PUSH, 3, [2], {"kinds": "d"}, [np.ones(3, np.float32)]))
            replies["not json"] = s.ask([b"\xff\x00garbage"])
            replies["empty header"] = s.ask([b""])
            replies["unknown command"] = s.ask([b'{"c": 999, "t": 1}'])
            replies["truncated"] = s.ask([b'{"c": 21, "t": 4, "k": [2], "a": [["float32", [3]]]}',
                                          b"\x00" * 7])
            replies["missing frame"] = s.ask([b'{"c": 21, "t": 4, "k": [2], '
                                              b'"a": [["float32", [3]]]}'])
            replies["object dtype"] = s.ask([b'{"c": 21, "t": 4, "k": [2], "a": [["object", [1]]]}',
                                             b"\x00" * 8])
            replies["huge shape"] = s.ask([b'{"c": 21, "t": 4, "k": [2], '
                                           b'"a": [["float32", [-1]]]}', b""])
        finally:
            s.close()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((40,)))            # split over both servers (bound 16)
        if kv.rank == 0:
            for ep in kv._po.servers:
                attack(ep["zmq"])
            go.set()
        else:
            go.wait(20)
        seen = []
        for _ in range(3):
            kv.push(1, mx.nd.ones((40,)))
            seen.append(kv.pull(1).asnumpy())
        return seen

    res = cluster.run(fn)
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        for got in res[rank]:
            np.testing.assert_array_equal(got, np.full(40, 2.0))
    for what, reply in replies.items():
        assert reply["c"] == Command.ERROR, (what, reply)
        assert reply["b"]["kind"] == "ProtocolError", (what, reply)
    for what in ("no rank", "wrong proof", "scheduler proof"):
        assert "refused" in replies[what]["b"]["msg"], replies[what]
    assert cluster.join(10) == {"scheduler": 0, "server 0": 0, "server 1": 0}
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "refused" in logged


def test_malformed_requests_from_an_admitted_worker(thread_cluster: Any) -> None:
    # an admitted peer sending nonsense gets an ERROR reply; the server keeps serving
    cluster = thread_cluster(2, 1)

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            bad = [(Command.PUSH, [2], {"kinds": "x"}, [np.ones(3, np.float32)]),
                   (Command.PUSH, [2], {"kinds": "d"}, [np.ones(4, np.float32)]),
                   (Command.PUSH, [2], None, [np.ones(3, np.float32)]),
                   (Command.PUSH, [12345], {"kinds": "d"}, [np.ones(3, np.float32)]),
                   (Command.PULL, [777], None, []),
                   (Command.INIT, [2], {"entries": [{"key": 1, "shape": [3]}]},
                    [np.ones(3, np.float32)]),
                   (Command.COMMAND, [], {"op": "explode"}, []),
                   (Command.COMMAND, [], {"op": "optimizer", "spec": {"name": "nope"}}, []),
                   (Command.RSP_PULL, [2], None, [np.array([5], np.int64)])]
            errors = []
            for cmd, keys, body, arrays in bad:
                ts = kv._kv.request(0, cmd, keys, body, arrays)
                try:
                    kv._kv.wait(ts, timeout=5)
                except mx.KVStoreError as err:
                    errors.append(err)
            assert len(errors) == len(bad), errors
            assert all("(reported by server 0)" in str(e) for e in errors)
        kv.barrier()
        kv.push(1, mx.nd.ones((3,)))
        return kv.pull(1).asnumpy()

    res = cluster.run(fn)
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        np.testing.assert_array_equal(res[rank], np.full(3, 2.0))
    assert cluster.join(10) == {"scheduler": 0, "server 0": 0}


# ---- the same-host socket (Unix domain) -------------------------------------------------------
def uds_exchange(path: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes.

    Ends with ``<open>`` if the server kept the connection, ``<reset>`` if it closed it with
    bytes unread (the kernel then resets the connection, and its reply may be lost).
    """
    if path.startswith("tcp:"):          # the cross-host stream path: host:port
        host, _, port = path[4:].rpartition(":")
        family, addr = socket.AF_INET, (host, int(port))
    else:
        family, addr = socket.AF_UNIX, path    # type: ignore[assignment]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(addr)
        got = b""
        try:
            sock.sendall(data)
            while True:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    return got + b"<open>"
                if not chunk:
                    return got
                got += chunk
        except (ConnectionResetError, BrokenPipeError):
            return got + b"<reset>"


def uds_frame(header: bytes, payload: bytes = b"") -> bytes:
    return b"PSKV" + struct.pack("<I", len(header)) + header + payload


@pytest.mark.parametrize("endpoint", ["uds", "tcp"])
def test_garbage_on_the_stream_sockets(endpoint: str, thread_cluster: Any) -> None:
    # the Unix socket (same host) and the TCP stream socket (other hosts) take the same framing
    cluster = thread_cluster(2, 1)
    replies: dict[str, bytes] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            path = kv._po.servers[0].get(endpoint)
            if path is not None:
                replies["garbage"] = uds_exchange(path, b"GET / HTTP/1.0\r\n\r\n")
                replies["bad header"] = uds_exchange(path, uds_frame(b"{not json"))
                replies["bad dtype"] = uds_exchange(path, uds_frame(
                    b'{"c": 21, "t": 4, "k": [2], "a": [["object", [1]]]}', b"\x00" * 8))
                replies["unadmitted push"] = uds_exchange(path, uds_frame(
                    b'{"c": 21, "t": 4, "k": [2], "b": {"kinds": "d"}, '
                    b'"a": [["float32", [3]]]}', b"\x00" * 12), timeout=1.0)
                # a stranger may not make the server hold a big message
                replies["big before hello"] = uds_exchange(path, uds_frame(
                    b'{"c": 21, "t": 4, "k": [2], "b": {"kinds": "d"}, '
                    b'"a": [["float32", [1000000000]]]}'), timeout=2.0)
            go.set()
        else:
            go.wait(20)
        kv.push(1, mx.nd.ones((3,)))
        return kv.pull(1).asnumpy()

    res = cluster.run(fn)
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        np.testing.assert_array_equal(res[rank], np.full(3, 2.0))
    assert cluster.join(10) == {"scheduler": 0, "server 0": 0}
    if not replies:
        pytest.skip("the server opened no Unix socket: this needs a platform with AF_UNIX and "
                    "PSKV_TRANSPORT unset, auto or ipc")
    # an ERROR reply, then the connection is closed (the reply may be lost to a reset when
    # the server drops a connection with bytes unread)
    for what in ("garbage", "bad header", "bad dtype", "big before hello"):
        reply = replies[what]
        assert b'"c":42' in reply or reply.endswith(b"<reset>"), (what, reply)
        assert not reply.endswith(b"<open>"), (what, reply)
    # a well-formed request from a peer that never said HELLO: refused, nothing applied
    assert b'"c":42' in replies["unadmitted push"], replies["unadmitted push"]


def test_truncated_message_on_the_same_host_socket_does_not_stall_the_server(
        thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1, request_timeout=12.0)
    took: dict[int, float] = {}
    missing: list[bool] = []
    go = threading.Event()
    holder: list[socket.socket] = []

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            path = kv._po.servers[0].get("uds")
            if path is None:
                missing.append(True)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                holder.append(sock)
                sock.connect(path)
                sock.sendall(uds_frame(b'{"c": 22, "t": 4, "k": [2], '
                                       b'"a": [["float32", [3]]]}', b"\x00" * 4))  # 4 of 12
                time.sleep(0.2)
            go.set()
        else:
            go.wait(20)
        start = time.monotonic()
        kv.push(1, mx.nd.ones((3,)))
        value = kv.pull(1).asnumpy()
        took[kv.rank] = time.monotonic() - start
        return value

    try:
        res = cluster.run(fn)
    finally:
        for sock in holder:
            sock.close()
    if missing:
        pytest.skip("the server opened no Unix socket: this needs a platform with AF_UNIX and "
                    "PSKV_TRANSPORT unset, auto or ipc")
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
    # a stalled server would hold both workers for the whole request timeout (12 s)
    assert max(took.values()) < 6.0, took
