"""Type aliases of the public store API (``from pskv._types import Key``)."""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, Union

__all__ = ["Array", "Key", "KeyArg", "KeyList", "OutArg", "Updater", "ValueArg"]


class Array(Protocol):
    """What ``pull(key)`` with ``out=None`` returns: an array of the kind the key was
    initialized with (a pskv NDArray, a NumPy array or a torch tensor)."""

    @property
    def shape(self) -> Any:
        """The array's shape."""


#: a user's key: one kind (int or str) per store
Key = Union[int, str]
#: a list of keys (duplicates allowed: their values are summed on push)
KeyList = Union[list[Key], tuple[Key, ...]]
#: one key, or a list of keys
KeyArg = Union[Key, Sequence[Key]]
#: one array, a list of arrays (one key on several devices), or a list of those per key
ValueArg = Any
#: where a pull writes: one array, a list of arrays, or a list of those per key
OutArg = Union[Array, Sequence[Any]]
#: ``updater(key, input, stored)`` mutates ``stored`` in place
Updater = Callable[[Any, Any, Any], None]
