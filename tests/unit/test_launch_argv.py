"""How pskv-launch parses flags and builds each process's argv and environment.

Nothing here starts a process: ssh and mpirun command lines are checked exactly.
"""
from __future__ import annotations

import dataclasses
import logging
import shlex
import socket
import sys

import pytest

from pskv._ps.config import (ENV_NODE_HOST, ENV_NUM_SERVER, ENV_NUM_WORKER, ENV_ROLE,
                             ENV_ROOT_PORT, ENV_ROOT_URI, ENV_SECRET, ENV_SERVER_ID,
                             ENV_WORKER_ID, Role)
from pskv.errors import ConfigError
from pskv.launch import LaunchSpec, build_processes, main, parse_args
from pskv.launch._net import free_port, guess_host_ip
from pskv.launch._env import cluster_env, forwarded_env, get_secret, parse_env_pair
from pskv.launch._hosts import Host, parse_hostfile, place, read_hostfile
from pskv.launch._local import local_processes
from pskv.launch._mpi import mpi_processes, mpirun_argv
from pskv.launch._spec import DEFAULT_SERVER_COMMAND
from pskv.launch._ssh import SSH_OPTIONS, remote_command, ssh_processes
from pskv.launch._supervise import exit_status

SSH = ("ssh", "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes")


def cluster(role: str, *, uri: str = "127.0.0.1", port: int = 9000, workers: int = 2,
            servers: int = 1) -> dict[str, str]:
    return {ENV_ROLE: role, ENV_ROOT_URI: uri, ENV_ROOT_PORT: str(port),
            ENV_NUM_SERVER: str(servers), ENV_NUM_WORKER: str(workers)}


# -- flags ------------------------------------------------------------------------------
def test_defaults() -> None:
    spec = parse_args(["-n", "2", "python", "train.py"], environ={})
    assert spec == LaunchSpec(("python", "train.py"), 2, 2, "local")
    assert spec.num_servers == 2  # -s defaults to -n, as tools/launch.py
    assert spec.launcher == "local"
    assert spec.hostfile is None and spec.timeout is None and spec.port is None
    assert spec.env == spec.env_server == spec.env_worker == ()
    assert spec.server_command == DEFAULT_SERVER_COMMAND == (sys.executable, "-m",
                                                             "pskv.server")
    assert spec.secret is None


def test_long_flags_and_command_remainder() -> None:
    spec = parse_args(["--num-workers", "3", "--num-servers", "1", "--timeout", "2.5",
                       "--port", "9123", "python", "train.py", "-n", "5", "--lr", "0.1"],
                      environ={})
    assert (spec.num_workers, spec.num_servers, spec.timeout, spec.port) == (3, 1, 2.5, 9123)
    # flags after the command belong to the command
    assert spec.command == ("python", "train.py", "-n", "5", "--lr", "0.1")


def test_double_dash_separates_the_command() -> None:
    assert parse_args(["-n", "1", "--", "-weird", "x"], environ={}).command == ("-weird", "x")


def test_hostfile_defaults_to_ssh(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("a\n")
    spec = parse_args(["-n", "1", "-H", str(hosts), "python", "x.py"], environ={})
    assert spec.launcher == "ssh" and spec.hostfile == str(hosts)
    spec = parse_args(["-n", "1", "-H", str(hosts), "--launcher", "mpi", "x"], environ={})
    assert spec.launcher == "mpi"


def test_env_flags() -> None:
    spec = parse_args(["-n", "1", "--env", "A:1", "--env", "URL:http://h:80/x", "--env", "HOME",
                       "--env-server", "S:2", "--env-worker", "W:", "python", "x.py"],
                      environ={"HOME": "/home/me"})
    assert spec.env == (("A", "1"), ("URL", "http://h:80/x"), ("HOME", "/home/me"))
    assert spec.env_server == (("S", "2"),)
    assert spec.env_worker == (("W", ""),)


@pytest.mark.parametrize("text", ["1A:x", "A-B:x", ":x", "A B:x"])
def test_env_bad_names(text: str) -> None:
    with pytest.raises(ConfigError, match="not an environment variable name"):
        parse_env_pair(text)


def test_env_bare_name_must_be_set() -> None:
    with pytest.raises(ConfigError, match=r"NOPE is not set here.*--env NOPE:VALUE"):
        parse_env_pair("NOPE", environ={})


@pytest.mark.parametrize("name", [ENV_ROLE, ENV_ROOT_URI, ENV_ROOT_PORT, ENV_NUM_SERVER,
                                  ENV_NUM_WORKER, ENV_WORKER_ID, ENV_SERVER_ID])
def test_env_cannot_set_cluster_variables(name: str) -> None:
    with pytest.raises(ConfigError, match="the launcher sets"):
        parse_args(["-n", "1", "--env-worker", f"{name}:1", "x"], environ={})


@pytest.mark.parametrize("argv, match", [
    (["python", "x.py"], "required: -n/-np/--num-workers"),
    (["-n", "two", "x"], "invalid int value"),
    (["-n", "0", "x"], "at least one worker"),
    (["-n", "2", "-s", "0", "x"], "at least one server"),
    (["-n", "2"], "no command to launch"),
    (["-n", "2", "--"], "no command to launch"),
    (["-n", "2", "--launcher", "ssh", "x"], "needs a hostfile"),
    (["-n", "2", "--launcher", "sge", "x"], "invalid choice"),
    (["-n", "2", "-H", "hosts", "--launcher", "local", "x"], "takes no hostfile"),
    (["-n", "2", "--port", "70000", "x"], "not a TCP port"),
    (["-n", "2", "--timeout", "0", "x"], "positive number of seconds"),
    (["-n", "2", "--timeout", "inf", "x"], "positive number of seconds"),
    (["-n", "2", "--server-command", "python 'unbalanced", "x"], "--server-command"),
    (["-n", "2", "--server-command", "", "x"], "server_command is empty"),
    (["-n", "2", "--host-ip", "not an ip", "x"], "neither an IP address"),
])
def test_bad_flags(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_args(argv, environ={})
    assert isinstance(info.value, ValueError)


def test_server_command_is_split_not_shelled() -> None:
    spec = parse_args(["-n", "1", "--server-command", "python -c 'print(1); x = \"$HOME\"'",
                       "w"], environ={})
    assert spec.server_command == ("python", "-c", 'print(1); x = "$HOME"')


def test_sync_dst_dir_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pskv.launch"):
        spec = parse_args(["-n", "1", "--sync-dst-dir", "/tmp/x", "w"], environ={})
    assert spec.command == ("w",)
    assert "--sync-dst-dir /tmp/x is ignored" in caplog.text


def test_main_returns_2_on_bad_flags(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="pskv.launch"):
        assert main(["-n", "0", "x"]) == 2
    assert "at least one worker" in caplog.text


def test_main_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--num-workers", "--num-servers", "--hostfile", "--launcher", "--env-server",
                 "--env-worker", "--timeout", "--port", "--sync-dst-dir", "--host-ip"):
        assert flag in out


def test_spec_is_frozen_and_slotted() -> None:
    spec = LaunchSpec(("x",), 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_workers = 3  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")
    assert LaunchSpec(["x", 1], 1).command == ("x", "1")  # type: ignore[arg-type]


# -- environment per role ---------------------------------------------------------------
def test_cluster_env_per_role() -> None:
    spec = LaunchSpec(("w",), 2, 1, env=(("A", "all"), ("B", "all")),
                      env_server=(("B", "server"),), env_worker=(("A", "worker"),))
    def env(role: Role) -> dict[str, str]:
        return cluster_env(spec, role, root_uri="127.0.0.1", port=9000, secret="s3")

    assert env(Role.SCHEDULER) == {
        "A": "all", "B": "server", **cluster("scheduler"), ENV_SECRET: "s3"}
    assert env(Role.SERVER) == {
        "A": "all", "B": "server", **cluster("server"), ENV_SECRET: "s3"}
    assert env(Role.WORKER) == {
        "A": "worker", "B": "all", **cluster("worker"), ENV_SECRET: "s3",
        "WORLD_SIZE": "2"}     # torchrun's variables, RANK only with a rank
    assert ENV_SECRET not in cluster_env(spec, Role.WORKER, root_uri="h", port=1, secret=None)


def test_local_processes() -> None:
    spec = LaunchSpec(("python", "train.py"), 2, 1, server_command=("srv", "--x"),
                      env_worker=(("W", "1"),))
    procs = local_processes(spec, port=9000, secret="s")
    assert [(p.role, p.rank, p.label) for p in procs] == [
        (Role.SCHEDULER, 0, "scheduler"), (Role.SERVER, 0, "server 0"),
        (Role.WORKER, 0, "worker 0"), (Role.WORKER, 1, "worker 1")]
    assert [p.argv for p in procs] == [("srv", "--x")] * 2 + [("python", "train.py")] * 2
    assert dict(procs[0].env) == {**cluster("scheduler"), ENV_SECRET: "s"}
    assert dict(procs[1].env) == {**cluster("server"), ENV_SERVER_ID: "0", ENV_SECRET: "s"}
    # the rank each worker is given is its label's, so [worker 1] is kv.rank 1
    assert dict(procs[3].env) == {"W": "1", **cluster("worker"), ENV_WORKER_ID: "1",
                                  ENV_SECRET: "s", "WORLD_SIZE": "2", "RANK": "1",
                                  "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert all(p.stdin is None for p in procs)


def test_secret_precedence() -> None:
    spec = LaunchSpec(("w",), 1)
    generated = get_secret(spec, {})
    assert len(generated) == 64 and int(generated, 16) >= 0
    assert get_secret(spec, {}) != generated  # one per job
    assert get_secret(spec, {ENV_SECRET: "from-env"}) == "from-env"
    with_flag = LaunchSpec(("w",), 1, env=((ENV_SECRET, "from-flag"),))
    assert get_secret(with_flag, {ENV_SECRET: "from-env"}) == "from-flag"
    explicit = dataclasses.replace(with_flag, secret="explicit")
    assert get_secret(explicit, {ENV_SECRET: "from-env"}) == "explicit"


def test_build_processes_local_shares_port_and_secret() -> None:
    procs = build_processes(LaunchSpec(("w",), 2, 2), environ={})
    envs = [dict(p.env) for p in procs]
    assert len({e[ENV_ROOT_PORT] for e in envs}) == 1
    assert len({e[ENV_SECRET] for e in envs}) == 1
    assert {e[ENV_ROOT_URI] for e in envs} == {"127.0.0.1"}
    assert build_processes(LaunchSpec(("w",), 1), environ={ENV_SECRET: "k"})[0].env[-1] == \
        (ENV_SECRET, "k")


def test_exit_status() -> None:
    assert [exit_status(rc) for rc in (0, 1, 255, -2, -9, -15)] == [0, 1, 255, 130, 137, 143]


# -- hostfiles --------------------------------------------------------------------------
def test_parse_hostfile() -> None:
    text = "# cluster\n\nnode1\nnode2:2222   # comment\n  10.0.0.3 slots=4\n[::1]:23\nfe80::1\n"
    assert parse_hostfile(text) == [Host("node1"), Host("node2", 2222), Host("10.0.0.3", 22, 4),
                                    Host("::1", 23), Host("fe80::1")]


@pytest.mark.parametrize("line, match", [
    ("a:x", "not an ssh port"), ("a:0", "not an ssh port"), ("a:65536", "not an ssh port"),
    ("a slots=x", "cannot read"), ("a b", "cannot read"), ("[::1", "IPv6"), (":22", "empty"),
])
def test_parse_hostfile_errors(line: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_hostfile(line, "hosts")


def test_read_hostfile(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a\nb:2\n")
    assert read_hostfile(str(path)) == [Host("a"), Host("b", 2)]
    path.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="lists no hosts"):
        read_hostfile(str(path))
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "missing"))


# -- ssh --------------------------------------------------------------------------------
def test_place_round_robin_servers_first() -> None:
    a, b = Host("a"), Host("b")
    assert [(r, i, h.name) for r, i, h in place(2, 3, [a, b])] == [
        (Role.SERVER, 0, "a"), (Role.SERVER, 1, "b"),
        (Role.WORKER, 0, "a"), (Role.WORKER, 1, "b"), (Role.WORKER, 2, "a")]


def test_ssh_command_lines() -> None:
    spec = LaunchSpec(("python", "train.py", "--name", "it's me"), 2, 1, hostfile="hosts",
                      server_command=("py", "-m", "pskv.server"), env_worker=(("W", "a b"),))
    hosts = [Host("n1"), Host("n2", 2222)]
    procs = ssh_processes(spec, hosts, port=9000, secret="sec", root_uri="10.0.0.1",
                          cwd="/work dir", environ={"PSKV_CONNECT_TIMEOUT": "5",
                                                    "PSKV_SECRET": "no", "HOME": "/x"})
    sched, server, w0, w1 = procs
    assert sched.argv == ("py", "-m", "pskv.server")
    assert dict(sched.env) == {**cluster("scheduler", uri="10.0.0.1"), ENV_SECRET: "sec",
                               ENV_NODE_HOST: "10.0.0.1"}
    env = ("PSKV_CONNECT_TIMEOUT=5 {extra}DMLC_ROLE={role} DMLC_PS_ROOT_URI=10.0.0.1 "
           "DMLC_PS_ROOT_PORT=9000 DMLC_NUM_SERVER=1 DMLC_NUM_WORKER=2 {rank} "
           "DMLC_NODE_HOST={host}")
    head = "cd '/work dir' && IFS= read -r PSKV_SECRET && export PSKV_SECRET && export "
    assert server.argv == (*SSH, "-p", "22", "n1",
                           head + env.format(role="server", host="n1", extra="",
                                             rank="DMLC_SERVER_ID=0")
                           + " && exec py -m pskv.server")
    assert w0.argv == (*SSH, "-p", "2222", "n2",
                       head + env.format(role="worker", host="n2", extra="W='a b' ",
                                         rank="DMLC_WORKER_ID=0 WORLD_SIZE=2 RANK=0 "
                                              "LOCAL_RANK=0 LOCAL_WORLD_SIZE=1")
                       + " && exec python train.py --name 'it'\"'\"'s me'")
    assert w1.argv[:len(SSH) + 3] == (*SSH, "-p", "22", "n1")
    assert SSH_OPTIONS == SSH[1:]
    for p in (server, w0, w1):
        assert p.stdin == b"sec\n" and p.env == ()
        assert all("sec" not in a for a in p.argv)  # the secret is never on a command line
    assert [(p.role, p.rank) for p in procs] == [
        (Role.SCHEDULER, 0), (Role.SERVER, 0), (Role.WORKER, 0), (Role.WORKER, 1)]


def test_remote_command_round_trips_through_a_shell_parser() -> None:
    argv = ["python", "-c", "print('$HOME; rm -rf /')", "a b", "", "*"]
    cmd = remote_command("/d", {"V": "x; y", "E": ""}, argv, secret_on_stdin=False)
    words = shlex.split(cmd)
    assert words[:7] == ["cd", "/d", "&&", "export", "V=x; y", "E=", "&&"]
    assert words[7:] == ["exec", *argv]


def test_build_processes_ssh(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\nh2:23\n")
    spec = LaunchSpec(("w",), 1, 1, hostfile=str(hosts), host_ip="10.1.2.3", port=9001,
                      secret="k", server_command=("srv",))
    procs = build_processes(spec, environ={}, cwd="/c")
    assert procs[1].argv == (*SSH, "-p", "22", "h1", "cd /c && IFS= read -r PSKV_SECRET && "
                             "export PSKV_SECRET && export DMLC_ROLE=server DMLC_PS_ROOT_URI="
                             "10.1.2.3 DMLC_PS_ROOT_PORT=9001 DMLC_NUM_SERVER=1 "
                             "DMLC_NUM_WORKER=1 DMLC_SERVER_ID=0 DMLC_NODE_HOST=h1 && "
                             "exec srv")
    assert procs[2].argv[:len(SSH) + 3] == (*SSH, "-p", "23", "h2")


# -- mpi --------------------------------------------------------------------------------
def test_mpi_command_lines() -> None:
    spec = LaunchSpec(("python", "train.py"), 4, 2, launcher="mpi", hostfile="hosts",
                      server_command=("py", "-m", "pskv.server"), env_server=(("S", "1"),))
    procs = mpi_processes(spec, port=9000, secret="sec", root_uri="10.0.0.1",
                          environ={"OMP_NUM_THREADS": "2"})
    sched, servers, workers = procs
    assert (sched.role, sched.argv) == (Role.SCHEDULER, ("py", "-m", "pskv.server"))
    assert dict(sched.env) == {**cluster("scheduler", uri="10.0.0.1", workers=4, servers=2),
                               "S": "1", ENV_SECRET: "sec", ENV_NODE_HOST: "10.0.0.1"}
    names = ["-x", "DMLC_ROLE", "-x", "DMLC_PS_ROOT_URI", "-x", "DMLC_PS_ROOT_PORT",
             "-x", "DMLC_NUM_SERVER", "-x", "DMLC_NUM_WORKER", "-x", "PSKV_SECRET"]
    assert servers.argv == ("mpirun", "-n", "2", "--hostfile", "hosts", "-x", "OMP_NUM_THREADS",
                            "-x", "S", *names, "py", "-m", "pskv.server")
    assert workers.argv == ("mpirun", "-n", "4", "--hostfile", "hosts", "-x", "OMP_NUM_THREADS",
                            *names, "-x", "WORLD_SIZE", "python", "train.py")
    assert dict(servers.env) == {"OMP_NUM_THREADS": "2", "S": "1",
                                 **cluster("server", uri="10.0.0.1", workers=4, servers=2),
                                 ENV_SECRET: "sec"}
    assert (servers.rank, workers.rank, servers.label, workers.label) == \
        (None, None, "servers", "workers")
    assert all("sec" not in a for p in procs for a in p.argv)


def test_mpi_without_hostfile() -> None:
    assert mpirun_argv(3, None, [], ("x",)) == ("mpirun", "-n", "3", "x")
    spec = LaunchSpec(("w",), 1, 1, launcher="mpi", host_ip="10.0.0.9", port=9002)
    procs = build_processes(spec, environ={})
    assert procs[2].argv[:4] == ("mpirun", "-n", "1", "-x")
    assert dict(procs[2].env)[ENV_ROOT_URI] == "10.0.0.9"


def test_forwarded_env() -> None:
    environ = {"PSKV_A": "1", ENV_SECRET: "no", "MXNET_KVSTORE_BIGARRAY_BOUND": "9",
               "OMP_NUM_THREADS": "4", "LD_LIBRARY_PATH": "/l", "DMLC_INTERFACE": "eth0",
               "AWS_SECRET_ACCESS_KEY": "no", "PATH": "/bin"}
    assert forwarded_env(environ) == {
        "DMLC_INTERFACE": "eth0", "LD_LIBRARY_PATH": "/l", "MXNET_KVSTORE_BIGARRAY_BOUND": "9",
        "OMP_NUM_THREADS": "4", "PSKV_A": "1"}


# -- ports and addresses ----------------------------------------------------------------
def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_explicit_port_is_used() -> None:
    procs = build_processes(LaunchSpec(("w",), 1, port=12345), environ={})
    assert {dict(p.env)[ENV_ROOT_PORT] for p in procs} == {"12345"}


def test_guess_host_ip_is_not_loopback() -> None:
    try:
        ip = guess_host_ip()
    except ConfigError as err:
        assert "--host-ip" in str(err)
    else:
        assert not ip.startswith("127.") and ip != "::1"


def test_free_port_avoids_the_ephemeral_range() -> None:
    # the OS gives ports of its ephemeral range to any program's bind(0) (srun's I/O, for
    # one): a scheduler port picked there was taken before the scheduler bound it
    from pskv.launch._net import FIRST_PORT, ephemeral_low
    low = ephemeral_low()
    if low - FIRST_PORT < 1000:
        pytest.skip(f"no room below this OS's ephemeral range (it starts at {low})")
    ports = {free_port() for _ in range(20)}
    assert all(FIRST_PORT <= p < low for p in ports), ports
    assert len(ports) > 1          # random, not one port every time
