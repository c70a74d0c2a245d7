"""``pskv.nd``: NDArray, its creation functions and common operators, as ``mxnet.nd``."""
from __future__ import annotations

from . import random, sparse
from .creation import arange, array, empty, full, ones, waitall, zeros
from .ndarray import NDArray
from .ops import (abs, add_n, clip, concat, dot, max, maximum, mean, min, minimum, norm,
                  ones_like, sqrt, square, stack, sum, zeros_like)
from .random import normal as random_normal
from .random import uniform as random_uniform
from .sparse import RowSparseNDArray

__all__ = ["NDArray", "RowSparseNDArray", "abs", "add_n", "arange", "array", "clip",
           "concat", "dot", "empty", "full", "max", "maximum", "mean", "min", "minimum",
           "norm", "ones", "ones_like", "random", "random_normal", "random_uniform",
           "sparse", "sqrt", "square", "stack", "sum", "waitall", "zeros", "zeros_like"]
