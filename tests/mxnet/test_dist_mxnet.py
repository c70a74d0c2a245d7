"""Compatibility: one dist_sync scenario on real MXNet 1.9.1 (ps-lite) and on pskv.

The same worker script (tests/dist/scripts/mx_sync_sgd.py: set_optimizer on every worker,
init, several rounds of pushes and pulls) runs with 2 workers and 1 server twice:

* MXNet: the scheduler and the server are ``python -c 'import mxnet'`` with
  ``DMLC_ROLE=scheduler|server`` (MXNet becomes the node at import), the workers run the
  script with ``import mxnet as mx``, all in the MXNet interpreter (``PSKV_MXNET_PYTHON``);
* pskv: the scheduler and the server are ``python -m pskv.server``, the workers run the
  script with ``import pskv as mx``.

Both get the same ps-lite variables on 127.0.0.1; every process has its own process group,
is bounded by a timeout and killed at the end. The pulled numbers must agree.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pskv.launch._net import free_port

pytestmark = pytest.mark.mxnet

ENV_MXNET_PYTHON = "PSKV_MXNET_PYTHON"
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "dist" / "scripts" / "mx_sync_sgd.py"
TIMEOUT = 120.0


def mxnet_python() -> str:
    path = os.environ.get(ENV_MXNET_PYTHON, "")
    if not path or not Path(path).exists():
        pytest.skip(f"no MXNet 1.9.1 interpreter: set {ENV_MXNET_PYTHON} to the python of a "
                    "venv with mxnet==1.9.1 and numpy<1.24 (the README's Tests section "
                    "shows the two commands)")
    return path


def run_cluster(node_argv: list[str], worker_argv: list[str], tmp: Path,
                extra_env: dict[str, str]) -> dict[int, dict[str, Any]]:
    """Scheduler, 1 server, 2 workers; the workers' JSON reports by rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PSKV_", "MXNET_"))}
    env.update({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
                "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "2", "DMLC_NODE_HOST": "127.0.0.1",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra_env})
    roles = [("scheduler", node_argv), ("server", node_argv),
             ("worker", worker_argv), ("worker", worker_argv)]
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for i, (role, argv) in enumerate(roles):
            log = tmp / f"{i}-{role}.log"
            with open(log, "wb") as out:
                procs.append((role, subprocess.Popen(
                    argv, env={**env, "DMLC_ROLE": role}, cwd=REPO, stdout=out,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True), log))
        end = time.monotonic() + TIMEOUT
        for role, popen, _ in procs:
            try:
                popen.wait(max(0.01, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a {role} did not finish within {TIMEOUT} s:\n{dump(procs)}")
        codes = [popen.returncode for _, popen, _ in procs]
        assert codes == [0, 0, 0, 0], dump(procs)
        reports = {}
        for role, _, log in procs:
            for line in log.read_text(errors="replace").splitlines():
                if role == "worker" and line.startswith("{"):
                    report = json.loads(line)
                    reports[report["rank"]] = report
        assert sorted(reports) == [0, 1], dump(procs)
        return reports
    finally:
        for _, popen, _ in procs:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            popen.wait(5)


def dump(procs: list[tuple[str, subprocess.Popen[bytes], Path]]) -> str:
    return "\n".join(f"--- {role} rc={popen.poll()}\n{log.read_text(errors='replace')[-3000:]}"
                     for role, popen, log in procs)


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_dist_sync_sgd_same_numbers_as_mxnet() -> None:
    mxpy = mxnet_python()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "mxnet").mkdir()
        (base / "pskv").mkdir()
        mxnet = run_cluster([mxpy, "-c", "import mxnet"], [mxpy, str(SCRIPT), "mxnet"],
                            base / "mxnet", {"MXNET_ENGINE_TYPE": "NaiveEngine"})
        ours = run_cluster([sys.executable, "-m", "pskv.server"],
                           [sys.executable, str(SCRIPT), "pskv"], base / "pskv",
                           {"PSKV_HEARTBEAT_INTERVAL": "0.5", "PSKV_HEARTBEAT_TIMEOUT": "10",
                            "PSKV_REQUEST_TIMEOUT": "60"})
    for rank in (0, 1):
        assert ours[rank]["num_workers"] == mxnet[rank]["num_workers"] == 2
        want, got = mxnet[rank]["values"], ours[rank]["values"]
        assert len(got) == len(want) == 4
        for step, (w_step, g_step) in enumerate(zip(want, got)):
            for w, g in zip(w_step, g_step):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                           err_msg=f"rank {rank}, round {step}")
    # both workers see the same numbers, which are a local store's with the summed gradients
    assert ours[0]["values"] == ours[1]["values"]
    for step, (w_step, g_step) in enumerate(zip(local_oracle(), ours[0]["values"])):
        for w, g in zip(w_step, g_step):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"round {step}")


def local_oracle() -> list[list[np.ndarray]]:
    """The script's rounds on a pskv 'local' store, both workers' gradients pushed as two
    devices (summed before the update, as the server sums the workers' pushes)."""
    import importlib.util

    import pskv as mx
    spec = importlib.util.spec_from_file_location("mx_sync_sgd", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, wd=0.01,
                                         rescale_grad=0.5))
    keys = sorted(script.SHAPES)
    kv.init(keys, [mx.nd.ones(script.SHAPES[k]) * (k / 10.0) for k in keys])
    values = []
    for step in range(script.ROUNDS):
        kv.push(keys, [[mx.nd.array(script.grad(r, step, k)) for r in (0, 1)] for k in keys])
        values.append([kv.pull(k).asnumpy().ravel() for k in keys])
    assert not np.allclose(values[-1][1], 0.9)      # the updates did something
    return values
