"""pskv-launch shows a child's partial lines live: a carriage-return progress bar keeps its
``[worker N]`` prefix and reaches the launcher's own output while the child still runs.

The child draws ``\\rstep i/3`` and then waits (bounded) until the test has read that step
from the launcher's stderr pipe; a launcher that passed on whole lines only would show
nothing until the child ended, and the test's bounded read would fail.
"""
from __future__ import annotations

import os
import shlex
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(90)]

PY = sys.executable

CHILD = """\
import os, sys, time
go = sys.argv[1]
for i in range(1, 4):
    sys.stderr.write(f"\\rstep {i}/3")
    sys.stderr.flush()
    end = time.monotonic() + 30
    while not os.path.exists(f"{go}.{i}") and time.monotonic() < end:
        time.sleep(0.02)
sys.stderr.write("\\n")
print("done")
"""
SERVER = [PY, "-c", "import time; time.sleep(0.2)"]


def read_until(fd: int, seen: bytearray, want: bytes, within: float = 30.0) -> None:
    """Read ``fd`` into ``seen`` until ``want`` is in it (fails after ``within`` s)."""
    end = time.monotonic() + within
    while want not in seen:
        left = end - time.monotonic()
        if left <= 0:
            pytest.fail(f"{want!r} did not come within {within} s; got {bytes(seen)!r}")
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                pytest.fail(f"the launcher's stderr ended before {want!r}: {bytes(seen)!r}")
            seen += chunk


def test_progress_bar_is_live_and_keeps_its_prefix(tmp_path: Path) -> None:
    script = tmp_path / "bar.py"
    script.write_text(CHILD)
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    cmd = [PY, "-m", "pskv.launch", "-n", "1", "-s", "1", "--launcher", "local",
           "--server-command", shlex.join(SERVER), "--timeout", "60", PY, str(script), str(go)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        assert proc.stderr is not None
        fd = proc.stderr.fileno()
        seen = bytearray()
        for i in range(1, 4):
            # step 1 opens the line; each later step redraws it after \r, prefix again
            want = (b"[worker 0] step 1/3" if i == 1
                    else f"\r[worker 0] step {i}/3".encode())
            read_until(fd, seen, want)
            (tmp_path / f"go.{i}").touch()
        out, err = proc.communicate(timeout=60)
        seen += err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert proc.returncode == 0, bytes(seen)
    assert b"[worker 0] step 1/3\r[worker 0] step 2/3\r[worker 0] step 3/3\n" in seen
    assert b"[worker 0] done\n" in out


def test_log_dir_keeps_the_bar_as_written(tmp_path: Path) -> None:
    script = tmp_path / "bar.py"
    script.write_text(CHILD)
    go = tmp_path / "go"
    for i in range(1, 4):
        (tmp_path / f"go.{i}").touch()            # no waiting
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    cmd = [PY, "-m", "pskv.launch", "-n", "1", "-s", "1", "--launcher", "local",
           "--server-command", shlex.join(SERVER), "--timeout", "60",
           "--log-dir", str(tmp_path / "logs"), PY, str(script), str(go)]
    done = subprocess.run(cmd, capture_output=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "logs" / "worker-0.log").read_bytes()
    # the bar (stderr) as written; "done" comes on stdout, another pipe, so it may land
    # before or after the bar's end
    bar = b"\rstep 1/3\rstep 2/3\rstep 3/3\n"
    assert log in (bar + b"done\n", b"done\n" + bar), log


def test_server_logs_say_what_happened(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    script = Path(__file__).resolve().parent / "scripts" / "sync_sum.py"
    cmd = [PY, "-m", "pskv.launch", "-n", "2", "-s", "1", "--launcher", "local",
           "--timeout", "60", "--log-dir", str(tmp_path), PY, str(script)]
    done = subprocess.run(cmd, capture_output=True, env=env, timeout=80)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "server-0.log").read_text()
    assert "INFO pskv.kvstore.server._core: server 0: serving dist_sync for 2 workers at " in log
    assert "INFO pskv.kvstore.server._core: server 0: all 2 workers connected" in log
    assert "worker 0 connected" not in log         # per worker: DEBUG only
