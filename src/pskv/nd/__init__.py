"""``pskv.nd``: NDArray and its creation functions, as ``mxnet.nd``."""
from __future__ import annotations

from . import random, sparse
from .ndarray import NDArray, arange, array, empty, full, ones, waitall, zeros
from .random import normal as random_normal
from .random import uniform as random_uniform
from .sparse import RowSparseNDArray

__all__ = ["NDArray", "RowSparseNDArray", "arange", "array", "empty", "full", "ones",
           "random", "random_normal", "random_uniform", "sparse", "waitall", "zeros"]
