"""Helpers of tests/dist: comparing what two runs of a job returned, bit for bit."""
from __future__ import annotations

from typing import Any, Collection

import numpy as np


def same(x: Any, y: Any, skip: Collection[str] = ()) -> None:
    """Assert that ``x`` and ``y`` (dicts, lists and arrays nested) hold the same bits,
    leaving out the dict entries named in ``skip`` (facts of the path, not results)."""
    if isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            if k not in skip:
                same(x[k], y[k], skip)
    elif isinstance(x, list):
        assert len(x) == len(y)
        for a, b in zip(x, y):
            same(a, b, skip)
    else:
        a, b = np.asarray(x), np.asarray(y)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b), f"max difference {np.abs(a - b).max()}"
