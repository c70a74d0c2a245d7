"""Attacks on durability's new doors: the backups' listeners, the ``shard`` field that
routes a request to a copy, and the restart that takes a dead node's rank.

A worker holds the cluster secret and its own rank's key; neither may let it write into a
backup, read another shard through a server, or take a live node's rank (and with it the
rank's key) by pretending to be its restart.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.auth import prove
from pskv._ps.message import Command, encode, error_from_body
from pskv._ps.stream import StreamConn
from pskv.errors import KVStoreError, ProtocolError

from .conftest import Stranger, admitted_body, assert_unharmed, next_reply



@pytest.mark.timeout(60)
def test_a_worker_cannot_write_into_a_backup(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 2, replicas=1)
    secret = cluster.cfg.secret
    seen: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(3, mx.nd.ones((4,)))
        kv.barrier()
        if kv.rank == 0:
            pk = kv._store[3].pskey
            for srv in range(2):
                conn = StreamConn.connect(kv._po.servers[srv]["r_tcp"], 5.0, "backups")
                try:
                    other = 1 - srv       # claim to be the other server, the primary
                    for label, key in (("secret", secret), ("worker key", kv._po.key)):
                        conn.send(Command.HELLO, 1, body={"role": "server", "rank": other})
                        challenge = next_reply(conn)
                        assert challenge.cmd == Command.CHALLENGE, challenge
                        conn.send(Command.HELLO, 2, body={
                            "role": "server", "rank": other,
                            **prove(key, "backup", challenge.body, "server", other)})
                        seen[f"{srv} {label}"] = next_reply(conn)
                    # a round for the shard, never admitted
                    conn.send(Command.COMMAND, 3, (), {
                        "op": "r_rounds", "shard": other, "arrays": [1], "rounds": [{
                            "key": pk, "round": 1, "kind": "d", "applied": []}]},
                        [np.full(4, 1e6, np.float32)])
                    seen[f"{srv} round"] = next_reply(conn)
                    conn.send(Command.COMMAND, 4, (), {
                        "op": "r_rounds", "shard": other, "arrays": [1], "rounds": [{
                            "key": pk, "round": 1, "kind": "d", "applied": []}]},
                        [np.full(4, 1e6, np.float32)])
                    seen[f"{srv} rounds"] = next_reply(conn)
                    # a ring to map, and rounds said to lie in one
                    conn.send(Command.COMMAND, 5, (), {
                        "op": "r_ring", "shard": other, "bytes": 64})
                    seen[f"{srv} ring"] = next_reply(conn)
                    conn.send(Command.COMMAND, 6, (), {
                        "op": "r_rounds", "shard": other, "arrays": [1], "rounds": [{
                            "key": pk, "round": 1, "kind": "d", "applied": []}],
                        "ring": [[0, 16, "<f4", [4]]]})
                    seen[f"{srv} ring rounds"] = next_reply(conn)
                finally:
                    conn.close()
        kv.barrier()
        kv.push(3, mx.nd.ones((4,)))
        return kv.pull(3).asnumpy()

    res = cluster.run(fn)
    assert len(seen) == 12, seen
    for label, meta in seen.items():
        assert meta.cmd == Command.ERROR, (label, meta)
    assert "refused" in seen["0 secret"].body["msg"], seen["0 secret"].body
    assert "never admitted" in seen["0 round"].body["msg"], seen["0 round"].body
    assert "never admitted" in seen["1 rounds"].body["msg"], seen["1 rounds"].body
    assert "never admitted" in seen["0 ring"].body["msg"], seen["0 ring"].body
    assert "never admitted" in seen["1 ring rounds"].body["msg"], seen["1 ring rounds"].body
    assert_unharmed(cluster, res, np.full(4, 2.0, np.float32))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mapped", [True, False])
def test_rounds_reach_a_same_host_backup_through_its_ring_or_else_the_socket(
        thread_cluster: Any, monkeypatch: pytest.MonkeyPatch, mapped: bool) -> None:
    """Each primary offers its backup (here: same process, Unix sockets) a ring; with it
    mapped the rounds travel there, and a backup that cannot map it (refused) still gets
    every round over the socket; the job goes on
    unharmed either way (that a backup's copy is right after a takeover, ring or not, is
    tests/durability/test_restart.py's: its replicas jobs run on one host)."""
    from pskv._ps import ring
    offered, placed = [], []
    real_open, real_place = ring.RingReader.open, ring.RingWriter.place

    def refuse(*args: Any) -> Any:
        offered.append(args)
        if mapped:
            return real_open(*args)
        os.close(args[0])                   # the descriptor that was passed
        raise ProtocolError("this backup cannot open rings")

    def place(self: Any, arrays: Any) -> Any:
        got = real_place(self, arrays)
        placed.append(got is not None)
        return got
    monkeypatch.setattr(ring.RingReader, "open", refuse)
    monkeypatch.setattr(ring.RingWriter, "place", place)
    cluster = thread_cluster(2, 2, replicas=1)

    def fn(kv: Any) -> Any:
        kv.init(list(range(4)), [mx.nd.zeros((1000,)) for _ in range(4)])
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=-1.0))   # logged rounds: "l"/"f"
        for _ in range(5):
            kv.push(list(range(4)), [mx.nd.ones((1000,)) for _ in range(4)])
            kv.pull(list(range(4)), out=[mx.nd.zeros((1000,)) for _ in range(4)])
        kv.barrier()
        return kv.pull(0).asnumpy()

    res = cluster.run(fn)
    assert len(offered) == 2                 # each primary offered its backup a ring
    assert (mapped and placed and all(placed)) or (not mapped and not placed), placed
    assert_unharmed(cluster, res, np.full(1000, 10.0, np.float32))


#: placements an INIT may carry that describe no part of its key: (label, place)
BAD_PLACES = [
    ("not a list", "0:4"),
    ("two fields", [0, 4]),
    ("start not an int", ["0", 4, [4]]),
    ("shape not a list", [0, 4, "ab"]),
    ("units beyond the key", [0, 4, [2]]),
    ("a key over the size limit", [0, 4, [1 << 40]]),
]


@pytest.mark.timeout(60)
def test_a_replicated_init_with_bad_placements_is_refused_as_a_workers(
        thread_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup checks a replicated INIT's placements with the check a server gives a
    worker's INIT (``bounds.check_init``): a bad one from a primary's link (a bug, or a
    holder of the servers' key) gets the same error, and the copy holds nothing of it."""
    from pskv.kvstore.durable import _backups
    backups: dict[int, Any] = {}
    real_start = _backups.Backups.start

    def start(self: Any, po: Any) -> None:
        backups[po.rank] = self
        real_start(self, po)

    monkeypatch.setattr(_backups.Backups, "start", start)
    cluster = thread_cluster(2, 2, replicas=1, bigarray_bound=4)
    fake = 1 << 20                  # an ikey no worker uses
    seen: dict[tuple[int, str], Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(3, mx.nd.ones((8,)))        # split: each server serves a part, backs the other
        kv.barrier()
        if kv.rank == 0:
            for srv in range(2):
                po, other = backups[srv]._po, 1 - srv       # pretend to be the primary
                conn = StreamConn.connect(kv._po.servers[srv]["r_tcp"], 5.0, "backups")
                try:
                    conn.send(Command.HELLO, 1, body={"role": "server", "rank": other})
                    challenge = next_reply(conn)
                    conn.send(Command.HELLO, 2, body={
                        "role": "server", "rank": other,
                        **prove(po.server_key, _backups.PURPOSE, challenge.body, "server",
                                other)})
                    assert next_reply(conn).cmd == Command.ACK
                    for ts, (label, place) in enumerate(BAD_PLACES, 3):
                        entry = {"key": "w", "shape": [4], "place": place}
                        conn.send(Command.COMMAND, ts, (), {
                            "op": "r_init", "shard": other, "keys": [fake],
                            "entries": [entry]}, [np.ones(4, np.float32)])
                        got = next_reply(conn)
                        wts = kv._kv.request(srv, Command.INIT, [fake], {"entries": [entry]},
                                             [np.ones(4, np.float32)])
                        try:
                            kv._kv.wait(wts)
                            worker_err = None
                        except KVStoreError as err:
                            worker_err = err
                        seen[srv, label] = (got, worker_err)
                finally:
                    conn.close()
                with backups[srv].lock:
                    seen[srv, "held"] = fake in backups[srv].engines[other]
        kv.barrier()
        kv.push(3, mx.nd.ones((8,)))
        return kv.pull(3).asnumpy()

    res = cluster.run(fn)
    assert len(seen) == 2 * (len(BAD_PLACES) + 1), seen
    for srv in range(2):
        assert seen[srv, "held"] is False, srv
        for label, _ in BAD_PLACES:
            got, worker_err = seen[srv, label]
            assert got.cmd == Command.ERROR, (srv, label, got)
            assert worker_err is not None, (srv, label)
            backup_err = error_from_body(got.body, f"server {srv}")
            assert type(backup_err) is type(worker_err), (srv, label, backup_err, worker_err)
            assert str(backup_err) == str(worker_err), (srv, label)
    assert type(seen[0, "a key over the size limit"][1]).__name__ == "LimitError"
    assert_unharmed(cluster, res, np.full(8, 2.0, np.float32))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replicas", [0, 1])
def test_a_worker_cannot_route_requests_to_copies_or_send_replication_ops(
        replicas: int, thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 2, replicas=replicas)
    errors: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(5, mx.nd.zeros((6,)))
        kv.barrier()
        if kv.rank == 0:
            w = kv._kv
            pk = kv._store[5].pskey
            attempts = {
                "replication op": (Command.COMMAND, (), {
                    "op": "r_noop", "shard": 0}, []),
                "copy taken": (Command.COMMAND, (), {"op": "r_state", "shard": 1,
                                                     "entries": []}, []),
                "batch of rounds": (Command.COMMAND, (), {
                    "op": "r_rounds", "shard": 0, "arrays": [1], "rounds": [{
                        "key": pk, "round": 7, "kind": "d", "applied": []}]},
                    [np.full(6, 9.0, np.float32)]),
                "shard not an int": (Command.PULL, [pk], {"shard": "1"}, []),
                "shard out of range": (Command.PULL, [pk], {"shard": 9}, []),
                "another server's shard": (Command.PULL, [pk], {"shard": 1}, []),
                "again not a bool": (Command.PULL, [pk], {"again": "yes"}, []),
            }
            for label, (cmd, keys, body, arrays) in attempts.items():
                ts = w.request(0, cmd, keys, body, arrays)
                try:
                    w.wait(ts)
                    errors[label] = None
                except KVStoreError as err:
                    errors[label] = err
        kv.barrier()
        kv.push(5, mx.nd.ones((6,)))
        return kv.pull(5).asnumpy()

    res = cluster.run(fn)
    assert set(errors) == {"replication op", "copy taken", "batch of rounds",
                           "shard not an int", "shard out of range", "another server's shard",
                           "again not a bool"}
    for label, err in errors.items():
        assert isinstance(err, ProtocolError), (label, err)
    assert "unknown command" in str(errors["replication op"])
    assert "unknown command" in str(errors["batch of rounds"])
    # with replicas server 0 holds a copy of shard 1 (its backup), but server 1 lives:
    # refused (after waiting a moment for a death report), never taken over
    assert ("not known dead" if replicas else "holds no shard") in \
        str(errors["another server's shard"])
    assert "'shard'" in str(errors["shard not an int"])
    assert_unharmed(cluster, res, np.full(6, 2.0, np.float32))


@pytest.mark.timeout(60)
def test_a_live_rank_is_not_handed_to_a_pretended_restart(thread_cluster: Any) -> None:
    """With --max-restarts the scheduler gives a restarted node its dead predecessor's
    rank and that rank's key; a secret holder claiming a live rank gets neither."""
    cluster = thread_cluster(2, 1, max_restarts=1, handshake_timeout=2.0)
    secret = cluster.cfg.secret
    got: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(2, mx.nd.zeros((3,)))
        kv.barrier()
        if kv.rank == 0:
            s = Stranger(cluster.cfg.root_address)
            try:
                body = admitted_body(s, secret, "scheduler", rank=1)   # "worker 1, restarted"
                got["reply"] = s.ask(encode(Command.HELLO, 1, body=body), timeout=10.0)
            finally:
                s.close()
        kv.barrier()
        kv.push(2, mx.nd.ones((3,)))
        return kv.pull(2).asnumpy()

    res = cluster.run(fn)
    reply = got["reply"]
    assert reply is not None and reply["c"] == Command.ERROR, reply
    assert "is alive" in reply["b"]["msg"], reply
    assert "key" not in reply["b"], reply
    assert_unharmed(cluster, res, np.full(3, 2.0, np.float32))


@pytest.mark.timeout(60)
def test_a_briefly_silent_server_keeps_its_rank(thread_cluster: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A live server that sends no heartbeat for 2 s (a GC pause, swap: well under
    PSKV_HEARTBEAT_TIMEOUT, 3 s here, and its connections intact) is not dead: a secret
    holder claiming its rank as its "restart" is refused, and gets no key."""
    import threading

    from pskv._ps import postoffice
    cluster = thread_cluster(2, 1, max_restarts=1, handshake_timeout=2.0)
    secret = cluster.cfg.secret
    mute = threading.Event()
    real = postoffice.send_message

    def muted(sock: Any, cmd: Command, *args: Any, **kw: Any) -> Any:
        if mute.is_set() and cmd == Command.HEARTBEAT and \
                threading.current_thread().name == "pskv-server-control":
            return None
        return real(sock, cmd, *args, **kw)

    monkeypatch.setattr(postoffice, "send_message", muted)
    got: dict[str, Any] = {}

    def fn(kv: Any) -> Any:
        kv.init(2, mx.nd.zeros((3,)))
        kv.barrier()
        if kv.rank == 0:
            s = Stranger(cluster.cfg.root_address)
            try:
                mute.set()                          # server 0 pauses ...
                time.sleep(1.5)
                body = admitted_body(s, secret, "scheduler", role="server", rank=0)
                s.sock.send_multipart(encode(Command.HELLO, 1, body=body))
                time.sleep(0.5)
                mute.clear()                        # ... and goes on, 2 s later
                got["reply"] = json.loads(s.sock.recv_multipart()[0]) \
                    if s.sock.poll(10_000) else None
            finally:
                s.close()
        kv.barrier()
        kv.push(2, mx.nd.ones((3,)))
        return kv.pull(2).asnumpy()

    res = cluster.run(fn)
    reply = got["reply"]
    assert reply is not None and reply["c"] == Command.ERROR, reply
    assert "is alive" in reply["b"]["msg"], reply
    assert "worker_keys" not in reply["b"] and "sealed" not in reply["b"], reply
    assert_unharmed(cluster, res, np.full(3, 2.0, np.float32))
