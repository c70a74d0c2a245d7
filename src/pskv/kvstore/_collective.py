"""Which keys of a dist store take the collective path (docs/collective.md).

One rule, decided at a key's ``init`` and the same on every worker (the init barrier
compares the choices): a key is summed among the workers (``_ps/collective.py``) when the
store is ``dist_sync`` with at least two workers, the key is dense, no optimizer runs on the
servers, no gradient compression is set, no server feature needs every round on the
servers (``PSKV_REPLICAS``, periodic checkpoints, ``--max-restarts``), and either its bytes
reach ``PSKV_COLLECTIVE_BYTES`` (0: none does) or ``kv.set_collective(key, True)`` asked for
it before its init; ``set_collective(key, False)`` keeps it on the servers whatever its
size. Everything else stays on the servers: small keys, row_sparse keys, tables,
``dist_async``.
"""
from __future__ import annotations

from typing import Any

from ..errors import KeyTypeError, UnsupportedError, ValueTypeError
from .._ps.config import ClusterConfig
from .._types import Key

__all__ = ["Choice", "key_list"]


def key_list(key: Any) -> list[Key]:
    """``key`` (one key or a list of them) as a list, each checked to be an int or a str."""
    keys = list(key) if isinstance(key, (list, tuple)) else [key]
    for k in keys:
        if type(k) is not int and type(k) is not str:
            raise KeyTypeError(f"set_collective takes int or str keys (or a list of them), "
                               f"got {k!r} of type {type(k).__name__}.", key=None)
    return keys


class Choice:
    """A dist store's collective choices: the store-wide conditions and the per-key ones."""

    def __init__(self, store_type: str, cfg: ClusterConfig, num_workers: int) -> None:
        self.store_type = store_type
        self.threshold = cfg.collective_bytes
        self.prefs: dict[Key, bool] = {}
        #: set by set_optimizer: keys initialized from then on stay on the servers
        self.optimizer = False
        self.compression = False
        self._fixed = None
        if "async" in store_type:
            self._fixed = (f"a {store_type!r} store applies each push on the servers as it "
                           "comes; the collective path sums dist_sync rounds")
        elif num_workers < 2:
            self._fixed = "one worker has nothing to exchange"
        elif cfg.replicas or cfg.checkpoint_every or cfg.max_restarts:
            self._fixed = ("PSKV_REPLICAS, periodic checkpoints and --max-restarts need every "
                           "round on the servers")

    def off(self) -> str | None:
        """Why no key of this store can take the path now, or None."""
        if self._fixed is not None:
            return self._fixed
        if self.optimizer:
            return ("the store has an optimizer (set_optimizer): the servers update the "
                    "weights, so the pushes must reach them")
        if self.compression:
            return "gradient compression is set: the servers decompress the pushes"
        return None

    def prefer(self, keys: list[Key], enabled: Any) -> None:
        """Record ``set_collective(keys, enabled)`` (keys checked by the store)."""
        if type(enabled) is not bool:
            raise ValueTypeError(f"set_collective(key, enabled): enabled must be True or "
                                 f"False, got {enabled!r}.")
        if enabled and self._fixed is not None:
            raise UnsupportedError(f"set_collective({keys[0]!r}, True): {self._fixed}. Leave "
                                   "the key on the servers.", key=keys[0],
                                   store_type=self.store_type)
        for k in keys:
            self.prefs[k] = enabled

    def decide(self, key: Key, sparse: bool, nbytes: int) -> bool:
        """Whether ``key`` (being initialized) takes the collective path; raises
        UnsupportedError where ``set_collective(key, True)`` cannot be honoured."""
        pref = self.prefs.get(key)
        if pref is False:
            return False
        why = self.off()
        if why is None and sparse:
            why = "it is row_sparse: the collective path sums dense keys"
        if pref:
            if why is not None:
                raise UnsupportedError(
                    f"key {key!r} was set to take the collective path "
                    f"(set_collective), but {why}. Call set_collective({key!r}, False), "
                    "or init the key before set_optimizer / set_gradient_compression.",
                    key=key, store_type=self.store_type)
            return True
        return why is None and self.threshold > 0 and nbytes >= self.threshold
