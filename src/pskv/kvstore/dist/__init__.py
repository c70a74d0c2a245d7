"""The dist store wing: ``DistKVStore`` (``_store``) and what it is made of: the data path
(``_datapath``, ``_placement``, ``_held``), the collective path (``_collective``), init
agreement (``_agree``), checkpoints, join, staleness and table keys (``_checkpoints``,
``_join``, ``_staleness``, ``_tables``), and torchrun's adoption (``_torchrun``). It never
imports the server wing.
"""
from ._store import DistKVStore

__all__ = ["DistKVStore"]
