"""``kv.subscribe``: a reader of a table key's change stream, on any store (E1-E10).

A :class:`Subscription` remembers, per shard, the lineage and version its caller has
been given; :meth:`Subscription.poll` reads each shard's changes since then (every page
of one read, ``table._stream.read_all``) through the store's ``fetch`` and advances.
The store supplies ``fetch(shard, since, lineage, cursor, upto)``: a local store reads
its table, a dist store asks the server that serves the shard (``Op.CHANGES``).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Mapping

from ..errors import ConfigError, StaleReadError
from ..table._stream import ChangeBatch, read_all

__all__ = ["Subscription", "check_since", "check_subscribe"]

Fetch = Callable[[int, int, "str | None", int, "int | None"], ChangeBatch]


def check_subscribe(key: Any, raw: Any, max_rows: Any) -> None:
    """ConfigError unless ``raw`` is a bool and ``max_rows`` a whole number >= 1."""
    if not isinstance(raw, bool):
        raise ConfigError(f"subscribe({key!r}, raw={raw!r}): raw is True or False.", key=key)
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ConfigError(f"subscribe({key!r}, max_rows={max_rows!r}): give a whole "
                          "number >= 1.", key=key)


def check_since(key: Any, since: Any, num_shards: int) -> dict[int, tuple[str | None, int]]:
    """``since`` as ``{shard: (lineage, version)}``: None (from the start), a position
    (:attr:`Subscription.position`, as it is or after a JSON round trip), else ConfigError."""
    if since is None:
        return {}
    if isinstance(since, (str, bytes)):
        try:
            since = json.loads(since)
        except ValueError as err:
            raise ConfigError(f"subscribe({key!r}, since=...): not a position ({err}). Pass "
                              "a Subscription.position (or its JSON).", key=key) from err
    if not isinstance(since, Mapping):
        raise ConfigError(f"subscribe({key!r}, since={since!r}): a position is a mapping "
                          "{shard: [lineage, version]}, as Subscription.position gives it.",
                          key=key)
    out: dict[int, tuple[str | None, int]] = {}
    for s, pos in since.items():
        try:
            shard = int(s)
            lineage, version = pos
        except (TypeError, ValueError) as err:
            raise ConfigError(f"subscribe({key!r}, since=...): entry {s!r}: {pos!r} is not "
                              "[lineage, version] of a shard.", key=key) from err
        if not 0 <= shard < num_shards or isinstance(version, bool) or \
                not isinstance(version, int) or version < -1 or \
                not (lineage is None or isinstance(lineage, str)):
            raise ConfigError(f"subscribe({key!r}, since=...): entry {s!r}: {pos!r} is not "
                              f"[lineage, version >= -1] of a shard in 0..{num_shards - 1}.",
                              key=key)
        out[shard] = (lineage, version)
    return out


class Subscription:
    """A reader of table ``key``'s change stream: see ``kv.subscribe``.

    Attributes
    ----------
    key : int or str
    num_shards : int
        How many shards (servers) the table has; batches name theirs.
    """

    def __init__(self, key: Any, fetch: Fetch, num_shards: int, since: Any) -> None:
        self.key, self.num_shards = key, int(num_shards)
        self._fetch = fetch
        self._pos = check_since(key, since, self.num_shards)
        self._lock = threading.Lock()
        #: seconds (time.time) each shard's last read was complete
        self.read_at: dict[int, float] = {}

    @property
    def position(self) -> dict[str, list[Any]]:
        """Where each shard's stream was read to: ``{"shard": [lineage, version]}``, JSON-
        able; ``kv.subscribe(key, since=position)`` resumes there (in another process too)."""
        with self._lock:
            return {str(s): [lin, v] for s, (lin, v) in sorted(self._pos.items())}

    def version(self, shard: int) -> int:
        """The version of ``shard`` read to (-1: none yet)."""
        with self._lock:
            return self._pos.get(shard, (None, -1))[1]

    def poll(self) -> list[ChangeBatch]:
        """Read every shard's changes since the last poll (or ``since``): the batches, in
        version order per shard (apply each: ``removed`` first, then ``rows``). A shard
        with nothing new gives one empty batch, whose version says where it is."""
        with self._lock:
            out: list[ChangeBatch] = []
            for s in range(self.num_shards):
                lineage, v = self._pos.get(s, (None, -1))
                pages = read_all(lambda since, lin, cur, upto, s=s:
                                 self._fetch(s, since, lin, cur, upto), v, lineage)
                out.extend(pages)
                self._pos[s] = pages[-1].position
                self.read_at[s] = time.time()
            return out

    def wait(self, versions: Mapping[int, int], timeout: float = 30.0,
             interval: float = 0.05) -> list[ChangeBatch]:
        """Poll until each ``shard`` of ``versions`` is read to at least its version (the
        batches read meanwhile); StaleReadError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        got: list[ChangeBatch] = []
        while True:
            got.extend(self.poll())
            behind = {s: v for s, v in versions.items() if self.version(int(s)) < v}
            if not behind:
                return got
            if time.monotonic() >= deadline:
                s, v = next(iter(behind.items()))
                raise StaleReadError(
                    f"table {self.key!r}: shard {s} is at version {self.version(int(s))}, "
                    f"not yet {v}, after {timeout:g} s. Is the job still training?",
                    key=self.key)
            time.sleep(interval)
