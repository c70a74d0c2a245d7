"""The read side of table keys every store shares: the change stream (``kv.subscribe``,
``kv.table_versions``; docs/embeddings.md E1-E10) and seeing into a table
(``kv.explain``, ``kv.hot_ids``; H1-H3). A mixin of :class:`._tables.TableMethods`: it
calls the store's ``_tables`` (a local store's tables, or a dist store's, which ask the
servers) under the store's lock.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ..table._stream import PAGE_ROWS
from .._types import Key
from ._subscription import Subscription, check_subscribe

__all__ = ["StreamMethods"]


class StreamMethods:
    """``subscribe``, ``table_versions``, ``explain`` and ``hot_ids`` of a store."""

    _tables: Any
    _lock: Any

    def _table_begin(self) -> None:
        """What every table call checks first (``TableMethods`` says what)."""

    def subscribe(self, key: Key, since: Any = None, *, raw: bool = False,
                  max_rows: int = PAGE_ROWS) -> Subscription:
        """A reader of table key ``key``'s change stream (docs/embeddings.md, E1-E10).

        Parameters
        ----------
        key : int or str
            A table key.
        since : mapping or str, optional
            Where to resume: a :attr:`Subscription.position` (or its JSON), read by this
            or another process. None: from the start (the first poll gives each shard
            whole, marked ``reset``).
        raw : bool
            Rows in the table's storage dtype (float16, or bfloat16 bit patterns as
            uint16) instead of float32.
        max_rows : int
            The most rows one batch carries (a read of more comes in pages).

        Returns
        -------
        Subscription
            ``poll()`` gives the :class:`~pskv.table.ChangeBatch` es since the last poll.

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec, Constant
        >>> kv = mx.kv.create('local')
        >>> kv.init('emb', TableSpec(dim=2, init=Constant(0.0)))
        >>> sub = kv.subscribe('emb')
        >>> _ = kv.lookup('emb', np.array([7, 8]))
        >>> [(b.version, b.reset, b.ids.tolist()) for b in sub.poll()]
        [(1, True, [7, 8])]
        >>> kv.push('emb', (np.array([8]), np.ones((1, 2), np.float32)))
        >>> [(b.version, b.ids.tolist(), b.rows.tolist()) for b in sub.poll()]
        [(2, [8], [[1.0, 1.0]])]
        >>> sub.position == {'0': [sub.position['0'][0], 2]}
        True
        """
        check_subscribe(key, raw, max_rows)
        with self._lock:
            self._table_begin()
            n = self._tables.num_shards(key)
            fetch = self._tables.fetch(key, raw, max_rows)
        lock = self._lock

        def locked(*args: Any) -> Any:
            with lock:
                self._table_begin()
                return fetch(*args)
        return Subscription(key, locked, n, since)

    def explain(self, key: Key, id: Any) -> dict[str, Any]:
        """What table key ``key`` knows of ID ``id`` (docs/embeddings.md, "Seeing into a
        table"): ``id``, ``shard`` (the server holding it), ``present``, ``admission``
        (the spec's rule), the table's ``step`` and ``version``; for a row held
        ``born_step``, ``born_by`` (``pull``: a training lookup, ``push``, ``assign``,
        ``restore``: re-created for a push sent again, ``replicated``, ``checkpoint``:
        loaded), ``last_used_step``, ``seconds_since_use``, ``uses``,
        ``last_change_version``; for an ID without a row under ``CountAdmission``,
        ``sightings``, ``min_count`` and ``needs`` (sightings still to go); and
        ``evicted``: None, or the ``version`` and ``reason`` (``ttl``, ``capacity``,
        ``score``, ``replicated``) of its last removal the table still remembers.

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec, CountAdmission
        >>> kv = mx.kv.create('local')
        >>> kv.init(0, TableSpec(dim=2, admission=CountAdmission(3)))
        >>> _ = kv.lookup(0, np.array([5]))
        >>> e = kv.explain(0, 5); e['present'], e['sightings'], e['needs']
        (False, 1, 2)
        """
        if isinstance(id, bool) or not isinstance(id, (int, np.integer)):
            raise ConfigError(f"explain({key!r}, {id!r}): give one integer ID.", key=key)
        with self._lock:
            self._table_begin()
            return self._tables.explain(key, int(id))

    def hot_ids(self, key: Key, k: int = 10) -> list[tuple[int, int]]:
        """The ``k`` (1 to 256) IDs of table key ``key`` looked up most lately, with the
        count-min estimate of each, highest first (docs/embeddings.md H1-H3; a dist store
        merges its servers').

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec
        >>> kv = mx.kv.create('local')
        >>> kv.init(0, TableSpec(dim=2))
        >>> _ = kv.lookup(0, np.array([4, 4, 4, 9]))
        >>> kv.hot_ids(0, k=2)
        [(4, 3), (9, 1)]
        """
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 256:
            raise ConfigError(f"hot_ids({key!r}, k={k!r}): give a whole number in 1..256.",
                              key=key)
        with self._lock:
            self._table_begin()
            return self._tables.hot(key, k)

    def table_versions(self, key: Key) -> list[int]:
        """Each shard's version of table key ``key`` (one per server; E1): a reader of
        the change stream has every change up to it once its position says so.

        Examples
        --------
        >>> import numpy as np, pskv as mx
        >>> from pskv.table import TableSpec
        >>> kv = mx.kv.create('local')
        >>> kv.init(0, TableSpec(dim=2))
        >>> _ = kv.lookup(0, np.array([1, 2]))
        >>> kv.table_versions(0)
        [1]
        """
        with self._lock:
            self._table_begin()
            return self._tables.versions(key)

