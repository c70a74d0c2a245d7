"""pskv.data's Sampler without a cluster (docs/data.md D1, D2, D6, D7): the split, its
errors, and torch's DataLoader reading it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError


@dataclass
class _Store:
    """What a Sampler reads of a store; records the steps it was told."""
    rank: int = 0
    num_workers: int = 1
    resume: int = 0
    steps: list[int] = field(default_factory=list)

    def _data_position(self) -> int:
        return self.resume

    def _data_step(self, step: int) -> None:
        self.steps.append(step)


@pytest.mark.parametrize("workers, n, batch", [(1, 10, 4), (3, 50, 4), (3, 7, 5),
                                               (4, 101, 8), (2, 2, 1)])
def test_the_split_deals_every_sample_once_an_epoch(workers: int, n: int, batch: int) -> None:
    samplers = [mx.data.Sampler(_Store(r, workers), n, batch, epochs=3, seed=1)
                for r in range(workers)]
    per = samplers[0].steps_per_epoch
    assert all(s.num_steps == 3 * per for s in samplers)
    orders = []
    for epoch in range(3):
        count = np.zeros(n, int)
        for s in samplers:
            for t in range(epoch * per, (epoch + 1) * per):
                idx = s.indices(t)
                assert idx.dtype == np.int64 and len(idx) >= min(batch, n // workers)
                np.add.at(count, idx, 1)
        assert (count == 1).all()
        orders.append(np.concatenate([samplers[0].indices(t) for t in range(epoch * per,
                                                                             (epoch + 1) * per)]))
    if n > 5:          # a new permutation each epoch, the same one on every run
        assert not np.array_equal(orders[0], orders[1])
    again = mx.data.Sampler(_Store(0, workers), n, batch, epochs=3, seed=1)
    np.testing.assert_array_equal(again.indices(per), samplers[0].indices(per))


def test_iterating_tells_the_store_each_step_and_resumes_where_it_says() -> None:
    store = _Store(resume=3)
    s = mx.data.Sampler(store, 20, 4, epochs=1, shuffle=False)
    assert (s.start, s.step, len(s)) == (3, 2, 2)
    got = [b.tolist() for b in s]
    assert got == [[12, 13, 14, 15], [16, 17, 18, 19]] and store.steps == [3, 4]
    assert s.step == 4 and s.epoch == 0


def test_follow_advances_as_the_loop_takes_batches_not_as_the_loader_fetches() -> None:
    store = _Store()
    s = mx.data.Sampler(store, 12, 3, shuffle=False)
    fetched = list(iter(s))            # iterated alone, each batch is the next step
    assert store.steps == [0, 1, 2, 3]
    store.steps.clear()
    s2 = mx.data.Sampler(store, 12, 3, shuffle=False)
    ahead = iter(s2)
    taken = []
    for i, item in enumerate(s2.follow(b.tolist() for b in ahead)):
        assert store.steps == list(range(i + 1))   # advanced on taking, one at a time
        taken.append(item)
    assert taken == [b.tolist() for b in fetched]
    with pytest.raises(ConfigError, match="more than the 4 batches"):
        list(mx.data.Sampler(_Store(), 12, 3).follow(range(5)))


@pytest.mark.parametrize("kwargs, match", [
    ({"num_samples": 1}, "num_samples must be an int of at least 2"),
    ({"batch_size": 0}, "batch_size must be an int of at least 1"),
    ({"epochs": 1.5}, "epochs must be an int"),
    ({"seed": -1}, "seed must be a non-negative int"),
])
def test_bad_arguments_say_which_and_why(kwargs: dict, match: str) -> None:
    args = {"num_samples": 10, "batch_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        mx.data.Sampler(_Store(0, 2), **args)
    with pytest.raises(ConfigError, match="at least one array"):
        next(mx.data.batches(mx.data.Sampler(_Store(), 4, 2)))


def test_a_torch_data_loader_takes_it_as_its_batch_sampler() -> None:
    torch = pytest.importorskip("torch", reason="DataLoader needs torch: pip install -e .[torch]")
    ds = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    s = mx.data.Sampler(mx.kv.create("local"), 10, 3, shuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=s)
    assert len(loader) == 3
    assert [ib.tolist() for _x, ib in s.follow(loader)] == [[0, 1, 2], [3, 4, 5],
                                                          [6, 7, 8, 9]]


def test_one_sampler_per_store_and_one_pass() -> None:
    """D9: a second Sampler of a store (it would start at the first one's step) and a
    second pass of a Sampler (it would train every sample again) raise ConfigError."""
    kv = mx.kv.create("local")
    s = mx.data.Sampler(kv, 12, 3, epochs=2, shuffle=False)
    with pytest.raises(ConfigError, match="has a Sampler already.*epochs=E"):
        mx.data.Sampler(kv, 12, 3)
    assert len(list(s)) == 8                         # one pass: both epochs
    with pytest.raises(ConfigError, match="iterated a second time.*sampler.epoch"):
        next(iter(s))
    s2 = mx.data.Sampler(mx.kv.create("local"), 12, 3, shuffle=False)
    assert len(list(s2.follow(iter(s2)))) == 4       # a loader that reads it: one pass
    with pytest.raises(ConfigError, match="followed a second time"):
        next(s2.follow(range(4)))


def test_a_data_loader_looped_once_per_epoch_is_refused() -> None:
    torch = pytest.importorskip("torch", reason="DataLoader needs torch: pip install -e .[torch]")
    ds = torch.utils.data.TensorDataset(torch.arange(12.0))
    s = mx.data.Sampler(mx.kv.create("local"), 12, 3, epochs=2)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=s)
    assert len(list(loader)) == 8
    with pytest.raises(ConfigError, match="iterated a second time"):
        list(loader)                                 # the second epoch of the torch idiom
