"""The engine wing: stored values and the rules that change them, with no sockets and no
threads (docs/architecture.md "The engine").

``_core`` (``Engine``, ``Ticket``: rounds, pulls, applies), ``_state`` (a shard's copy and
restore), ``_tables`` (a server's shard of a table key), ``_uneven`` (joined and closed
workers), ``_entries`` (an INIT's entries, checked first). It imports only the ground floor
of ``pskv.kvstore`` (``tests/unit/test_architecture.py``).
"""
__all__: list[str] = []
