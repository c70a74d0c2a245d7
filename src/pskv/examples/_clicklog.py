"""Synthetic click logs for ``train_ctr``: ID streams that keep producing new IDs.

Every sample has one ID per field: a *user*, an *item* and a *context* (the page or slot).
Users and items churn: each field keeps a window of ``pool`` live serial numbers that
slides forward by ``new_per_day`` serials a day, continuously, so a new ID is born at every
moment and old ones fade out. Within the window an ID's popularity falls with its age as a
power law (age ``a`` has weight ``a ** (1 / gamma - 1)``): a fresh ID is seen often, an
old one rarely, and many IDs are seen once or twice in all (the long tail that admission is
for). Contexts are a small fixed set, Zipf-distributed.

The label of a sample is drawn from the *generating model*:
``p = sigmoid(bias + b_user + b_item + b_ctx + u_user . v_item)``, with per-ID effects
``b`` and rank-``r`` interaction vectors ``u``, ``v`` drawn once per serial from the seed.
``ClickLog.*_p`` keeps those true probabilities, so the AUC they reach on an eval set is
the ceiling any model can reach there.

Raw IDs are what a real log carries: 64-bit hashes of ``(field, serial)``, negative and
huge ones included (a bijection, so no two IDs of the log collide).

Invariants: everything follows from the seed (every worker of a cluster makes the same
log); the train samples of day ``d`` are ``train_*[day_bounds[d]:day_bounds[d + 1]]`` in
time order; day ``d``'s eval samples are drawn from the same moments as its train samples
(a held-out share of the day).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FIELDS", "ClickLog", "make_log", "raw_ids"]

#: the fields of a sample, in column order
FIELDS = ("user", "item", "context")
#: an odd 64-bit multiplier: multiplying by it modulo 2**64 is a bijection
_MIX = np.uint64(0x9E3779B97F4A7C15)
#: steps a day in which the windows of live IDs move
_SLOTS = 200


@dataclass(frozen=True)
class ClickLog:
    """A synthetic, time-ordered click log (see the module docstring).

    ``*_ids`` are ``(n, 3)`` int64 raw IDs (columns: :data:`FIELDS`), ``*_y`` 0/1 float32
    clicks, ``*_p`` the generating model's click probabilities (float64).
    ``train_day_bounds`` / ``eval_day_bounds`` have ``days + 1`` entries.
    """

    train_ids: np.ndarray
    train_y: np.ndarray
    train_p: np.ndarray
    train_day_bounds: np.ndarray
    eval_ids: np.ndarray
    eval_y: np.ndarray
    eval_p: np.ndarray
    eval_day_bounds: np.ndarray

    @property
    def days(self) -> int:
        """Days in the log."""
        return len(self.train_day_bounds) - 1

    def day(self, d: int, split: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, y, p)`` of day ``d`` (from 0) of ``split`` (``'train'`` or ``'eval'``)."""
        bounds = self.train_day_bounds if split == "train" else self.eval_day_bounds
        s = slice(int(bounds[d]), int(bounds[d + 1]))
        if split == "train":
            return self.train_ids[s], self.train_y[s], self.train_p[s]
        return self.eval_ids[s], self.eval_y[s], self.eval_p[s]


def raw_ids(field: int, serial: np.ndarray) -> np.ndarray:
    """The raw int64 IDs of ``serial`` numbers of field ``field`` (a bijective hash).

    Examples
    --------
    >>> ids = raw_ids(1, np.arange(3))
    >>> ids.dtype, len(set(ids.tolist())), bool((ids < 0).any() or (ids > 2**40).any())
    (dtype('int64'), 3, True)
    """
    key = serial.astype(np.uint64) + (np.uint64(field + 1) << np.uint64(40))
    with np.errstate(over="ignore"):
        return (key * _MIX).view(np.int64)


def _draw(rng: np.random.Generator, t: np.ndarray, pool: int, new: int,
          weight: np.ndarray, slots: int) -> np.ndarray:
    """The serial of each sample at times ``t`` (sorted, in days): from the window of
    ``pool`` serials live then, in proportion to ``weight`` (the window moves ``new``
    serials a day, in ``slots`` steps a day)."""
    out = np.empty(len(t), np.int64)
    slot = (t * slots).astype(np.int64)
    bounds = np.searchsorted(slot, np.arange(slot[-1] + 2)) if len(t) else np.zeros(1, int)
    for k in range(len(bounds) - 1):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        if lo == hi:
            continue
        start = k * new // slots                       # the window's oldest serial now
        w = weight[start:start + pool]
        out[lo:hi] = start + rng.choice(pool, size=hi - lo, p=w / w.sum())
    return out


def make_log(days: int, samples_per_day: int, *, users: int | None = None,
             new_users: int | None = None, items: int | None = None,
             new_items: int | None = None, contexts: int = 50, skew: float = 1.0,
             rank: int = 4, effect_std: float = 0.8, interaction_std: float = 0.3,
             one_off: float = 0.3, bias: float = -1.0, eval_fraction: float = 0.2, seed: int = 0) -> ClickLog:
    """Generate ``days`` days of ``samples_per_day`` samples (train plus eval) from ``seed``.

    Parameters
    ----------
    days : int
        Days in the log (``train_ctr`` trains one day per epoch).
    samples_per_day : int
        Samples a day; a share ``eval_fraction`` of them, drawn at random, is held out.
    users, items : int, optional
        Live IDs of the field at any moment (the window). Default: ``samples_per_day``
        over 80 and over 250, so that an ID is seen about as often at any size.
    new_users, new_items : int, optional
        IDs born a day (the window slides by this much a day). Default: ``users / 2``
        and ``items``.
    contexts : int
        Context IDs (fixed; Zipf(1.2) popularity).
    skew : float
        Standard deviation of the log of an ID's popularity (its share of the traffic
        while it lives is proportional to a lognormal draw): larger, a longer tail.
    rank : int
        Rank of the user-item interaction.
    effect_std, interaction_std : float
        Standard deviation of each per-ID effect and of the interaction term's logit.
    one_off : float
        The share of samples whose user is a one-off visitor: an ID seen once in the whole
        log, with no effect of its own (it clicks like an average user), so that only
        admission keeps the table free of them.
    bias : float
        The logit's constant (sets the click rate).
    eval_fraction : float
        The held-out share of each day.
    seed : int

    Returns
    -------
    ClickLog

    Examples
    --------
    >>> log = make_log(days=2, samples_per_day=1000, seed=0)
    >>> log.days, log.train_ids.shape, log.eval_ids.shape
    (2, (1600, 3), (400, 3))
    >>> bool(np.intersect1d(log.day(0)[0][:, 1], log.day(1)[0][:, 1]).size
    ...      < np.unique(log.day(1)[0][:, 1]).size)     # day 1 brings new items
    True
    """
    users = max(samples_per_day // 80, 1) if users is None else users
    items = max(samples_per_day // 250, 1) if items is None else items
    new_users = users // 2 if new_users is None else new_users
    new_items = items if new_items is None else new_items
    rng = np.random.default_rng([seed, 0x5EED])
    n = days * samples_per_day
    t = np.sort(rng.random(n) * days)                 # sample times, in days
    day = np.minimum(t.astype(np.int64), days - 1)
    serial = np.empty((n, 3), np.int64)
    # per-serial truths, drawn in one go for every serial the log can name
    fx = np.random.default_rng([seed, 0xEFFEC7])
    top_u, top_i = users + days * new_users + 1, items + days * new_items + 1
    for f, (pool, new, top) in enumerate(((users, new_users, top_u),
                                          (items, new_items, top_i))):
        weight = np.exp(fx.normal(0.0, skew, top))
        serial[:, f] = _draw(rng, t, pool, new, weight, _SLOTS)
    # one-off visitors: serials past every regular user's, one each, without effects
    once = np.flatnonzero(rng.random(n) < one_off)
    serial[once, 0] = top_u + np.arange(len(once))
    zipf = 1.0 / np.arange(1, contexts + 1) ** 1.2
    serial[:, 2] = rng.choice(contexts, size=n, p=zipf / zipf.sum())
    b_user = np.concatenate([fx.normal(0.0, effect_std, top_u), np.zeros(len(once))])
    b_item = fx.normal(0.0, effect_std, top_i)
    b_ctx = fx.normal(0.0, effect_std, contexts)
    scale = np.sqrt(interaction_std / np.sqrt(rank))  # u . v then has std interaction_std
    u = np.concatenate([fx.normal(0.0, scale, (top_u, rank)), np.zeros((len(once), rank))])
    v = fx.normal(0.0, scale, (top_i, rank))
    logit = (bias + b_user[serial[:, 0]] + b_item[serial[:, 1]] + b_ctx[serial[:, 2]]
             + np.einsum("nr,nr->n", u[serial[:, 0]], v[serial[:, 1]]))
    p = 1.0 / (1.0 + np.exp(-logit))
    y = (rng.random(n) < p).astype(np.float32)
    ids = np.stack([raw_ids(f, serial[:, f]) for f in range(3)], axis=1)
    held = np.zeros(n, bool)
    held[rng.permutation(n)[:int(round(n * eval_fraction))]] = True
    bounds = np.arange(days + 1)

    def cut(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (ids[mask], y[mask], p[mask],
                np.searchsorted(day[mask], bounds, side="left").astype(np.int64))

    tr, ev = cut(~held), cut(held)
    return ClickLog(*tr, *ev)
