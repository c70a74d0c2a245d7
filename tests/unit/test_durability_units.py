"""Durability pieces without sockets: config, launcher flag, push log, engine snapshots and
counters, checkpoint files and resharding (docs/durability.md)."""
from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv._ps.config import ClusterConfig, Role
from pskv._ps.replay import PushLog, backup_of
from pskv.errors import CheckpointError, ConfigError, NodeFailedError, ProtocolError
from pskv.kvstore.engine._core import Engine, EngineEvents, Ticket
from pskv.kvstore.durable._backups import install_copy
from pskv.kvstore.durable._replica import encode_copy
from pskv.kvstore.base import check_optimizer
from pskv.kvstore._snapshot import (MANIFEST, Reader, latest, prune, round_dir, shard_name,
                                    write_manifest, write_shard)
from pskv.launch import parse_args
from pskv.launch._spec import LaunchSpec
from pskv.launch._supervise import run_processes
from pskv.launch._spec import ProcessSpec


def _env(**extra: str) -> dict[str, str]:
    return {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "1", **extra}


def test_config_reads_the_durability_variables() -> None:
    cfg = ClusterConfig.from_env(_env(PSKV_CHECKPOINT_DIR="/ck", PSKV_CHECKPOINT_EVERY="5",
                                      PSKV_CHECKPOINT_KEEP="2", PSKV_REPLICAS="1",
                                      PSKV_MAX_RESTARTS="3", PSKV_RESTART="1"))
    assert (cfg.checkpoint_dir, cfg.checkpoint_every, cfg.checkpoint_keep) == ("/ck", 5, 2)
    assert (cfg.replicas, cfg.max_restarts, cfg.restart) == (1, 3, 1)


@pytest.mark.parametrize("extra, match", [
    ({"PSKV_CHECKPOINT_EVERY": "5"}, "needs PSKV_CHECKPOINT_DIR"),
    ({"PSKV_REPLICAS": "2"}, "at most one backup"),
    ({"PSKV_REPLICAS": "1", "DMLC_NUM_SERVER": "1"}, "at least 2 servers"),
    ({"PSKV_CHECKPOINT_KEEP": "0"}, "at least 1"),
])
def test_config_refuses_bad_durability_settings(extra: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ClusterConfig.from_env(_env(**extra))


def test_max_restarts_flag() -> None:
    assert parse_args(["-n", "2", "--max-restarts", "3", "python", "t.py"]).max_restarts == 3
    assert parse_args(["-n", "2", "python", "t.py"]).max_restarts == 0
    with pytest.raises(ConfigError, match="negative"):
        LaunchSpec(("python",), 1, max_restarts=-1)
    # mpirun starts the processes and ends the job when one dies: it cannot restart one
    # (kubernetes can: the kubelet restarts the container, tests/unit/test_k8s_restarts.py;
    # ray can: the launcher starts the process again in its actor, test_launch_ray.py)
    with pytest.raises(ConfigError, match="--max-restarts works with.*mpirun"):
        LaunchSpec(("python",), 1, max_restarts=1, launcher="mpi")
    assert LaunchSpec(("python",), 1, max_restarts=1, launcher="ray").max_restarts == 1


def test_supervisor_restarts_a_dead_worker_with_its_rank(tmp_path: Path) -> None:
    # exits 3 on its first run, 0 on its restart; reports what it was given
    body = ("import os, sys\n"
            f"open({str(tmp_path / 'runs')!r}, 'a').write(os.environ['PSKV_RESTART'] + "
            "os.environ['DMLC_WORKER_ID'] + os.environ['PSKV_MAX_RESTARTS'] + '\\n')\n"
            "sys.exit(3 if os.environ['PSKV_RESTART'] == '0' else 0)\n")
    spec = ProcessSpec(Role.WORKER, 1, (sys.executable, "-c", body),
                       (("DMLC_WORKER_ID", "1"),))
    out = io.StringIO()
    result = run_processes([spec], max_restarts=2, stdout=out, stderr=out)
    assert result.returncode == 0
    assert (tmp_path / "runs").read_text().split() == ["012", "112"]
    failing = ProcessSpec(Role.WORKER, 0, (sys.executable, "-c", "raise SystemExit(4)"))
    assert run_processes([failing], max_restarts=1, stdout=out, stderr=out).returncode == 4


def test_no_restart_once_the_scheduler_has_exited(tmp_path: Path) -> None:
    """The job is over once its scheduler exited (a failed job's scheduler ends cleanly): a
    worker that fails then is the job's end, not a restart that waits out its connect
    timeout for a scheduler that is gone (the long chaos soak restarted 17 so)."""
    gone = tmp_path / "scheduler-gone"
    scheduler = ProcessSpec(Role.SCHEDULER, None, (
        sys.executable, "-c", f"open({str(gone)!r}, 'w').close()"))
    body = ("import os, sys, time\n"
            f"open({str(tmp_path / 'runs')!r}, 'a').write('run\\n')\n"
            f"while not os.path.exists({str(gone)!r}): time.sleep(0.01)\n"
            "time.sleep(0.2)\n"
            "sys.exit(5)\n")
    worker = ProcessSpec(Role.WORKER, 0, (sys.executable, "-c", body),
                         (("DMLC_WORKER_ID", "0"),))
    out = io.StringIO()
    result = run_processes([scheduler, worker], max_restarts=3, stdout=out, stderr=out,
                           timeout=60)
    assert result.returncode == 5 and result.failed is not None
    assert result.failed.label == "worker 0"
    assert (tmp_path / "runs").read_text().split() == ["run"]


def test_a_server_killed_as_the_job_ends_leaves_its_status_0(tmp_path: Path,
                                                             caplog: Any) -> None:
    """A server killed (the chaos soak's SIGKILL) while its restart waits out its back-off,
    and meanwhile every worker exits 0 and the scheduler ends the job: the job succeeded,
    its status is 0 (it was 137 when the supervisor saw the server before the workers)."""
    dead = tmp_path / "server-dead"
    wait = f"import os, time\nwhile not os.path.exists({str(dead)!r}): time.sleep(0.01)\n"
    scheduler = ProcessSpec(Role.SCHEDULER, None, (sys.executable, "-c", wait))
    server = ProcessSpec(Role.SERVER, 0, (sys.executable, "-c", (
        f"import os, signal\nopen({str(dead)!r}, 'w').close()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")), (("DMLC_SERVER_ID", "0"),))
    worker = ProcessSpec(Role.WORKER, 0, (sys.executable, "-c", wait),
                         (("DMLC_WORKER_ID", "0"),))
    out = io.StringIO()
    caplog.set_level("WARNING", logger="pskv.launch._supervise")
    result = run_processes([scheduler, server, worker], max_restarts=3, stdout=out,
                           stderr=out, timeout=60)
    assert result.returncode == 0, out.getvalue()
    assert result.failed is None
    # whichever the supervisor saw first, the workers' exits or the server's death
    assert "server 0 (pid" in caplog.text and (
        "after every worker had finished; the job's status stays 0" in caplog.text or
        "after the scheduler ended the job; the workers' statuses decide" in caplog.text)


def test_backup_placement_rule() -> None:
    assert [backup_of(s, s, 3) for s in range(3)] == [1, 2, 0]
    assert backup_of(0, 1, 3) == 0        # taken over by server 1: its restart backs it up


def test_push_log_sends_again_what_was_not_applied() -> None:
    log = PushLog(keep=3)
    for i in range(5):
        log.record(0, [10, 12], "dr", [np.full(2, i), np.array([i]), np.full((1, 2), i)])
    log.record(1, [10], "d", [np.zeros(2)])
    again = log.since(0, {10: 3, 12: 4})
    assert [(pk, kind) for pk, kind, _, _ in again] == [(10, "d"), (10, "d"), (12, "r")]
    assert [int(arrays[0][0]) for _pk, _kind, arrays, _ in again] == [3, 4, 4]
    assert log.since(0, {10: 5, 12: 5}) == []
    with pytest.raises(NodeFailedError, match="no longer keeps push 2"):
        log.since(0, {10: 1, 12: 5})


def test_push_log_drops_pushes_a_restarted_worker_makes_again() -> None:
    log = PushLog(keep=0)
    log.applied_before(0, {10: 2})
    assert log.skipping
    keys, body, arrays = log.drop_applied(0, [10, 12], {"kinds": "dd"}, [np.ones(1), np.zeros(1)])
    assert (keys, body["kinds"], len(arrays)) == ([12], "d", 1)
    keys, _, _ = log.drop_applied(0, [10], {"kinds": "d"}, [np.ones(1)])
    assert keys == [] and not log.skipping
    keys, _, _ = log.drop_applied(0, [10], {"kinds": "d"}, [np.ones(1)])
    assert keys == [10]


def test_engine_counts_each_workers_held_pushes() -> None:
    # held: applied, in the open round, or deferred to the next (a restarted worker skips
    # them all; test_engine.py has why)
    engine = Engine(num_workers=2)
    engine.init(5, np.zeros(3, np.float32))
    engine.push(5, 0, [np.ones(3, np.float32)], "d")
    engine.push(5, 0, [np.ones(3, np.float32)], "d")      # next round: waits
    assert engine.applied_by(0) == [[5, 2]] and engine.applied_by(1) == [[5, 0]]
    engine.push(5, 1, [np.ones(3, np.float32)], "d")      # round 1 closes, 2 opens
    assert engine.applied_by(0) == [[5, 2]] and engine.applied_by(1) == [[5, 1]]
    asyn = Engine(num_workers=2, sync=False)
    asyn.init(5, np.zeros(3, np.float32))
    for _ in range(3):
        asyn.push(5, 1, [np.ones(3, np.float32)], "d")
    assert asyn.applied_by(1) == [[5, 3]] and asyn.applied_by(0) == [[5, 0]]


def test_engine_round_observer_runs_before_answers() -> None:
    seen: list[Any] = []

    class Answers(EngineEvents):
        def done(self, engine: Engine, ticket: Ticket) -> None:
            seen.append("answer")
    engine = Engine(num_workers=1, events=Answers())

    class Observer:
        wants_merged = True

        def round_applied(self, key: Any, merged: Any, rnd: int,
                          applied: dict[int, int]) -> None:
            seen.append((key, merged.asnumpy().tolist(), rnd, dict(applied)))
    engine.observer = Observer()
    engine.init(1, np.zeros(2, np.float32))
    ticket = Ticket(None, 1, None, (1,))
    engine.hold(ticket)
    engine.push(1, 0, [np.full(2, 3, np.float32)], "d", ticket)
    engine.release(ticket)
    assert seen == [(1, [3.0, 3.0], 1, {0: 1}), "answer"]
    backup = Engine(num_workers=1)
    backup.init(1, np.zeros(2, np.float32))
    backup.replay(1, mx.nd.array([3.0, 3.0]), 1, {0: 1})
    assert backup.stored[1].asnumpy().tolist() == [3.0, 3.0] and backup.applied_by(0) == [[1, 1]]


def _shard(tmp: Path, index: int, parts: list[tuple[int, int]], full: np.ndarray) -> None:
    engine = Engine()
    engine.set_optimizer_spec(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9).to_spec())
    for i, (a, b) in enumerate(parts):
        engine.init(i, full.reshape(-1)[a:b], name="k", place=(a, b, full.shape))
        engine.apply(i, mx.nd.array(np.arange(a, b, dtype=np.float32)))
    write_shard(engine.snapshot(), str(tmp), index)


def test_reader_cuts_values_and_states_to_any_placement(tmp_path: Path) -> None:
    full = np.arange(12, dtype=np.float32).reshape(3, 4)
    _shard(tmp_path, 0, [(0, 5)], full)
    _shard(tmp_path, 1, [(5, 12)], full)
    write_manifest(str(tmp_path), 2, 7, "dist_sync")
    reader = Reader(str(tmp_path))
    got = reader.value("k", 3, 9, (6,))
    # SGD(lr 0.5, momentum 0.9) on zero momentum: w - 0.5 * g, with g = the element index
    np.testing.assert_array_equal(got, np.arange(3, 9) * 0.5)
    state = reader.state("k", 3, 9, (6,))
    np.testing.assert_array_equal(state.asnumpy(), -0.5 * np.arange(3, 9))
    whole = Engine()
    whole.init("k", np.zeros((3, 4), np.float32))
    whole.restore(reader)
    np.testing.assert_array_equal(whole.stored["k"].asnumpy(), (full * 0.5))
    assert whole.updater is not None
    reader.close()


def test_incomplete_and_foreign_checkpoints_are_refused(tmp_path: Path) -> None:
    write_manifest(str(tmp_path), 2, None, "local")
    with pytest.raises(CheckpointError, match="incomplete: shard-00000.npz"):
        Reader(str(tmp_path))
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="is not a manifest"):
        Reader(str(tmp_path))
    np.save(tmp_path / shard_name(0), np.zeros(2))
    with pytest.raises(CheckpointError):
        write_manifest(str(tmp_path), 1, None, "local")
        Reader(str(tmp_path))


def test_latest_and_prune_keep_the_newest_complete(tmp_path: Path) -> None:
    engine = Engine()
    engine.init("k", np.zeros(2, np.float32))
    for rnd in (2, 4, 6, 8):
        d = round_dir(str(tmp_path), rnd)
        write_shard(engine.snapshot(), d, 0)
        if rnd != 8:                      # round 8's manifest is not written yet
            write_manifest(d, 1, rnd, "local")
    assert latest(str(tmp_path)) == round_dir(str(tmp_path), 6)
    prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(round_dir("", r))
                                            for r in (4, 6, 8)]


def test_push_log_forgets_acknowledged_pushes() -> None:
    log = PushLog(keep=8)
    for i in range(4):
        log.record(0, [10], "d", [np.full(1, i)])
    counts = log.counts(0, [10])
    log.record(0, [10], "d", [np.full(1, 4)])
    log.forget(0, counts)                 # a pull sent after push 4 was answered
    assert [int(a[0][0]) for _pk, _k, a, _ in log.since(0, {10: 4})] == [4]
    with pytest.raises(NodeFailedError):
        log.since(0, {10: 2})


def test_push_log_reuses_buffers_of_forgotten_pushes_without_mixing_them_up() -> None:
    log = PushLog(keep=3)
    grad = np.zeros(5, np.float32)
    for value in (1, 2):
        grad[:] = value                    # the caller reuses its gradient buffer
        log.record(0, [7], "d", [grad])
    grad[:] = -1
    first, second = (arrays[0] for _pk, _k, arrays, _ in log.since(0, {7: 0}))
    assert (float(first[0]), float(second[0])) == (1.0, 2.0)   # copies, not the caller's
    log.forget(0, {7: 1})                  # push 1 acknowledged: its buffer is free
    log.record(0, [7], "d", [np.full(5, 3, np.float32)])
    kept = [arrays[0] for _pk, _k, arrays, _ in log.since(0, {7: 1})]
    assert [float(a[0]) for a in kept] == [2.0, 3.0]
    assert kept[1] is first                # push 3 went into push 1's buffer
    assert kept[0] is second               # push 2's copy untouched


def test_periodic_copies_write_one_copy_once_every_key_reached_the_round() -> None:
    from pskv.kvstore.durable._snapshots import PeriodicCopies
    written: list[tuple[int, list[Any]]] = []
    engine = Engine(num_workers=1)
    engine.init(1, np.zeros(2, np.float32))
    engine.init(2, np.zeros(2, np.float32))
    engine.observer = PeriodicCopies(engine, 2, lambda rnd, copy: written.append(
        (rnd, [m["id"] for m in copy.entries])))
    for _ in range(2):
        engine.push(1, 0, [np.ones(2, np.float32)], "d")
    assert written == []                      # key 2 has not reached round 2
    for _ in range(2):
        engine.push(2, 0, [np.ones(2, np.float32)], "d")
    assert written == [(2, [1, 2])]


def test_a_shard_sends_a_round_to_its_backup_before_its_periodic_copy() -> None:
    from pskv.kvstore.durable._shards import Shard
    order: list[str] = []

    class Repl:
        def round(self, key: Any, merged: Any, rnd: int, applied: dict[int, int]) -> None:
            order.append(f"backup {key}:{rnd}:{merged.asnumpy().tolist()}")

    class Periodic:
        wants_merged = False

        def round_applied(self, key: Any, merged: Any, rnd: int,
                          applied: dict[int, int]) -> None:
            order.append(f"copy {key}:{rnd}")
    engine = Engine(num_workers=1)
    engine.init(3, np.zeros(1, np.float32))
    engine.observer = Shard(0, engine, replicator=Repl(), periodic=Periodic())  # type: ignore[arg-type]
    engine.push(3, 0, [np.full(1, 5, np.float32)], "d")
    assert order == ["backup 3:1:[5.0]", "copy 3:1"]



def test_a_primary_reads_every_buffered_acknowledgment_before_it_sleeps(monkeypatch: Any) \
        -> None:
    """A step of many keys (ResNet-50: 71 and 100 rounds per shard) leaves more of the
    backup's acknowledgments in the connection's read buffer than one read hands out; poll
    does not see them there, so the primary must read on, not sleep until its poll times
    out (it slept 0.5 s a step, most of what replication cost for many keys)."""
    from types import SimpleNamespace

    from pskv._ps.message import Command, Meta
    from pskv.kvstore.durable import _replica
    from pskv.kvstore.durable._replica import Replicator

    class Buffered:
        """A link whose acknowledgments all arrived: held in its read buffer, where poll
        does not look, and handed out ``limit`` at a time (the Connection contract)."""
        peer, max_bytes = "server 1", None

        def __init__(self, n: int) -> None:
            self.held = [Meta(Command.ACK, ts) for ts in range(1, n + 1)]

        def receive(self, alloc_for: Any = None, limit: int = 64) -> list[Any]:
            got, self.held = self.held[:limit], self.held[limit:]
            return [(meta, []) for meta in got]

        def pollable(self) -> int:
            return -1

        def close(self) -> None:
            pass

    class NoPoll:
        def register(self, *args: Any) -> None:
            pass

        def poll(self, *args: Any) -> list[Any]:
            raise AssertionError("the primary slept with acknowledgments it had not taken")

    monkeypatch.setattr(_replica.zmq, "Poller", NoPoll)
    n = 3 * 64 + 5
    repl = Replicator.__new__(Replicator)
    repl.cfg = SimpleNamespace(request_timeout=5.0)  # type: ignore[assignment]
    repl.backup, repl._conn, repl._outstanding = 1, Buffered(n), set(range(1, n + 1))
    repl._batch, repl._batch_bytes, repl._copy = [], 0, None
    repl.drain()
    assert repl.pending == 0 and repl.up        # every one taken, and the link kept


class _Link:
    """A primary's link to its backup, without sockets: what is sent (copied as it goes,
    as a socket would), each acknowledged at once."""
    peer, max_bytes = "server 1", None

    def __init__(self) -> None:
        self.sent: list[tuple[dict[str, Any], list[np.ndarray]]] = []
        self.acks: list[Any] = []

    def send(self, cmd: Any, ts: int = 0, keys: Any = (), body: Any = None,
             arrays: Any = ()) -> None:
        from pskv._ps.message import Command, Meta
        self.sent.append((body, [np.array(a) for a in arrays]))
        self.acks.append((Meta(Command.ACK, ts), []))

    def receive(self, alloc_for: Any = None, limit: int = 64) -> list[Any]:
        got, self.acks = self.acks[:limit], self.acks[limit:]
        return got

    def pollable(self) -> int:
        return -1

    def close(self) -> None:
        pass


def _linked(engine: Engine) -> tuple[Any, _Link]:
    from types import SimpleNamespace

    from pskv.kvstore.durable._replica import Replicator
    from pskv.kvstore.durable._shards import Shard
    repl = Replicator.__new__(Replicator)
    link = _Link()
    repl.cfg = SimpleNamespace(request_timeout=5.0,  # type: ignore[assignment]
                               max_message_bytes=4 << 30)
    repl.engine, repl.shard, repl.backup, repl.endpoints = engine, 0, 1, {}
    repl._conn, repl._ts, repl._outstanding, repl._batch = link, 0, set(), []
    repl._batch_bytes, repl._ring, repl._copy, repl._held = 0, None, None, []
    repl._copy_over = True
    shard = Shard(0, engine, replicator=repl)
    engine.observer = shard
    return shard, link


def test_the_rounds_of_one_request_reach_the_backup_as_one_message() -> None:
    from pskv._ps import validate
    from pskv._ps.message import Command, Meta
    from pskv._ps.ops import ReplOp, parse
    engine = Engine(num_workers=1)
    engine.set_optimizer_spec(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9).to_spec())
    for k in range(3):
        engine.init(k, np.zeros(4, np.float32))
    shard, link = _linked(engine)
    for k in range(3):                      # one push message of three keys
        engine.push(k, 0, [np.full(4, k + 1.0, np.float32)], "d")
    assert link.sent == []                  # queued: nothing is answered yet
    shard.forward(ReplOp.OPTIMIZER, {"spec": None})     # another change: the rounds first
    (body, arrays), (after, _) = link.sent
    assert parse(body) is ReplOp.ROUNDS and parse(after) is ReplOp.OPTIMIZER
    assert [r["key"] for r in body["rounds"]] == [0, 1, 2]
    assert sum(body["arrays"]) == len(arrays)
    validate.request(Meta(Command.COMMAND, 1, (), body), arrays)    # well formed
    pos = 0
    for k, (one, n) in enumerate(zip(body["rounds"], body["arrays"])):
        if one["kind"] != "f":              # a logged round: the merged push
            np.testing.assert_array_equal(arrays[pos], np.full(4, k + 1.0, np.float32))
        pos += n
    engine.push(0, 0, [np.ones(4, np.float32)], "d")    # one round alone: a batch of one
    shard.replicator.drain()
    assert parse(link.sent[-1][0]) is ReplOp.ROUNDS and shard.replicator.pending == 0
    assert len(link.sent[-1][0]["rounds"]) == 1


def test_with_a_ring_the_rounds_arrays_go_through_shared_memory_and_come_out_equal() -> None:
    """A backup on the same host maps the primary's ring (``_ps/ring.py``): the batch's
    message names where each array lies and carries none; read back they are the
    rounds' values, and the message passes the backups' checks."""
    import os

    from pskv._ps import ring as ringmod, validate
    from pskv._ps.message import Command, Meta
    from pskv._ps.ops import ReplOp, parse
    if not ringmod.supported():
        pytest.skip("no sealed memfds here")
    engine = Engine(num_workers=1)
    engine.set_optimizer_spec(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9).to_spec())
    for k in range(3):
        engine.init(k, np.zeros(4, np.float32))
    shard, link = _linked(engine)
    shard.replicator._ring = ringmod.RingWriter(1 << 16)
    reader = ringmod.RingReader.open(os.dup(shard.replicator._ring.fd), 1 << 16, "s0")
    for k in range(3):
        engine.push(k, 0, [np.full(4, k + 1.0, np.float32)], "d")
    shard.replicator.drain()
    (body, arrays), = link.sent
    assert parse(body) is ReplOp.ROUNDS and arrays == []
    assert len(body["ring"]) == sum(body["arrays"]) and len(body["rounds"]) == 3
    validate.request(Meta(Command.COMMAND, 1, (), body), arrays)
    got = reader.read(body["ring"], lambda i, d, s: None, 1 << 20)
    pos = 0
    for k, (one, n) in enumerate(zip(body["rounds"], body["arrays"])):
        if one["kind"] != "f":              # a logged round: the merged push
            np.testing.assert_array_equal(got[pos], np.full(4, k + 1.0, np.float32))
        pos += n
    bad = {**body, "ring": body["ring"][:-1]}               # an entry short
    with pytest.raises(ProtocolError):
        validate.request(Meta(Command.COMMAND, 1, (), bad), [])
    with pytest.raises(ProtocolError):                      # entries and arrays at once
        validate.request(Meta(Command.COMMAND, 1, (), body), [np.zeros(4, np.float32)])
    with pytest.raises(ProtocolError):
        validate.request(Meta(Command.COMMAND, 1, (), {"op": "r_ring", "shard": 0,
                                                       "bytes": 0}), [])


def test_a_round_is_sent_before_a_deferred_push_reuses_its_buffer() -> None:
    """A worker's next push of a key may wait in the engine while its round is open; when
    the round closes it opens the next one in the same merge buffer, in the same request:
    the closed round must reach the backup as it was, not as the buffer is then."""
    engine = Engine(num_workers=2)
    engine.init(7, np.zeros(3, np.float32))
    _shard, link = _linked(engine)
    engine.push(7, 0, [np.full(3, 1.0, np.float32)], "d")
    engine.push(7, 0, [np.full(3, 10.0, np.float32)], "d")     # deferred: its next round
    engine.push(7, 1, [np.full(3, 2.0, np.float32)], "d")      # closes round 1
    engine.observer.replicator.flush()  # type: ignore[union-attr]
    sent = [(b, a) for b, a in link.sent]
    assert len(sent) == 1 and [r["round"] for r in sent[0][0]["rounds"]] == [1]
    np.testing.assert_array_equal(sent[0][1][0], np.full(3, 3.0, np.float32))


def test_a_batch_never_carries_more_than_its_cap(monkeypatch: Any) -> None:
    """Rounds that would pass the cap (64 MiB, and never PSKV_MAX_MESSAGE_BYTES, which the
    backup enforces on every message) go in the next message, in order."""
    from pskv._ps.ops import ReplOp, parse
    from pskv.kvstore.durable import _replica
    monkeypatch.setattr(_replica, "BATCH_BYTES", 40)      # two rounds of 16 bytes fit
    engine = Engine(num_workers=1)
    for k in range(5):
        engine.init(k, np.zeros(4, np.float32))
    shard, link = _linked(engine)
    for k in range(5):
        engine.push(k, 0, [np.full(4, float(k), np.float32)], "d")
    shard.replicator.drain()
    assert all(parse(body) is ReplOp.ROUNDS for body, _ in link.sent)
    assert [[r["key"] for r in body["rounds"]] for body, _ in link.sent] == \
        [[0, 1], [2, 3], [4]]
    assert all(sum(a.nbytes for a in arrays) <= 40 for _, arrays in link.sent)


@pytest.mark.parametrize("body, narrays, match", [
    ({"rounds": [], "arrays": []}, 0, "a list of rounds"),
    ({"rounds": [{"key": 1, "round": 1, "kind": "d", "applied": []}], "arrays": [2]}, 1,
     "a list of rounds"),
    ({"rounds": [{"key": 1, "round": 1, "kind": "d", "applied": []}], "arrays": [-1]}, 1,
     "a list of rounds"),
    ({"rounds": "x", "arrays": [1]}, 1, "a list of rounds"),
    ({"rounds": [7], "arrays": [1]}, 1, "a list of rounds"),
    ({"rounds": [{"key": 1, "round": 1, "kind": "d", "applied": []},
                 {"key": 2, "round": 1, "kind": "x", "applied": []}], "arrays": [1, 1]}, 2,
     "kind"),
    ({"rounds": [{"key": 1, "round": 1, "kind": "l", "applied": []}], "arrays": [1]}, 1,
     "update counts"),
    ({"rounds": [{"key": 1, "round": 1, "kind": "d", "applied": []},
                 {"key": 2, "round": 1, "kind": "d", "applied": []}], "arrays": [2, 0]}, 2,
     "merged value"),
])
def test_a_malformed_batch_of_rounds_is_refused(body: dict[str, Any], narrays: int,
                                                match: str) -> None:
    from pskv._ps import validate
    from pskv._ps.message import Command, Meta
    from pskv.errors import ProtocolError
    full = {"op": "r_rounds", "shard": 0, **body}
    with pytest.raises(ProtocolError, match=match):
        validate.request(Meta(Command.COMMAND, 1, (), full),
                         [np.zeros(2, np.float32)] * narrays)


def _shards_with_fakes(monkeypatch: Any, rank: int, held: dict[int, int],
                       restart: int = 0, unreachable: set[int] | None = None) \
        -> tuple[Any, list[Any]]:
    """A server's `Shards` whose backup links are recorded, not opened; its backups hold
    a copy of each shard in `held` (shard -> the server it came from); a link to a server
    in `unreachable` fails as a refused connection does (it forgets where the backup is)."""
    from types import SimpleNamespace

    from pskv.kvstore.durable import _shards
    links: list[Any] = []
    down = unreachable if unreachable is not None else set()

    class Link:
        def __init__(self, cfg: Any, zctx: Any, po: Any, shard: int, backup: int,
                     engine: Engine) -> None:
            self.shard, self.backup, self.endpoints = shard, backup, None
            self.sent: list[Any] = []
            self.up, self.copying = False, False
            links.append(self)

        def aim(self, announced: Any) -> None:
            self.endpoints = announced

        def send(self, op: Any, body: Any, arrays: Any = (), wait: bool = True) -> None:
            if self.endpoints is None:          # a link with no backup sends nothing
                return
            if self.backup in down:
                self.endpoints = None
                return
            self.sent.append(op)
            self.up = True

        def close(self) -> None:
            pass

    class Held:
        def held_from(self, shard: int) -> tuple[int, float] | None:
            return (held[shard], 0.0) if shard in held else None

        def take(self, shard: int) -> Engine | None:
            return Engine(num_workers=2) if held.pop(shard, None) is not None else None

        def empty(self) -> Engine:
            return Engine(num_workers=2)

    monkeypatch.setattr(_shards, "Replicator", Link)
    po = SimpleNamespace(rank=rank, num_servers=3, num_workers=2,
                         servers={r: f"server-{r}" for r in range(3)})
    cfg = SimpleNamespace(restart=restart)
    snapshots = SimpleNamespace(start=lambda engine, index, n: None)
    shards = _shards.Shards(cfg, None, po, snapshots, Held(), Engine())  # type: ignore[arg-type]
    return shards, links


def test_a_takeover_whose_backup_is_back_copies_the_shard_before_answering(
        monkeypatch: Any) -> None:
    """Server 0 died and was restarted before a worker asked server 2 for shard 2 (server 0
    had served it, server 2 kept its copy): the restarted server 0 is shard 2's backup now
    and gets the whole shard at the takeover, not at its next change, which may come after
    server 2 died too (the long chaos soak lost shard 2 so)."""
    from pskv._ps.ops import ReplOp
    shards, links = _shards_with_fakes(monkeypatch, rank=2, held={2: 0})
    shards.lost[0] = time.monotonic()
    shards.rejoined(0)
    shard = shards.get(2)
    (link,) = links
    assert (shard.index, link.backup, link.endpoints) == (2, 0, "server-0")
    assert link.sent == [ReplOp.NOOP]           # connects and sends the whole shard now


def test_a_takeover_never_aims_at_a_backup_reported_dead_and_not_back(monkeypatch: Any) \
        -> None:
    """Shard 2 came back to server 2 from server 0, which died: its backup is server 0,
    which is not back yet. Connecting to where server 0 was would fail and report server 0
    lost, and the scheduler took that for the death of server 0's restart (the long chaos
    soak lost shard 2 so): the link waits for the restart's announcement."""
    from pskv._ps.ops import ReplOp
    shards, links = _shards_with_fakes(monkeypatch, rank=2, held={2: 0})
    shards.lost[0] = time.monotonic()
    shards.get(2)
    (link,) = links
    assert (link.backup, link.endpoints, link.sent) == (0, None, [])
    shards.rejoined(0)
    assert (link.endpoints, link.sent) == ("server-0", [ReplOp.NOOP])


def test_a_takeover_whose_backup_is_dead_copies_when_it_is_back(monkeypatch: Any) -> None:
    # server 1 died (it served shard 1; server 2 kept the copy): its restart is the backup
    from pskv._ps.ops import ReplOp
    shards, links = _shards_with_fakes(monkeypatch, rank=2, held={1: 1})
    shards.lost[1] = time.monotonic()
    shards.get(1)
    (link,) = links
    assert (link.backup, link.endpoints, link.sent) == (1, None, [])
    shards.rejoined(1)
    assert link.sent == [ReplOp.NOOP]


def test_a_restarted_server_asked_for_a_shard_it_never_got_says_the_shard_is_lost(
        monkeypatch: Any) -> None:
    from pskv.errors import ProtocolError
    shards, _links = _shards_with_fakes(monkeypatch, rank=0, held={}, restart=1)
    shards.backups = None
    with pytest.raises(ProtocolError, match="holds no shard 2"):
        shards.get(2)
    shards, _links = _shards_with_fakes(monkeypatch, rank=0, held={}, restart=1)
    with pytest.raises(ProtocolError, match="holds no copy of shard 2.*is lost.*checkpoint"):
        shards.get(2)


def test_a_backup_serves_empty_the_shard_of_a_server_that_died_before_its_first_copy(
        monkeypatch: Any) -> None:
    """Server 0 died before its first copy reached server 1 (a kill 0.8 s after start on a
    loaded machine): a server answers no worker before that copy is in place, so the
    shard is empty, and its first backup serves it empty once the scheduler says server 0
    died (before, the request waits for that word)."""
    from pskv.kvstore.durable._shards import TakeoverPending
    shards, links = _shards_with_fakes(monkeypatch, rank=1, held={})
    with pytest.raises(TakeoverPending):
        shards.get(0)
    shards.lost[0] = time.monotonic()
    shard = shards.get(0)
    assert shard.index == 0 and len(shard.engine) == 0 and shards.get(0) is shard
    assert [link.shard for link in links] == [0]     # its backup: server 0 once it is back


def test_only_the_first_backup_never_restarted_serves_a_shard_empty(monkeypatch: Any) -> None:
    from pskv.errors import ProtocolError
    shards, _links = _shards_with_fakes(monkeypatch, rank=1, held={})
    shards.lost[2] = time.monotonic()
    with pytest.raises(ProtocolError, match="holds no shard 2"):
        shards.get(2)                    # server 0 backs shard 2 up, not server 1
    shards.lost[3] = time.monotonic()
    with pytest.raises(ProtocolError, match="holds no shard 3"):
        shards.get(3)                    # no such shard (3 servers), though 3 + 1 = 1 mod 3
    shards, _links = _shards_with_fakes(monkeypatch, rank=1, held={}, restart=1)
    shards.lost[0] = time.monotonic()
    with pytest.raises(ProtocolError, match="holds no copy of shard 0.*is lost"):
        shards.get(0)                    # restarted: it may have lost the copy it had


def test_a_server_answers_nobody_before_its_backup_has_the_first_copy(
        monkeypatch: Any) -> None:
    """The rule the empty takeover rests on: while the backup lives and cannot be reached,
    the shard is not copied (the server waits, and tries again); once the scheduler
    reports the backup dead, the copy waits for its restart."""
    from pskv._ps.ops import ReplOp
    down = {1}
    shards, links = _shards_with_fakes(monkeypatch, rank=0, held={}, unreachable=down)
    shards.serve(0, shards.own)
    assert not shards.copied(0) and not shards.copied(0)
    down.clear()                         # reachable again: the whole shard goes now
    assert shards.copied(0) and links[0].sent == [ReplOp.NOOP]
    down.add(1)
    shards, links = _shards_with_fakes(monkeypatch, rank=0, held={}, unreachable=down)
    shards.serve(0, shards.own)
    shards.lost[1] = time.monotonic()
    assert shards.copied(0) and links[0].sent == []


def _momentum_engine(spec: dict[str, Any], steps: int) -> Engine:
    """An engine that ran ``steps`` rounds of SGD with momentum on key "n" (gradient 3)."""
    engine = Engine()
    engine.init("n", np.ones(2, np.float32))
    engine.set_optimizer_spec(spec)
    for _ in range(steps):
        engine.apply("n", mx.nd.array(np.full(2, 3.0, np.float32)))
    return engine


def _worker_spec() -> dict[str, Any]:
    """The optimizer spec as a worker sends it (fresh: no counts), through JSON."""
    opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)
    return json.loads(json.dumps(check_optimizer(opt, need_spec=True)))


def _one_more_round(engine: Engine) -> np.ndarray:
    engine.apply("n", mx.nd.array(np.full(2, 3.0, np.float32)))
    return engine.stored["n"].asnumpy()


def test_a_restarted_workers_optimizer_leaves_a_taken_over_copys_momentum() -> None:
    # the long chaos soak: a backup took a shard over (its copy's optimizer rebuilt from the
    # primary's spec *with its counts*), then a restarted worker sent its optimizer again:
    # not an identical repeat of the copy's spec, so the momentum of every key of the shard
    # was reset to zero (the dist_sync job ended 32.13 off the calm run's "n")
    spec = _worker_spec()
    primary = _momentum_engine(spec, 20)
    body, arrays = encode_copy(primary.snapshot(), True)
    copy = Engine()
    install_copy(copy, json.loads(json.dumps(body)), arrays)
    copy.set_optimizer_spec(_worker_spec())         # the restarted worker's
    primary.set_optimizer_spec(_worker_spec())      # an identical repeat there too
    np.testing.assert_array_equal(_one_more_round(copy), _one_more_round(primary))


def test_a_restarted_workers_optimizer_leaves_a_restored_checkpoints_momentum(
        tmp_path: Path) -> None:
    # the same through a checkpoint (a server restarted from one, then a worker restarted)
    spec = _worker_spec()
    primary = _momentum_engine(spec, 20)
    write_shard(primary.snapshot(), str(tmp_path), 0)
    write_manifest(str(tmp_path), 1, 20, "dist_sync")
    restored = Engine()
    restored.init("n", np.zeros(2, np.float32))
    reader = Reader(str(tmp_path))
    restored.restore(reader)
    reader.close()
    restored.set_optimizer_spec(_worker_spec())
    np.testing.assert_array_equal(_one_more_round(restored), _one_more_round(primary))


def test_a_different_optimizer_from_a_worker_still_replaces_a_copys() -> None:
    primary = _momentum_engine(_worker_spec(), 20)
    body, arrays = encode_copy(primary.snapshot(), True)
    copy = Engine()
    install_copy(copy, json.loads(json.dumps(body)), arrays)
    before = copy.stored["n"].asnumpy().copy()
    copy.set_optimizer_spec(json.loads(json.dumps(
        check_optimizer(mx.optimizer.SGD(learning_rate=0.5), need_spec=True))))
    # plain SGD, lr 0.5, no momentum: w - 0.5 * 3
    np.testing.assert_array_equal(_one_more_round(copy), before - 1.5)


@pytest.mark.parametrize("value, servers, match", [
    ("yes", 2, "PSKV_REPLICAS='yes' is not an integer"),
    ("true", 2, "PSKV_REPLICAS='true' is not an integer"),
    ("2", 2, "at most one backup"),
    ("1", 1, "at least 2 servers"),
])
def test_the_launcher_refuses_what_the_servers_refuse(
        monkeypatch: pytest.MonkeyPatch, value: str, servers: int, match: str) -> None:
    """One reading of PSKV_REPLICAS: what a server refuses, pskv-launch refuses before it
    starts anything (it announced backups the servers would not keep for 'yes')."""
    import pskv.launch as launcher
    from pskv.launch import launch_spec

    def started(spec: LaunchSpec) -> None:
        raise AssertionError(f"PSKV_REPLICAS={value!r}: the launcher started the job")

    monkeypatch.setattr(launcher, "build_processes", started)
    with pytest.raises(ConfigError, match=match):
        ClusterConfig.from_env(_env(PSKV_REPLICAS=value, DMLC_NUM_SERVER=str(servers)))
    spec = LaunchSpec(("python", "t.py"), 1, servers, env=(("PSKV_REPLICAS", value),))
    with pytest.raises(ConfigError, match=match):
        launch_spec(spec)
    from pskv.launch._spec import backed_up
    assert backed_up(LaunchSpec(("t",), 1, 2, env=(("PSKV_REPLICAS", "1"),)), {})
    assert not backed_up(LaunchSpec(("t",), 1, 2, env=(("PSKV_REPLICAS", "0"),)), {})
