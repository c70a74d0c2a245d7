"""Shared helpers for the benchmarks: machine and commit info, result files, workers.

Nothing here imports pskv; the benchmark scripts import this module as ``_common`` (they run
as scripts from ``benchmarks/``, so it sits next to them on ``sys.path``).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit_info() -> dict[str, Any]:
    """The commit benchmarked: short hash, and whether tracked files differ from it."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "--short", "HEAD"),
            "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info() -> dict[str, Any]:
    """Platform, Python and NumPy versions, CPU model and count, memory, load average."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "mem_total_gib": mem_total_gib(), "loadavg_at_start": load}


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, relative to the repository (no machine-specific paths)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(REPO_ROOT)
    except ValueError:
        script = Path(script.name)
    return shlex.join(["python", str(script), *argv[1:]])


def timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_results(name: str, data: dict[str, Any], markdown: str,
                  out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"{name}.json", out_dir / f"{name}.md"
    jpath.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    mpath.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return jpath, mpath


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table with aligned columns, for stdout."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


class WorkerError(RuntimeError):
    """A benchmark worker failed, timed out or exited."""


class Worker:
    """A benchmark worker process spoken to in JSON lines, every reply bounded by a timeout.

    Parameters
    ----------
    argv : list of str
        The worker's command line (an argv list, never a shell string).
    env : dict
        Its environment.
    prefix : str
        The marker its reply lines start with; other stdout lines are ignored.
    timeout : float
        Seconds to wait for the first reply (imports) and, by default, for each reply.
    """

    def __init__(self, argv: list[str], env: dict[str, str], prefix: str,
                 timeout: float = 120.0) -> None:
        self.prefix, self.timeout = prefix, timeout
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=env, cwd=BENCH_DIR, text=True,
                                     bufsize=1, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"bench-worker-{self.proc.pid}")
        self._reader.start()
        self.hello = self._reply(timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.prefix):
                self._lines.put(line[len(self.prefix):])
        self._lines.put(None)

    def stderr_tail(self, n: int = 2000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-n:]

    def _reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerError(f"worker gave no reply within {timeout:.0f} s; killed it") from None
        if line is None:
            self.proc.wait(timeout=10)
            raise WorkerError(f"worker exited with code {self.proc.returncode}: "
                              f"{self.stderr_tail()}")
        return json.loads(line)

    def call(self, request: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send one request; return its reply (``{"ok": bool, ...}``)."""
        if self.proc.poll() is not None:
            raise WorkerError(f"worker exited with code {self.proc.returncode}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise WorkerError(f"worker stdin closed: {err}") from err
        return self._reply(self.timeout if timeout is None else timeout)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not exit after SIGKILL", self.proc.pid)

    def close(self) -> None:
        """Ask the worker to quit; kill it if it does not within 30 s."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.kill()
        self._stderr.close()


def push_pull_samples(kv: Any, nd: Any, size: int, iters: int, warmup: int = 3) \
        -> list[float]:
    """Seconds per ``kv.push`` + ``kv.pull`` of a ``size``-element float32 key 0, one sample
    per iteration after ``warmup`` untimed ones (``nd``: the store's ``mx.nd``; this module
    imports no pskv)."""
    import time
    value = nd.array(np.ones(size, np.float32))
    out = nd.zeros((size,))
    kv.init(0, nd.zeros((size,)))
    for _ in range(warmup):
        kv.push(0, value)
        kv.pull(0, out=out)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        kv.push(0, value)
        kv.pull(0, out=out)
        samples.append(time.perf_counter() - start)
    return samples
