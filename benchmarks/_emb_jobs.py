"""The processes ``bench_embeddings.py`` starts: peers' scripts and pskv dist jobs.

- :func:`run_peer` runs one of the peers' scripts in ``../shared/bench/embeddings/``
  under the peer's own interpreter, with the run's workload flags, and parses the JSON
  lines it prints (one per phase).
- :class:`TableJob` runs a pskv cluster on this host: a scheduler, S servers
  (``python -m pskv.server``) and 2 workers (``_emb_dist_worker.py``), each in its own
  session with the ``DMLC_*`` variables, as ``bench_dist.py`` does; it reads the
  servers' resident memory when worker 0 says the table is empty and when it is full, and
  the CPU seconds of every process (``/proc/<pid>/stat``) when worker 0 says a phase
  starts and ends; with a ``profile_dir`` the servers run under ``_emb_server_prof.py``
  and profile one phase (``train``; switched on and off by signals).

Every process has a hard timeout and its process group is killed at the end, on errors
too. Nothing here imports pskv.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common
import _emb_workload as W

__all__ = ["PeerError", "TableJob", "parse_peer_lines", "peer_env", "run_peer"]

WORKER = Path(__file__).resolve().parent / "_emb_dist_worker.py"
SERVER_PROF = Path(__file__).resolve().parent / "_emb_server_prof.py"
NUM_WORKERS = 2

#: pinned to one intra-op thread per process, as the peers' README asks on a small box
THREAD_VARS = {"OMP_NUM_THREADS": "1", "BENCH_THREADS": "1", "MKL_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1"}


class PeerError(RuntimeError):
    """A peer's script or a pskv job failed or timed out."""


def peer_env() -> dict[str, str]:
    """Our environment without cluster variables, threads pinned to one."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "PSKV_", "MXNET_")) and k != "PYTHONPATH"}
    env.update(THREAD_VARS)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def parse_peer_lines(text: str) -> dict[str, dict[str, Any]]:
    """``phase -> record`` of a peer's stdout (JSON objects with a ``phase``; others skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "phase" in rec and "ms_per_batch" in rec:
            out[str(rec["phase"])] = rec
    return out


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_peer(python: str, script: Path, args: list[str], timeout: float) -> dict[str, Any]:
    """Run ``python script args`` in the peers' folder; its records by phase, its log tail."""
    argv = [python, str(script), *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=script.parent, env=peer_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise PeerError(f"{script.name} {' '.join(args)} still running after {timeout:g} s; "
                        "killed") from None
    finally:
        _kill_group(proc)           # spawned children (torch.multiprocessing, DGL servers)
    records = parse_peer_lines(text)
    if proc.returncode != 0 or not records:
        raise PeerError(f"{script.name} {' '.join(args)} exited with code {proc.returncode} "
                        f"and {len(records)} records; log tail:\n{text[-1500:]}")
    return {"records": records, "wall_s": time.monotonic() - t0}


class TableJob:
    """One pskv cluster (scheduler, ``num_servers`` servers, 2 workers) for one table run."""

    def __init__(self, mode: str, num_servers: int, config: dict[str, Any], tmp: Path,
                 tag: str, python: str = sys.executable) -> None:
        self.mode, self.num_servers, self.tag, self.python = mode, num_servers, tag, python
        self.tmp = tmp
        self.markers = tmp / f"{tag}.markers"
        self.markers.mkdir(parents=True, exist_ok=True)
        self.config = dict(config, mode=mode, marker_dir=str(self.markers))
        self.config_path = tmp / f"{tag}.config.json"
        self.config_path.write_text(json.dumps(self.config))
        self.out_prefix = tmp / f"{tag}.out"
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.server_rss: dict[str, list[int | None]] = {}
        #: marker -> {process label: (user, system) CPU seconds} read when worker 0 dropped it
        self.cpu: dict[str, dict[str, tuple[float, float] | None]] = {}
        self.profile_dir = config.get("profile_dir")
        self.profile_phase = config.get("profile_phase", "train")

    def _env(self, role: str, port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DMLC_", "MXNET_")) and k != "PSKV_SECRET"}
        env.update(THREAD_VARS)
        env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(port), "DMLC_NUM_SERVER": str(self.num_servers),
                    "DMLC_NUM_WORKER": str(NUM_WORKERS), "DMLC_NODE_HOST": "127.0.0.1",
                    "PYTHONDONTWRITEBYTECODE": "1"})
        return env

    def _start(self, label: str, argv: list[str], env: dict[str, str]) -> None:
        logf = self.tmp / f"{self.tag}.{label.replace(' ', '')}.log"
        with open(logf, "wb") as f:
            p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=_common.BENCH_DIR,
                                 start_new_session=True)
        self.procs.append((label, p, logf))

    def _servers(self) -> list[subprocess.Popen[bytes]]:
        return [p for lbl, p, _ in self.procs if lbl.startswith("server")]

    def _acknowledge(self) -> None:
        """For every marker worker 0 dropped: read the servers' memory (``before``,
        ``prefilled``) or every process's CPU seconds (``<phase>.start|end``, the servers'
        profilers switched at ``train``'s); then ack it."""
        for mark in sorted(self.markers.iterdir()):
            name = mark.name
            ack = self.markers / f"{name}.ack"
            if name.endswith(".ack") or ack.exists():
                continue
            if name in ("before", "prefilled"):
                rss = [W.rss_of_pid(p.pid) for p in self._servers()]
                self.server_rss[name] = [None if r is None else r["VmRSS"] for r in rss]
            else:
                if self.profile_dir and name == f"{self.profile_phase}.end":
                    self._signal_servers(signal.SIGUSR2)
                self.cpu[name] = {lbl: W.cpu_seconds_of_pid(p.pid)
                                  for lbl, p, _ in self.procs}
                if self.profile_dir and name == f"{self.profile_phase}.start":
                    self._signal_servers(signal.SIGUSR1)
            ack.write_text("ok")

    def _signal_servers(self, sig: int) -> None:
        for p in self._servers():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    def cpu_per_step(self, phase: str, steps: int) -> dict[str, float] | None:
        """CPU ms per step of ``phase`` by role (``worker``, ``server``: summed over the
        processes of the role; ``scheduler``; ``total``; ``system``: the part of the total
        spent in the kernel, sockets mostly), from the readings at its start and end
        markers over ``steps`` steps (warm-up included); None if one is missing."""
        a, b = self.cpu.get(f"{phase}.start"), self.cpu.get(f"{phase}.end")
        if not a or not b or steps <= 0:
            return None
        out: dict[str, float] = {"worker": 0.0, "server": 0.0, "scheduler": 0.0}
        system = 0.0
        for lbl, v0 in a.items():
            v1 = b.get(lbl)
            if v0 is None or v1 is None:
                return None
            role = lbl.split()[0]
            out[role] = out.get(role, 0.0) + 1e3 * (sum(v1) - sum(v0)) / steps
            system += 1e3 * (v1[1] - v0[1]) / steps
        out["total"] = sum(out.values())
        out["system"] = system
        return out

    def run(self, port: int, timeout: float) -> list[dict[str, Any]]:
        """Run the job to its end; the workers' results (by rank). Raises PeerError."""
        try:
            self._start("scheduler", [self.python, "-m", "pskv.server"],
                        self._env("scheduler", port))
            for i in range(self.num_servers):
                argv = [self.python, "-m", "pskv.server"]
                if self.profile_dir:
                    argv = [self.python, str(SERVER_PROF), str(
                        Path(self.profile_dir) / f"server{i}.{self.profile_phase}.prof")]
                self._start(f"server {i}", argv, self._env("server", port))
            wargv = [self.python, str(WORKER), str(self.config_path), str(self.out_prefix)]
            for i in range(NUM_WORKERS):
                self._start(f"worker {i}", wargv, self._env("worker", port))
            deadline = time.monotonic() + timeout
            workers = [w for w in self.procs if w[0].startswith("worker")]
            while any(p.poll() is None for _, p, _ in workers):
                self._acknowledge()
                bad = [w for w in self.procs if w[1].poll() not in (None, 0)]
                if bad:
                    raise PeerError(self._why(bad, "exited with an error"))
                if time.monotonic() > deadline:
                    raise PeerError(self._why([w for w in workers if w[1].poll() is None],
                                              f"still running after {timeout:g} s"))
                time.sleep(0.05)
            bad = [w for w in workers if w[1].returncode != 0]
            if bad:
                raise PeerError(self._why(bad, "exited with an error"))
            return [json.loads(Path(f"{self.out_prefix}.{r}.json").read_text())
                    for r in range(NUM_WORKERS)]
        finally:
            self.kill()

    def _why(self, procs: list[tuple[str, Any, Path]], what: str) -> str:
        parts = []
        for label, p, logf in procs:
            try:
                tail = logf.read_bytes()[-1500:].decode(errors="replace")
            except OSError:
                tail = ""
            parts.append(f"{label} (pid {p.pid}, exit {p.poll()}) {what}; log tail:\n{tail}")
        return f"{self.tag}: " + "\n".join(parts)

    def kill(self) -> None:
        """SIGKILL every process group this job started."""
        for _, p, _ in self.procs:
            _kill_group(p)
