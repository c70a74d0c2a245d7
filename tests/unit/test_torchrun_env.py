"""torchrun's variables -> a pskv worker's (issue #29, item 6), without starting a node:
a process that is neither global rank 0 nor a node's local rank 0 starts nothing."""
from __future__ import annotations

import pytest

from pskv.errors import ConfigError
from pskv.kvstore.dist._torchrun import _children, adopt_torchrun

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_a_torchrun_process_becomes_worker_rank_of_world_size():
    env = dict(TORCHRUN, PSKV_SERVERS_PER_NODE="3")
    assert adopt_torchrun(env)
    assert {k: env[k] for k in env if k.startswith("DMLC_")} == {
        "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "5", "DMLC_PS_ROOT_URI": "10.0.0.1",
        "DMLC_PS_ROOT_PORT": "29501", "DMLC_NUM_WORKER": "8", "DMLC_NUM_SERVER": "6"}
    assert _children == []
    env = dict(TORCHRUN, PSKV_SCHEDULER_PORT="7000")
    assert adopt_torchrun(env) and env["DMLC_PS_ROOT_PORT"] == "7000"


def test_dmlc_role_or_a_missing_torchrun_variable_changes_nothing():
    env = dict(TORCHRUN, DMLC_ROLE="worker")
    assert not adopt_torchrun(env) and "DMLC_NUM_WORKER" not in env
    env = {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}
    assert not adopt_torchrun(env) and "DMLC_ROLE" not in env


@pytest.mark.parametrize("change, words", [
    ({"LOCAL_WORLD_SIZE": "3"}, "not a multiple of LOCAL_WORLD_SIZE=3"),
    ({"RANK": "x"}, "RANK='x'"),
    ({"PSKV_SERVERS_PER_NODE": "0"}, "PSKV_SERVERS_PER_NODE='0'"),
])
def test_unusable_torchrun_variables_are_refused_by_name(change, words):
    with pytest.raises(ConfigError, match=words):
        adopt_torchrun({**TORCHRUN, **change})
