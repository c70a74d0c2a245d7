"""``pskv.ndarray``: :mod:`pskv.nd` under MXNet's long name (``mxnet.ndarray``).

``import mxnet.ndarray as nd`` and ``from mxnet import ndarray`` become
``import pskv.ndarray as nd`` and ``from pskv import ndarray``: every name here is the
object :mod:`pskv.nd` has (``pskv.ndarray.NDArray is pskv.nd.NDArray``), its submodules
``random`` and ``sparse`` included. Unlike MXNet, ``pskv.ndarray`` is a module of its own, not
the same module object as ``pskv.nd``.

Examples
--------
>>> import pskv.ndarray as nd
>>> import pskv as mx
>>> nd.ones((2,)).asnumpy(), nd.zeros is mx.nd.zeros
(array([1., 1.], dtype=float32), True)
"""
from __future__ import annotations

from . import nd as _nd
from .nd import *  # noqa: F401,F403  (the same names, re-exported)

__all__ = list(_nd.__all__)
