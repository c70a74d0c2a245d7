"""The metrics endpoint and the Pushgateway push under attack (issue #34 items 1 and 4):
half-sent requests cost a node a bounded number of descriptors and threads, its data port
and a good scraper unaffected; a gateway that answers a byte at a time cannot hold a node
past the push's deadline."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from pskv._ps.config import ENV_SECRET
from pskv.launch._net import free_port

from .conftest import FAST_ENV, Stranger, hello_body
from pskv._ps.message import Command, encode

pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                    "(prometheus_client) to test the metrics endpoint")

HALF_SENT = 300
#: the scheduler's descriptor limit in the test: fewer than the half-sent connections
NOFILE = 256


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    """A scheduler process (descriptor limit NOFILE) serving /metrics: (proc, data port,
    metrics port)."""
    port, mport = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env.update({"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_SERVER": "1",
                "DMLC_NUM_WORKER": "1", ENV_SECRET: "metrics-endpoint-secret",
                "PSKV_METRICS_PORT": str(mport), "PSKV_METRICS_CONNECTIONS": "8",
                **FAST_ENV, "PSKV_CONNECT_TIMEOUT": "120"})

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    log = open(tmp_path / "scheduler.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pskv.server"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=limit)
    try:
        end = time.monotonic() + 60
        while True:       # until it serves /metrics
            assert proc.poll() is None, (tmp_path / "scheduler.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < end, "the scheduler never served /metrics"
                time.sleep(0.2)
        yield proc, port, mport
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(30)
        log.close()


def test_half_sent_requests_cost_bounded_descriptors_and_threads(
        scheduler: tuple[subprocess.Popen[bytes], int, int]) -> None:
    proc, port, mport = scheduler
    threads_before = _threads(proc.pid)
    attackers: list[socket.socket] = []
    try:
        for _ in range(HALF_SENT):
            s = socket.create_connection(("127.0.0.1", mport), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")      # never the blank line
            attackers.append(s)
        # a good scraper is served, with every half-sent request still open on this side
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            assert r.status == 200 and b"pskv_" in r.read()
        # the data port still accepts and answers: a stranger's HELLO gets a challenge
        stranger = Stranger(f"tcp://127.0.0.1:{port}")
        try:
            reply = stranger.ask(encode(Command.HELLO, 1, body=hello_body()), timeout=10)
            assert reply is not None and reply["c"] == Command.CHALLENGE, reply
        finally:
            stranger.close()
        # one thread for the endpoint, whatever its clients do
        assert _threads(proc.pid) <= threads_before + 1
        # every half-sent request is dropped (evicted, or after its 5 s)
        dropped = 0
        for s in attackers:
            s.settimeout(30)
            try:
                dropped += s.recv(1) == b""
            except ConnectionResetError:
                dropped += 1
            except TimeoutError:
                pass
        assert dropped == HALF_SENT
    finally:
        for s in attackers:
            s.close()


def test_a_pushgateway_answering_a_byte_at_a_time_is_cut_off_at_the_deadline() -> None:
    """The gateway dribbles its answer a byte every 0.2 s, 150 bytes (30 s): each read
    is quick, but the push (deadline 1 s here) hangs up long before the last byte."""
    from pskv._ps.observe.metrics import NodeMetrics
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    sent: list[int] = []

    def gateway() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            answer = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 200
            n = 0
            try:
                for n in range(150):
                    conn.sendall(answer[n:n + 1])
                    time.sleep(0.2)
            except OSError:       # the client hung up
                pass
            sent.append(n)
    thread = threading.Thread(target=gateway, daemon=True)
    thread.start()
    metrics = NodeMetrics("worker", 0, "job")
    metrics.gateway = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        assert metrics.push(timeout=1.0) is False      # cut off: logged, not raised
        thread.join(60)
        assert not thread.is_alive()
        assert sent and sent[0] < 149, "the push read the gateway's whole slow answer"
    finally:
        listener.close()


def test_with_a_token_only_requests_that_carry_it_are_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PSKV_METRICS_TOKEN: /metrics answers 401 without ``Authorization: Bearer <token>``
    (or with another token); pskv-top sends it from its own environment."""
    from pskv._ps.config import ClusterConfig
    from pskv._ps.observe.metrics import start
    from pskv._ps.observe.series import SchedulerMetrics
    from pskv.top import _fetch
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1",
           "PSKV_METRICS_PORT": str(free_port()), "PSKV_METRICS_TOKEN": "s3cret-token"}
    cfg = ClusterConfig.from_env(env)
    assert "s3cret" not in repr(cfg)
    metrics = start(cfg, lambda: SchedulerMetrics("job", lambda role: 1.0))
    assert metrics is not None and metrics.port is not None
    url = f"http://127.0.0.1:{metrics.port}/metrics"
    try:
        for header in (None, "Bearer wrong", "Basic czNjcmV0LXRva2Vu", "Bearer s3cret-token"):
            request = urllib.request.Request(url, headers={"Authorization": header}
                                             if header else {})
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    status, body = r.status, r.read()
            except urllib.error.HTTPError as err:
                status, body = err.code, err.read()
            if header == "Bearer s3cret-token":
                assert status == 200 and b"pskv_" in body
            else:
                assert status == 401 and b"PSKV_METRICS_TOKEN" in body, (header, status)
        assert _fetch(url, 10) is None
        monkeypatch.setenv("PSKV_METRICS_TOKEN", "s3cret-token")
        assert "pskv_" in (_fetch(url, 10) or "")
    finally:
        metrics.close()
