"""The server wing: a server node (``_core.KVServer``) around its engines and shards, its
table and staleness commands (``_tables``, ``_staleness``), what ``/metrics`` reads of it
(``_observed``) and the node roles (``_roles``, re-exported by ``pskv.server``). The only
part of ``pskv.kvstore`` that imports the server side of ``pskv._ps`` (``serve``).
"""
__all__: list[str] = []
