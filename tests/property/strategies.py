"""Hypothesis strategies shared by the property tests: keys, shapes, arrays, updaters."""
from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

__all__ = ["SHAPES", "UPDATER_NAMES", "bad_shape_for", "int_keys", "key_lists", "str_keys",
           "values_for"]

#: shapes a key may be initialized with (small: the machine checks every key every step)
SHAPES = [(3,), (2, 3), (1, 4), (2, 1, 2)]

#: updaters known to both pskv.testing.UPDATERS and pskv.testing.numpy_updater
UPDATER_NAMES = ["assign", "add2", "sub_half"]

#: int keys: plain ints, including big and negative ones
int_keys = st.integers(min_value=-(2**40), max_value=2**40)

#: str keys: short names, any printable characters
str_keys = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                   min_size=1, max_size=6)

# small integer-valued floats: sums and updates stay exact in float32
_elements = st.integers(min_value=-8, max_value=8).map(float)


def values_for(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays of ``shape`` with small integer values."""
    return arrays(np.float32, shape, elements=_elements)


def bad_shape_for(shape: tuple[int, ...]) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes other than ``shape`` (same size included, e.g. a transpose)."""
    return st.sampled_from(SHAPES + [(6,), (3, 2), (4,)]).filter(lambda s: s != shape)


def key_lists(keys: list[Any]) -> st.SearchStrategy[list[Any]]:
    """Non-empty lists drawn from ``keys``, with repeats (duplicate keys in one call)."""
    return st.lists(st.sampled_from(keys), min_size=1, max_size=5)
