"""RedisSink (pskv.sinks, K1-K6) against a real redis-server this test starts on a free
127.0.0.1 port: the rows in Redis, read back, equal the table bit for bit; AUTH, SELECT,
resume, per-shard resets, and the client's errors. Skips without a redis-server binary."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ClusterError, ConfigError, ProtocolError
from pskv.kvstore._subscription import Subscription
from pskv.launch._net import free_port
from pskv.sinks import RedisSink, load_redis, run_sink
from pskv.sinks._resp import RespClient, parse_url
from pskv.table import TTL, Capacity, DynamicTable, TableSpec, Uniform
from pskv.table._stream import read_changes

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="no redis-server binary: install it "
                                 "(apt-get install redis-server) to run the Redis sink tests")


@contextmanager
def redis_server(tmp_path, password: str | None = None) -> Iterator[str]:
    """A redis-server of this test's own (no persistence), its URL; killed by pid."""
    port = free_port()
    argv = [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(tmp_path)]
    if password is not None:
        argv += ["--requirepass", password]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        auth = f":{password}@" if password is not None else ""
        yield f"redis://{auth}127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _spec(dtype="float32", **kw):
    base = dict(dim=4, init=Uniform(-0.1, 0.1), seed=5, dtype=dtype,
                eviction=(Capacity(max_rows=60, policy="lfu"), TTL(steps=6)))
    base.update(kw)
    return TableSpec(**base)


def _same(url: str, key, tables: list[DynamicTable], raw: bool, prefix="pskv") -> None:
    """Redis, read back, equals the shards' rows bit for bit, at their versions."""
    mirror = load_redis(url, key, prefix)
    want_ids, want_rows = [], []
    for t in tables:
        ids = t.ids()
        rows = t._values[t._index.find(ids)] if raw else \
            t.lookup(ids, train=False)[0].astype(np.float32)
        want_ids.append(ids)
        want_rows.append(np.ascontiguousarray(rows))
    ids, order = np.concatenate(want_ids), None
    order = np.argsort(ids, kind="stable")
    got_ids, got_rows = mirror.table()
    assert np.array_equal(got_ids, ids[order])
    assert got_rows.tobytes() == np.concatenate(want_rows)[order].tobytes()
    assert mirror.since() == {s: (t.lineage, t.version) for s, t in enumerate(tables)}
    # no row key is left over outside the ID sets (a GET by ID would find it: K5)
    client = RespClient(url)
    try:
        keys = client.call("KEYS", f"{prefix}:{key}:row:*")
        assert sorted(int(k.rsplit(b":", 1)[1]) for k in keys) == got_ids.tolist()
    finally:
        client.close()


class Shards:
    """Several shards (one DynamicTable each) behind the Subscription every store gives."""

    def __init__(self, n: int, spec: TableSpec, key="emb") -> None:
        self.key, self.spec = key, spec
        self.tables = [DynamicTable(spec, name=key) for _ in range(n)]

    def subscribe(self, key, since=None, *, raw=False):
        def fetch(s, since_v, lineage, cursor, upto):
            return read_changes(self.tables[s], since_v, lineage, cursor=cursor, upto=upto,
                                max_rows=9, raw=raw, key=key, shard=(s, len(self.tables)))
        return Subscription(key, fetch, len(self.tables), since)


@needs_redis
@pytest.mark.parametrize("dtype,raw", [("float32", False), ("bfloat16", True)])
def test_redis_holds_the_table_bit_for_bit(tmp_path, dtype, raw):
    rng = np.random.default_rng(0)
    kv = mx.kv.create("local")
    kv.init("emb", _spec(dtype))
    kv.set_optimizer(mx.optimizer.AdaGrad(learning_rate=0.1))
    table = kv._tables.get("emb", "test")
    with redis_server(tmp_path) as url, RedisSink(url, "emb", raw=raw) as sink:
        sub = kv.subscribe("emb", since=sink.position(), raw=raw, max_rows=16)
        for _ in range(15):
            for _ in range(int(rng.integers(0, 5))):
                ids = rng.integers(0, 200, 30)
                kv.lookup("emb", ids)
                kv.push("emb", (ids, rng.standard_normal((30, 4)).astype(np.float32)))
            sink.write(sub.poll())
            _same(url, "emb", [table], raw)
        assert table.stats()["evictions"] > 0
        # any client reads a row: GET P:T:row:ID is its little-endian bytes (K1, K3)
        client = RespClient(url)
        try:
            one = int(table.ids()[0])
            width = np.dtype("<u2" if raw else "<f4")
            got = np.frombuffer(client.call("GET", f"pskv:emb:row:{one}"), width)
            want = table._values[table._index.find(np.array([one]))][0] if raw else \
                table.lookup(np.array([one]), train=False)[0][0]
            assert got.tobytes() == np.asarray(want, width).tobytes()
            meta = client.call("HGETALL", "pskv:emb:meta")
            meta = {meta[i].decode(): meta[i + 1].decode() for i in range(0, len(meta), 2)}
            assert meta["dtype"] == ("bfloat16" if raw else "float32")
            assert meta["dim"] == "4" and meta["num_shards"] == "1"
            assert meta["version:0"] == str(table.version)
            assert json.loads(meta["position"]) == sub.position
            # K2: the ID set holds exactly the rows there are, no removed row stays behind
            members = sorted(int(i) for i in client.call("SMEMBERS", "pskv:emb:ids:0"))
            assert members == table.ids().tolist()
            assert client.call("DBSIZE") == len(members) + 2
        finally:
            client.close()


@needs_redis
def test_each_shard_resets_alone_and_a_new_sink_resumes(tmp_path):
    rng = np.random.default_rng(1)
    src = Shards(3, _spec(eviction=(Capacity(max_rows=20, policy="lru"),)))

    def step():
        for s, t in enumerate(src.tables):
            ids = rng.integers(0, 100, 10) * 3 + s
            t.lookup(ids)
            t.push(ids, rng.standard_normal((10, 4)).astype(np.float32))
            t.sweep(40)

    with redis_server(tmp_path) as url:
        with RedisSink(url, "emb", prefix="serve") as sink:
            step()
            early = src.tables[1].state()        # shard 1 goes back to it below
            assert run_sink(src, "emb", sink, polls=1) == sink.position()
            assert sink.write(src.subscribe("emb", since=sink.position()).poll()) == 0
            _same(url, "emb", src.tables, raw=False, prefix="serve")
        step()
        with RedisSink(url, "emb", prefix="serve") as sink:       # a restart: resumes
            sub = src.subscribe("emb", since=sink.position())
            batches = sub.poll()
            assert not any(b.reset for b in batches)
            sink.write(batches)
            _same(url, "emb", src.tables, raw=False, prefix="serve")
            step()
            # shard 1 reloaded from its early state: a new lineage, and the rows born
            # since are gone from it (K5: a reset deletes them from Redis too)
            src.tables[1] = DynamicTable.from_state(src.spec, *early, name="emb")
            gone = set(load_redis(url, "emb", "serve").ids().tolist()) \
                - set(src.tables[1].ids().tolist())
            assert {i for i in gone if i % 3 == 1}
            step()              # (a restored table's first operation commits its load)
            batches = sub.poll()
            assert {b.shard for b in batches if b.reset} == {1}
            sink.write(batches)
            _same(url, "emb", src.tables, raw=False, prefix="serve")
        with pytest.raises(ConfigError, match="raw=True"):
            RedisSink(url, "emb", prefix="serve", raw=True)
        with pytest.raises(ConfigError, match="no sink wrote table 'other'"):
            load_redis(url, "other", "serve")


@needs_redis
def test_auth_and_select(tmp_path):
    with redis_server(tmp_path, password="s3cret") as url:
        kv = mx.kv.create("local")
        kv.init(5, _spec())
        kv.lookup(5, np.arange(7))
        db3 = url.replace("/0", "/3")
        with RedisSink(db3, 5) as sink:
            run_sink(kv, 5, sink, polls=1)
        _same(db3, 5, [kv._tables.get(5, "test")], raw=False)
        client = RespClient(url)
        try:
            assert client.call("DBSIZE") == 0                     # db 0 untouched
            client.call("SELECT", 3)
            assert client.call("DBSIZE") == 7 + 2
        finally:
            client.close()
        bad = url.replace("s3cret", "wrong")
        with pytest.raises(ClusterError, match="refused the password"):
            RedisSink(bad, 5)
        assert "wrong" not in repr(parse_url(bad)) and "wrong" not in str(parse_url(bad))
        with pytest.raises(ClusterError, match="NOAUTH"):
            RedisSink(url.replace(":s3cret@", ""), 5)


def test_the_client_names_what_went_wrong(tmp_path):
    """No server; a server that speaks no RESP; one that goes silent: each a clear error,
    each wait bounded."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]                 # closed again: nothing listens
    with pytest.raises(ClusterError, match="cannot connect.*Is redis-server running"):
        RespClient(f"redis://127.0.0.1:{port}/0", timeout=2)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    replies = [b"?what\r\n", b"$5\r\nabcdeXX", b""]
    conns = []

    def serve():
        for reply in replies:
            conn, _ = listener.accept()
            conns.append(conn)
            conn.recv(1024)
            if reply:
                conn.sendall(reply)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    try:
        c = RespClient(url, timeout=2)
        with pytest.raises(ProtocolError, match="unknown type"):
            c.call("PING")
        c.close()
        c = RespClient(url, timeout=2)
        with pytest.raises(ProtocolError, match="CRLF"):
            c.call("GET", "x")
        c.close()
        c = RespClient(url, timeout=0.5)
        with pytest.raises(ClusterError, match="did not answer within 0.5 s"):
            c.call("PING")
        c.close()
    finally:
        t.join(timeout=10)
        for conn in conns:
            conn.close()
        listener.close()
    with pytest.raises(ConfigError, match="not a redis:// URL"):
        parse_url("http://127.0.0.1:6379")
