"""``pskv.base``: what MXNet code imports from ``mxnet.base``: :data:`MXNetError`.

``from mxnet.base import MXNetError`` becomes ``from pskv.base import MXNetError``; it is
:class:`pskv.KVStoreError` under MXNet's name (docs/differences.md).
"""
from __future__ import annotations

from .errors import MXNetError

__all__ = ["MXNetError"]
