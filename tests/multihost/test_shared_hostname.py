"""Two network namespaces with one hostname are two hosts (issue #29, item 5).

``ip netns exec`` shares the caller's UTS namespace, so both namespaces have this machine's
hostname; their abstract Unix sockets cannot reach each other. The scheduler, the server and
worker A run in one namespace, worker B in the other, linked by a veth pair (no sshd): the
job must finish with the right sums, its links over TCP where the namespaces differ (the
data path's, and the collective path's between the two workers). Each namespace is removed
in a finally block (by name, its processes killed by pid); every process is bounded.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Sequence

import pytest

from .conftest import SRC, load_testbed

pytestmark = pytest.mark.multihost

JOB_S = 90
WORKER = """
import json, pskv as mx
with mx.kv.create("dist_sync") as kv:
    kv.init("w", mx.nd.zeros((8,)))
    kv.set_collective("c", True)
    kv.init("c", mx.nd.zeros((64,)))
    for r in range(3):
        out, col = mx.nd.zeros((8,)), mx.nd.zeros((64,))
        kv.pushpull("w", mx.nd.ones((8,)) * (kv.rank + 1 + 10 * r), out=out)
        kv.pushpull("c", mx.nd.ones((64,)) * (kv.rank + 1), out=col)
        print(json.dumps({"rank": kv.rank, "round": r, "w": float(out.asnumpy()[0]),
                          "c": float(col.asnumpy()[0])}), flush=True)
"""


def _missing() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
        return "no ip binary (apt-get install iproute2)"
    return None


@pytest.fixture
def two_netns() -> Iterator[tuple[str, str]]:
    """Two namespaces, ``a`` at 10.229.0.1 and ``b`` at 10.229.0.2, one veth pair apart."""
    missing = _missing()
    if missing is not None:
        pytest.skip(f"two network namespaces cannot be made here: {missing}")
    tb = load_testbed()
    tb.sweep()
    # the bed's naming: sweep() removes them if this process is killed before its finally
    stem = f"{tb.NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    a, b = f"{stem}-h0", f"{stem}-h1"
    try:
        for ns in (a, b):
            tb._run(["ip", "netns", "add", ns])
            tb._run(["ip", "-n", ns, "link", "set", "lo", "up"])
        tb._run(["ip", "-n", a, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
                 "netns", b])
        for ns, addr in ((a, "10.229.0.1"), (b, "10.229.0.2")):
            tb._run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            tb._run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        yield a, b
    finally:
        for ns in (a, b):
            tb._kill_netns(ns)
        assert not {a, b} & set(tb._netns_list())


def _start(ns: str, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_a_worker_in_another_netns_with_the_same_hostname_finishes(two_netns):
    a, b = two_netns
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": SRC,
            "DMLC_PS_ROOT_URI": "10.229.0.1", "DMLC_PS_ROOT_PORT": "9387",
            "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "2", "PSKV_CONNECT_TIMEOUT": "30",
            "PSKV_SHUTDOWN_TIMEOUT": "10", "PSKV_HEARTBEAT_INTERVAL": "0.5"}
    procs = []
    try:
        for role in ("scheduler", "server"):
            procs.append(_start(a, [sys.executable, "-m", "pskv.server"],
                                {**base, "DMLC_ROLE": role, "DMLC_NODE_HOST": "10.229.0.1"}))
        for ns, addr in ((a, "10.229.0.1"), (b, "10.229.0.2")):
            procs.append(_start(ns, [sys.executable, "-c", WORKER],
                                {**base, "DMLC_ROLE": "worker", "DMLC_NODE_HOST": addr}))
        outs, end = [], time.monotonic() + JOB_S
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = "(killed after the job's bound)"
            outs.append(out)
        output = "\n".join(f"--- {p.args[-1][:20]!r}: rc {p.returncode}\n{o}"
                           for p, o in zip(procs, outs))
        assert [p.returncode for p in procs] == [0, 0, 0, 0], output
        reps = [json.loads(line) for o in outs[2:] for line in o.splitlines()
                if line.startswith("{")]
        for rank in (0, 1):
            got = [(r["w"], r["c"]) for r in reps if r["rank"] == rank]
            assert got == [(3.0 + 20 * r, 3.0) for r in range(3)], output
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
