"""Data positions in a thread cluster (docs/data.md): a Sampler's steps tag the pushes, the
seals let rounds close, every sample is trained once, and in ``dist_sync`` the weights are
those of the same loop without a Sampler (a seal changes when a round closes, never what it
sums)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import pskv as mx

pytestmark = pytest.mark.dist

N, BATCH, EPOCHS = 50, 4, 2


@dataclass
class _Split:
    """What a Sampler reads of a store, for the same split without a store's seals."""
    rank: int
    num_workers: int

    def _data_position(self) -> int:
        return 0

    def _data_step(self, step: int) -> None:
        pass


def _loop(kv: Any, batches: Any) -> dict[str, np.ndarray]:
    """A counting job: "seen" counts each sample pushed (lr 1: each sample adds exactly 1),
    "w" takes a gradient that depends on the weights (a step on stale weights would show)."""
    kv.init(["seen", "w"], [mx.nd.zeros(N), mx.nd.ones(8)])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    w = mx.nd.zeros(8)
    for idx in batches:
        kv.pull("w", out=w)
        seen = np.zeros(N, np.float32)
        np.add.at(seen, idx, -1.0)
        grad = (w.asnumpy() * 0.05 + idx.sum() / 1000.0).astype(np.float32)
        kv.push(["seen", "w"], [mx.nd.array(seen), mx.nd.array(grad)])
    kv.barrier()
    return {k: kv.pull(k).asnumpy() for k in ("seen", "w")}


def _with_sampler(kv: Any) -> dict[str, np.ndarray]:
    sampler = mx.data.Sampler(kv, N, BATCH, epochs=EPOCHS, seed=3)
    assert sampler.start == 0 and kv._data_sealing()
    return _loop(kv, sampler)


def _without(kv: Any) -> dict[str, np.ndarray]:
    ref = mx.data.Sampler(_Split(kv.rank, kv.num_workers), N, BATCH, epochs=EPOCHS, seed=3)
    return _loop(kv, list(ref))


@pytest.mark.parametrize("store_type", ["dist_sync", "dist_async"])
def test_each_sample_is_trained_once_and_sealing_changes_no_bit(run_threads: Any,
                                                                store_type: str) -> None:
    got = run_threads(_with_sampler, num_workers=2, num_servers=2, store_type=store_type)
    assert not any(isinstance(r, BaseException) for r in got.values()), got
    np.testing.assert_array_equal(got[0]["seen"], np.full(N, float(EPOCHS)))
    if store_type == "dist_sync":
        want = run_threads(_without, num_workers=2, num_servers=2, store_type=store_type)
        assert not any(isinstance(r, BaseException) for r in want.values()), want
        np.testing.assert_array_equal(got[0]["w"], want[0]["w"])

