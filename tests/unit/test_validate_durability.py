"""The message checks durability added: replication ops, the ``shard`` and ``again``
fields, and the ADMIT fields of a restarted node (``rejoin``, ``server_key``)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pskv._ps import validate
from pskv._ps.message import Command, Meta
from pskv.errors import ProtocolError

F32 = np.zeros(3, np.float32)


def _round(n: int = 1, shard: Any = 0, **changes: Any) -> dict[str, Any]:
    """An ``r_rounds`` message of one round (with ``changes``) said to carry ``n`` arrays."""
    one = {"key": 12, "round": 3, "kind": "d", "applied": [[0, 2], [1, 2]]}
    one.update(changes)
    return {"op": "r_rounds", "shard": shard, "arrays": [n], "rounds": [one]}


def test_a_well_formed_replicated_round_passes() -> None:
    validate.request(Meta(Command.COMMAND, 1, (), _round()), [F32])
    validate.request(Meta(Command.COMMAND, 1, (), _round(2, kind="r")),
                     [np.arange(2), np.zeros((2, 3), np.float32)])


@pytest.mark.parametrize("body, arrays, field", [
    (_round(shard=-1), [F32], "shard"),
    (_round(shard="0"), [F32], "shard"),
    (_round(key="12"), [F32], "key"),
    (_round(round=-4), [F32], "round"),
    (_round(kind="x"), [F32], "kind"),
    (_round(applied=[[0, "2"]]), [F32], "applied"),
    (_round(applied={"0": 2}), [F32], "applied"),
    (_round(0), [], "arrays"),
    (_round(kind="r"), [F32], "arrays"),
    ({"op": "r_init", "shard": 0, "keys": [1, 2], "entries": [{}]}, [F32], "keys"),
    ({"op": "r_state", "shard": 0, "entries": "all"}, [], "entries"),
    ({"op": "r_load", "shard": 0}, [F32], "state bytes"),
    ({"op": "r_restore", "shard": 0, "path": 7}, [], "path"),
    ({"op": "r_optimizer", "shard": 0, "spec": "sgd"}, [], "spec"),
    ({"op": "r_bogus", "shard": 0}, [], "op"),
])
def test_malformed_replication_commands_are_refused(body: dict[str, Any],
                                                    arrays: list[np.ndarray],
                                                    field: str) -> None:
    with pytest.raises(ProtocolError) as err:
        validate.request(Meta(Command.COMMAND, 1, (), body), arrays)
    if field != "arrays":
        assert field in str(err.value)


@pytest.mark.parametrize("cmd, body, ok", [
    (Command.PULL, {"shard": 1}, True),
    (Command.PULL, {"shard": True}, False),
    (Command.PULL, {"shard": -1}, False),
    (Command.PULL, {"shard": [1]}, False),
    (Command.FLUSH, {"shard": "x"}, False),
    (Command.PULL, {"again": 1}, False),
    (Command.COMMAND, {"op": "applied", "shard": 0}, True),
    (Command.COMMAND, {"op": "initial"}, True),
])
def test_the_shard_and_again_fields(cmd: Command, body: dict[str, Any], ok: bool) -> None:
    meta = Meta(cmd, 1, (7,) if cmd == Command.PULL else (), body)
    if ok:
        validate.request(meta, [])
    else:
        with pytest.raises(ProtocolError):
            validate.request(meta, [])


def _admit(**changes: Any) -> dict[str, Any]:
    body = {"role": "server", "rank": 0, "job": "j", "num_workers": 1, "num_servers": 1,
            "servers": [{"tcp": "tcp:127.0.0.1:1"}], "worker_keys": ["k"],
            "server_key": "s", "rejoin": True}
    body.update(changes)
    return body


def test_admit_reply_of_a_restarted_node() -> None:
    assert validate.admit_reply(_admit())["rejoin"] is True
    for bad in (_admit(rejoin="yes"), _admit(server_key=5)):
        with pytest.raises(ProtocolError):
            validate.admit_reply(bad)
