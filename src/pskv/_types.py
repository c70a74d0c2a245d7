"""Type aliases shared by the store modules."""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

__all__ = ["Key", "KeyArg", "Updater", "ValueArg"]

Key = Union[int, str]
#: one key, or a list of keys (duplicates allowed: their values are summed on push)
KeyArg = Union[Key, Sequence[Key]]
#: one array, a list of arrays (one key on several devices), or a list of those per key
ValueArg = Any
#: ``updater(key, input, stored)`` mutates ``stored`` in place
Updater = Callable[[Any, Any, Any], None]
