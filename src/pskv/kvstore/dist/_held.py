"""HeldPush: the one small ``dist_sync`` push a worker may hold back, and its rule.

The rule, in full:

1. A ``dist_sync`` push whose messages are all dense (or compressed) and carry at most
   ``PSKV_COALESCE_BYTES`` bytes in all is not sent at once: the store keeps a copy here.
2. If the store's next call is a pull of exactly the same keys (a training loop's
   push-then-pull), the held push and the pull travel together as one PUSHPULL per
   server, and the round's value comes back in the reply: one round trip instead of two.
3. Any other call of the store (push, init, barrier, pushpull, row_sparse_pull, a pull of
   other keys, close, ...) sends the held push first, as a plain PUSH.
4. A push held for :data:`MAX_HOLD` seconds or more is sent by the worker's control thread
   (the Postoffice's, about every half heartbeat interval) if the store is idle, so a worker
   that pushes and then blocks on something outside the store (another framework's
   collective, a sleep, input) delays the other workers' round by at most about
   ``MAX_HOLD + PSKV_HEARTBEAT_INTERVAL / 2``, not for as long as it blocks.

``PSKV_COALESCE_BYTES=0`` turns holding off. ``dist_async`` never holds.
"""
from __future__ import annotations

import time

import numpy as np

from ..._types import Key

__all__ = ["HeldPush", "Items", "MAX_HOLD"]

#: seconds after which a held push is sent without waiting for the store's next call
MAX_HOLD = 0.05

#: per server: ps_keys, one kind letter per key ('d', 'c' or 'r') and the arrays of a push
Items = dict[int, tuple[list[int], str, list[np.ndarray]]]


class HeldPush:
    """At most one held push (see the module docstring for the rule).

    Parameters
    ----------
    limit : int
        Largest push (bytes, all servers together) that is held; 0 never holds.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: list[Key] | None = None
        self._items: Items | None = None
        self._since = 0.0

    def __bool__(self) -> bool:
        return self._items is not None

    def hold(self, keys: list[Key], items: Items) -> bool:
        """Keep a copy of ``items`` if rule 1 allows (then True: do not send them now).

        The caller has sent (:meth:`release`) any push held before.
        """
        if self.limit <= 0 or self._items is not None:
            return False
        nbytes = 0
        for _, kinds, arrays in items.values():
            if "r" in kinds:
                return False
            nbytes += sum(a.nbytes for a in arrays)
        if nbytes > self.limit:
            return False
        # copied: the caller may change its arrays (and the send buffers) once push returns
        self._keys = list(keys)
        self._items = {s: (pk, kinds, [np.array(a) for a in arrays])
                       for s, (pk, kinds, arrays) in items.items()}
        self._since = time.monotonic()
        return True

    def overdue(self) -> bool:
        """Whether a push has been held for :data:`MAX_HOLD` seconds (rule 4)."""
        return self._items is not None and time.monotonic() - self._since >= MAX_HOLD

    def take_for_pull(self, keys: list[Key]) -> Items | None:
        """The held push if a pull of ``keys`` may carry it (rule 2); it is no longer held."""
        if self._items is None or self._keys != keys:
            return None
        return self.release()

    def release(self) -> Items | None:
        """The held push, to be sent now (rule 3); None if nothing is held."""
        items, self._items, self._keys = self._items, None, None
        return items
