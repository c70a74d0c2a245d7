"""``pskv-launch --sink KEY=URL``: what it asks for, and what it refuses (no process is
started here: tests/dist/test_stream_sinks_job.py runs one)."""
from __future__ import annotations

import sys

import pytest

from pskv.errors import ConfigError
from pskv.launch import launch_spec, parse_args
from pskv.launch._beside import beside_env, sink


def test_sink_flags_become_sink_processes():
    spec = parse_args(["-n", "1", "--sink", "emb=file:/tmp/x", "--sink",
                       "user=redis://127.0.0.1:6379/0", "python", "t.py"])
    assert spec.sinks == ("emb=file:/tmp/x", "user=redis://127.0.0.1:6379/0")
    s = sink(spec.sinks[1])
    assert s.label == "sink user"
    assert s.argv == (sys.executable, "-m", "pskv.sinks", "--key", "user", "--to",
                      "redis://127.0.0.1:6379/0")


@pytest.mark.parametrize("bad", ["emb", "=file:/x", "emb="])
def test_a_sink_without_key_or_url_is_refused(bad):
    with pytest.raises(ConfigError, match="give KEY=URL"):
        sink(bad)


def test_sinks_run_beside_local_jobs_only():
    spec = parse_args(["-n", "1", "--launcher", "slurm", "--sink", "emb=file:/x", "true"])
    with pytest.raises(ConfigError, match="local launcher only"):
        launch_spec(spec)


def test_a_process_beside_the_job_gets_no_rank():
    env = beside_env({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "RANK": "0",
                      "PSKV_SECRET": "s", "DMLC_PS_ROOT_PORT": "9"})
    assert env == {"DMLC_ROLE": "worker", "PSKV_SECRET": "s", "DMLC_PS_ROOT_PORT": "9"}
