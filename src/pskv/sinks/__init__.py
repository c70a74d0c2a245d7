"""``pskv.sinks``: a table's change stream written where a serving stack reads it
(docs/embeddings.md, "Sinks"): files (:class:`FileSink`, read back by :func:`replay`) or
Redis (:class:`RedisSink`, read back by :func:`load_redis` or any Redis client), fed by
:func:`run_sink` or ``python -m pskv.sinks``.

This wing owns the files and the Redis layout a sink writes and the loop that feeds it; it
reads the stream through any source with ``subscribe(key, since=..., raw=...)`` (a store,
or a reader process) and imports no store. A sink is anything with ``raw``,
``position()``, ``write(batches)`` and ``close()`` (:class:`Sink`).

**Files (F1-F8)**

* F1. *Files.* A directory holds ``manifest.json``, segments ``seg-NNNNNNNN-full.npz`` and
  ``seg-NNNNNNNN-delta.npz`` (``NNNNNNNN`` rising) and a ``.lock``. A segment is an
  ``np.savez`` archive of plain arrays (load it with ``allow_pickle=False``): per batch
  ``shard``, ``num_shards``, ``version``, ``reset``, ``complete``, ``lineage``, ``n_ids``,
  ``n_removed``; the batches' ``ids``, ``rows``, ``removed`` and ``reasons`` one after
  the other, in batch order (little-endian).
* F2. *Durable before named.* A segment is written under a temporary name, fsynced and
  renamed into place (the directory fsynced) before the manifest names it; the manifest
  is replaced the same way (``os.replace``). A reader sees the old manifest or the new
  one, and every segment it names is whole.
* F3. *The manifest* (JSON) says ``key``, ``dim``, ``dtype`` (``float32``, or with ``raw``
  the storage dtype: ``float16``, or ``bfloat16`` stored as its uint16 bits),
  ``row_dtype`` (NumPy's: ``<f4``, ``<f2``, ``<u2``), ``raw``, ``num_shards``, the
  ``segments`` in order (each ``file``, ``kind``, ``bytes``, ``sha256`` and the
  ``position`` every shard is at after it) and ``position``, the last one: pass it as
  ``subscribe(key, since=position)``. Replaying applies the segments in order, each
  batch as the stream's: ``reset`` drops the shard's rows, then ``removed`` IDs are
  deleted, then ``ids`` and ``rows`` upserted.
* F4. *A full snapshot* is a segment of kind ``full``: exactly one batch per shard
  ``0..num_shards-1``, each ``reset`` and complete, with every row of that shard at the
  shard's (lineage, version). It rebuilds the table alone. The manifest's first segment
  is always a full snapshot, and the only one; the rest are deltas.
* F5. *Rotation.* A write becomes a full snapshot of the table after it, instead of a
  delta, when the directory has none yet, when a batch of the write is ``reset`` (that
  shard was read whole again: a reload, or a reader behind the tombstones; each shard
  resets on its own, and any one of them rotates), or when the deltas would pass
  ``max_deltas`` files or ``max_bytes`` (default: the full snapshot's size, at least
  1 MiB). It waits while a shard is in the middle of a paged read. Once the manifest
  naming the new snapshot is in place, the older segments are deleted.
* F6. *Checked on read.* Each segment's size and sha256 are the manifest's, its arrays add
  up, and the positions after it are the ones the manifest lists; else
  :class:`~pskv.errors.CheckpointError` names the file.
* F7. *Readers and rotation.* A reader that finds a named segment gone reads the manifest
  again (a rotation ran meanwhile; :func:`replay` does, up to 5 times).
* F8. *Resume.* A new sink on a directory replays it (F6), deletes files no manifest names
  (what a crash left), and goes on with deltas from the manifest's position: no full
  snapshot unless F5 asks for one. A poll that changes nothing writes nothing. One sink
  per directory (a second one is refused).

**Redis (K1-K6)**

With ``T`` the table key as text and ``P`` the prefix (default ``pskv``):

* K1. ``P:T:row:ID`` (a string; ``ID`` in decimal) holds the row's bytes, little-endian:
  ``dim`` float32 values, or with ``raw`` the storage dtype's (float16, or bfloat16 as
  uint16 bits).
* K2. ``P:T:ids:S`` is a set of the IDs (decimal) shard ``S`` holds: what a reset deletes.
* K3. ``P:T:meta`` is a hash: ``format``, ``dim``, ``dtype``, ``row_dtype``, ``raw``,
  ``num_shards``, ``lineage:S`` and ``version:S`` per shard, and ``position`` (JSON:
  ``subscribe(key, since=position)``).
* K4. *Atomic per shard read.* The batches of one shard of one poll go in one
  ``MULTI``/``EXEC``: the deletes of removed IDs, the rows, and that shard's
  ``version:S`` and the ``position`` with them; a reader never sees a shard half-way
  between two versions (read several keys in one ``MULTI`` to see one version).
* K5. *Reset.* A reset batch deletes every ``P:T:row:ID`` of the shard's set, and the set,
  in the same transaction as its new rows.
* K6. *Resume.* A new sink reads ``position`` from the meta hash; a meta of another dim,
  dtype or ``raw`` is refused. One sink per table and prefix.
"""
from __future__ import annotations

from ._files import FileSink, replay
from ._redis import RedisSink, load_redis
from ._run import Sink, main, run_sink

__all__ = ["FileSink", "RedisSink", "Sink", "load_redis", "main", "replay", "run_sink"]
