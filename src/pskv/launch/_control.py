"""The control channel of a running job: remove a server, add it back, ask how the servers are.

``pskv-launch --control PATH ...`` makes the supervisor (``_supervise.py``) listen on a Unix
stream socket at PATH, created with mode 0600 and removed when the job ends. One thread
accepts connections; each connection carries one request line (at most
:data:`MAX_REQUEST` bytes, read within :data:`READ_S` seconds) and gets one JSON line back:

* ``remove-server R``: SIGUSR1 to server R, which retires (its backup takes its shard,
  ``PSKV_REPLICAS=1``) and exits 0; ``{"ok": true, "server": R, "state": "retiring"}``.
* ``add-server R``: start retired server R's command again (``PSKV_RESTART`` one more);
  ``{"ok": true, "server": R, "state": "starting"}``.
* ``status``: ``{"ok": true, "servers": [{"server": 0, "state": "running", "pid": ...}]}``.

A refused request is ``{"ok": false, "error": "..."}``, saying what is wrong and what to do.

Invariant: the socket thread never touches the supervisor's process table. It hands each
parsed request to the watch loop (:class:`Requests`: a queue, then ``wake``) and waits for
the answer, which the watch loop computes with ``_slots.answer`` over the small ``Slots``
interface the supervisor implements; so every change to the job happens in one thread.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import socket
import stat
import tempfile
import threading
import time
from typing import Callable

from ..errors import ClusterTimeoutError, ConfigError
from ._slots import Op, Request, Slots, answer, refuse as _refuse

__all__ = ["MAX_REQUEST", "READ_S", "REPLY_S", "ControlSocket", "Op", "Request", "Requests",
           "ask_cli", "cli_request", "control", "parse_request"]

logger = logging.getLogger(__name__)

#: the longest request line, newline included
MAX_REQUEST = 4096
#: seconds a connection gets to send its line
READ_S = 5.0
#: seconds a request waits for the watch loop's answer (it answers within a poll, 50 ms,
#: unless it is stopping the job)
REPLY_S = 5.0
#: the longest reply a client reads
_MAX_REPLY = 1 << 20
_ACCEPT_POLL_S = 0.2
#: how often ``wait`` asks for the status
_WAIT_POLL_S = 0.2
#: sun_path of struct sockaddr_un holds 108 bytes, the terminating NUL included
_MAX_PATH = 107


def _usage() -> str:
    return ("Send one line: remove-server R, add-server R or status "
            "(pskv-launch --control PATH --remove-server R | --add-server R | --status).")


def parse_request(data: bytes) -> Request:
    """The request in `data` (one line, its newline optional); ValueError saying what is
    wrong.

    Examples
    --------
    >>> parse_request(b'remove-server 2\\n')
    Request(op=<Op.REMOVE_SERVER: 'remove-server'>, server=2)
    >>> parse_request(b'status').line
    'status'
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"the request is not UTF-8 text. {_usage()}") from None
    words = text.strip().split()
    if not words:
        raise ValueError(f"the request is empty. {_usage()}")
    try:
        op = Op(words[0])
    except ValueError:
        raise ValueError(f"unknown request {words[0][:40]!r}. {_usage()}") from None
    if op is Op.STATUS:
        if len(words) != 1:
            raise ValueError(f"status takes no argument. {_usage()}")
        return Request(op)
    if len(words) != 2:
        raise ValueError(f"{op.value} takes one server rank, e.g. '{op.value} 1'.")
    try:
        server = int(words[1])
    except ValueError:
        raise ValueError(f"{op.value} {words[1][:40]!r}: the server rank is not an integer. "
                         f"Pass a rank such as '{op.value} 1' (status lists them).") from None
    return Request(op, server)


# -- the hand-over to the watch loop ---------------------------------------------------
class _Pending:
    """A request waiting for the watch loop; claimed by it, or abandoned by the socket
    thread when no answer came in time (never both: an abandoned request is not done)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.reply: dict[str, object] | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._state = "new"     # new -> claimed -> answered, or new -> abandoned

    def _leave_new(self, state: str) -> bool:
        """Move from ``new`` to ``state``; False if another thread moved it first."""
        with self._lock:
            if self._state != "new":
                return False
            self._state = state
            return True

    def claim(self) -> bool:
        return self._leave_new("claimed")

    def abandon(self) -> bool:
        return self._leave_new("abandoned")

    def answer(self, reply: dict[str, object]) -> None:
        self.reply = reply
        self.done.set()


class Requests:
    """The hand-over from the socket thread to the watch loop: a queue and its wake-up."""

    def __init__(self, wake: threading.Event) -> None:
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._wake = wake
        self._closed: str | None = None

    def submit(self, request: Request, timeout: float = REPLY_S) -> dict[str, object]:
        """Queue `request` and wait up to `timeout` seconds for the watch loop's answer."""
        if self._closed is not None:
            return _refuse(self._closed, request.server)
        pending = _Pending(request)
        self._queue.put(pending)
        self._wake.set()
        if not pending.done.wait(timeout) and pending.abandon():
            return _refuse(f"the launcher did not take the request within {timeout:.3g} s "
                           "(it is stopping the job, or starting it). Ask again.",
                           request.server)
        pending.done.wait(timeout)   # claimed: the watch loop is answering it now
        return pending.reply or _refuse("the launcher did not answer. Ask again.",
                                        request.server)

    def serve(self, slots: Slots) -> None:
        """Answer every queued request (the watch loop calls this)."""
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                return
            if not pending.claim():
                continue
            try:
                reply = answer(pending.request, slots)
            except Exception as err:  # noqa: BLE001 - a bad request never stops the job
                logger.exception("control request %r failed", pending.request.line)
                reply = _refuse(f"the launcher failed to carry out {pending.request.line!r}: "
                                f"{err}")
            if reply.get("ok"):
                logger.info("control: %s: %s", pending.request.line, reply.get("state", "ok"))
            pending.answer(reply)

    def close(self, why: str) -> None:
        """Refuse every queued and later request with `why`."""
        self._closed = why
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                return
            if pending.claim():
                pending.answer(_refuse(why, pending.request.server))


# -- the socket ---------------------------------------------------------------------------
def _check_path(path: str) -> None:
    """ConfigError unless `path` is free, or a stale socket (removed here)."""
    if len(os.fsencode(path)) > _MAX_PATH:
        raise ConfigError(f"--control {path!r} is longer than a Unix socket path may be "
                          f"({_MAX_PATH} bytes). Pass a shorter path.")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"--control {path!r} exists and is not a socket. Pass a path "
                          "that does not exist (pskv-launch creates the socket there).")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)     # stale: the job that made it has ended without removing it
        logger.info("removed the stale control socket %s", path)
        return
    except OSError:
        pass                 # alive but slow: a job listens there
    finally:
        probe.close()
    raise ConfigError(f"--control {path!r}: another pskv-launch listens there. Pass "
                      "another path, or talk to that job with pskv-launch --control "
                      f"{path} --status.")


class ControlSocket:
    """The listening socket at `path` and its accepting thread; `handle` answers a
    request."""

    def __init__(self, path: str, handle: Callable[[Request], dict[str, object]]) -> None:
        self.path = os.path.abspath(path)
        self.handle = handle
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._inode: tuple[int, int] | None = None

    def open(self) -> None:
        """Bind and listen (mode 0600), and start the accepting thread; ConfigError for a
        path that cannot be used."""
        _check_path(self.path)
        # bound in a private directory (0700) and linked into place: nobody can connect
        # before the mode is 0600, and an existing path is never replaced
        where = os.path.dirname(self.path)
        try:
            private = tempfile.mkdtemp(prefix=".pskv-control-", dir=where)
        except OSError as err:
            raise ConfigError(f"--control {self.path!r}: cannot create the socket in "
                              f"{where!r}: {err.strerror}. Pass a path in a directory you "
                              "can write.") from err
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = os.path.join(private, "s")
        try:
            sock.bind(tmp)
            os.chmod(tmp, 0o600)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise ConfigError(f"--control {self.path!r} was created by someone else "
                                  "just now. Pass another path.") from None
            sock.listen(8)
        except BaseException:
            sock.close()
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            os.rmdir(private)
        st = os.lstat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        sock.settimeout(_ACCEPT_POLL_S)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="pskv-launch control",
                                        daemon=True)
        self._thread.start()
        logger.info("control channel at %s (pskv-launch --control %s --status)", self.path,
                    self.path)

    def close(self) -> None:
        """Stop accepting, join the thread, remove the socket file if it is still ours."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(_ACCEPT_POLL_S + READ_S + REPLY_S + 1.0)
        if self._sock is not None:
            self._sock.close()
        try:
            st = os.lstat(self.path)
            if self._inode == (st.st_dev, st.st_ino):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(_ACCEPT_POLL_S)   # e.g. EMFILE: try again, never spin
                continue
            with conn:
                try:
                    self._serve(conn)
                except OSError as err:   # the client went away: its loss only
                    logger.debug("control connection: %s", err)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(READ_S)
        try:
            data = _read_line(conn, MAX_REQUEST)
        except TimeoutError:
            reply = _refuse(f"no request line within {READ_S:.3g} s. {_usage()}")
        except ValueError as err:
            reply = _refuse(str(err))
        else:
            try:
                request = parse_request(data)
            except ValueError as err:
                reply = _refuse(str(err))
            else:
                reply = self.handle(request)
        conn.sendall(json.dumps(reply).encode() + b"\n")


def _read_line(conn: socket.socket, limit: int) -> bytes:
    """Bytes up to the first newline (or the end), at most `limit`; ValueError beyond."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(limit + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > limit and b"\n" not in data[:limit]:
            raise ValueError(f"the request is longer than {limit} bytes. {_usage()}")
    return data.split(b"\n", 1)[0]


# -- the client ---------------------------------------------------------------------------
def _ask(path: str, line: str, timeout: float) -> dict[str, object]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(line.encode() + b"\n")
        data = _read_line(sock, _MAX_REPLY)
    except TimeoutError as err:
        raise ClusterTimeoutError(f"the launcher at {path!r} did not answer {line!r} "
                                  f"within {timeout:.3g} s. Ask again, or raise the "
                                  "timeout.") from err
    except OSError as err:       # no such file, nobody listening, not a socket
        raise ConfigError(f"no pskv-launch listens at {path!r} ({err.strerror}). Pass "
                          "the --control PATH of a running job.") from err
    except ValueError as err:
        raise ConfigError(f"the launcher at {path!r} sent a reply over {_MAX_REPLY} bytes: "
                          "is it a pskv-launch control socket?") from err
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise ConfigError(f"the launcher at {path!r} sent {data[:80]!r}, not a JSON "
                          "object: is it a pskv-launch control socket?")
    return reply


def _server_state(reply: dict[str, object], server: int) -> dict[str, object] | None:
    servers = reply.get("servers")
    if not isinstance(servers, list):
        return None
    return next((s for s in servers if isinstance(s, dict) and s.get("server") == server),
                None)


def control(path: str, request: str, server: int | None = None, *, timeout: float = 10.0,
            wait: float | None = None) -> dict[str, object]:
    """Send one request to the job whose ``pskv-launch --control`` is `path`.

    Parameters
    ----------
    path : str
        The job's control socket (``pskv-launch --control PATH``).
    request : {'remove-server', 'add-server', 'status'}
    server : int, optional
        The server rank, for ``'remove-server'`` and ``'add-server'``.
    timeout : float
        Seconds to wait for the reply.
    wait : float, optional
        ``'remove-server'`` only: then wait up to this many seconds until the server has
        retired (its state ``'retired'``, asking ``status`` every 0.2 s).

    Returns
    -------
    dict
        The launcher's JSON reply: ``{'ok': True, 'server': 2, 'state': 'retiring', ...}``,
        or ``{'ok': False, 'error': '...'}`` for a refused request (or, with `wait`, a
        server that did not retire in time: its last ``'state'`` is included).

    Raises
    ------
    ConfigError
        A bad request or rank, or no job listens at `path`.
    ClusterTimeoutError
        No reply within `timeout`.
    """
    try:
        op = Op(request)
    except ValueError:
        raise ConfigError(f"unknown request {request!r}. Use 'remove-server', 'add-server' "
                          "or 'status'.") from None
    if (op is Op.STATUS) != (server is None):
        raise ConfigError(f"{op.value} takes {'no' if op is Op.STATUS else 'a'} server rank. "
                          "Pass server=R with 'remove-server' and 'add-server' only.")
    if server is not None and (isinstance(server, bool) or not isinstance(server, int)
                               or server < 0):
        raise ConfigError(f"server={server!r} is not a server rank. Pass an int >= 0.")
    if wait is not None and (op is not Op.REMOVE_SERVER or not 0 < wait < float("inf")):
        raise ConfigError(f"wait={wait!r}: only 'remove-server' waits, for a positive "
                          "number of seconds. Leave wait out for the others.")
    if not 0 < timeout < float("inf"):
        raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds.")
    reply = _ask(path, Request(op, server).line, timeout)
    if wait is None or not reply.get("ok"):
        return reply
    assert server is not None
    end = time.monotonic() + wait
    while True:
        try:
            status = _ask(path, Op.STATUS.value, timeout)
        except ConfigError:
            return _refuse(f"the job ended while server {server} was retiring.", server)
        slot = _server_state(status, server)
        state = None if slot is None else slot.get("state")
        if state == "retired":
            return {**reply, "state": "retired"}
        if state != "retiring":
            return {**_refuse(f"server {server} did not retire: it is {state} (returncode "
                              f"{None if slot is None else slot.get('returncode')}). See its "
                              "output.", server), "state": state}
        if time.monotonic() >= end:
            return {**_refuse(f"server {server} is still retiring after {wait:.3g} s. Ask "
                              "status later.", server), "state": state}
        time.sleep(_WAIT_POLL_S)


# -- pskv-launch --control PATH --status | --remove-server R | --add-server R -------------
_REQUEST_FLAGS = ("--remove-server", "--add-server", "--status")


def cli_request(args: argparse.Namespace) -> tuple[str, int | None] | None:
    """The control request of the command line (None: it launches a job); ConfigError for
    a request given with a job's flags, or two requests."""
    given = [(flag, value) for flag, value in zip(_REQUEST_FLAGS, (
        args.remove_server, args.add_server, args.status or None)) if value is not None]
    if not given:
        if args.wait is not None:
            raise ConfigError("--wait waits for --remove-server R to retire. Pass it with "
                              "--control PATH --remove-server R, or drop it.")
        return None
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(f for f, _ in given)}: one request at a time. "
                          "Pass one of them.")
    flag, value = given[0]
    if args.control is None:
        raise ConfigError(f"{flag} asks a running job: pass its socket with --control PATH "
                          "(the --control PATH it was launched with).")
    if args.num_workers is not None or args.command:
        raise ConfigError(f"{flag} asks a running job and launches none: drop -n and the "
                          "command.")
    if args.wait is not None and flag != "--remove-server":
        raise ConfigError(f"--wait waits for --remove-server R to retire, not for {flag}. "
                          "Drop --wait.")
    for name, seconds in (("--wait", args.wait), ("--timeout", args.timeout)):
        if seconds is not None and not 0 < seconds < float("inf"):
            raise ConfigError(f"{name} {seconds}: pass a positive number of seconds.")
    if flag != "--status" and value < 0:
        raise ConfigError(f"{flag} {value}: a server rank is 0 or more. --status lists "
                          "them.")
    return flag[2:], None if flag == "--status" else int(value)


def ask_cli(args: argparse.Namespace, request: str, server: int | None) -> int:
    """Send the request, print the JSON reply (the command's output); 0 when it is ok,
    else 1."""
    try:
        reply = control(args.control, request, server, wait=args.wait,
                        timeout=10.0 if args.timeout is None else args.timeout)
    except (ConfigError, TimeoutError) as err:   # no job at PATH, or no answer in time
        reply = {"ok": False, "error": str(err)}
    print(json.dumps(reply))
    return 0 if reply.get("ok") is True else 1
