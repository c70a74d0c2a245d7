"""Malformed messages: no message kills a node; each gets an ERROR reply or a log line.

Deeply nested headers, wrong types in every field a node reads, to the scheduler and to a
server, before and after admission. After each attack the cluster still runs a sync round.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.message import Command, encode

from .conftest import Stranger, admitted_body, frame, hello_body, stream_exchange

#: a header nested 100,000 levels deep (about 200 KB): Python's JSON parser raises
#: RecursionError on it
DEEP = b'{"c": 1, "t": 1, "b": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SMALL_DEEP = b'{"c": 1, "t": 1, "b": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"


def _round(kv: Any) -> Any:
    kv.push(1, mx.nd.ones((3,)))
    return kv.pull(1).asnumpy()


def _check(res: dict[int, Any], cluster: Any, value: float = 2.0) -> None:
    for rank in (0, 1):
        assert not isinstance(res[rank], BaseException), res[rank]
        np.testing.assert_array_equal(res[rank], np.full(3, value))
    codes = cluster.join(15)
    assert all(c == 0 for c in codes.values()), codes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", [b"adversarial-secret", None])
def test_deep_and_mistyped_headers_to_the_scheduler(secret: bytes | None,
                                                    thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1, secret=secret)
    stranger = Stranger(cluster.cfg.root_address)
    replies: dict[str, Any] = {}
    try:
        replies["deep"] = stranger.ask([DEEP])          # over 64 KiB: refused unread
        replies["small deep"] = stranger.ask([SMALL_DEEP])
        for name, body in [("null body", None), ("rank x", hello_body(rank="x")),
                           ("rank inf", None), ("role 7", {"role": 7}),
                           ("endpoints list", hello_body("server", endpoints=[1])),
                           ("huge rank", hello_body(rank=10 ** 30))]:
            raw = encode(Command.HELLO, 3, body=body)
            if name == "rank inf":
                raw = [b'{"c": 1, "t": 3, "b": {"role": "worker", "rank": Infinity}}']
            replies[name] = stranger.ask(raw)
        replies["nan ts"] = stranger.ask([b'{"c": 5, "t": NaN}'])
        replies["float ts"] = stranger.ask([b'{"c": 5, "t": 1e400}'])
    finally:
        stranger.close()
    for what, reply in replies.items():
        assert reply is not None and reply["c"] == Command.ERROR, (what, reply)
    res = cluster.run(lambda kv: (kv.init(1, mx.nd.zeros((3,))), _round(kv))[1])
    _check(res, cluster)


@pytest.mark.timeout(60)
def test_admitted_nodes_send_malformed_control_messages(thread_cluster: Any) -> None:
    # a node holding the secret sends nonsense after admission: the scheduler goes on
    cluster = thread_cluster(2, 1)
    hits: list[Any] = []

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            po = kv._po
            for body in (None, {"group": None}, {"group": ["worker"]}, {"group": "nobody"},
                         {"role": "worker", "rank": "x"}, {"role": 1, "rank": 0},
                         {"role": "worker", "rank": 0, "endpoints": "x"},
                         {"role": "worker", "rank": 0, "endpoints": {"uds": 7}}):
                for cmd in (Command.BARRIER, Command.PEER_LOST):
                    po._post(cmd, body)
            for cmd in (Command.ADMIT, Command.ACK, Command.SHUTDOWN):
                po._post(cmd, None)
            hits.append(True)
        kv.barrier()
        return _round(kv)

    res = cluster.run(fn)
    assert hits
    _check(res, cluster)


@pytest.mark.timeout(60)
def test_malformed_requests_to_a_server_before_and_after_admission(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1)
    before: dict[str, bytes] = {}
    after: list[BaseException] = []
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            ep = kv._po.servers[0]["tcp"]
            before["deep"] = stream_exchange(ep, frame(DEEP))
            before["small deep"] = stream_exchange(ep, frame(SMALL_DEEP))
            before["null hello"] = stream_exchange(ep, frame(b'{"c": 1, "t": 1, "b": null}'))
            before["rank x"] = stream_exchange(ep, frame(
                b'{"c": 1, "t": 1, "b": {"role": "worker", "rank": "x"}}'))
            before["rank inf"] = stream_exchange(ep, frame(
                b'{"c": 1, "t": 1, "b": {"role": "worker", "rank": Infinity}}'))
            before["rank 99"] = stream_exchange(ep, frame(
                b'{"c": 1, "t": 1, "b": {"role": "worker", "rank": 99}}'))
            # after admission, as worker 0: every request type with wrong field types
            bad = [(Command.INIT, [8], {"entries": [{"key": [1], "shape": [3]}]},
                    [np.ones(3, np.float32)]),
                   (Command.INIT, [8], {"entries": [{"key": 4, "shape": "3"}]},
                    [np.ones(3, np.float32)]),
                   (Command.INIT, [8], {"entries": None}, [np.ones(3, np.float32)]),
                   (Command.PUSH, [2], {"kinds": 5}, [np.ones(3, np.float32)]),
                   (Command.PUSH, [2, 2], {"kinds": "dd"}, [np.ones(3, np.float32)] * 2),
                   (Command.PULL, [2], None, [np.ones(3, np.float32)]),
                   (Command.RSP_PULL, [2], None, [np.ones((1, 1), np.float32)]),
                   (Command.COMMAND, [], {"op": "optimizer", "spec": "sgd"}, []),
                   (Command.COMMAND, [], {"op": "optimizer", "spec": {"name": "sgd",
                                          "kwargs": {"learning_rate": "abc"}}}, []),
                   (Command.COMMAND, [], {"op": "compression", "params": [1]}, []),
                   (Command.COMMAND, [], {"op": "save", "dump": "yes"}, []),
                   (Command.COMMAND, [], {"op": "load"}, [np.ones(2, np.float32)]),
                   (Command.COMMAND, [], {"op": "mode", "sync": False}, []),
                   (Command.COMMAND, [], None, []),
                   (Command.HELLO, [], {"role": "worker", "rank": 0}, []),
                   (Command.ADMIT, [], None, []),
                   (Command.DATA, [], None, [])]
            for cmd, keys, body, arrays in bad:
                ts = kv._kv.request(0, cmd, keys, body, arrays)
                try:
                    kv._kv.wait(ts, timeout=5)
                except mx.KVStoreError as err:
                    after.append(err)
                else:
                    after.append(AssertionError(f"{cmd.name} {body} was accepted"))
            go.set()
        else:
            go.wait(20)
        kv.barrier()
        return _round(kv)

    res = cluster.run(fn)
    for what, reply in before.items():
        assert b'"c":42' in reply or reply.endswith(b"<reset>"), (what, reply)
    assert all(isinstance(e, mx.KVStoreError) for e in after), after
    assert all("(reported by server 0)" in str(e) for e in after), after
    # the `mode` command is gone: a worker cannot flip a server's mode
    assert "'mode'" in str(after[12]) or "op" in str(after[12]), after[12]
    _check(res, cluster)


@pytest.mark.timeout(60)
def test_malformed_hello_to_a_server_of_a_cluster_without_secret(thread_cluster: Any) -> None:
    # a cluster without a secret: a HELLO with a null body or a bad rank must not crash
    cluster = thread_cluster(2, 1, secret=None, transport="zmq")
    replies: dict[str, Any] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            s = Stranger(kv._po.servers[0]["zmq"])
            try:
                replies["null"] = s.ask(encode(Command.HELLO, 1, body=None))
                replies["rank x"] = s.ask(encode(Command.HELLO, 1, body=hello_body(rank="x")))
                replies["no rank"] = s.ask(encode(Command.HELLO, 1, body=hello_body()))
                # the rank without its key from the scheduler: a challenge it cannot answer
                replies["rank 1"] = s.ask(encode(Command.HELLO, 1, body=admitted_body(
                    s, b"guess", "server", rank=1)))
                replies["deep"] = s.ask([SMALL_DEEP])
            finally:
                s.close()
            go.set()
        else:
            go.wait(20)
        return _round(kv)

    res = cluster.run(fn)
    for what, reply in replies.items():
        assert reply is not None and reply["c"] == Command.ERROR, (what, reply)
    _check(res, cluster)


def test_header_parser_bounds() -> None:
    from pskv._ps.message import MAX_DEPTH, loads
    from pskv.errors import ProtocolError
    assert loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    for raw in (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), DEEP, b"NaN", b"[Infinity]",
                b'{"a": -Infinity}', b"\xff"):
        with pytest.raises(ProtocolError):
            loads(raw)
    assert json.loads(b"[1e400]")[0] == float("inf")   # JSON floats overflow: ts checks int
