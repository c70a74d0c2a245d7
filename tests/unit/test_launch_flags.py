"""pskv-launch's newer flags: --version, -np, -H host:slots lists, --log-level, --log-dir."""
from __future__ import annotations

import logging

import pytest

import pskv
from pskv.errors import ConfigError
from pskv.launch import build_processes, main, parse_args
from pskv.launch._hosts import Host, parse_host_list


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pskv-launch {pskv.__version__}"


def test_np_is_n() -> None:
    assert parse_args(["-np", "3", "x"], environ={}).num_workers == 3


def test_host_list() -> None:
    assert parse_host_list("a:2,b:4,c") == [Host("a", slots=2), Host("b", slots=4), Host("c")]
    with pytest.raises(ConfigError, match="'a:x'"):
        parse_host_list("a:x")


def test_h_takes_a_host_list() -> None:
    spec = parse_args(["-H", "n1:2,n2:1", "-n", "2", "-s", "1", "w"], environ={})
    assert spec.launcher == "ssh" and spec.hosts == "n1:2,n2:1"
    procs = build_processes(spec.__class__(**{**{f: getattr(spec, f) for f in (
        "command", "num_workers", "num_servers", "launcher", "hostfile", "hosts")},
        "host_ip": "10.0.0.1", "port": 9000, "secret": "s"}), environ={}, cwd="/c")
    # slots fill hosts in order: server 0 and worker 0 on n1, worker 1 on n2
    assert [p.argv[7] for p in procs[1:]] == ["n1", "n1", "n2"]


def test_missing_hostfile_is_a_usage_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["-H", "no-such-hosts.txt", "-n", "1", "x"]) == 2
    assert "no-such-hosts.txt" in caplog.text


@pytest.mark.parametrize("argv, env, level", [
    ([], {}, None), (["--log-level", "debug"], {}, "DEBUG"),
    ([], {"PSKV_LOG_LEVEL": "warning"}, "WARNING"),
    (["--log-level", "ERROR"], {"PSKV_LOG_LEVEL": "warning"}, "ERROR")])
def test_log_level(argv: list[str], env: dict[str, str], level: str | None) -> None:
    spec = parse_args([*argv, "-n", "1", "x"], environ=env)
    assert spec.log_level == level
    procs = build_processes(spec, environ={})
    assert {dict(p.env).get("PSKV_LOG_LEVEL") for p in procs} == {level}


def test_bad_log_level() -> None:
    with pytest.raises(ConfigError, match="PSKV_LOG_LEVEL='loud'"):
        parse_args(["-n", "1", "x"], environ={"PSKV_LOG_LEVEL": "loud"})


def test_log_dir() -> None:
    assert parse_args(["--log-dir", "logs", "-n", "1", "x"], environ={}).log_dir == "logs"


def test_every_launcher_name_has_one_registry_row_and_one_way_to_run() -> None:
    """Issue #30: launchers come from one table, not string chains; each builds the
    processes started here or runs the job itself, never both."""
    from pskv.launch._launchers import REGISTRY
    from pskv.launch._spec import LAUNCHERS, MANAGED
    assert tuple(REGISTRY) == LAUNCHERS
    for name, launcher in REGISTRY.items():
        assert (launcher.build is None) != (launcher.run is None), name
        assert launcher.scheduler_here == (name not in MANAGED), name
