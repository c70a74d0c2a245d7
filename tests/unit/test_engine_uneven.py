"""The Engine's uneven-data rules (``Engine.worker_left``): joined workers count as pushing
zeros, a worker that closed without joining fails every round that needs it at once.

No sockets, no threads: the request sequences are written out by hand (test_engine.py's
harness).
"""
from __future__ import annotations

import numpy as np
import pytest

from pskv.errors import WorkerClosedError
from test_engine import Harness


def test_joined_worker_counts_as_zeros() -> None:
    h = Harness(3)
    h.engine.init(0, np.zeros(4, np.float32))
    h.engine.worker_left(2, joined=True)
    h.push(0, 0, np.ones(4), ts=1)
    h.push(1, 0, np.full(4, 2.0), ts=2)
    assert sorted(h.done) == [1, 2]               # closed without worker 2
    np.testing.assert_array_equal(h.value(0), np.full(4, 3.0))


def test_join_closes_an_open_round() -> None:
    h = Harness(3)
    h.engine.init(0, np.zeros(4, np.float32))
    h.push(2, 0, np.full(4, 4.0), ts=1)            # held back: rank 0 has not pushed
    h.push(1, 0, np.full(4, 2.0), ts=2)
    assert h.done == []
    h.engine.worker_left(0, joined=True)
    assert sorted(h.done) == [1, 2]
    np.testing.assert_array_equal(h.value(0), np.full(4, 6.0))
    # the next round starts its sum afresh at rank 1 (no updater: the sum is assigned)
    h.push(1, 0, np.full(4, 1.0), ts=3)
    h.push(2, 0, np.full(4, 1.0), ts=4)
    np.testing.assert_array_equal(h.value(0), np.full(4, 2.0))   # assigned: 1 + 1


def test_joined_rank_zero_rank_order_sum() -> None:
    """With rank 0 joined the others' pushes are still added in rank order, whatever
    order they come in: the same bits as a server adding them (float32 rounding)."""
    values = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]
    for order in ([2, 1], [1, 2]):
        h = Harness(3)
        h.engine.init(0, np.zeros(1, np.float32))
        h.engine.worker_left(0, joined=True)
        for ts, w in enumerate(order):
            h.push(w, 0, [values[w]], ts=ts)
        assert len(h.done) == 2
        assert h.value(0)[0] == np.float32(values[1] + values[2])


def test_closed_worker_fails_the_open_round() -> None:
    h = Harness(2)
    h.engine.init(3, np.zeros(2, np.float32))
    h.push(0, 3, np.ones(2), ts=1)
    h.pull(0, 3, ts=2)
    h.engine.worker_left(1, joined=False)
    assert sorted(ts for ts, _ in h.failed) == [1, 2]
    err = h.failed[0][1]
    assert isinstance(err, WorkerClosedError) and err.key == 3
    assert "worker 1 closed its store" in str(err) and "round 0 of key 3" in str(err)
    assert "kv.join()" in str(err)


def test_push_after_a_worker_closed_fails_at_once() -> None:
    h = Harness(2)
    h.engine.init(3, np.zeros(2, np.float32))
    h.push(0, 3, np.ones(2), ts=1)
    h.push(1, 3, np.ones(2), ts=2)
    assert sorted(h.done) == [1, 2]
    h.engine.worker_left(1, joined=False)
    h.push(0, 3, np.ones(2), ts=3)
    assert [ts for ts, _ in h.failed] == [3]
    assert "round 1 of key 3" in str(h.failed[0][1])
    np.testing.assert_array_equal(h.value(3), np.full(2, 2.0))   # nothing applied


def test_closing_after_join_is_no_failure() -> None:
    h = Harness(2)
    h.engine.init(3, np.zeros(2, np.float32))
    h.engine.worker_left(1, joined=True)
    h.engine.worker_left(1, joined=False)
    h.push(0, 3, np.ones(2), ts=1)
    assert h.failed == [] and h.done == [1]


@pytest.mark.parametrize("joined", [True, False])
def test_async_never_waits(joined: bool) -> None:
    h = Harness(2, sync=False)
    h.engine.init(0, np.zeros(2, np.float32))
    h.engine.worker_left(1, joined=joined)
    h.push(0, 0, np.ones(2), ts=1)
    assert h.done == [1] and h.failed == []


def test_a_pull_after_a_refused_push_fails_too() -> None:
    """A push that failed because a worker closed leaves nothing pending: this worker's
    next pull of the key fails alike, instead of reading the last round as if its push
    had been applied (a PUSHPULL's pull comes right after its push)."""
    h = Harness(2)
    h.engine.init(3, np.zeros(2, np.float32))
    h.engine.worker_left(1, joined=False)
    h.push(0, 3, np.ones(2), ts=1)
    h.pull(0, 3, ts=2)
    assert [ts for ts, _ in h.failed] == [1, 2] and h.done == []
    h.pull(0, 3, ts=3)                   # once: a later read is a plain read
    assert h.done == [3]
