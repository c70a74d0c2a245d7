"""``pskv-top`` in a real terminal (tmux) on a running job, and its one-line errors when
pointed at something that is not a pskv job."""
from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

PY = sys.executable
TMUX = shutil.which("tmux")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


@pytest.mark.skipif(TMUX is None, reason="needs tmux on PATH (apt-get install tmux) to run "
                    "pskv-top in a real terminal")
def test_top_shows_every_node_of_a_running_job(run_threads: Any) -> None:
    pytest.importorskip("prometheus_client", reason="pip install 'pskv[metrics]' "
                        "(prometheus_client) to serve and read metrics")
    from pskv.launch._net import free_port
    first = free_port()
    sock = f"pskv-top-test-{os.getpid()}"
    tmux = [str(TMUX), "-L", sock]
    done = threading.Event()
    screens: list[str] = []

    def train(kv: Any) -> None:
        kv.init("w", np.zeros(1000, np.float32))
        kv._barrier()
        if kv.rank == 0:
            subprocess.run(tmux + ["new-session", "-d", "-s", "top", "-x", "110", "-y", "30",
                                   "env", f"PYTHONPATH={_env()['PYTHONPATH']}", PY, "-m",
                                   "pskv.top", f"127.0.0.1:{first}", "--interval", "0.5",
                                   "--ports", "8"], check=True, timeout=20)
        end = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < end:
            kv.push("w", np.ones(1000, np.float32))
            kv.pull("w", out=np.zeros(1000, np.float32))
            if kv.rank == 0:
                screen = subprocess.run(tmux + ["capture-pane", "-p", "-t", "top"],
                                        capture_output=True, text=True, timeout=10).stdout
                if all(s in screen for s in ("server 0", "worker 0", "worker 1",
                                             "2 workers alive", "last to push (",
                                             "hottest keys (MB/s pushed): w ")):
                    screens.append(screen)
                    done.set()
            kv._barrier()      # rank 0 decided: both stop after the same round

    try:
        run_threads(train, metrics_port=first)
        assert screens, "pskv-top never showed the whole job"
        subprocess.run(tmux + ["send-keys", "-t", "top", "q"], timeout=10)
        end = time.monotonic() + 10       # q quits: the session ends with its program
        while time.monotonic() < end and subprocess.run(
                tmux + ["has-session", "-t", "top"], capture_output=True).returncode == 0:
            time.sleep(0.1)
        assert subprocess.run(tmux + ["has-session", "-t", "top"],
                              capture_output=True).returncode != 0, "q did not quit"
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True, timeout=10)
    screen = screens[0]
    assert "pskv-top  job " in screen and "scheduler: 1 servers and 2 workers alive" in screen
    assert "% " in screen.split("last to push (")[1] or "%" in screen
    for node in ("server 0", "worker 0", "worker 1"):    # as the scheduler lists them
        assert next(x for x in screen.splitlines() if x.startswith(node)).split()[2] == "alive"


def test_top_says_what_is_wrong_in_one_line() -> None:
    from pskv.launch._net import free_port

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>not metrics</html>\n")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for target, says in ((f"127.0.0.1:{server.server_port}",
                              "is not a pskv node's metrics endpoint"),
                             (f"127.0.0.1:{free_port()}", "nothing answers at")):
            got = subprocess.run([PY, "-m", "pskv.top", target, "--once", "--ports", "1",
                                  "--interval", "0.1"], capture_output=True, text=True,
                                 env=_env(), timeout=30)
            assert got.returncode == 2, got
            assert got.stderr.count("\n") == 1 and says in got.stderr, got.stderr
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
