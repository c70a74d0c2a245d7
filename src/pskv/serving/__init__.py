"""``pskv.serving``: a read-only replica of tables that follows their change streams.

A :class:`Replica` reads the change stream of each table it serves (from a store's
``kv.subscribe`` or, outside the job, a :class:`pskv.stream.Reader`) on a thread of its
own and answers lookups at a version it reports, without touching the training servers
(docs/embeddings.md, "Serving replica", rules V1-V6):

* V1. *Versions.* A lookup answers ``(rows, found, versions)``: ``versions[shard]`` is the
  version of each shard the rows were read at (E1); with ``min_version`` it waits, up to
  ``timeout`` seconds, until every shard is at least there, else
  :class:`~pskv.errors.StaleReadError`.
* V2. *Whole batches.* A poll's batches are applied under the replica's lock; a lookup
  never sees part of one (nor a shard between two pages of a read).
* V3. *Unknown IDs.* An ID the replica holds no row of reads zeros, ``found`` False (the
  replica knows no spec: no initializer, R4 is the servers').
* V4. *Errors.* A source that fails (the job ended, a refused read) stops the following;
  the error is kept and raised by the next lookup with ``min_version`` above what is held
  (and by :meth:`Replica.check`); reads of what is held go on.
* V5. *Over the wire.* :meth:`Replica.serve` answers :class:`ReplicaClient` s on TCP: a
  length-prefixed JSON header and raw little-endian arrays. With a secret (the job's
  ``PSKV_SECRET``) a client first proves it: HMAC-SHA256 under a key derived for purpose
  ``replica`` over a nonce the replica chose for that connection (a proof made for a
  server or the scheduler is worthless here). Every message is checked and bounded
  (``_wire.MAX_HEADER``: 64 KiB a header, ``MAX_IDS``: 2**22 IDs a lookup); a bad one is answered with an error and the
  connection closed; nothing a client sends stops the replica. A connection that says
  nothing for 60 s is closed; at most 64 are served at once.
* V6. *No secret:* the replica binds 127.0.0.1 unless told another host, and warns.

``python -m pskv.serving --keys emb --port 7070`` runs one beside a job (its variables:
``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``, ``PSKV_SECRET``...) until SIGTERM; the rows
it holds stay served after the job ends.
"""
from __future__ import annotations

from ._replica import Replica
from ._wire import ReplicaClient
from .__main__ import main

__all__ = ["Replica", "ReplicaClient", "main"]
