"""The data of the training example: scikit-learn's bundled digits, split, shuffled, sharded.

Invariants: the split and every epoch's order depend on the seed alone, never on the rank,
so every worker sees the same global batches and takes a disjoint shard of each.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["Digits", "global_batches", "load_digits", "shard"]


@dataclass(frozen=True, slots=True)
class Digits:
    """Standardized 8x8 digit images (float32, 64 features) and their labels (int64)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_features(self) -> int:
        """Features per sample (64)."""
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        """Classes (10)."""
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(seed: int, test_fraction: float = 0.25) -> Digits:
    """scikit-learn's bundled digits (1797 samples, no download), split by ``seed``.

    Features are standardized with the training set's mean and standard deviation
    (pixels that never vary keep standard deviation 1).
    """
    from sklearn import datasets  # type: ignore[import-untyped, unused-ignore]

    bunch = datasets.load_digits()
    x = np.asarray(bunch.data, dtype=np.float64)
    y = np.asarray(bunch.target, dtype=np.int64)
    order = np.random.default_rng([seed, 0]).permutation(len(x))
    n_test = round(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std == 0] = 1.0
    x = ((x - mean) / std).astype(np.float32)
    return Digits(x[train], y[train], x[test], y[test])


def global_batches(num_samples: int, batch_size: int, seed: int, epoch: int
                   ) -> Iterator[np.ndarray]:
    """Sample indices of each global batch of one epoch; the last one may be short.

    The order is a permutation seeded by ``(seed, epoch)``: the same on every worker.
    """
    order = np.random.default_rng([seed, 1, epoch]).permutation(num_samples)
    for start in range(0, num_samples, batch_size):
        yield order[start:start + batch_size]


def shard(batch: np.ndarray, rank: int, num_workers: int) -> np.ndarray:
    """Worker ``rank``'s contiguous slice of a global batch (``np.array_split`` cuts)."""
    return np.array_split(batch, num_workers)[rank]
