"""The collective path's shared memory between workers on one host (``_ps/shm.py``,
docs/collective.md): the same bits as the servers and as the sockets, for 2 to 4 workers in
threads and processes; a segment that is not a sealed memfd of its size, or a SEGMENT
without its descriptor, fails both sides with a KVStoreError naming the sender and never
the thread; nothing is left in /dev/shm or the temp dir; a killed worker is named at once;
``PSKV_COLLECTIVE_SHM=0`` gives the socket path."""
from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _compare import same as compare

from pskv._ps import shm
from pskv._ps.config import ENV_COLLECTIVE_SHM, KNOWN_ENV, ClusterConfig
from pskv._ps.message import Command
from pskv.errors import (ClusterError, ConfigError, KVStoreError, NodeFailedError,
                         ProtocolError)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120),
              pytest.mark.skipif(not shm.supported(), reason="no sealed memfds here")]

REPO = Path(__file__).resolve().parents[2]
#: key -> shape, dtype: sizes below and above the worker count, odd sizes, two dtypes
KEYS = {"a": ((3,), np.float32), "b": ((1000, 7), np.float32), "d": ((4097,), np.float64),
        "small": ((6,), np.float32)}


def ok(results: dict[int, Any]) -> dict[int, Any]:
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return dict(results)


def grad(rank: int, step: int, key: str) -> np.ndarray:
    """Magnitudes differing by rank: the order of the sum shows in the last bits."""
    shape, dtype = KEYS[key]
    rng = np.random.default_rng([rank, step, len(key)])
    return (rng.standard_normal(shape) * 10.0 ** (rank - 1)).astype(dtype)


def rounds(kv: Any) -> dict[str, Any]:
    """Pushes and pulls of every call shape, two pushes in a row, and where the data went."""
    keys = list(KEYS)
    kv.init(keys, [np.full(KEYS[k][0], kv.rank + 1, KEYS[k][1]) for k in keys])
    got: dict[str, Any] = {}
    for step in range(4):
        kv.push(keys, [grad(kv.rank, step, k) for k in keys])
        if step == 1:            # a second push before any pull: its slot must wait
            kv.push(keys, [grad(kv.rank, step + 40, k) for k in keys])
        outs = [np.empty(*KEYS[k]) for k in keys]
        kv.pull(keys, out=outs)
        got[f"pull{step}"] = outs
        out = np.empty(*KEYS["b"])
        kv.pushpull("b", [grad(kv.rank, step + 10, "b"), grad(kv.rank, step + 20, "b")],
                    out=out)
        got[f"pushpull{step}"] = out
        got[f"new{step}"] = kv.pull(["d", "small"])
    coll = kv._peers.path
    got["shm"] = sorted(coll._shm) if coll is not None else []
    got["segments"] = sorted(str(k.name) for k in coll._keys.values()
                             if k.seg is not None) if coll is not None else []
    return got


def same(x: Any, y: Any) -> None:
    compare(x, y, skip=("shm", "segments"))


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_shared_memory_gives_the_servers_and_the_sockets_bits(run_threads: Any,
                                                              workers: int) -> None:
    servers = ok(run_threads(rounds, num_workers=workers))
    shared = ok(run_threads(rounds, num_workers=workers, collective_bytes=8))
    sockets = ok(run_threads(rounds, num_workers=workers, collective_bytes=8,
                             collective_shm=False))
    for r in range(workers):
        assert shared[r]["shm"] == [p for p in range(workers) if p != r]
        assert shared[r]["segments"] == ["a", "b", "d", "small"]
        assert sockets[r]["shm"] == [] and sockets[r]["segments"] == []
        same(shared[r], servers[r])
        same(sockets[r], servers[r])
        same(shared[r], shared[0])
    want = grad(0, 0, "b").copy()
    for r in range(1, workers):
        want += grad(r, 0, "b")
    same(shared[0]["pull0"][1], want)


def _memfds() -> tuple[int, int]:
    """This process's pskv memfd mappings and descriptors."""
    maps = Path("/proc/self/maps").read_text().count("memfd:pskv-")
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pskv-")
        except OSError:
            pass
    return maps, fds


def test_closed_stores_unmap_and_close_every_segment(run_threads: Any) -> None:
    before = _memfds()
    seen = ok(run_threads(lambda kv: (rounds(kv), _memfds())[1], num_workers=3,
                          collective_bytes=8))
    assert all(maps > before[0] and fds > before[1] for maps, fds in seen.values()), seen
    gc.collect()
    assert _memfds() == before


def test_one_worker_with_shm_off_links_every_pair_by_socket(thread_cluster: Any) -> None:
    cluster = thread_cluster(3, collective_bytes=8)
    configs = [cluster.worker_config(), cluster.worker_config(collective_shm=False),
               cluster.worker_config()]
    res = ok(cluster.run(rounds, configs=configs))
    off = [r for r in range(3) if res[r]["shm"] == []]       # ranks follow arrival
    assert len(off) == 1, res
    a, b = (r for r in range(3) if r not in off)
    assert res[a]["shm"] == [b] and res[b]["shm"] == [a]
    for r in range(3):
        same(res[r], res[0])


def test_tcp_links_between_workers_of_one_host_keep_the_sockets(run_threads: Any) -> None:
    # PSKV_TRANSPORT=tcp: the workers link as if on different hosts, so nothing is shared
    tcp = ok(run_threads(rounds, num_workers=2, collective_bytes=8, transport="tcp"))
    servers = ok(run_threads(rounds, num_workers=2))
    for r in range(2):
        assert tcp[r]["shm"] == [] and tcp[r]["segments"] == []
        same(tcp[r], servers[r])


def test_the_switch_is_read_from_the_environment() -> None:
    env = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "2"}
    assert ClusterConfig.from_env(env).collective_shm is True
    assert ClusterConfig.from_env({**env, ENV_COLLECTIVE_SHM: "0"}).collective_shm is False
    assert ClusterConfig.from_env({**env, ENV_COLLECTIVE_SHM: "1"}).collective_shm is True
    with pytest.raises(ConfigError, match="PSKV_COLLECTIVE_SHM='yes' is not 0 or 1"):
        ClusterConfig.from_env({**env, ENV_COLLECTIVE_SHM: "yes"})
    assert ENV_COLLECTIVE_SHM in KNOWN_ENV
    assert f"| `{ENV_COLLECTIVE_SHM}` | 1 |" in (REPO / "docs/env.md").read_text()
    assert f"`{ENV_COLLECTIVE_SHM}=0`" in (REPO / "docs/collective.md").read_text()


# ---- a peer that breaks the rules ----------------------------------------------------------
def _sealed(nbytes: int, seals: int = shm.SEALS) -> int:
    fd = os.memfd_create("pskv-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _bad_fds(kind: str, nbytes: int, tmp: Path) -> list[int]:
    """What worker 1 passes instead of its segment (the test closes them)."""
    if kind == "wrong size":
        return [_sealed(nbytes + 64)]
    if kind == "unsealed":
        return [_sealed(nbytes, 0)]         # could shrink under the mapping: SIGBUS
    if kind == "writable":
        return [_sealed(nbytes)]            # its size sealed, but anyone may rewrite it
    if kind == "a file":
        path = tmp / "not-shared"
        path.write_bytes(bytes(nbytes))
        return [os.open(path, os.O_RDWR)]
    if kind == "a pipe":
        r, w = os.pipe()
        os.close(w)
        return [r]
    if kind == "too many":
        return [_sealed(nbytes) for _ in range(shm.MAX_PENDING + 1)]
    return []                               # "no descriptor"


@pytest.mark.parametrize("kind", ["wrong size", "unsealed", "writable", "a file", "a pipe",
                                  "too many",
                                  "no descriptor", "push before segment", "push with data"])
def test_a_segment_or_round_that_breaks_the_rules_fails_both_sides_not_the_thread(
        run_threads: Any, kind: str, tmp_path: Path) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(300, np.float32))
        coll = kv._peers.path
        k = coll._keys[kv._store["w"].pskey]
        fds = []
        if kv.rank == 1:        # instead of its first push (which sends the real one)
            lay = shm.layout(300, k.dtype, k.bounds[1])
            with coll._cond:
                if kind.startswith("push"):      # a round's message, no segment sent
                    coll._queue(0, Command.PUSH, 1, k.pskey,
                                np.ones(150, np.float32) if kind.endswith("data") else None)
                else:
                    fds = _bad_fds(kind, lay.nbytes, tmp_path)
                    coll._queue(0, Command.SEGMENT, 0, k.pskey, None, fds=fds)
            coll._wake()
        try:
            with pytest.raises(KVStoreError) as info:
                if kv.rank == 1:         # worker 0's refusal comes back (bounded)
                    end = time.monotonic() + 30
                    with coll._cond:
                        while coll._failure is None and time.monotonic() < end:
                            coll._cond.wait(0.1)
                    coll._raise_failure()
                for _ in range(100):     # worker 0 waits in its first round till then
                    kv.push("w", np.ones(300, np.float32))
                    kv.pull("w")
        finally:
            for fd in fds:
                os.close(fd)
        assert coll._thread is not None and coll._thread.is_alive()
        return type(info.value), str(info.value)

    res = ok(run_threads(fn, collective_bytes=8))
    cls = ClusterError if kind.startswith("push") else ProtocolError
    assert res[0][0] is cls and res[1][0] is cls, res
    assert res[0][1].startswith("worker 1 sent "), res[0]
    assert "reported by worker 0" in res[1][1] and "worker 1 sent" in res[1][1], res[1]
    nbytes = shm.layout(300, np.dtype(np.float32), (150, 300)).nbytes
    want = {"wrong size": f"of {nbytes + 64} bytes, not {nbytes}",
            "unsealed": "size is not sealed",
            "writable": "other processes may still write (no F_SEAL_FUTURE_WRITE)",
            "a file": "not a memfd", "a pipe": "not a memory file",
            "too many": f"more than {shm.MAX_PENDING} descriptors",
            "no descriptor": "without its descriptor",
            "push before segment": "key 'w': round 1 before its shared-memory segment",
            "push with data": "key 'w': 1 arrays on a shared-memory link"}[kind]
    assert want in res[0][1], res[0]


def test_a_segment_on_a_socket_link_is_refused(run_threads: Any) -> None:
    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(300, np.float32))
        coll = kv._peers.path
        pskey = kv._store["w"].pskey
        if kv.rank == 1:
            fd = _sealed(64)
            with coll._cond:
                coll._queue(0, Command.SEGMENT, 0, pskey, None, fds=[fd])
            coll._wake()
            time.sleep(0.2)
            os.close(fd)
        with pytest.raises(KVStoreError) as info:
            for _ in range(100):
                kv.push("w", np.ones(300, np.float32))
                kv.pull("w")
        return str(info.value)

    res = ok(run_threads(fn, collective_bytes=8, collective_shm=False))
    assert "worker 1 sent a shared-memory segment on a link that does not take one" \
        in res[0], res[0]


# ---- processes -----------------------------------------------------------------------------
def _listing(*dirs: Path) -> set[str]:
    out = set()
    for d in dirs:
        try:
            out |= {str(d / name) for name in os.listdir(d)}
        except OSError:
            pass
    return out


@pytest.mark.parametrize("workers", [2, 4])
def test_processes_give_the_same_digest_and_leave_no_file(local_cluster: Any, tmp_path: Path,
                                                          workers: int) -> None:
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    shared = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    before = _listing(*shared)
    digests, shm_peers = {}, {}
    for name, env in (("servers", {}), ("shm", {"PSKV_COLLECTIVE_BYTES": "4096"}),
                      ("sockets", {"PSKV_COLLECTIVE_BYTES": "4096", ENV_COLLECTIVE_SHM: "0"})):
        cluster = local_cluster(workers, 1, env={**env, "TMPDIR": str(own_tmp)})
        cluster.start("collective_sum.py")
        codes = cluster.wait(90)
        assert set(codes.values()) == {0}, cluster.dump()
        reports = [r for p in cluster.workers for r in p.reports()]
        assert sorted(r["rank"] for r in reports) == list(range(workers)), cluster.dump()
        digests[name] = {r["digest"] for r in reports}
        shm_peers[name] = {r["rank"]: r["shm"] for r in reports}
    assert len(digests["servers"]) == 1
    assert digests["shm"] == digests["servers"] == digests["sockets"]
    assert all(len(v) == workers - 1 for v in shm_peers["shm"].values()), shm_peers
    assert all(v == [] for v in shm_peers["sockets"].values()), shm_peers
    assert list(own_tmp.iterdir()) == []
    # other work on this machine may come and go: only a name of pskv's would be ours
    assert not [n for n in _listing(*shared) - before if "pskv" in n.lower()]


def test_a_worker_killed_mid_round_is_named_and_its_memory_goes(local_cluster: Any,
                                                                tmp_path: Path) -> None:
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    # a request timeout far beyond the test's bound: the error must come from the broken link
    cluster = local_cluster(2, 1, env={"PSKV_COLLECTIVE_BYTES": "64",
                                       "PSKV_REQUEST_TIMEOUT": "300", "TMPDIR": str(own_tmp)})
    cluster.start("fail_node.py", "worker-dies")
    end = time.monotonic() + 30
    while time.monotonic() < end and not all(
            any(r.get("event") == "ready" for r in p.reports()) for p in cluster.workers):
        time.sleep(0.05)
    ready = [r for p in cluster.workers for r in p.reports() if r.get("event") == "ready"]
    assert sorted(r["shm"] for r in ready) == [[0], [1]], cluster.dump()
    for p in cluster.workers:     # its segments are memfds, nothing with a path
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert "memfd:pskv-" in maps and "/dev/shm/" not in maps, p.label
    assert not [n for n in _listing(Path("/dev/shm")) if "pskv" in n.lower()]
    assert list(own_tmp.iterdir()) == []
    victim = cluster.worker_by_rank(1)
    time.sleep(0.3)                        # rank 0 is now waiting for rank 1's push
    victim.kill()
    codes = cluster.wait(40)
    errors = [r for p in cluster.workers for r in p.reports() if "error" in r]
    assert len(errors) == 1, cluster.dump()
    err = errors[0]
    assert err["rank"] == 0 and err["error"] == "NodeFailedError", err
    assert "worker 1 is gone" in err["msg"], err
    assert codes[cluster.worker_by_rank(0).label] == 3
    assert list(own_tmp.iterdir()) == []


def test_a_worker_whose_links_break_mid_round_is_named_at_once(thread_cluster: Any) -> None:
    cluster = thread_cluster(3, request_timeout=60.0, collective_bytes=8)

    def fn(kv: Any) -> Any:
        kv.init("w", np.zeros(100_000, np.float32))
        kv.push("w", np.ones(100_000, np.float32))
        kv.pull("w")
        assert len(kv._peers.path._shm) == 2
        if kv.rank == 2:        # it pushed its round, then dies before the sums go out
            with kv._peers.path._cond:
                kv._peers.path._keys[kv._store["w"].pskey].sending = 99     # its sum never goes
            kv.push("w", np.ones(100_000, np.float32))
            time.sleep(0.2)
            import socket
            for conn in kv._peers.path._conns.values():
                conn.sock.shutdown(socket.SHUT_RDWR)
            return "dead"
        with pytest.raises(NodeFailedError, match="worker 2 is gone") as info:
            for _ in range(2):
                kv.push("w", np.ones(100_000, np.float32))
                kv.pull("w")
        return str(info.value)

    results = cluster.run(fn, timeout=40)
    assert results[2] == "dead"
    for r in (0, 1):
        assert isinstance(results[r], str), results[r]
