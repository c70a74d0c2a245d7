"""``pskv.nd``: NDArray and its creation functions, as ``mxnet.nd``."""
from __future__ import annotations

from . import sparse
from .ndarray import NDArray, array, empty, full, ones, waitall, zeros
from .sparse import RowSparseNDArray

__all__ = ["NDArray", "RowSparseNDArray", "array", "empty", "full", "ones", "sparse",
           "waitall", "zeros"]
