"""pskv-launch --control without sockets: the request lines, the rules over the server slots
(a fake supervisor), the hand-over to the watch loop, and the flags.

The real supervisor, socket and CLI with fake server processes:
tests/dist/test_launch_control_jobs.py.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import replace

import pytest

from pskv.errors import ConfigError
from pskv.launch import control, main, parse_args
from pskv.launch._control import Requests, parse_request
from pskv.launch._slots import Op, Request, Slot, answer


# -- request lines ------------------------------------------------------------------------
@pytest.mark.parametrize("data, want", [
    (b"remove-server 2\n", Request(Op.REMOVE_SERVER, 2)),
    (b"  add-server   0  \r\n", Request(Op.ADD_SERVER, 0)),
    (b"status", Request(Op.STATUS)),
])
def test_parse_request(data: bytes, want: Request) -> None:
    assert parse_request(data) == want


@pytest.mark.parametrize("data, match", [
    (b"", "empty"), (b"\n", "empty"), (b"reboot 1", "unknown request 'reboot'"),
    (b"remove-server", "takes one server rank"), (b"add-server 1 2", "takes one server rank"),
    (b"remove-server one", "'one': the server rank is not an integer"),
    (b"status 1", "status takes no argument"), (b"\xff\xfe", "not UTF-8"),
])
def test_bad_request_lines_say_what_to_send(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_request(data)
    # and what to send instead
    assert any(hint in str(info.value) for hint in ("Send one line", "e.g.", "such as"))


# -- the rules over the slots (a fake supervisor) -----------------------------------------
class FakeSlots:
    """Slots as the supervisor keeps them; records what the rules did to it."""

    def __init__(self, states: list[str], replicated: bool = True) -> None:
        self.table = [Slot(i, s, 100 + i) for i, s in enumerate(states)]
        self.on = replicated
        self.why: str | None = None
        self.done: list[tuple[str, int]] = []

    def slots(self) -> list[Slot]:
        return list(self.table)

    def replicated(self) -> bool:
        return self.on

    def ending(self) -> str | None:
        return self.why

    def retire(self, server: int) -> Slot:
        self.done.append(("retire", server))
        self.table[server] = replace(self.table[server], state="retiring")
        return self.table[server]

    def rejoin(self, server: int) -> Slot:
        self.done.append(("rejoin", server))
        self.table[server] = Slot(server, "running", 200 + server)
        return self.table[server]


def test_remove_retires_a_running_server() -> None:
    slots = FakeSlots(["running", "running", "running"])
    assert answer(Request(Op.REMOVE_SERVER, 1), slots) == {
        "ok": True, "server": 1, "state": "retiring", "pid": 101}
    assert slots.done == [("retire", 1)]


def test_add_starts_a_retired_server() -> None:
    slots = FakeSlots(["running", "retired"])
    assert answer(Request(Op.ADD_SERVER, 1), slots) == {
        "ok": True, "server": 1, "state": "starting", "pid": 201}
    assert slots.done == [("rejoin", 1)]


def test_status_lists_every_server() -> None:
    slots = FakeSlots(["running", "retired"])
    reply = answer(Request(Op.STATUS), slots)
    assert reply == {"ok": True, "ending": False, "servers": [
        {"server": 0, "state": "running", "pid": 100, "returncode": None},
        {"server": 1, "state": "retired", "pid": 101, "returncode": None}]}


@pytest.mark.parametrize("states, request_, replicated, match", [
    (["running", "running"], Request(Op.REMOVE_SERVER, 5), True,
     "no server 5 in this job \\(its server ranks: 0, 1\\)"),
    (["running", "running"], Request(Op.ADD_SERVER, 1), True,
     "server 1 is running: every server slot of this job is in use"),
    (["running", "running"], Request(Op.REMOVE_SERVER, 1), False,
     "PSKV_REPLICAS is not 1.*--env PSKV_REPLICAS:1"),
    (["running"], Request(Op.REMOVE_SERVER, 0), True, "the job has 1 server"),
    (["running", "retiring", "running"], Request(Op.REMOVE_SERVER, 0), True,
     "server 1 is retiring: one server slot is out at a time. First wait until it has "
     "retired"),
    (["running", "retired", "running"], Request(Op.REMOVE_SERVER, 2), True,
     "server 1 is retired: one server slot is out at a time. First add it back "
     "\\(add-server 1\\)"),
    (["exited", "running", "running"], Request(Op.REMOVE_SERVER, 2), True,
     "server 0 is exited.*no other server may leave"),
    (["running", "retiring"], Request(Op.REMOVE_SERVER, 1), True,
     "server 1 is retiring, not running"),
    (["running", "retiring"], Request(Op.ADD_SERVER, 1), True, "server 1 is still retiring"),
    (["running", "retired", "running"], Request(Op.ADD_SERVER, 2), True,
     "server 2 is running, not retired.*server 1 is the one retired"),
    (["exited", "running"], Request(Op.ADD_SERVER, 0), True, "server 0 is exited"),
])
def test_refusals_change_nothing_and_say_why(states: list[str], request_: Request,
                                            replicated: bool, match: str) -> None:
    slots = FakeSlots(states, replicated)
    reply = answer(request_, slots)
    assert reply["ok"] is False and reply["server"] == request_.server
    assert slots.done == []
    assert re.search(match, str(reply["error"])), reply["error"]


def test_no_change_while_the_job_ends() -> None:
    slots = FakeSlots(["running", "retired"])
    slots.why = "every worker has finished"
    reply = answer(Request(Op.ADD_SERVER, 1), slots)
    assert reply["ok"] is False and "every worker has finished" in str(reply["error"])
    assert answer(Request(Op.STATUS), slots)["ending"] is True
    assert slots.done == []


# -- the hand-over: the socket thread waits, the watch loop answers -----------------------
def test_requests_are_answered_by_the_thread_that_serves_them() -> None:
    wake = threading.Event()
    requests = Requests(wake)
    slots = FakeSlots(["running", "running"])
    replies: list[dict[str, object]] = []
    asker = threading.Thread(target=lambda: replies.append(
        requests.submit(Request(Op.REMOVE_SERVER, 0), timeout=10.0)))
    asker.start()
    assert wake.wait(10.0)          # the watch loop is woken, not polled
    served_by: list[str] = []
    slots.retire = lambda s, f=slots.retire: (served_by.append(  # type: ignore[method-assign]
        threading.current_thread().name), f(s))[1]
    requests.serve(slots)
    asker.join(10.0)
    assert replies == [{"ok": True, "server": 0, "state": "retiring", "pid": 100}]
    assert served_by == [threading.current_thread().name]


def test_an_unanswered_request_is_abandoned_and_never_carried_out() -> None:
    requests = Requests(threading.Event())
    reply = requests.submit(Request(Op.REMOVE_SERVER, 0), timeout=0.05)
    assert reply["ok"] is False and "did not take the request" in str(reply["error"])
    slots = FakeSlots(["running", "running"])
    requests.serve(slots)           # the watch loop comes back later: too late
    assert slots.done == []


def test_a_failing_request_is_an_error_reply(caplog: pytest.LogCaptureFixture) -> None:
    requests = Requests(threading.Event())
    slots = FakeSlots(["running", "retired"])

    def broken(server: int) -> Slot:
        raise OSError("no such file")
    slots.rejoin = broken  # type: ignore[method-assign]
    replies: list[dict[str, object]] = []
    asker = threading.Thread(target=lambda: replies.append(
        requests.submit(Request(Op.ADD_SERVER, 1), timeout=10.0)))
    asker.start()
    with caplog.at_level(logging.ERROR, logger="pskv.launch"):
        while asker.is_alive() and not replies:
            requests.serve(slots)
            asker.join(0.01)
    assert replies[0]["ok"] is False and "no such file" in str(replies[0]["error"])


def test_closed_requests_are_refused_at_once() -> None:
    requests = Requests(threading.Event())
    requests.close("the job has ended")
    assert requests.submit(Request(Op.STATUS), timeout=10.0) == {
        "ok": False, "error": "the job has ended"}


# -- flags --------------------------------------------------------------------------------
def test_control_is_a_launch_flag() -> None:
    spec = parse_args(["-n", "1", "-s", "2", "--control", "/run/j.sock", "w"], environ={})
    assert spec.control == "/run/j.sock"
    assert parse_args(["-n", "1", "w"], environ={}).control is None


@pytest.mark.parametrize("launcher, why", [
    ("mpi", "mpirun starts the servers"), ("kubernetes", "pods"), ("ray", "Ray actors"),
])
def test_control_is_refused_where_it_cannot_reach_the_servers(launcher: str,
                                                              why: str) -> None:
    extra = ["--image", "img"] if launcher == "kubernetes" else []
    with pytest.raises(ConfigError, match=f"not --launcher {launcher} \\(.*{why}") as info:
        parse_args(["-n", "1", "--launcher", launcher, *extra, "--control", "/j.sock",
                    "w"], environ={})
    assert "Drop --control" in str(info.value)


def test_control_is_refused_for_ssh(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\n")
    with pytest.raises(ConfigError, match="ssh client does not reach the remote server"):
        parse_args(["-n", "1", "-H", str(hosts), "--control", "/j.sock", "w"], environ={})


@pytest.mark.parametrize("argv, match", [
    (["--status"], "pass its socket with --control PATH"),
    (["--control", "/j.sock", "--status", "--remove-server", "1"], "one request at a time"),
    (["--control", "/j.sock", "--status", "-n", "1"], "drop -n and the command"),
    (["--control", "/j.sock", "--add-server", "1", "--wait", "5"], "not for --add-server"),
    (["--control", "/j.sock", "--remove-server", "-1"], "a server rank is 0 or more"),
    (["--control", "/j.sock", "--remove-server", "1", "--wait", "0"],
     "--wait 0.0: pass a positive number"),
    (["--control", "/j.sock", "--remove-server", "x"], "invalid int value"),
    (["-n", "1", "--wait", "5", "w"], "--wait waits for --remove-server"),
])
def test_client_usage_errors_exit_2(argv: list[str], match: str,
                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 2
    assert match in caplog.text


def test_parse_args_launches_and_refuses_requests() -> None:
    with pytest.raises(ConfigError, match="ask a running job"):
        parse_args(["--control", "/j.sock", "--status"], environ={})
    with pytest.raises(ConfigError, match="required: -n/-np/--num-workers"):
        parse_args(["--control", "/j.sock", "w"], environ={})


@pytest.mark.parametrize("args, kwargs, match", [
    (("reboot",), {}, "unknown request 'reboot'"),
    (("status", 1), {}, "status takes no server rank"),
    (("remove-server",), {}, "remove-server takes a server rank"),
    (("add-server", True), {}, "not a server rank"),
    (("add-server", 1), {"wait": 5.0}, "only 'remove-server' waits"),
    (("status",), {"timeout": 0}, "positive number of seconds"),
])
def test_control_checks_its_arguments_before_connecting(args: tuple, kwargs: dict,
                                                        match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        control("/nonexistent/j.sock", *args, **kwargs)
