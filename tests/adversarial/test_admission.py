"""Admission: a HELLO recorded in one job proves nothing in another, and a node holding
the cluster secret still cannot speak to a server as another worker's rank.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.auth import prove
from pskv._ps.message import Command, encode

from .conftest import (Stranger, admitted_body, assert_unharmed, hello_body, next_reply,
                       push_and_pull)


@pytest.mark.timeout(60)
def test_hello_recorded_in_one_job_fails_in_another(thread_cluster: Any) -> None:
    secret = b"one-secret-for-two-jobs"
    job_a = thread_cluster(1, 1, secret=secret)
    job_b = thread_cluster(1, 1, secret=secret)
    a, b = Stranger(job_a.cfg.root_address), Stranger(job_b.cfg.root_address)
    try:
        recorded = admitted_body(a, secret, "scheduler")       # a good HELLO for job A
        challenge = b.ask(encode(Command.HELLO, 1, body=hello_body()))
        assert challenge is not None and challenge["c"] == Command.CHALLENGE
        replayed = b.ask(encode(Command.HELLO, 1, body=recorded))
        # and a proof for B's nonce made under A's job id
        forged = b.ask(encode(Command.HELLO, 1, body=hello_body(**prove(
            secret, "scheduler", {"nonce": challenge["b"]["nonce"], "job": "job-a"},
            "worker", None))))
    finally:
        a.close()
        b.close()
    for reply in (replayed, forged):
        assert reply is not None and reply["c"] == Command.ERROR, reply
        assert "refused" in reply["b"]["msg"], reply
    for cluster in (job_a, job_b):
        res = cluster.run(lambda kv: (kv.init(1, mx.nd.zeros((2,))),
                                      kv.pull(1).asnumpy())[1])
        np.testing.assert_array_equal(res[0], np.zeros(2))
        assert all(c == 0 for c in cluster.join(15).values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["auto", "zmq"])
def test_secret_holder_cannot_claim_another_workers_rank(transport: str,
                                                         thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1, transport=transport)
    secret = cluster.cfg.secret
    replies: dict[str, Any] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            server = kv._po.servers[0]
            if transport == "zmq":
                s = Stranger(server["zmq"])
                try:
                    for purpose in ("server", "scheduler"):
                        replies[purpose] = s.ask(encode(Command.HELLO, 1, body=admitted_body(
                            s, secret, purpose, rank=1)))
                    # worker 0's own key, claiming rank 1
                    replies["own key"] = s.ask(encode(Command.HELLO, 1, body=admitted_body(
                        s, kv._po.key, "server", rank=1)))
                    # then a push as "worker 1": never admitted, refused
                    replies["push"] = s.ask(encode(Command.PUSH, -5, [kv._store[1].pskey],
                                                   {"kinds": "d"}, [np.ones(3, np.float32)]))
                finally:
                    s.close()
            else:
                from pskv._ps.stream import StreamConn
                conn = StreamConn.connect(server["tcp"], 5.0, "server 0")
                try:
                    for purpose, key in (("server", secret), ("own key", kv._po.key)):
                        conn.send(Command.HELLO, 1, body=hello_body(rank=1))
                        meta = next_reply(conn)
                        body = hello_body(rank=1, **prove(key, "server", meta.body, "worker",
                                                          1))
                        conn.send(Command.HELLO, 2, body=body)
                        replies[purpose] = {"c": int(next_reply(conn).cmd)}
                finally:
                    conn.close()
            go.set()
        else:
            go.wait(20)
        return push_and_pull(kv)

    res = cluster.run(fn)
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    for what, reply in replies.items():
        assert reply is not None and reply["c"] == Command.ERROR, (what, reply)

