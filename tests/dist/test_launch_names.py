"""A scheduler address that is a host name, not an IP (Kubernetes, Slurm): binds and runs.

Kubeflow's MXJob gives ``DMLC_PS_ROOT_URI`` as a Service's DNS name and sets
``DMLC_USE_KUBERNETES=1``; the slurm launcher gives the first node's name. Here the names
are ``localhost`` and this machine's host name, with real processes on this machine.
"""
from __future__ import annotations

import io
import socket
import sys
from pathlib import Path

import pytest

from pskv._ps.config import ENV_ROOT_URI
from pskv.launch._net import free_port
from pskv.launch._kubernetes import ENV_USE_KUBERNETES
from pskv.launch._local import local_processes
from pskv.launch._spec import LaunchSpec, ProcessSpec
from pskv.launch._supervise import run_processes
from pskv.testing import launch_reports

pytestmark = pytest.mark.dist

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None, socket.AF_INET)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("name", ["localhost", "hostname"])
@pytest.mark.parametrize("use_kubernetes", [False, True])
def test_a_named_root_uri_runs_a_sync_job(name: str, use_kubernetes: bool) -> None:
    host = socket.gethostname() if name == "hostname" else name
    if not resolves(host):
        pytest.skip(f"{host!r} does not resolve to an IPv4 address on this machine")
    spec = LaunchSpec((sys.executable, str(SCRIPTS / "sync_sum.py")), 2, 2,
                      env=(("MXNET_KVSTORE_BIGARRAY_BOUND", "100"),))
    procs = []
    for p in local_processes(spec, port=free_port("0.0.0.0"), secret="s" * 16):
        env = dict(p.env)
        env[ENV_ROOT_URI] = host
        if use_kubernetes:
            env[ENV_USE_KUBERNETES] = "1"
        procs.append(ProcessSpec(p.role, p.rank, p.argv, tuple(env.items())))
    out, err = io.StringIO(), io.StringIO()
    result = run_processes(procs, timeout=120, grace_period=2, stdout=out, stderr=err)
    assert result.returncode == 0, out.getvalue() + err.getvalue()
    rows = [r for label, r in launch_reports(out.getvalue()) if label.startswith("worker ")]
    assert len(rows) == 2 and all(r["ok"] for r in rows), out.getvalue()
