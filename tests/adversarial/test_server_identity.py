"""Workers authenticate the servers they (re)connect to, and key material never crosses the
scheduler link in clear.

A process at a server's address (a claimant that got a server's rank, a stale incarnation,
a worker, anything that answers there) must prove, over the worker's own nonce, the pair
key the scheduler gave only that worker and the server it admitted for that rank now. A
worker holds only its own row of pair keys, a server only its column, and a server's
column changes with each restart (a stale incarnation's keys are void).
"""
from __future__ import annotations

import select
import threading
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.auth import new_key, server_proof
from pskv._ps.config import Role
from pskv._ps.message import Command
from pskv._ps.stream import StreamListener
from pskv.errors import ProtocolError

from .conftest import assert_unharmed


class FakeServer:
    """Answers a worker's HELLO at a server's address like a server would, proving its rank
    with ``key`` (None: no proof at all)."""

    def __init__(self, job: str, rank: int, key: bytes | None) -> None:
        self.listener = StreamListener(host="127.0.0.1")
        self.endpoint = self.listener.endpoint
        self.job, self.rank, self.key = job, rank, key
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conns: list[Any] = []
        nonce = new_key()
        while not self.stop.is_set():
            select.select([self.listener.sock] + [c.sock for c in conns], [], [], 0.05)
            conns += self.listener.accept(5.0)
            for conn in conns:
                try:
                    got = conn.receive(None, 4)
                except Exception:  # noqa: BLE001 - the worker went away
                    continue
                for meta, _ in got:
                    if meta.cmd != Command.HELLO:
                        continue
                    if "proof" not in meta.body:
                        conn.send(Command.CHALLENGE, meta.ts, body={"nonce": nonce,
                                                                     "job": self.job})
                        continue
                    body: dict[str, Any] = {"applied": []}
                    if self.key is not None:
                        body["proof"] = server_proof(self.key, self.job, self.rank,
                                                     meta.body["rank"], nonce,
                                                     meta.body["wnonce"])
                    conn.send(Command.ACK, meta.ts, body=body)
        for conn in conns:
            conn.close()
        self.listener.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def _reconnect(w: Any, server: int, endpoint: str) -> None:
    """Point worker ``w``'s link to ``server`` at ``endpoint`` and say HELLO again (what a
    worker does when the scheduler says the server moved)."""
    w.drop(server)
    w._conns[server] = w._connect(server, {"tcp": endpoint})
    w.hello(server)


@pytest.mark.timeout(60)
def test_a_worker_refuses_a_node_that_is_not_the_admitted_server(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 2, transport="tcp")
    keys: dict[int, Any] = {}
    refused: dict[str, Any] = {}
    ready = threading.Barrier(2)

    def fn(kv: Any) -> Any:
        kv.init(4, mx.nd.zeros((8,)))
        po = kv._po
        keys[kv.rank] = (po.key_for(0), po.key_for(1))
        ready.wait(20)
        if kv.rank == 0:
            w, real = kv._kv, po.servers[0]["tcp"]
            holders = {
                "another worker's key": keys[1][0],      # worker 1's pair key with server 0
                "another server's key": keys[0][1],      # what server 1 holds for worker 0
                "no proof": None,
                "the cluster secret": cluster.cfg.secret,
            }
            for label, key in holders.items():
                fake = FakeServer(po.job, 0, key)
                try:
                    _reconnect(w, 0, fake.endpoint)
                    refused[label] = None
                except ProtocolError as err:
                    refused[label] = err
                finally:
                    fake.close()
            _reconnect(w, 0, real)           # the admitted server proves itself: accepted
        ready.wait(20)
        kv.push(4, mx.nd.ones((8,)))
        return kv.pull(4).asnumpy()

    res = cluster.run(fn)
    assert set(refused) == {"another worker's key", "another server's key", "no proof",
                            "the cluster secret"}, refused
    for label, err in refused.items():
        assert isinstance(err, ProtocolError), (label, err)
        assert "did not prove that it is server 0" in str(err), (label, err)
    assert_unharmed(cluster, res, np.full(8, 2.0, np.float32))


@pytest.mark.timeout(30)
def test_a_restarted_servers_pair_keys_are_new() -> None:
    """A stale incarnation of a server holds keys the scheduler replaced when the rank was
    taken over: the keys a worker gets in NODE_REJOINED differ from the old ones."""
    from pskv._ps.config import ClusterConfig
    from pskv._ps.scheduler import Scheduler
    from pskv.launch._net import free_port
    cfg = ClusterConfig(role=Role.SCHEDULER, root_port=free_port(), num_servers=2,
                        num_workers=1, secret=b"s")
    sched = Scheduler(cfg)
    try:
        before = [sched._pair(0, s) for s in range(2)]
        sched._epochs[1] += 1               # what _rejoin does for a restarted server 1
        after = [sched._pair(0, s) for s in range(2)]
    finally:
        sched.loop.close()
        sched._zctx.close()
    assert before[0] == after[0] and before[1] != after[1]
