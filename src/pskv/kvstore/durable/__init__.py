"""The durability wing: what a server does so that no acknowledged push is lost
(docs/durability.md).

``_snapshots`` (a server's checkpoint writers, restart reload, periodic copies),
``_replica`` (a shard's backup link and the copies a backup keeps), ``_backup_log`` (the
rounds a backup logs), ``_shards`` (what one server serves, and the takeover of a dead
primary's shard). It imports the engine wing and the ground floor of ``pskv.kvstore``,
never the server or the dist store.
"""
__all__: list[str] = []
