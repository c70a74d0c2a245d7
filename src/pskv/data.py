"""Data positions kept on the servers: each sample trained exactly once, across restarts.

:class:`Sampler` deals a data set's sample indices to the workers, a batch per step, and
keeps where this worker is in the servers' replicated state with its pushes: a worker
killed and restarted (``pskv-launch --max-restarts``) resumes at the first step whose
pushes the servers do not all hold, and a push of that step that a server holds is not
applied again. docs/data.md has the rules (D1-D9) and how it works.

>>> import numpy as np, pskv as mx
>>> kv = mx.kv.create('local')
>>> sampler = mx.data.Sampler(kv, num_samples=10, batch_size=4, shuffle=False)
>>> [b.tolist() for b in sampler]
[[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from .errors import ConfigError

__all__ = ["Sampler", "batches"]


class Sampler:
    """This worker's batches of sample indices, resumable from the servers' state.

    Every epoch orders the ``num_samples`` indices (a permutation drawn from ``seed`` and
    the epoch, or in order), and cuts them into steps of ``batch_size`` samples per worker
    (D1); step ``s`` of every worker covers the same ``kv.num_workers * batch_size``
    samples, split among the workers by rank; the samples left over by the last whole step
    of an epoch are spread over that step's workers (D2), so every sample is trained once an
    epoch and every worker takes the same number of steps (``dist_sync`` rounds never wait
    for a worker that ran out). Iterating yields 1-d int64 arrays of indices; it is a
    ``batch_sampler`` for ``torch.utils.data.DataLoader`` as it is.

    Create it before the first push of the training loop: from then on each push carries
    the step, and a restarted worker's sampler starts at the step the servers say (D4).
    One Sampler per store, iterated once (its one pass covers every epoch); a second
    Sampler of the store, or a second pass, raises ConfigError (D9).

    Parameters
    ----------
    kv : KVStore
        The store the training loop pushes to (any type: a store in one process starts at
        step 0 and has nothing to resume).
    num_samples : int
        The data set's size (at least ``kv.num_workers``).
    batch_size : int
        Samples per worker and step (the last step of an epoch may have more, D2).
    epochs : int, default 1
    shuffle : bool, default True
        A new permutation every epoch (NumPy's PCG64 from ``[seed, epoch]``: the same on
        every worker and every run), or the indices in order.
    seed : int, default 0

    Attributes
    ----------
    start : int
        The step this sampler began at (0, or where a restarted worker resumed).
    step : int
        The step of the batch yielded last (``start - 1`` before the first).
    steps_per_epoch, num_steps : int
        Steps in an epoch, and in the whole job.
    """

    def __init__(self, kv: Any, num_samples: int, batch_size: int, *, epochs: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        workers = int(kv.num_workers)
        for name, value, low in (("num_samples", num_samples, workers),
                                 ("batch_size", batch_size, 1), ("epochs", epochs, 1)):
            if type(value) is not int or value < low:
                raise ConfigError(
                    f"Sampler: {name} must be an int of at least {low}, got {value!r}"
                    + (f" (every one of the {workers} workers needs a sample a step)"
                       if name == "num_samples" else "") + ".")
        if type(seed) is not int or seed < 0:
            raise ConfigError(f"Sampler: seed must be a non-negative int, got {seed!r}.")
        self.num_samples, self.batch_size, self.epochs = num_samples, batch_size, epochs
        self.shuffle, self.seed = bool(shuffle), seed
        self.rank, self.num_workers = int(kv.rank), workers
        self.steps_per_epoch = max(1, num_samples // (workers * batch_size))
        self.num_steps = self.steps_per_epoch * epochs
        self._kv = kv
        self.start = min(int(kv._data_position()), self.num_steps)
        self.step = self.start - 1
        self._order: tuple[int, np.ndarray] | None = None
        self._followed = False
        self._passes = {"iterated": 0, "followed": 0}

    @property
    def epoch(self) -> int:
        """The epoch of the batch yielded last (of :attr:`start` before the first)."""
        return max(self.step, self.start) // self.steps_per_epoch

    def __len__(self) -> int:
        """The batches one iteration yields (``DataLoader`` reads it)."""
        return self.num_steps - self.start

    def indices(self, step: int, rank: int | None = None) -> np.ndarray:
        """The sample indices worker ``rank`` (default: this one) trains at ``step`` (D1,
        D2): a pure function of the arguments, the same on every worker and every run."""
        if not 0 <= step < self.num_steps:
            raise ConfigError(f"Sampler: step {step} is not in [0, {self.num_steps}).")
        epoch, s = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples) \
                if self.shuffle else np.arange(self.num_samples)
            self._order = (epoch, order.astype(np.int64))
        per = self.num_workers * self.batch_size
        hi = self.num_samples if s == self.steps_per_epoch - 1 else (s + 1) * per
        part = np.array_split(self._order[1][s * per:hi], self.num_workers)
        return part[self.rank if rank is None else rank].copy()

    def _one_pass(self, what: str) -> None:
        """D9: one pass deals every epoch's batches; a second would train them again."""
        self._passes[what] += 1
        if self._passes[what] > 1:
            raise ConfigError(
                f"Sampler: {what} a second time. One pass deals the batches of all "
                f"{self.epochs} epochs (steps {self.start} to {self.num_steps - 1}), each "
                "sample once an epoch; a second pass would train them again and move the "
                "data position back. Loop over the sampler (or its loader) once, not once "
                "per epoch: sampler.epoch says which epoch a batch is of. See docs/data.md "
                "D9.")

    def __iter__(self) -> Iterator[np.ndarray]:
        self._one_pass("iterated")       # by the loop, or by the loader follow() reads
        for t in range(self.start, self.num_steps):
            if not self._followed:
                self._begin(t)
            yield self.indices(t)

    def follow(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield the items of ``batches`` (a loader that takes its indices from this
        sampler and may fetch ahead, as ``DataLoader(num_workers > 0)`` does), each as the
        training loop's next step (D6): the step then advances when the loop takes a batch,
        not when the loader asks for the next indices."""
        self._one_pass("followed")
        self._followed = True
        step = self.start
        for item in batches:
            if step >= self.num_steps:
                raise ConfigError(f"Sampler.follow: the loader gave more than the "
                                  f"{self.num_steps - self.start} batches this sampler "
                                  "deals; give it this sampler as its batch_sampler.")
            self._begin(step)
            step += 1
            yield item

    def _begin(self, step: int) -> None:
        self._kv._data_step(step)      # the last step's pushes are sealed first (D3)
        self.step = step


def batches(sampler: Sampler, *arrays: Any) -> Iterator[tuple[Any, ...]]:
    """Each of ``sampler``'s batches as the rows of ``arrays`` it names (NumPy arrays, or
    anything indexed by an int64 array), one tuple per step.

    >>> import numpy as np, pskv as mx
    >>> x, y = np.arange(12).reshape(6, 2), np.arange(6)
    >>> s = mx.data.Sampler(mx.kv.create('local'), 6, 3, shuffle=False)
    >>> [yb.tolist() for _xb, yb in mx.data.batches(s, x, y)]
    [[0, 1, 2], [3, 4, 5]]
    """
    if not arrays:
        raise ConfigError("batches: give at least one array to take the batches from.")
    for idx in sampler:
        yield tuple(a[idx] for a in arrays)
