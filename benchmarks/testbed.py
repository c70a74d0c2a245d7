"""A multi-host test bed on one machine: network namespaces as hosts, each with its own sshd.

``HostBed(4)`` makes four "hosts" ``h0`` .. ``h3``. Each is a network namespace with ``lo`` up
and one interface ``eth0`` (a veth pair) at ``10.213.0.{10+i}/24``. The other ends of the
veth pairs sit in a bridge ``br0`` inside a fifth namespace, the switch, so nothing at all is
added to this machine's own network namespace: the test subnet exists only inside the bed.
Every host runs its own ``sshd -D -f <its config>`` that accepts only a key generated for this
bed into a private temporary directory, next to a generated host key and an ssh client config
(``ssh -F``) that logs in as this user with that key, without host-key checks. A directory
with an ``ssh`` wrapper that passes ``-F`` comes first on the ``PATH`` of `HostBed.env`, so
that ``pskv-launch`` and ``mpirun`` (whose ``ssh`` calls take no config option) use the bed.
Links can be rate limited (``tc tbf`` on both ends, e.g. ``1gbit``) and cut
(`HostBed.set_link`).

All hosts share this machine's filesystem, so a command that works here (the same python by
absolute path, the same ``PYTHONPATH``) works on every host. The launcher itself runs on a
host too (``h0``, `HostBed.exec_argv`), so the scheduler is reachable at ``h0``'s address.

`HostBed.down` removes everything `HostBed.up` made and is safe to call twice: it kills every
process in the bed's namespaces by pid (``ip netns pids``), deletes the namespaces (which
deletes the veths and the bridge with them) and the temporary directory. Names carry the
creating process's pid (``pskvbed-<pid>-<token>-h0``); `sweep` removes the beds of creators
that are gone (a test run that was killed). Needs root, ``ip`` (iproute2) with netns support,
``sshd`` and ``ssh``/``ssh-keygen`` (openssh-server, openssh-client); see `missing`.

As a script, for benchmarks::

    python benchmarks/testbed.py up --hosts 4 --rate 1gbit --state /tmp/bed.json
    python benchmarks/testbed.py exec --state /tmp/bed.json h0 -- env   # the bed's PATH etc.
    python benchmarks/testbed.py down --state /tmp/bed.json

See docs/multihost.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["BedError", "BedHost", "HostBed", "NAME_PREFIX", "main", "missing", "sweep"]

log = logging.getLogger(__name__)

NAME_PREFIX = "pskvbed-"
#: the bed's subnet; it exists only inside the bed's namespaces
DEFAULT_SUBNET = "10.213.0"
FIRST_HOST = 10
SSH_PORT = 22
_STEP_S = 20.0          # bound on any one ip/tc/ssh-keygen command
_SBIN = "/usr/sbin:/usr/local/sbin:/sbin"
_ETC_NETNS = "/etc/netns"
_OWNED = re.compile(re.escape(NAME_PREFIX) + r"(\d+)-([0-9a-f]+)-(sw|h\d+)\Z")


class BedError(RuntimeError):
    """The bed could not be made (or a command inside it failed); the message says why."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + _SBIN)


def missing() -> str | None:
    """Why no bed can be made here (not root, no ip netns, no sshd...), or None if it can."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool, package in (("ip", "iproute2"), ("sshd", "openssh-server"),
                          ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")):
        if _which(tool) is None:
            return f"no {tool} binary (apt-get install {package})"
    probe = f"{NAME_PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}"
    ip = _which("ip")
    assert ip is not None
    try:
        made = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True,
                              timeout=_STEP_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"ip netns add failed: {err}"
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run([ip, "netns", "delete", probe], capture_output=True, timeout=_STEP_S)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(argv: Sequence[str], *, check: bool = True,
         timeout: float = _STEP_S) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise BedError(f"{' '.join(argv)} did not finish within {timeout:g} s") from err
    if check and done.returncode != 0:
        raise BedError(f"{' '.join(argv)} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout).strip()}")
    return done


def _netns_list() -> list[str]:
    ip = _which("ip")
    if ip is None:
        return []
    done = _run([ip, "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _kill_netns(ns: str) -> None:
    """SIGKILL every process whose network namespace is `ns`, by pid, then delete it."""
    ip = _which("ip") or "ip"
    for _ in range(20):
        done = _run([ip, "netns", "pids", ns], check=False)
        pids = [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _run([ip, "netns", "delete", ns], check=False)


def sweep() -> list[str]:
    """Delete the namespaces of beds whose creating process is gone; returns their names."""
    gone = []
    for ns in _netns_list():
        m = _OWNED.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_netns(ns)
            shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
            gone.append(ns)
    return gone


@dataclass
class BedHost:
    """One host of the bed: its name (``h0``), namespace, address and sshd."""

    name: str
    netns: str
    address: str
    sshd_pid: int | None = None


@dataclass
class HostBed:
    """`num_hosts` hosts from network namespaces on one bridge, each with an sshd.

    Parameters
    ----------
    num_hosts : int
        How many hosts (``h0`` .. ``h{n-1}``); ``h0`` is where a launcher runs.
    rate : str, optional
        A ``tc`` rate (``1gbit``, ``10gbit``) for every link, both directions; None: none.
    subnet : str
        The first three octets of the bed's /24.
    owner : str, optional
        Goes into the names instead of this process's pid (the script uses ``cli``, so that
        `sweep` leaves its beds alone).
    """

    num_hosts: int = 4
    rate: str | None = None
    subnet: str = DEFAULT_SUBNET
    owner: str | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    workdir: str = ""
    hosts: list[BedHost] = field(default_factory=list)
    switch: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.num_hosts <= 200:
            raise BedError(f"num_hosts={self.num_hosts}: a bed has 1 to 200 hosts")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", self.subnet):
            raise BedError(f"subnet {self.subnet!r}: give three octets, e.g. 10.213.0")
        # the sshd children of this process, to reap them (not a field: not in the state file)
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}
        stem = f"{NAME_PREFIX}{self.owner or os.getpid()}-{self.token}"
        self.switch = self.switch or f"{stem}-sw"
        if not self.hosts:
            self.hosts = [BedHost(f"h{i}", f"{stem}-h{i}", f"{self.subnet}.{FIRST_HOST + i}")
                          for i in range(self.num_hosts)]

    # ---- paths ------------------------------------------------------------------------------
    @property
    def ssh_config(self) -> str:
        """The ssh client config (``ssh -F``): the bed's key, no host-key checks."""
        return os.path.join(self.workdir, "ssh_config")

    @property
    def bin_dir(self) -> str:
        """Holds the ``ssh`` wrapper that adds ``-F ssh_config``; first on `env`'s PATH."""
        return os.path.join(self.workdir, "bin")

    @property
    def head(self) -> BedHost:
        """``h0``: where the launcher (and the scheduler) runs."""
        return self.hosts[0]

    def host(self, name: str) -> BedHost:
        """The host called `name` (``h1``) or with that address."""
        for h in self.hosts:
            if name in (h.name, h.address):
                return h
        raise BedError(f"no host {name!r} in this bed ({', '.join(h.name for h in self.hosts)})")

    # ---- making and removing ----------------------------------------------------------------
    def up(self, sshd_timeout: float = 15.0) -> HostBed:
        """Make the namespaces, links, keys and sshds; on any failure remove them and raise."""
        reason = missing()
        if reason is not None:
            raise BedError(f"cannot make a bed here: {reason}")
        try:
            self._make_files()
            self._make_network()
            for h in self.hosts:
                self._start_sshd(h)
            self._wait_sshd(sshd_timeout)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Remove everything `up` made (idempotent); returns what could not be removed."""
        left: list[str] = []
        for h in self.hosts:
            self.stop_sshd(h)
        present = set(_netns_list())
        for ns in [h.netns for h in self.hosts] + [self.switch]:
            if ns in present:
                _kill_netns(ns)
        present = set(_netns_list())
        left += [ns for ns in [h.netns for h in self.hosts] + [self.switch] if ns in present]
        for ns in [h.netns for h in self.hosts]:
            etc = os.path.join(_ETC_NETNS, ns)
            if os.path.isdir(etc):
                shutil.rmtree(etc, ignore_errors=True)
                if os.path.exists(etc):
                    left.append(etc)
        if self.workdir and os.path.isdir(self.workdir):
            shutil.rmtree(self.workdir, ignore_errors=True)
            if os.path.exists(self.workdir):
                left.append(self.workdir)
        if left:
            log.warning("the bed left behind: %s", ", ".join(left))
        return left

    def __enter__(self) -> HostBed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _make_files(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix=f"{NAME_PREFIX}{self.token}-")
        keygen = _which("ssh-keygen")
        assert keygen is not None
        for key in ("host_ed25519", "id_ed25519"):
            _run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"pskv bed {self.token}",
                  "-f", os.path.join(self.workdir, key)])
        shutil.copyfile(os.path.join(self.workdir, "id_ed25519.pub"),
                        os.path.join(self.workdir, "authorized_keys"))
        # sshd needs its privilege-separation directory; the package makes it at boot
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for h in self.hosts:
            Path(self.workdir, f"sshd_config.{h.name}").write_text(
                f"ListenAddress {h.address}:{SSH_PORT}\n"
                f"HostKey {self.workdir}/host_ed25519\n"
                f"AuthorizedKeysFile {self.workdir}/authorized_keys\n"
                f"PidFile {self.workdir}/sshd.{h.name}.pid\n"
                "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                # the key lives in a fresh 0700 temp dir under /tmp (sticky, world-writable)
                "StrictModes no\nUseDNS no\nPrintMotd no\nX11Forwarding no\n"
                "MaxStartups 100:30:200\nMaxSessions 100\nLogLevel ERROR\n",
                encoding="utf-8")
        user = os.environ.get("USER") or "root"
        Path(self.ssh_config).write_text(
            "Host *\n"
            f"  User {user}\n"
            f"  IdentityFile {self.workdir}/id_ed25519\n"
            "  IdentitiesOnly yes\n  BatchMode yes\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  GlobalKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  ConnectTimeout 5\n"
            # a partitioned host's ssh client gives up after 10 s without the server
            "  ServerAliveInterval 2\n  ServerAliveCountMax 5\n",
            encoding="utf-8")
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: the hosts
        # resolve each other's names (h0, h1, ...) as on a real cluster
        hosts_text = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            os.makedirs(os.path.join(_ETC_NETNS, h.netns), exist_ok=True)
            Path(_ETC_NETNS, h.netns, "hosts").write_text(hosts_text, encoding="utf-8")
        os.makedirs(self.bin_dir)
        ssh = _which("ssh")
        assert ssh is not None
        wrapper = Path(self.bin_dir, "ssh")
        wrapper.write_text(f'#!/bin/sh\nexec {ssh} -F {self.ssh_config} "$@"\n',
                           encoding="utf-8")
        wrapper.chmod(0o755)

    def _make_network(self) -> None:
        ip = _which("ip")
        assert ip is not None
        sw = self.switch
        _run([ip, "netns", "add", sw])
        _run([ip, "-n", sw, "link", "set", "lo", "up"])
        _run([ip, "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run([ip, "-n", sw, "link", "set", "br0", "up"])
        for i, h in enumerate(self.hosts):
            _run([ip, "netns", "add", h.netns])
            _run([ip, "-n", h.netns, "link", "set", "lo", "up"])
            port = f"v{i}"
            _run([ip, "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", h.netns])
            _run([ip, "-n", sw, "link", "set", port, "master", "br0"])
            _run([ip, "-n", sw, "link", "set", port, "up"])
            _run([ip, "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
            _run([ip, "-n", h.netns, "link", "set", "eth0", "up"])
            if self.rate:
                self._limit(h.netns, "eth0")
                self._limit(sw, port)

    def _limit(self, ns: str, dev: str) -> None:
        """A token bucket on `dev`'s egress: at most `rate`, a few ms of burst."""
        tc = _which("tc")
        if tc is None:
            raise BedError("a rate limit needs tc (apt-get install iproute2)")
        assert self.rate is not None
        ip = _which("ip")
        assert ip is not None
        _run([ip, "netns", "exec", ns, tc, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", self.rate, "burst", _burst(self.rate), "latency", "50ms"])

    def _start_sshd(self, h: BedHost) -> None:
        sshd = _which("sshd")
        ip = _which("ip")
        assert sshd is not None and ip is not None
        unshare = _which("unshare")
        if unshare is None:
            raise BedError("no unshare binary (apt-get install util-linux)")
        # its own UTS namespace: every process that logs in gets the host's own hostname, as
        # on separate machines (pskv takes a server with the worker's hostname for a local
        # one and talks to it over a Unix socket); `ip netns exec`, `unshare` and `sh` all
        # exec, so the pid is sshd's, in its own session for cleanup
        argv = [ip, "netns", "exec", h.netns, *_as_host(unshare, h.name), sshd, "-D", "-e",
                "-f", os.path.join(self.workdir, f"sshd_config.{h.name}")]
        with open(os.path.join(self.workdir, f"sshd.{h.name}.log"), "ab") as logf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                    start_new_session=True)
        h.sshd_pid = proc.pid
        self._sshd[h.name] = proc

    def _wait_sshd(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        pending = list(self.hosts)
        last = ""
        while pending:
            h = pending[0]
            done = self.run(self.head, ["ssh", "-o", "ConnectTimeout=2", h.address, "true"],
                            timeout=10, check=False)
            if done.returncode == 0:
                pending.pop(0)
                continue
            last = done.stderr.strip()
            if time.monotonic() > end:
                log_text = Path(self.workdir, f"sshd.{h.name}.log").read_text(
                    encoding="utf-8", errors="replace")
                raise BedError(f"sshd on {h.name} ({h.address}) did not accept the bed's key "
                               f"within {timeout:g} s: {last}; sshd said: {log_text.strip()}")
            time.sleep(0.2)

    # ---- using it -----------------------------------------------------------------------------
    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (``os.environ``) with the ``ssh`` wrapper first on PATH, for mpirun too."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = self.bin_dir + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        # mpirun as root, its ssh agent with the bed's config (OpenMPI's plm_rsh_*), and its
        # own traffic on the bed's subnet only
        env.update({
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_plm_rsh_agent": os.path.join(self.bin_dir, "ssh"),
            "OMPI_MCA_oob_tcp_if_include": f"{self.subnet}.0/24",
            "OMPI_MCA_btl_tcp_if_include": f"{self.subnet}.0/24",
            # PMIx's shared-memory store refuses root ("NO-PERMISSIONS"); its hash store works
            "PMIX_MCA_gds": "hash",
        })
        return env

    def exec_argv(self, host: BedHost | str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: ``ip netns exec <its namespace> argv...``."""
        h = self.host(host) if isinstance(host, str) else host
        ip, unshare = _which("ip"), _which("unshare")
        assert ip is not None and unshare is not None
        return [ip, "netns", "exec", h.netns, *_as_host(unshare, h.name), *argv]

    def run(self, host: BedHost | str, argv: Sequence[str], *, timeout: float,
            check: bool = True, env: Mapping[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on `host` and wait at most `timeout` s (then kill its group and raise)."""
        proc = subprocess.Popen(self.exec_argv(host, argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                env=self.env() if env is None else dict(env),
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise BedError(f"{' '.join(argv)} on {host} did not finish within "
                           f"{timeout:g} s") from exc
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and done.returncode != 0:
            raise BedError(f"{' '.join(argv)} on {host} failed ({done.returncode}): "
                           f"{err.strip()}")
        return done

    def set_link(self, host: BedHost | str, up: bool) -> None:
        """Bring `host`'s ``eth0`` up or down: down partitions it from every other host."""
        h = self.host(host) if isinstance(host, str) else host
        ip = _which("ip")
        assert ip is not None
        _run([ip, "-n", h.netns, "link", "set", "eth0", "up" if up else "down"])

    def stop_sshd(self, host: BedHost | str) -> None:
        """Kill `host`'s sshd: its address then refuses ssh connections."""
        h = self.host(host) if isinstance(host, str) else host
        if h.sshd_pid is not None:
            try:
                os.kill(h.sshd_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc = self._sshd.pop(h.name, None)
            if proc is not None:   # not there for a bed loaded from a state file
                proc.wait(_STEP_S)
            h.sshd_pid = None

    def hostfile(self, hosts: Sequence[BedHost | str], path: str, *,
                 slots: int | None = None) -> str:
        """Write a hostfile of `hosts`' addresses (``addr`` or ``addr slots=N``) to `path`."""
        lines = []
        for host in hosts:
            h = self.host(host) if isinstance(host, str) else host
            lines.append(h.address if slots is None else f"{h.address} slots={slots}")
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    # ---- state file (the script) ------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write what `down` needs (names, pids, temp dir) to `path` as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str) -> HostBed:
        """A bed from a state file written by `save`."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["hosts"] = [BedHost(**h) for h in data["hosts"]]
        return cls(**data)


def _as_host(unshare: str, hostname: str) -> list[str]:
    """The argv prefix that runs a command in a new UTS namespace named `hostname`.

    The name goes to ``sh`` as ``$0`` and the command as ``"$@"``, so nothing is parsed.
    """
    return [unshare, "--uts", "--", "/bin/sh", "-c", 'hostname "$0" && exec "$@"', hostname]


def _burst(rate: str) -> str:
    """About 4 ms of `rate` (at least 64 KiB) as tbf's bucket, e.g. ``1gbit`` -> ``500000``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if m is None:
        raise BedError(f"rate {rate!r}: write it as tc does, e.g. 1gbit or 100mbit")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return str(max(65536, int(bits / 8 * 0.004)))


def main(argv: Sequence[str] | None = None) -> int:
    """``up``, ``down``, ``exec`` or ``sweep`` a bed from the command line."""
    p = argparse.ArgumentParser(description="Make or remove a multi-host test bed of "
                                "network namespaces with sshd (see docs/multihost.md).")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make a bed; writes its state file, prints it")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--rate", help="tc rate for every link, e.g. 1gbit or 10gbit")
    up.add_argument("--subnet", default=DEFAULT_SUBNET)
    up.add_argument("--state", required=True, help="where to write the state file")
    down = sub.add_parser("down", help="remove the bed of a state file")
    down.add_argument("--state", required=True)
    ex = sub.add_parser("exec", help="run a command on a host of the bed, with its env")
    ex.add_argument("--state", required=True)
    ex.add_argument("--timeout", type=float, default=3600.0)
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("sweep", help="remove the beds of test runs that are gone")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="testbed: %(message)s")
    try:
        if args.cmd == "up":
            bed = HostBed(args.hosts, rate=args.rate, subnet=args.subnet, owner="cli").up()
            bed.save(args.state)
            print(json.dumps({"state": args.state, "ssh_config": bed.ssh_config,
                              "PATH": bed.env()["PATH"],
                              "hosts": {h.name: h.address for h in bed.hosts}}, indent=1))
        elif args.cmd == "down":
            left = HostBed.load(args.state).down()
            if not left:
                os.unlink(args.state)
            return 1 if left else 0
        elif args.cmd == "exec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            bed = HostBed.load(args.state)
            proc = subprocess.Popen(bed.exec_argv(args.host, command), env=bed.env(),
                                    start_new_session=True)
            try:
                return proc.wait(timeout=args.timeout)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return 124
        else:
            for ns in sweep():
                print(f"removed {ns}")
    except BedError as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
