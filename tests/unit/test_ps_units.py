"""The parameter-server pieces that need no sockets: wire codec, partition, config, auth."""
from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest

from pskv._ps import auth
from pskv._ps.config import (ENV_BIGARRAY_BOUND, ENV_HEARTBEAT_INTERVAL,
                             ENV_HEARTBEAT_TIMEOUT, ENV_NODE_HOST, ENV_NUM_SERVER,
                             ENV_NUM_WORKER, ENV_REQUEST_TIMEOUT, ENV_ROLE, ENV_ROOT_PORT,
                             ENV_ROOT_URI, ENV_ROUND_TIMEOUT, ENV_SECRET, ENV_TRANSPORT,
                             ClusterConfig, Role)
from pskv._ps.message import (ALLOWED_DTYPES, BINARY_TAG, MAX_HEADER, Command, Meta, decode,
                              encode)
from pskv._ps.partition import Segment, covers, place, ps_key
from pskv._ps.stream import drop_sent
from pskv.errors import ConfigError, KVStoreError, ProtocolError


# ---- message codec ------------------------------------------------------------------------
def frames_bytes(frames: list) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


def test_roundtrip_header_and_arrays() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, -2], np.int64)
    c = np.zeros((0, 4), np.float64)
    frames = frames_bytes(encode(Command.PUSH, 7, [2, 9], {"kinds": "dd"}, [a, b, c]))
    meta, arrays = decode(frames)
    assert meta == Meta(Command.PUSH, 7, (2, 9), {"kinds": "dd"})
    assert [x.dtype for x in arrays] == [a.dtype, b.dtype, c.dtype]
    for got, want in zip(arrays, [a, b, c]):
        np.testing.assert_array_equal(got, want)
        assert got.shape == want.shape
    assert not arrays[0].flags.writeable        # views of the frames, never copied in


def test_non_contiguous_arrays_are_sent_contiguous() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    _, arrays = decode(frames_bytes(encode(Command.DATA, 1, arrays=[a])))
    np.testing.assert_array_equal(arrays[0], a)


def test_minimal_message() -> None:
    frames = frames_bytes(encode(Command.ACK))
    assert frames[0][0] == BINARY_TAG           # no body: the binary header
    assert decode(frames) == (Meta(Command.ACK), [])
    frames = frames_bytes(encode(Command.BARRIER, body={"group": "all"}))
    assert json.loads(frames[0]) == {"c": int(Command.BARRIER), "t": 0, "b": {"group": "all"}}


def header(**fields: object) -> bytes:
    return json.dumps({"c": int(Command.PUSH), "t": 1, **fields}).encode()


BAD_FRAMES = {
    "empty": [],
    "not json": [b"\xff\xfe"],
    "empty header": [b""],
    "json list": [b"[1, 2]"],
    "no command": [b'{"t": 1}'],
    "unknown command": [b'{"c": 999}'],
    "float ts": [header(t=1.5)],
    "str key": [header(k=["a"])],
    "bool key": [header(k=[True])],
    "keys not a list": [header(k=3)],
    "missing data frame": [header(a=[["float32", [2]]])],
    "extra data frame": [header(), b"\x00" * 4],
    "specs not a list": [header(a="float32"), b"\x00"],
    "bad spec": [header(a=[["float32"]]), b"\x00" * 4],
    "object dtype": [header(a=[["object", [1]]]), b"\x00" * 8],
    "unknown dtype": [header(a=[["complex128", [1]]]), b"\x00" * 16],
    "negative dim": [header(a=[["float32", [-1]]]), b""],
    "float dim": [header(a=[["float32", [1.0]]]), b"\x00" * 4],
    "huge dim": [header(a=[["uint8", [1 << 41]]]), b""],
    "too many dims": [header(a=[["uint8", [1] * 33]]), b"\x00"],
    "truncated": [header(a=[["float32", [3]]]), b"\x00" * 11],
    "too long": [header(a=[["float32", [3]]]), b"\x00" * 13],
}


@pytest.mark.parametrize("frames", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_decode_rejects(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert isinstance(info.value, KVStoreError)


def test_decode_rejects_oversized_header() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode([b" " * (MAX_HEADER + 1)])


def test_allowed_dtypes_roundtrip() -> None:
    for name in sorted(ALLOWED_DTYPES):
        a = np.ones(3, dtype=name)
        _, arrays = decode(frames_bytes(encode(Command.DATA, arrays=[a])))
        assert arrays[0].dtype == np.dtype(name)


# ---- partition -----------------------------------------------------------------------------
def test_ps_key_int_and_str_never_collide() -> None:
    assert ps_key(0) == 0 and ps_key(3) == 6 and ps_key(-5) == -10
    assert ps_key(2**62) == 2**63
    for name in ("a", "b", "weight", "", "w\u00e9"):
        pk = ps_key(name)
        assert pk % 2 == 1 and 0 < pk < 2**63
        assert ps_key(name) == pk                 # the same on every worker, every run
    assert ps_key("a") != ps_key("b")


def test_ps_key_of_str_is_stable() -> None:
    # a fixed value: workers in other processes (other PYTHONHASHSEEDs) must agree
    assert ps_key("w") == ps_key("w") and ps_key("w") != hash("w")
    import hashlib
    want = 2 * (int.from_bytes(hashlib.blake2b(b"w", digest_size=8).digest(), "big") >> 2) + 1
    assert ps_key("w") == want


def test_place_small_key_on_least_loaded_server() -> None:
    loads = [0, 0, 0]
    assert place(10, 4, 3, 100, 1, loads) == [Segment(0, 0, 10)]
    assert place(5, 4, 3, 100, 1, loads) == [Segment(1, 0, 5)]
    assert place(5, 4, 3, 100, 1, loads) == [Segment(2, 0, 5)]
    assert place(1, 4, 3, 100, 1, loads) == [Segment(1, 0, 1)]
    assert loads == [40, 24, 20]


def test_place_big_key_splits_evenly() -> None:
    loads = [0, 0]
    segs = place(33, 4, 2, 10, 1, loads)
    assert segs == [Segment(0, 0, 16), Segment(1, 16, 33)]
    assert covers(segs, 33) and loads == [64, 68]
    assert [s.size for s in segs] == [16, 17]


def test_place_bound_is_inclusive_and_counts_elements() -> None:
    assert len(place(10, 4, 2, 10, 1, [0, 0])) == 2            # size >= bound splits
    assert len(place(9, 4, 2, 10, 1, [0, 0])) == 1
    assert len(place(3, 40, 2, 30, 10, [0, 0])) == 2           # 3 rows of 10 elements
    assert len(place(4, 4, 1, 1, 1, [0])) == 1                 # one server: never split


def test_place_row_sparse_always_splits_rows() -> None:
    segs = place(6, 8, 2, 10**6, 2, [0, 0], split_always=True)
    assert segs == [Segment(0, 0, 3), Segment(1, 3, 6)]
    # fewer rows than servers: one row each, no empty segment
    segs = place(2, 8, 3, 10**6, 2, [0, 0, 0], split_always=True)
    assert segs == [Segment(0, 0, 1), Segment(1, 1, 2)]


def test_covers() -> None:
    assert covers([Segment(0, 0, 2), Segment(1, 2, 5)], 5)
    assert not covers([Segment(0, 0, 2), Segment(1, 3, 5)], 5)     # gap
    assert not covers([Segment(0, 0, 3), Segment(1, 2, 5)], 5)     # overlap
    assert not covers([Segment(0, 0, 2)], 5)                        # short
    assert not covers([Segment(0, 0, 0), Segment(1, 0, 5)], 5)     # empty segment
    assert covers([], 0)


# ---- config ---------------------------------------------------------------------------------
BASE = {ENV_ROLE: "worker", ENV_ROOT_URI: "127.0.0.1", ENV_ROOT_PORT: "9091",
        ENV_NUM_SERVER: "2", ENV_NUM_WORKER: "3"}


def test_from_env_defaults() -> None:
    cfg = ClusterConfig.from_env(BASE)
    assert (cfg.role, cfg.root_uri, cfg.root_port, cfg.num_servers, cfg.num_workers) == (
        Role.WORKER, "127.0.0.1", 9091, 2, 3)
    assert cfg.node_host == "127.0.0.1" and cfg.secret is None
    assert cfg.bigarray_bound == 1_000_000 and cfg.transport == "auto"
    assert cfg.root_address == "tcp://127.0.0.1:9091"


def test_from_env_every_setting() -> None:
    cfg = ClusterConfig.from_env({
        **BASE, ENV_ROLE: "SERVER", ENV_SECRET: "s3cret", ENV_BIGARRAY_BOUND: "1e3",
        ENV_REQUEST_TIMEOUT: "2.5", ENV_ROUND_TIMEOUT: "7", ENV_HEARTBEAT_INTERVAL: "0.2",
        ENV_HEARTBEAT_TIMEOUT: "2", ENV_NODE_HOST: "10.0.0.5", ENV_TRANSPORT: "tcp"})
    assert cfg.role is Role.SERVER and cfg.secret == b"s3cret"
    assert cfg.bigarray_bound == 1000
    assert (cfg.request_timeout, cfg.round_timeout) == (2.5, 7.0)
    assert (cfg.heartbeat_interval, cfg.heartbeat_timeout) == (0.2, 2.0)
    assert cfg.node_host == "10.0.0.5" and cfg.transport == "tcp"


def test_from_env_role_argument_and_hosts() -> None:
    assert ClusterConfig.from_env(BASE, role=Role.SCHEDULER).role is Role.SCHEDULER
    assert ClusterConfig.from_env({**BASE, ENV_ROOT_URI: "localhost"}).node_host == "127.0.0.1"
    assert ClusterConfig.from_env({**BASE, ENV_ROOT_URI: "10.1.2.3"}).node_host == "0.0.0.0"
    v6 = ClusterConfig.from_env({**BASE, ENV_ROOT_URI: "::1"})
    assert v6.root_address == "tcp://[::1]:9091"


BAD_ENV = {
    "no role": ({ENV_ROLE: ""}, ENV_ROLE),
    "bad role": ({ENV_ROLE: "boss"}, "boss"),
    "no uri": ({ENV_ROOT_URI: ""}, ENV_ROOT_URI),
    "no port": ({ENV_ROOT_PORT: ""}, ENV_ROOT_PORT),
    "port text": ({ENV_ROOT_PORT: "ninety"}, "'ninety' is not an integer"),
    "port range": ({ENV_ROOT_PORT: "70000"}, "not a TCP port"),
    "servers text": ({ENV_NUM_SERVER: "two"}, "DMLC_NUM_SERVER='two' is not an integer"),
    "zero workers": ({ENV_NUM_WORKER: "0"}, ENV_NUM_WORKER),
    "bound zero": ({ENV_BIGARRAY_BOUND: "0"}, ENV_BIGARRAY_BOUND),
    "timeout text": ({ENV_REQUEST_TIMEOUT: "soon"}, "not a number of seconds"),
    "timeout negative": ({ENV_ROUND_TIMEOUT: "-1"}, "positive"),
    "timeout inf": ({ENV_REQUEST_TIMEOUT: "inf"}, "finite"),
    "timeout nan": ({ENV_REQUEST_TIMEOUT: "nan"}, "positive"),
    "heartbeat order": ({ENV_HEARTBEAT_INTERVAL: "3", ENV_HEARTBEAT_TIMEOUT: "2"}, "exceed"),
    "transport": ({ENV_TRANSPORT: "udp"}, ENV_TRANSPORT),
}


@pytest.mark.parametrize("changes,match", list(BAD_ENV.values()), ids=list(BAD_ENV))
def test_from_env_errors(changes: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match.replace("[", r"\[")) as info:
        ClusterConfig.from_env({**BASE, **changes})
    assert isinstance(info.value, ValueError)


def test_config_is_frozen_and_with_role_copies() -> None:
    cfg = ClusterConfig(role=Role.WORKER)
    with pytest.raises(AttributeError):
        cfg.num_workers = 3  # type: ignore[misc]
    server = cfg.with_role(Role.SERVER)
    assert server.role is Role.SERVER and cfg.role is Role.WORKER
    with pytest.raises(ConfigError):
        ClusterConfig(role="worker")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ClusterConfig(role=Role.WORKER, num_servers=0)


# ---- auth -------------------------------------------------------------------------------------
def _verifier(job: str = "job-a") -> auth.Verifier:
    return auth.Verifier("scheduler", job, lambda role, rank: b"secret")


def test_auth_challenges_then_accepts_a_good_proof_once() -> None:
    verifier = _verifier()
    conn = object()
    assert verifier.check(conn, {"role": "worker"}) == auth.CHALLENGE
    challenge = verifier.challenge(conn)
    body = {"role": "worker", **auth.prove(b"secret", "scheduler", challenge, "worker", None)}
    assert verifier.check(conn, body) is None
    # the nonce was used: the same HELLO again (a replay) is refused
    assert "did not give" in str(verifier.check(conn, body))


@pytest.mark.parametrize("change", ["rank", "role", "job", "purpose", "secret", "conn"])
def test_auth_proof_binds_connection_job_role_and_rank(change: str) -> None:
    verifier, conn, other = _verifier(), object(), object()
    challenge = verifier.challenge(conn)
    verifier.challenge(other)
    made = {"job": "job-b"} if change == "job" else {}
    body = {"role": "worker", "rank": 1, **auth.prove(
        b"other" if change == "secret" else b"secret",
        "server" if change == "purpose" else "scheduler", {**challenge, **made}, "worker", 1)}
    if change == "rank":
        body["rank"] = 0
    if change == "role":
        body["role"] = "server"
    why = verifier.check(other if change == "conn" else conn, body)
    assert why == ("a proof for a challenge this node did not give to this connection"
                   if change == "conn" else "a wrong proof of the cluster secret")


def test_auth_key_for_refusal_and_no_key() -> None:
    def key_for(role: str, rank: int | None) -> bytes | None:
        if role == "server":
            raise ProtocolError("no servers here")
        return None

    verifier = auth.Verifier("server", "j", key_for)
    assert verifier.check(object(), {"role": "server"}) == "no servers here"
    assert verifier.check(object(), {"role": "worker"}) is None


def test_auth_challenge_needs_nonce_and_job() -> None:
    with pytest.raises(ProtocolError):
        auth.prove(b"s", "server", {"nonce": 1}, "worker", 0)


@pytest.mark.parametrize("sent, first, rest", [
    (0, 0, [b"abc", b"de", b"fgh"]),
    (2, 0, [b"c", b"de", b"fgh"]),          # part of the first: its rest replaces it
    (3, 1, [b"abc", b"de", b"fgh"]),        # the first whole: the index moves, no trim
    (4, 1, [b"abc", b"e", b"fgh"]),
    (5, 2, [b"abc", b"de", b"fgh"]),
    (8, 3, [b"abc", b"de", b"fgh"]),        # all of it
])
def test_drop_sent_moves_past_whole_buffers_and_trims_the_next(
        sent: int, first: int, rest: list[bytes]) -> None:
    for kind in (list, deque):
        bufs = kind(memoryview(b) for b in (b"abc", b"de", b"fgh"))
        assert drop_sent(bufs, 0, sent) == first
        assert [bytes(b) for b in bufs] == rest
    bufs = [memoryview(b"xx"), memoryview(b"abc"), memoryview(b"de")]
    assert drop_sent(bufs, 1, 4) == 2 and bytes(bufs[2]) == b"e"   # from index 1 on
