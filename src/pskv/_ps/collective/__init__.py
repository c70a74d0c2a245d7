"""The collective wing of ``pskv._ps``: worker-to-worker sums of dense ``dist_sync`` keys
(``core.Collective``) over authenticated peer links (``peerlinks``) and, within a host,
shared memory (``_ps.shm``). docs/collective.md.
"""
__all__: list[str] = []
