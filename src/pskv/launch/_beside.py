"""Processes started beside a job: sinks of tables' change streams (``--sink KEY=URL``).

A process beside the job is no node of it: it reads tables' change streams as a
``pskv.stream.Reader`` (no worker slot), with the job's variables (a worker's, without
a rank: ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``, ``PSKV_SECRET``...). Rules:

* they start with the job (a reader waits for the scheduler to admit the job);
* one that exits while the job runs fails the job: the launcher's exit status is 1 when
  the job itself succeeded, and the log names the process and its status;
* when the job has ended (its servers gone: they serve stream readers that are behind up
  to ``STREAM_DRAIN`` seconds first, E10), they are sent SIGTERM, then SIGKILL after the
  grace period; a sink writes what it read and exits 0 on SIGTERM.

Only the local launcher starts them (elsewhere start ``python -m pskv.sinks`` beside the
job yourself, with its variables).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import ConfigError

__all__ = ["Beside", "Sidecars", "beside_env", "sink"]

logger = logging.getLogger("pskv.launch")

#: the variables of a worker that name its rank: a process beside the job has none
_RANKED = ("DMLC_WORKER_ID", "DMLC_SERVER_ID", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
           "WORLD_SIZE", "OMP_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class Beside:
    """One process beside the job: its label (``sink emb``) and its argv."""

    label: str
    argv: tuple[str, ...]


def sink(arg: str) -> Beside:
    """The sink ``--sink KEY=URL`` asks for: ``python -m pskv.sinks --key KEY --to URL``.

    Examples
    --------
    >>> s = sink('emb=file:/tmp/out')
    >>> s.label, s.argv[1:]
    ('sink emb', ('-m', 'pskv.sinks', '--key', 'emb', '--to', 'file:/tmp/out'))
    """
    key, eq, url = arg.partition("=")
    if not eq or not key or not url:
        raise ConfigError(f"--sink {arg!r}: give KEY=URL, e.g. --sink emb=file:/data/emb or "
                          "--sink emb=redis://127.0.0.1:6379/0 (docs/embeddings.md, Sinks).")
    return Beside(f"sink {key}", (sys.executable, "-m", "pskv.sinks", "--key", key,
                                  "--to", url))


def beside_env(worker_env: Mapping[str, str]) -> dict[str, str]:
    """The variables of a process beside the job: a worker's, less its rank's."""
    return {k: v for k, v in worker_env.items() if k not in _RANKED}


class Sidecars:
    """The started processes beside a job (each in a process group of its own)."""

    def __init__(self, beside: Sequence[Beside], env: Mapping[str, str],
                 log_dir: str | None = None) -> None:
        self._procs: list[tuple[Beside, subprocess.Popen[bytes]]] = []
        full = {**os.environ, **env}
        for b in beside:
            out = None
            if log_dir is not None:
                os.makedirs(log_dir, exist_ok=True)
                out = open(os.path.join(log_dir, b.label.replace(" ", "-") + ".log"), "ab")
            try:
                popen = subprocess.Popen(b.argv, env=full, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT if out else None,
                                         start_new_session=True)
            except OSError as err:
                self.stop(1.0)
                raise ConfigError(f"cannot start {b.label} ({' '.join(b.argv)}): "
                                  f"{err.strerror}.") from err
            finally:
                if out is not None:
                    out.close()
            self._procs.append((b, popen))
            logger.info("started %s (pid %d)", b.label, popen.pid)

    def exited(self) -> list[str]:
        """``'LABEL (pid P) exited with status S'`` for each one that has exited."""
        out = []
        for b, p in self._procs:
            rc = p.poll()
            if rc is not None:
                status = 128 - rc if rc < 0 else rc
                out.append(f"{b.label} (pid {p.pid}) exited with status {status}")
        return out

    def stop(self, grace: float) -> None:
        """SIGTERM every running one, SIGKILL what still runs after ``grace`` seconds."""
        running = [p for _b, p in self._procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        for p in running:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5.0)
