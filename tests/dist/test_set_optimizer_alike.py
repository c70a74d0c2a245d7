"""Every store type refuses a bad optimizer in ``set_optimizer`` with the same error, and the
refusal changes nothing (one check, ``pskv.kvstore.base.check_optimizer``, for all of them).

The dist stores run in an in-process cluster (``pskv.testing.InprocCluster``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError
from pskv.testing import InprocCluster

pytestmark = pytest.mark.timeout(60)

BAD: list[Callable[[], Any]] = [
    lambda: mx.optimizer.SGD(learning_rate="abc"),
    lambda: mx.optimizer.SGD(momentum=float("nan")),
    lambda: mx.optimizer.create("adam", beta1="x"),
]


def _refusals(kv: Any) -> tuple[list[tuple[str, str]], np.ndarray]:
    """Each bad optimizer's (class, message); then the value after a push (assign: 5 in a
    local store, 5 per worker summed in a dist_sync round, or 5 in dist_async)."""
    kv.init(3, mx.nd.ones((2,)))
    seen = []
    for make in BAD:
        with pytest.raises(ConfigError) as info:
            kv.set_optimizer(make())
        seen.append((type(info.value).__name__, str(info.value)))
    kv.push(3, mx.nd.ones((2,)) * 5)
    return seen, kv.pull(3).asnumpy()


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_dist_and_local_stores_refuse_alike_and_change_nothing(store_type: str) -> None:
    with mx.kv.create("local") as kv:
        local, value = _refusals(kv)
    np.testing.assert_array_equal(value, np.full(2, 5.0))
    assert [c for c, _ in local] == ["ConfigError"] * len(BAD)
    assert "learning_rate='abc'" in local[0][1]

    with InprocCluster(num_workers=2) as cluster:
        results = cluster.run(_refusals, store_type=store_type)
    for rank, got in results.items():
        assert not isinstance(got, BaseException), (rank, got)
        seen, value = got
        assert seen == local, (rank, seen)          # same class, same message
        # still assigns: sync sums the round (5 + 5), async assigns each push (5)
        want = 10.0 if store_type == "dist_sync" else 5.0
        np.testing.assert_array_equal(value, np.full(2, want))


@mx.optimizer.Optimizer.register
class AlikeScaled(mx.optimizer.Optimizer):
    """A custom optimizer with a required argument of its own: no spec rebuilds it."""

    def __init__(self, factor: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        weight[:] = weight - self.factor * grad


def test_a_custom_optimizer_runs_locally_and_a_dist_store_refuses_it() -> None:
    """Each store checks what it needs (issue #29, item 4): the local store runs the
    object; a dist store would send a spec its servers cannot rebuild, and says so."""
    with mx.kv.create("local") as kv:
        kv.init(3, mx.nd.ones((2,)))
        kv.set_optimizer(AlikeScaled(0.5))
        kv.push(3, mx.nd.ones((2,)))
        np.testing.assert_allclose(kv.pull(3).asnumpy(), np.full(2, 0.5))

    def refused(kv: Any) -> str:
        kv.init(3, mx.nd.ones((2,)))
        with pytest.raises(ConfigError, match="AlikeScaled fails on a trial update") as info:
            kv.set_optimizer(AlikeScaled(0.5))
        return str(info.value)

    with InprocCluster(num_workers=2) as cluster:
        results = cluster.run(refused, store_type="dist_sync")
    for rank, got in results.items():
        assert isinstance(got, str), (rank, got)
