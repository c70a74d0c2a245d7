"""A replica over the wire (pskv.serving V5): proofs, strangers and garbage."""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError, ProtocolError, StaleReadError
from pskv.serving import Replica, ReplicaClient
from pskv.table import Constant, TableSpec

pytestmark = pytest.mark.dist


@pytest.fixture
def served():
    kv = mx.kv.create("local")
    kv.init("emb", TableSpec(dim=3, init=Constant(0.25)))
    kv.lookup("emb", np.arange(100))
    rep = Replica(kv, ["emb"], interval=0.01)
    addr = rep.serve("127.0.0.1", 0, secret="s3cret")
    yield kv, rep, addr
    rep.close()


def test_a_client_with_the_secret_reads_rows_at_a_version(served):
    kv, _rep, addr = served
    with ReplicaClient(addr, secret="s3cret") as c:
        rows, found, at = c.lookup("emb", np.array([5, 1000]), min_version=1)
        assert rows.tolist() == [[0.25] * 3, [0.0] * 3] and found.tolist() == [True, False]
        assert at == {0: 1} and c.versions("emb") == {0: 1}
        with pytest.raises(StaleReadError, match="not yet 99"):
            c.lookup("emb", np.array([5]), min_version=99, timeout=0.1)
        rows, _f, _a = c.lookup("emb", np.array([5]))      # the link goes on after it
        assert rows.shape == (1, 3)


@pytest.mark.parametrize("secret", [None, "wrong"])
def test_no_or_a_wrong_secret_reads_nothing(served, secret, monkeypatch):
    _kv, _rep, addr = served
    monkeypatch.delenv("PSKV_SECRET", raising=False)
    with pytest.raises((ProtocolError, ConfigError), match="secret"):
        ReplicaClient(addr, secret=secret).lookup("emb", np.array([1]))


@pytest.mark.parametrize("junk", [b"\xff\xff\xff\xff", b"\x00\x00\x00\x05nope!",
                                  struct.pack(">I", 8) + b'{"x": 1}', b""])
def test_garbage_and_strangers_do_not_stop_the_replica(served, junk):
    _kv, _rep, addr = served
    with socket.create_connection(addr, timeout=5) as s:
        s.recv(4096)                      # the hello
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)
        try:
            s.recv(4096)
        except OSError:
            pass
    with ReplicaClient(addr, secret="s3cret") as c:   # still serving
        assert c.lookup("emb", np.array([3]))[1].all()


def test_an_admitted_client_that_sends_garbage_loses_its_link_only(served):
    _kv, _rep, addr = served
    bad = ReplicaClient(addr, secret="s3cret")
    bad._sock.sendall(struct.pack(">I", 1 << 30))     # a header over the limit
    with pytest.raises((ProtocolError, OSError)):
        bad.lookup("emb", np.array([1]))
    bad.close()
    with ReplicaClient(addr, secret="s3cret") as c:
        assert c.lookup("emb", np.array([3]))[1].all()


def test_clients_at_once(served):
    _kv, _rep, addr = served
    out = []

    def one() -> None:
        with ReplicaClient(addr, secret="s3cret") as c:
            for _ in range(20):
                out.append(bool(c.lookup("emb", np.arange(50))[1].all()))
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [True] * 160
