"""The Engine on its own: sync rounds, async apply, updaters, row_sparse sums, failures.

No sockets and no threads: each test is a server's request sequence written out by hand,
with tickets standing in for requests and a fake clock for round timeouts.
"""
from __future__ import annotations

import itertools

from typing import Any

import numpy as np
import pytest

from pskv.errors import (ClusterTimeoutError, KeyAlreadyInitializedError,
                         KeyNotInitializedError, KVStoreError, NodeFailedError,
                         ShapeMismatchError)
from pskv.kvstore.engine._core import Engine, EngineEvents, Ticket
from pskv.nd.sparse import RowSparseNDArray


class Answers(EngineEvents):
    """Records the ts of each answered ticket, and (ts, error) of each failed one."""

    def __init__(self, done: list[int], failed: list[Any]) -> None:
        self.answered, self.errors = done, failed

    def done(self, engine: Engine, ticket: Ticket) -> None:
        self.answered.append(ticket.ts)

    def failed(self, engine: Engine, ticket: Ticket, err: KVStoreError) -> None:
        self.errors.append((ticket.ts, err))


class Harness:
    """An engine whose answers are recorded: ``done`` and ``failed`` hold ticket ts."""

    def __init__(self, num_workers: int = 2, sync: bool = True) -> None:
        self.done: list[int] = []
        self.failed: list[tuple[int, KVStoreError]] = []
        self.now = 0.0
        self.engine = Engine(num_workers, sync, Answers(self.done, self.failed), lambda: self.now)

    def push(self, worker: int, key: int, value: Any, ts: int, kind: str = "d") -> Ticket:
        ticket = Ticket(f"worker {worker}", ts, "push", (key,))
        arrays = list(value) if kind == "r" else [np.asarray(value, np.float32)]
        self.engine.check_push(key, kind, arrays)
        self.engine.request(ticket, lambda: self.engine.push(key, worker, arrays, kind, ticket))
        return ticket

    def pull(self, worker: int, key: int, ts: int) -> Ticket:
        ticket = Ticket(f"worker {worker}", ts, "pull", (key,))
        self.engine.request(ticket, lambda: self.engine.pull(key, worker, ticket))
        return ticket

    def value(self, key: int) -> np.ndarray:
        return self.engine.stored[key]._dense()


def test_round_closes_when_every_worker_pushed() -> None:
    h = Harness(3)
    h.engine.init(0, np.zeros(4, np.float32))
    h.push(0, 0, np.ones(4), ts=1)
    h.push(1, 0, np.full(4, 2.0), ts=2)
    assert h.done == [] and np.all(h.value(0) == 0)       # round still open
    h.push(2, 0, np.full(4, 3.0), ts=3)
    assert sorted(h.done) == [1, 2, 3]
    np.testing.assert_array_equal(h.value(0), np.full(4, 6.0))


def test_round_counts_distinct_workers() -> None:
    h = Harness(2)
    h.engine.init(0, np.zeros(2, np.float32))
    h.push(0, 0, np.ones(2), ts=1)
    h.push(0, 0, np.full(2, 10.0), ts=2)                  # its next round: waits
    assert h.done == [] and np.all(h.value(0) == 0)
    h.push(1, 0, np.full(2, 2.0), ts=3)                   # closes round 1: 1 + 2
    assert sorted(h.done) == [1, 3]
    np.testing.assert_array_equal(h.value(0), np.full(2, 3.0))
    h.push(1, 0, np.full(2, 5.0), ts=4)                   # closes round 2: 10 + 5
    assert sorted(h.done) == [1, 2, 3, 4]
    np.testing.assert_array_equal(h.value(0), np.full(2, 15.0))


def test_pushes_held_count_those_in_open_and_deferred_rounds() -> None:
    """What a restarted worker may skip: its pushes applied, and (dist_sync) the one in the
    open round and those deferred to the next. Counting only applied ones let a worker
    killed after a push and restarted push it again: twice in the round (the chaos soak)."""
    h = Harness(2)
    h.engine.init(0, np.zeros(2, np.float32))
    assert h.engine.applied_by(0) == [[0, 0]]
    h.push(0, 0, np.ones(2), ts=1)                        # waits in round 1
    h.push(0, 0, np.ones(2), ts=2)                        # deferred to round 2
    assert h.engine.applied_by(0) == [[0, 2]] and h.engine.applied_by(1) == [[0, 0]]
    h.push(1, 0, np.ones(2), ts=3)                        # closes round 1
    assert h.engine.applied_by(0) == [[0, 2]] and h.engine.applied_by(1) == [[0, 1]]
    h.push(1, 0, np.ones(2), ts=4)                        # closes round 2
    assert h.engine.applied_by(0) == [[0, 2]] and h.engine.applied_by(1) == [[0, 2]]


def test_pull_after_own_push_waits_for_the_round() -> None:
    h = Harness(2)
    h.engine.init(0, np.zeros(2, np.float32))
    h.pull(1, 0, ts=9)                                    # nothing pushed: answered
    assert h.done == [9]
    h.push(0, 0, np.ones(2), ts=1)
    h.pull(0, 0, ts=2)                                    # after its own push: waits
    h.pull(1, 0, ts=3)                                    # worker 1 did not push: now
    assert h.done == [9, 3]
    h.push(1, 0, np.ones(2), ts=4)
    assert sorted(h.done) == [1, 2, 3, 4, 9]
    assert [a.tolist() for a in h.engine.values(Ticket(None, 0, "pull", (0,)))] == [[2.0, 2.0]]


def test_async_applies_every_push_at_once() -> None:
    h = Harness(2, sync=False)
    h.engine.init(0, np.zeros(2, np.float32))
    h.engine.updater = lambda key, inp, stored: stored.__iadd__(inp)
    h.push(0, 0, np.ones(2), ts=1)
    h.push(0, 0, np.ones(2), ts=2)
    np.testing.assert_array_equal(h.value(0), np.full(2, 2.0))
    assert h.done == [1, 2]


def test_updater_runs_once_per_round_with_the_sum_and_the_user_key() -> None:
    h = Harness(2)
    h.engine.init(8, np.zeros(3, np.float32), name="w")
    calls: list[tuple[Any, list[float]]] = []

    def updater(key: Any, inp: Any, stored: Any) -> None:
        calls.append((key, inp.asnumpy().tolist()))
        stored -= inp

    h.engine.updater = updater
    h.push(0, 8, np.ones(3), ts=1)
    h.push(1, 8, np.full(3, 2.0), ts=2)
    assert calls == [("w", [3.0, 3.0, 3.0])]
    np.testing.assert_array_equal(h.value(8), np.full(3, -3.0))


def test_row_sparse_round_sums_rows_even_repeated_ones() -> None:
    h = Harness(2)
    h.engine.init(0, np.zeros((4, 2), np.float32), sparse=True)
    assert isinstance(h.engine.stored[0], RowSparseNDArray)
    rows0, data0 = np.array([3, 1, 3]), np.ones((3, 2), np.float32)
    rows1, data1 = np.array([1]), np.full((1, 2), 5.0, np.float32)
    h.push(0, 0, (rows0, data0), ts=1, kind="r")
    h.push(1, 0, (rows1, data1), ts=2, kind="r")
    np.testing.assert_array_equal(h.value(0), [[0, 0], [6, 6], [0, 0], [2, 2]])


def test_checks_reject_bad_pushes_and_change_nothing() -> None:
    h = Harness(1)
    h.engine.init(0, np.zeros(4, np.float32))
    with pytest.raises(ShapeMismatchError, match="got 3 values"):
        h.engine.check_push(0, "d", [np.zeros(3, np.float32)])
    with pytest.raises(ShapeMismatchError, match="row_sparse push to dense"):
        h.engine.check_push(0, "r", [np.zeros(1, np.int64), np.zeros((1,), np.float32)])
    with pytest.raises(KeyNotInitializedError, match="key 5"):
        h.engine.value_of(5, "push")
    with pytest.raises(KeyAlreadyInitializedError, match="initialized twice"):
        h.engine.init(0, np.ones(4, np.float32))
    np.testing.assert_array_equal(h.value(0), np.zeros(4))


def test_round_timeout_fails_every_waiting_ticket_once() -> None:
    h = Harness(2)
    h.engine.init(0, np.zeros(2, np.float32))
    h.engine.init(1, np.zeros(2, np.float32))
    t = Ticket("worker 0", 1, "push", (0, 1))
    h.engine.request(t, lambda: (h.engine.push(0, 0, [np.ones(2, np.float32)], "d", t),
                                 h.engine.push(1, 0, [np.ones(2, np.float32)], "d", t)))
    h.now = 5.0
    h.engine.check_rounds(10.0)
    assert h.failed == []
    h.now = 11.0
    h.engine.check_rounds(10.0)
    assert [ts for ts, _ in h.failed] == [1]                # once, though two keys waited
    err = h.failed[0][1]
    assert isinstance(err, ClusterTimeoutError) and "workers [1] have not pushed" in str(err)
    h.push(1, 0, np.ones(2), ts=2)                          # a fresh round
    assert h.done == [] and [ts for ts, _ in h.failed] == [1]


def test_fail_all_answers_pushers_and_pullers() -> None:
    h = Harness(2)
    h.engine.init(0, np.zeros(2, np.float32))
    h.push(0, 0, np.ones(2), ts=1)
    h.pull(0, 0, ts=2)
    h.engine.fail_all(NodeFailedError("worker 1 died"))
    assert sorted(ts for ts, _ in h.failed) == [1, 2]
    assert all(isinstance(e, NodeFailedError) for _, e in h.failed)


def test_accumulate_and_finish_are_the_extension_point() -> None:
    # the benchmarks' empty handler: rounds as usual, no arithmetic, stored value kept
    class EmptyEngine(Engine):
        def accumulate(self, key: Any, arrays: Any, kind: str, first: bool) -> None:
            pass

        def finish(self, key: Any) -> None:
            pass

    done: list[int] = []
    engine = EmptyEngine(2, True, Answers(done, []))
    engine.init(0, np.full(2, 5.0, np.float32))
    for worker, ts in ((0, 1), (1, 2)):
        ticket = Ticket(worker, ts, "push", (0,))
        engine.request(ticket, lambda: engine.push(0, worker, [np.ones(2, np.float32)], "d",
                                                   ticket))
    assert sorted(done) == [1, 2]
    np.testing.assert_array_equal(engine.stored[0]._dense(), np.full(2, 5.0))


def test_a_dense_round_is_summed_in_worker_rank_order_whatever_the_arrival_order() -> None:
    # float addition is not associative: ((a + b) + c) and ((a + c) + b) differ in the last
    # bit for these values; the round must be ((v0 + v1) + v2) + v3 in every arrival order
    rng = np.random.default_rng(7)
    values = [rng.standard_normal(257).astype(np.float32) * 10 ** i for i in range(4)]
    want = values[0].copy()
    for v in values[1:]:
        want += v
    shuffled = values[3].copy()
    for v in (values[1], values[0], values[2]):
        shuffled += v
    assert not np.array_equal(want, shuffled), "the values must tell the orders apart"
    for order in itertools.permutations(range(4)):     # rank 1 first too (no copy: below)
        h = Harness(4)
        h.engine.init(0, np.zeros(257, np.float32))
        for ts, w in enumerate(order, 1):
            h.push(w, 0, values[w], ts=ts)
        np.testing.assert_array_equal(h.value(0), want)
        # the next round starts at rank 0 again
        for ts, w in enumerate(reversed(order), 10):
            h.push(w, 0, values[w], ts=ts)
        np.testing.assert_array_equal(h.value(0), want)


def test_rank_one_may_start_a_round_without_a_copy() -> None:
    # v1 + v0 is v0 + v1 to the bit: a round that rank 1 opens keeps no copy of its push
    h = Harness(3)
    h.engine.init(0, np.zeros(5, np.float32))
    h.push(1, 0, np.full(5, 0.1, np.float32), ts=1)
    assert not h.engine._entries[0].early
    h.push(2, 0, np.full(5, 0.3, np.float32), ts=2)       # before rank 0: kept aside
    assert list(h.engine._entries[0].early) == [2]
    h.push(0, 0, np.full(5, 0.7, np.float32), ts=3)
    want = (np.float32(0.7) + np.float32(0.1)) + np.float32(0.3)
    np.testing.assert_array_equal(h.value(0), np.full(5, want, np.float32))
    assert not h.engine._entries[0].early and h.engine._entries[0].next_rank == 0


def test_a_one_float_key_costs_the_engine_little_bookkeeping() -> None:
    """Per-key bookkeeping in proportion (issue 34): a dense key makes no empty container
    for what only table, row_sparse or out-of-order rounds use. Measured with tracemalloc
    over 20,000 one-float keys: 1,247 bytes a key before, about 1,015 after (the array,
    the NDArray, its context, the entry, its set of pushers and its lists of waiters)."""
    import tracemalloc
    eng = Engine(num_workers=3)
    value = np.zeros(1, np.float32)
    n = 20_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(n):
            eng.init(k, value)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_key < 1150, f"{per_key:.0f} bytes a key"
    # the lazily made containers still work: rank 2's push held until ranks 0 and 1
    for worker, v in ((2, 4.0), (0, 1.0), (1, 2.0)):
        eng.push(0, worker, [np.full(1, v, np.float32)], "d")
    np.testing.assert_array_equal(eng.value_of(0, "pull")._data, [7.0])


def test_a_request_answers_once_every_key_is_queued_and_never_once_abandoned() -> None:
    """``Engine.request``: a ticket of two keys is answered when both rounds closed, not
    when the first did; a request whose calls raise is abandoned: the error goes to its
    maker, and the rounds that hold it close without answering it."""
    h = Harness(2)
    for k in (0, 1):
        h.engine.init(k, np.zeros(2, np.float32))
    t = Ticket("worker 0", 1, "push", (0, 1))
    h.engine.request(t, lambda: (h.engine.push(0, 0, [np.ones(2, np.float32)], "d", t),
                                 h.engine.push(1, 0, [np.ones(2, np.float32)], "d", t)))
    h.push(1, 0, [1, 1], ts=2)
    assert h.done == [2]                     # key 1's round is still open: not answered
    h.push(1, 1, [1, 1], ts=3)
    assert h.done == [2, 1, 3]

    bad = Ticket("worker 0", 4, "push", (0, 1))

    def fails() -> None:
        h.engine.push(0, 0, [np.ones(2, np.float32)], "d", bad)
        raise ValueError("the second key's update failed")
    with pytest.raises(ValueError, match="second key"):
        h.engine.request(bad, fails)
    assert bad.abandoned
    h.push(1, 0, [1, 1], ts=5)               # closes the round that held ``bad``
    assert h.done == [2, 1, 3, 5] and h.failed == []


def test_the_engine_reads_its_clock_for_round_events_only_when_its_listener_asks() -> None:
    """A local store's engine (no listener) reads no clock for a round's close or its
    update; a server's hears each close and, while metrics are on, each update's time
    (two reads more a round)."""
    class Watching(EngineEvents):
        def __init__(self, on: bool) -> None:
            self.watches_rounds = self.times_updates = on  # type: ignore[misc]
            self.closes: list[Any] = []
            self.times: list[float] = []

        def round_closed(self, engine: Engine, key: Any, worker: int, waited: float) -> None:
            self.closes.append((key, worker, engine.num_workers))

        def applied_in(self, seconds: float) -> None:
            self.times.append(seconds)

    def one_round(events: Watching) -> int:
        reads: list[int] = []

        def clock() -> float:
            reads.append(1)
            return 10.0 + len(reads)
        engine = Engine(2, True, events, clock)
        engine.init("k", np.zeros(2, np.float32))
        for worker in (1, 0):
            engine.request(Ticket("w", worker, "push", ("k",)), lambda: engine.push(
                "k", worker, [np.ones(2, np.float32)], "d", None))
        return len(reads)

    off, on = Watching(False), Watching(True)
    assert one_round(on) == one_round(off) + 2
    assert (off.closes, off.times) == ([], [])
    assert on.closes == [("k", 0, 2)] and on.times == [1.0]
