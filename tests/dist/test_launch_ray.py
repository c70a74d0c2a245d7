"""pskv-launch --launcher ray on a real local Ray, which the launcher starts and stops.

Skips when Ray is not installed (``pip install 'pskv[ray]'``). Each job is bounded in time,
and afterwards no process that carries the test's marker variable may be left (Ray's own
daemons included: they inherit the launcher's environment).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from pskv.testing import launch_reports

pytestmark = pytest.mark.dist

pytest.importorskip("ray", reason="Ray is not installed: pip install 'pskv[ray]'")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
MARK = "PSKV_TEST_RAY_MARK"


def marked(mark: str) -> list[int]:
    """Pids of the processes whose environment has MARK=mark."""
    pids = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def launch_ray(*args: str, timeout: float = 240,
               argv: list[str] | None = None) -> tuple[int, str, str]:
    """``pskv-launch --launcher ray ARGS`` (or `argv`) in a subprocess, bounded in time;
    afterwards no process with the test's marker may be left."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({MARK: mark, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    if argv is None:
        argv = [sys.executable, "-m", "pskv.launch", "--launcher", "ray", "--timeout",
                str(timeout - 60), *args]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, cwd=REPO)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        pytest.fail(f"the ray launcher did not finish in {timeout} s:\n{out}\n{err}")
    finally:
        end = time.monotonic() + 20  # Ray's daemons exit a moment after ray.shutdown()
        while marked(mark) and time.monotonic() < end:
            time.sleep(0.2)
        left = marked(mark)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"processes left behind after the job: {left}"
    return p.returncode, out, err


def test_sync_job_on_a_local_ray() -> None:
    rc, out, err = launch_ray("-n", "2", "-s", "1", "--env",
                              "MXNET_KVSTORE_BIGARRAY_BOUND:100", sys.executable,
                              str(SCRIPTS / "sync_sum.py"))
    assert rc == 0, out + err
    rows = {f"[{label}]": r for label, r in launch_reports(out) if label.startswith("worker ")}
    assert set(rows) == {"[worker 0]", "[worker 1]"}, out + err
    for label, row in rows.items():
        assert row["ok"] and label == f"[worker {row['rank']}]"


def test_first_failure_stops_all_and_is_named() -> None:
    rc, out, err = launch_ray("-n", "2", "-s", "1", sys.executable, "-c",
                              "import os, sys, time\n"
                              "if os.environ['DMLC_WORKER_ID'] == '1': sys.exit(3)\n"
                              "time.sleep(120)")
    assert rc == 3, out + err
    assert "worker 1 on " in err and "exited with status 3" in err


def test_a_local_ray_job_lives_on_loopback() -> None:
    """A local Ray started for the job: the scheduler and every listener on 127.0.0.1, as
    under the local launcher (Ray's node address is the machine's external one)."""
    rc, out, err = launch_ray("-n", "2", "-s", "1", "--log-level", "info", sys.executable,
                              "-c", "import os; print('root', os.environ['DMLC_PS_ROOT_URI'])\n"
                              "import pskv as mx, numpy as np\n"
                              "kv = mx.kv.create('dist_sync'); kv.init(0, np.ones(3))\n"
                              "kv.push(0, np.ones(3)); kv.pull(0, out=np.zeros(3))")
    assert rc == 0, out + err
    assert "scheduler at 127.0.0.1:" in err, err
    assert out.count("root 127.0.0.1") == 2, out
    listeners = re.findall(r"tcp:([0-9.]+):\d+", out + err)
    assert listeners and set(listeners) == {"127.0.0.1"}, out + err


def _durable(launcher: str, out: Path, restarts: int, die: int, after: float = 1.2,
             ) -> tuple[int, str, str, dict[str, np.ndarray]]:
    rc, stdout, stderr = launch_ray(argv=[sys.executable, str(SCRIPTS / "ray_durable.py"),
                                          launcher, str(out), str(restarts), str(die),
                                          str(after)])
    if rc != 0:
        return rc, stdout, stderr, {}
    with np.load(out / "weights.npz") as data:
        return rc, stdout, stderr, {k: data[k] for k in data.files}


@pytest.mark.timeout(600)
def test_replicas_keep_a_ray_job_and_a_restarted_server_rejoins(tmp_path: Path) -> None:
    """PSKV_REPLICAS=1 on Ray: a SIGKILLed server's backup serves its shard and the job goes
    on (one WARNING, status 0); with --max-restarts 1 the launcher starts it again in its
    actor as the new backup. Both end with the weights of a run where nothing died."""
    rc, out, err, want = _durable("local", tmp_path / "calm", 0, -1)
    assert rc == 0, out + err
    rc, out, err, kept = _durable("ray", tmp_path / "kept", 0, 0)
    assert rc == 0, out + err
    assert (tmp_path / "kept" / "died-0").exists(), "server 0 was not killed while the job ran"
    assert err.count("its backup serves its shard") == 1, err
    rc, out, err, back = _durable("ray", tmp_path / "back", 1, 1)
    assert rc == 0, out + err
    assert (tmp_path / "back" / "died-1").exists(), "server 1 was not killed while the job ran"
    assert re.search(r"restarting it in [0-9.]+ s \(1 of 1\)", err), err
    for got in (kept, back):
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
