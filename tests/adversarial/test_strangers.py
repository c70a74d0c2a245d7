"""Strangers and garbage: HELLOs without the secret, malformed frames and requests, on
every port of a thread cluster (the scheduler's and a server's ZeroMQ ports, the Unix and
TCP stream sockets), and truncated messages that must not stall a server.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command, encode

from .conftest import (Stranger, admitted_body, assert_unharmed, connect_stream, frame,
                       hello_body, push_and_pull, stream_exchange)


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
        wrong = admitted_body(stranger, b"wrong secret")
        made_up = {**admitted_body(stranger, secret), "nonce": "00" * 16}
        recorded = admitted_body(other, secret)
        admitted_body(stranger, secret)           # stranger's own challenge is another nonce
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
                results["late"] = s.ask(encode(Command.HELLO, 1, body=admitted_body(s, secret)))
                results["late_bad"] = s.ask(encode(Command.HELLO, 1,
                                                   body=admitted_body(s, b"bad")))
            finally:
                s.close()
        kv.barrier()
        return push_and_pull(kv)

    res = cluster.run(fn)
    assert_unharmed(cluster, res, np.full(3, 2.0), 10)
    for what in ("late", "late_bad"):
        assert results[what]["c"] == Command.ERROR, (what, results[what])
    assert "beyond" in results["late"]["b"]["msg"]
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
            replies["no rank"] = s.ask(encode(Command.HELLO, 1, body=hello_body("worker")))
            replies["wrong proof"] = s.ask(encode(Command.HELLO, 1, body=admitted_body(
                s, b"nope", "server", rank=1)))
            replies["scheduler proof"] = s.ask(encode(Command.HELLO, 1, body=admitted_body(
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
        return push_and_pull(kv)

    res = cluster.run(fn)
    assert_unharmed(cluster, res, np.full(3, 2.0), 10)


# ---- the same-host socket (Unix domain) -------------------------------------------------------
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
                replies["garbage"] = stream_exchange(path, b"GET / HTTP/1.0\r\n\r\n")
                replies["bad header"] = stream_exchange(path, frame(b"{not json"))
                replies["bad dtype"] = stream_exchange(path, frame(
                    b'{"c": 21, "t": 4, "k": [2], "a": [["object", [1]]]}', b"\x00" * 8))
                replies["unadmitted push"] = stream_exchange(path, frame(
                    b'{"c": 21, "t": 4, "k": [2], "b": {"kinds": "d"}, '
                    b'"a": [["float32", [3]]]}', b"\x00" * 12), timeout=1.0)
                # a stranger may not make the server hold a big message
                replies["big before hello"] = stream_exchange(path, frame(
                    b'{"c": 21, "t": 4, "k": [2], "b": {"kinds": "d"}, '
                    b'"a": [["float32", [1000000000]]]}'), timeout=2.0)
            go.set()
        else:
            go.wait(20)
        return push_and_pull(kv)

    res = cluster.run(fn)
    assert_unharmed(cluster, res, np.full(3, 2.0), 10)
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
                sock = connect_stream(path)
                holder.append(sock)
                sock.sendall(frame(b'{"c": 22, "t": 4, "k": [2], '
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
