"""Pre-admission limits: size caps, idle and surplus connections, descriptor exhaustion,
quiet refusal logs. Each attack runs against a live cluster, which must still run a round.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.limits import LOG_BURST
from pskv._ps.message import Command, encode

from .conftest import PY, Stranger, assert_unharmed, connect_stream, frame, push_and_pull

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _peak_rss(reset: bool = False) -> int:
    """This process's peak resident memory since the last reset, in bytes (Linux)."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")    # resets the peak (VmHWM)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    pytest.skip("no /proc/self/clear_refs: the memory check needs Linux 4.0 or later")


def _round(kv: Any) -> Any:
    kv.init(1, mx.nd.zeros((3,)))
    kv.push(1, mx.nd.ones((3,)))
    return kv.pull(1).asnumpy()


@pytest.mark.timeout(90)
def test_big_frames_before_admission_are_dropped_unread(thread_cluster: Any) -> None:
    # another process sends 4 frames of 64 MiB to the scheduler's port (in this process):
    # libzmq's MAXMSGSIZE drops the peer at the frame's length prefix
    cluster = thread_cluster(2, 1)
    sender = textwrap.dedent(f"""
        import zmq, sys
        ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 2000)
        s.connect({cluster.cfg.root_address!r})
        big = bytes(64 << 20)
        for _ in range(4):
            s.send(big)
        s.close(); ctx.term()
    """)
    before = _peak_rss(reset=True)
    subprocess.run([PY, "-c", sender], timeout=60, check=True)
    time.sleep(0.5)
    grew = _peak_rss() - before
    print(json.dumps({"scheduler process grew by MiB under 256 MiB of frames":
                      round(grew / 2 ** 20, 1)}))
    assert grew < 64 << 20, grew
    res = cluster.run(_round)
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)


@pytest.mark.timeout(90)
def test_idle_and_surplus_connections_are_closed(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1, max_unadmitted=8, handshake_timeout=1.0)
    found: dict[str, Any] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            socks = [connect_stream(kv._po.servers[0]["tcp"], 5.0) for _ in range(40)]
            time.sleep(0.5)
            # the surplus was closed at once (EOF), the first 8 are still open
            open_now = 0
            for s in socks:
                s.settimeout(0.05)
                try:
                    open_now += s.recv(1) != b""
                except TimeoutError:
                    open_now += 1
            found["open at first"] = open_now
            time.sleep(2.0)                   # past the handshake deadline
            closed = 0
            for s in socks:
                s.settimeout(1.0)
                try:
                    closed += s.recv(1) == b""
                except (TimeoutError, ConnectionResetError):
                    pass
                s.close()
            found["closed later"] = closed
            go.set()
        else:
            go.wait(20)
        return push_and_pull(kv)

    res = cluster.run(fn, timeout=40)
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    assert found["open at first"] <= 8, found
    assert found["closed later"] == 40, found


@pytest.mark.timeout(90)
def test_refusals_are_logged_quietly_without_payload(thread_cluster: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cluster = thread_cluster(2, 1)
    stranger = Stranger(cluster.cfg.root_address)
    try:
        for i in range(300):
            stranger.sock.send_multipart(encode(Command.BARRIER, i, body={
                "group": "worker", "payload": "SECRET-PAYLOAD" * 50}))
            stranger.sock.send_multipart([b'{"c": 1, "t": 1, "b": "SECRET-PAYLOAD"}'])
        # every message was answered (an ERROR each), or libzmq dropped the peer
        time.sleep(1.0)
    finally:
        stranger.close()
    res = cluster.run(_round)
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(lines) <= LOG_BURST, lines
    assert not any("SECRET-PAYLOAD" in r.getMessage() for r in caplog.records)


_EMFILE_CHILD = """
import resource, socket, threading, time, json, sys
sys.path.insert(0, {src!r})
from pskv._ps.auth import Verifier
from pskv._ps.message import Command, encode
from pskv._ps.serve import ServeLoop
from pskv._ps.stream import StreamListener

class H:
    def admit(self, conn, meta): return None
    def handle(self, conn, peer, meta, arrays): pass
    def tick(self): pass
    def dropped(self, conn): pass

resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
lis = StreamListener(host="127.0.0.1")
loop = ServeLoop("server", H(), Verifier("server", "job", lambda r, k: b"k"), 5.0,
                 listeners=[lis], handshake_timeout=1.0, max_unadmitted=1000)
stop = threading.Event()
t = threading.Thread(target=loop.run, args=(stop.is_set, 20, 0.1), daemon=True)
t.start()
host, port = lis.sock.getsockname()
socks = []
try:
    while len(socks) < 200:
        socks.append(socket.create_connection((host, port), 2))
except OSError as err:
    pass
time.sleep(1.0)
for s in socks:
    s.close()
time.sleep(2.5)                     # the loop's strangers expire; the listener resumes
s = socket.create_connection((host, port), 2)
s.sendall(b"PSKV" + len(h := encode(Command.HELLO, 1, body={{"role": "worker", "rank": 0}})[0]).to_bytes(4, "little") + h)
s.settimeout(5)
reply = s.recv(4096)
print(json.dumps({{"alive": t.is_alive(), "opened": len(socks), "challenged": b'"c":10' in reply}}))
stop.set(); t.join(2); loop.close()
"""


@pytest.mark.timeout(60)
def test_running_out_of_file_descriptors_refuses_and_goes_on(tmp_path: Path) -> None:
    script = tmp_path / "emfile.py"
    script.write_text(_EMFILE_CHILD.format(src=SRC))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=45)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["alive"] and got["challenged"], (got, out.stderr)
    assert "out of file descriptors" in out.stderr, out.stderr[-2000:]


@pytest.mark.timeout(60)
def test_stream_message_over_the_admission_cap_is_refused_unread(thread_cluster: Any) -> None:
    cluster = thread_cluster(2, 1)
    got: dict[str, bytes] = {}
    go = threading.Event()

    def fn(kv: Any) -> Any:
        kv.init(1, mx.nd.zeros((3,)))
        if kv.rank == 0:
            with connect_stream(kv._po.servers[0]["tcp"]) as s:
                # a header of 1 MiB announced: refused at the prefix, before it is read
                s.sendall(b"PSKV" + (1 << 20).to_bytes(4, "little") + b"{" * 1000)
                s.settimeout(3)
                try:
                    got["reply"] = s.recv(4096)
                except (ConnectionResetError, TimeoutError) as err:
                    got["reply"] = repr(err).encode()
            with connect_stream(kv._po.servers[0]["tcp"]) as s:
                s.sendall(frame(b'{"c": 21, "t": 4, "k": [2], "b": {"kinds": "d"}, '
                                b'"a": [["float32", [1000000000]]]}'))
                s.settimeout(3)
                try:
                    got["array"] = s.recv(4096)
                except (ConnectionResetError, TimeoutError) as err:
                    got["array"] = repr(err).encode()
            go.set()
        else:
            go.wait(20)
        return push_and_pull(kv)

    res = cluster.run(fn)
    assert_unharmed(cluster, res, np.full(3, 2.0), 15)
    for what, reply in got.items():
        assert b'"c":42' in reply or b"Reset" in reply, (what, reply)
