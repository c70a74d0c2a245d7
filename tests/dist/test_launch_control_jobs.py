"""pskv-launch --control with real processes: the supervisor, its socket, the CLI.

The servers are small fake ones (``SERVER``): each records its start (``PSKV_RESTART``,
``PSKV_MAX_RESTARTS``) once it handles SIGUSR1 and, on SIGUSR1, exits as its mode file
says (0, 3, or 0 once a release file appears), so these tests check the launcher's half of
live resharding without the servers' half. Every job has a timeout, and every process is reaped by the supervisor.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from pskv._ps.config import Role
from pskv.errors import ConfigError
from pskv.launch import LaunchResult, control, launch, main
from pskv.launch._control import MAX_REQUEST
from pskv.launch._spec import ProcessSpec
from pskv.launch._supervise import run_processes

pytestmark = pytest.mark.dist

PY = sys.executable

#: argv[1] is the job's directory; the rank is DMLC_SERVER_ID (the role for the scheduler)
SERVER = r"""
import os, signal, sys, time
d = sys.argv[1]
me = os.environ.get('DMLC_SERVER_ID', os.environ.get('DMLC_ROLE', '?'))
def mode():
    try:
        return open(os.path.join(d, 'mode-' + me)).read().strip()
    except OSError:
        return 'exit0'
def retire(*_):
    open(os.path.join(d, 'usr1-' + me), 'a').write('x')
    if mode() == 'hold':
        end = time.monotonic() + 30
        while not os.path.exists(os.path.join(d, 'release')) and time.monotonic() < end:
            time.sleep(0.02)
    sys.exit(3 if mode() == 'fail' else 0)
signal.signal(signal.SIGUSR1, retire)
# written once SIGUSR1 is handled: before that, SIGUSR1 kills (a death, not a retirement)
with open(os.path.join(d, 'starts-' + me), 'a') as f:
    f.write(os.environ.get('PSKV_RESTART', '-') + ' ' + os.environ.get('PSKV_MAX_RESTARTS', '-')
            + '\n')
end = time.monotonic() + 60
while not os.path.exists(os.path.join(d, 'stop')) and time.monotonic() < end:
    time.sleep(0.05)
"""
WORKER = r"""
import os, sys, time
end = time.monotonic() + 60
while not os.path.exists(os.path.join(sys.argv[1], 'stop')) and time.monotonic() < end:
    time.sleep(0.05)
"""


class Job:
    """run_processes in a thread with a control socket; `end()` lets it finish."""

    def __init__(self, d: Path, servers: int = 2, replicas: bool = True,
                 **kw: Any) -> None:
        self.d = d
        self.path = str(d / "ctl.sock")
        env = (("PSKV_REPLICAS", "1"),) if replicas else ()
        procs = [ProcessSpec(Role.SERVER, i, (PY, "-c", SERVER, str(d)),
                             (*env, ("DMLC_SERVER_ID", str(i)))) for i in range(servers)]
        procs.append(ProcessSpec(Role.WORKER, 0, (PY, "-c", WORKER, str(d))))
        self.out = io.StringIO()
        self.result: LaunchResult | None = None
        self.thread = threading.Thread(target=self._run, args=(procs, kw), daemon=True)
        self.thread.start()
        wait_for(lambda: os.path.exists(self.path) and len(self.status()["servers"]) == servers
                 and all(self.starts(i) for i in range(servers)))

    def _run(self, procs: list[ProcessSpec], kw: dict[str, Any]) -> None:
        self.result = run_processes(procs, stdout=self.out, stderr=self.out, timeout=60,
                                    control=self.path, grace_period=2.0, **kw)

    def ask(self, request: str, server: int | None = None, **kw: Any) -> dict[str, Any]:
        return control(self.path, request, server, **kw)

    def status(self) -> dict[str, Any]:
        return control(self.path, "status")

    def state(self, server: int) -> dict[str, Any]:
        return self.status()["servers"][server]

    def starts(self, server: int) -> list[str]:
        f = self.d / f"starts-{server}"
        return f.read_text().splitlines() if f.exists() else []

    def end(self) -> LaunchResult:
        (self.d / "stop").touch()
        self.thread.join(60)
        assert self.result is not None, "the job did not end within 60 s"
        return self.result


def wait_for(cond: Any, within: float = 20.0) -> None:
    end = time.monotonic() + within
    while True:
        try:
            if cond():
                return
        except (ConfigError, OSError):
            pass
        if time.monotonic() > end:
            raise AssertionError(f"not true within {within} s")
        time.sleep(0.05)


@pytest.fixture
def d() -> Iterator[Path]:
    # short: a Unix socket path has at most 107 bytes (tmp_path can be longer)
    path = Path(tempfile.mkdtemp(prefix="pskv-ctl-"))
    yield path
    (path / "stop").touch()     # any fake process still running exits
    (path / "release").touch()
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(120)
def test_remove_retires_then_add_starts_it_again(d: Path) -> None:
    job = Job(d, servers=3)
    before = job.state(1)
    assert before["state"] == "running"
    reply = job.ask("remove-server", 1, wait=20.0)
    assert reply == {"ok": True, "server": 1, "state": "retired", "pid": before["pid"]}
    assert (d / "usr1-1").read_text() == "x"           # the process got SIGUSR1
    assert not (d / "usr1-0").exists() and not (d / "usr1-2").exists()
    time.sleep(1.0)                                    # a restart would have come by now
    assert job.starts(1) == ["- -"]                    # not restarted: retired
    assert job.state(1) == {"server": 1, "state": "retired", "pid": before["pid"],
                            "returncode": 0}
    assert [s["state"] for s in job.status()["servers"]] == ["running", "retired", "running"]

    reply = job.ask("add-server", 1)
    assert reply["ok"] is True and reply["state"] == "starting"
    assert reply["pid"] != before["pid"]
    wait_for(lambda: len(job.starts(1)) == 2)
    assert job.starts(1)[1] == "1 1"                   # PSKV_RESTART=1, PSKV_MAX_RESTARTS=1
    assert job.state(1)["state"] == "running" and job.state(1)["pid"] == reply["pid"]

    # a second round: its restart count goes on
    assert job.ask("remove-server", 1, wait=20.0)["state"] == "retired"
    assert job.ask("add-server", 1)["ok"] is True
    wait_for(lambda: len(job.starts(1)) == 3)
    assert job.starts(1)[2] == "2 1"
    assert job.starts(0) == job.starts(2) == ["- -"]   # the others were left alone
    result = job.end()
    assert (result.returncode, result.reason) == (0, "ok"), job.out.getvalue()
    assert not os.path.exists(job.path)                # removed at the end


@pytest.mark.timeout(120)
def test_retired_is_no_failure_and_no_restart_with_max_restarts(d: Path) -> None:
    job = Job(d, max_restarts=2, backed_up=True)
    assert job.ask("remove-server", 0, wait=20.0)["state"] == "retired"
    time.sleep(1.5)           # past the first back-off (0.5 s) a restart would take
    assert job.starts(0) == ["0 2"]                   # PSKV_RESTART=0 from the start
    assert job.ask("add-server", 0)["ok"] is True
    wait_for(lambda: len(job.starts(0)) == 2)
    assert job.starts(0)[1] == "1 2"                   # --max-restarts 2 stays 2
    result = job.end()
    assert result.returncode == 0 and result.failed is None


@pytest.mark.timeout(120)
def test_a_retiring_server_that_fails_is_restarted_as_any(d: Path) -> None:
    (d / "mode-1").write_text("fail")
    job = Job(d, max_restarts=1)
    assert job.ask("remove-server", 1)["state"] == "retiring"
    wait_for(lambda: len(job.starts(1)) == 2)          # exit 3: a death, so a restart
    assert job.starts(1)[1] == "1 1"
    wait_for(lambda: job.state(1)["state"] == "running")
    reply = job.ask("add-server", 1)
    assert reply["ok"] is False and "every server slot" in reply["error"]
    assert job.end().returncode == 0


@pytest.mark.timeout(120)
def test_a_retiring_server_that_fails_without_restarts_fails_the_job(d: Path) -> None:
    (d / "mode-1").write_text("fail")
    job = Job(d)
    assert job.ask("remove-server", 1)["ok"] is True
    job.thread.join(30)
    assert job.result is not None
    assert (job.result.returncode, job.result.reason) == (3, "failed")
    assert job.result.failed is not None and job.result.failed.label == "server 1"


@pytest.mark.timeout(120)
def test_one_slot_out_at_a_time(d: Path) -> None:
    (d / "mode-1").write_text("hold")
    job = Job(d, servers=3)
    assert job.ask("remove-server", 1) == {"ok": True, "server": 1, "state": "retiring",
                                           "pid": job.state(1)["pid"]}
    wait_for(lambda: (d / "usr1-1").exists())
    assert job.state(1)["state"] == "retiring"
    second = job.ask("remove-server", 2)
    assert second["ok"] is False and "server 1 is retiring" in second["error"]
    again = job.ask("remove-server", 1)
    assert again["ok"] is False and "one server slot is out" not in again["error"]
    early = job.ask("add-server", 1)
    assert early["ok"] is False and "still retiring" in early["error"]
    (d / "release").touch()
    wait_for(lambda: job.state(1)["state"] == "retired")
    second = job.ask("remove-server", 2)
    assert second["ok"] is False and "First add it back (add-server 1)" in second["error"]
    assert not (d / "usr1-2").exists()
    assert job.end().returncode == 0


@pytest.mark.timeout(120)
def test_refusals(d: Path) -> None:
    job = Job(d, replicas=False)
    unknown = job.ask("remove-server", 7)
    assert unknown["ok"] is False and "no server 7" in unknown["error"]
    nothing_out = job.ask("add-server", 0)
    assert nothing_out["ok"] is False and "every server slot" in nothing_out["error"]
    no_backups = job.ask("remove-server", 0)
    assert no_backups["ok"] is False and "PSKV_REPLICAS" in no_backups["error"]
    assert not (d / "usr1-0").exists()
    assert [s["state"] for s in job.status()["servers"]] == ["running", "running"]
    assert job.end().returncode == 0


def raw(path: str, data: bytes, shut: bool = True) -> dict[str, Any]:
    """Send bytes as they are; the JSON line that comes back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(path)
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return json.loads(reply)


@pytest.mark.timeout(120)
def test_garbage_and_oversized_lines_get_an_error_and_the_job_goes_on(d: Path) -> None:
    job = Job(d)
    for data in (b"\xff\xfe\n", b"reboot now\n", b"\n", b"x" * (MAX_REQUEST + 10),
                 b"remove-server " + b"9" * 5000 + b"\n", b"status 1 2 3"):
        reply = raw(job.path, data)
        assert reply["ok"] is False and reply["error"], data[:20]
    assert "longer than 4096 bytes" in raw(job.path, b"y" * 10000)["error"]
    assert raw(job.path, b"status")["ok"] is True         # no newline: the end is the end
    assert [s["state"] for s in job.status()["servers"]] == ["running", "running"]
    assert job.end().returncode == 0


@pytest.mark.timeout(120)
def test_the_socket_is_private_and_removed_at_the_end(d: Path) -> None:
    job = Job(d)
    mode = os.lstat(job.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".pskv")) == []
    job.end()
    assert not os.path.exists(job.path)


def test_a_path_in_use_is_refused_before_anything_starts(d: Path) -> None:
    path = d / "taken"
    path.write_text("mine")
    spec = ProcessSpec(Role.WORKER, 0, (PY, "-c", f"open({str(d / 'ran')!r}, 'w')"))
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        run_processes([spec], control=str(path), timeout=30)
    assert path.read_text() == "mine" and not (d / "ran").exists()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(d / "live"))
    listening.listen(1)
    try:
        with pytest.raises(ConfigError, match="another pskv-launch listens there"):
            run_processes([spec], control=str(d / "live"), timeout=30)
    finally:
        listening.close()
    assert not (d / "ran").exists()


def test_a_stale_socket_is_replaced(d: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d / "stale"))
    stale.close()                   # the file stays, nobody listens: a crashed launcher's
    spec = ProcessSpec(Role.WORKER, 0, (PY, "-c", "pass"))
    assert run_processes([spec], control=str(d / "stale"), timeout=30).returncode == 0
    assert not (d / "stale").exists()


@pytest.mark.timeout(120)
def test_cli(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(d)
    ctl = ["--control", job.path]
    assert main([*ctl, "--status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [s["state"] for s in status["servers"]] == ["running", "running"]
    assert main([*ctl, "--add-server", "0"]) == 1
    assert "every server slot" in json.loads(capsys.readouterr().out)["error"]
    assert main([*ctl, "--remove-server", "0", "--wait", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "retired"
    assert main([*ctl, "--add-server", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "starting"
    assert main(["--control", str(d / "nobody"), "--status"]) == 1
    assert "no pskv-launch listens" in json.loads(capsys.readouterr().out)["error"]
    assert job.end().returncode == 0


@pytest.mark.timeout(120)
def test_launch_with_control_end_to_end(d: Path) -> None:
    """launch(control=...): the local launcher's servers, their PSKV_REPLICAS from --env."""
    path = str(d / "job.sock")
    box: dict[str, LaunchResult] = {}
    out = io.StringIO()
    t = threading.Thread(target=lambda: box.setdefault("r", launch(
        [PY, "-c", WORKER, str(d)], 1, 2, server_command=[PY, "-c", SERVER, str(d)],
        env={"PSKV_REPLICAS": "1"}, control=path, timeout=60, stdout=out, stderr=out)),
        daemon=True)
    t.start()
    wait_for(lambda: os.path.exists(path) and len(control(path, "status")["servers"]) == 2
             and (d / "starts-0").exists() and (d / "starts-1").exists())
    assert control(path, "remove-server", 1, wait=20.0)["state"] == "retired"
    assert control(path, "add-server", 1)["ok"] is True
    wait_for(lambda: len((d / "starts-1").read_text().splitlines()) == 2)
    assert (d / "starts-1").read_text().splitlines()[1] == "1 1"
    assert not (d / "usr1-scheduler").exists()
    (d / "stop").touch()
    t.join(60)
    assert box["r"].returncode == 0, out.getvalue()
    assert not os.path.exists(path)
