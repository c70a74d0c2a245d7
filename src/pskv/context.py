"""Device contexts: ``cpu(i)``, ``gpu(i)`` and ``Context``, as in MXNet.

pskv keeps arrays in host memory; a Context is a tag that says which device an array
belongs to, so that multi-device code (one gradient per GPU) runs unchanged.
"""
from __future__ import annotations

import contextvars
from types import TracebackType

from .errors import ConfigError

__all__ = ["Context", "cpu", "cpu_pinned", "current_context", "gpu", "num_gpus"]

_DEVTYPES = {"cpu": 1, "gpu": 2, "cpu_pinned": 3, "cpu_shared": 5}
_DEFAULT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "pskv_default_context", default=None)


class Context:
    """A device context: a device type and an id.

    Parameters
    ----------
    device_type : str or Context
        ``'cpu'``, ``'gpu'``, ``'cpu_pinned'`` or ``'cpu_shared'``; a Context is copied.
    device_id : int, default 0
        The device number.

    Examples
    --------
    >>> import pskv as mx
    >>> mx.gpu(1)
    gpu(1)
    >>> mx.Context('cpu', 2) == mx.cpu(2)
    True
    >>> with mx.Context('gpu', 1):
    ...     mx.current_context()
    gpu(1)
    """

    __slots__ = ("device_type", "device_id", "_tokens")
    device_type: str
    device_id: int

    devtype2str = {v: k for k, v in _DEVTYPES.items()}
    devstr2type = dict(_DEVTYPES)

    def __init__(self, device_type: str | Context, device_id: int = 0) -> None:
        if isinstance(device_type, Context):
            device_id = device_type.device_id
            device_type = device_type.device_type
        if not isinstance(device_type, str) or device_type not in _DEVTYPES:
            raise ConfigError(
                f"unknown device type {device_type!r}. Use one of {sorted(_DEVTYPES)}.")
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ConfigError(
                f"device id {device_id!r} is not a non-negative int. Use e.g. mx.gpu(0).")
        self.device_type = device_type
        self.device_id = int(device_id)
        self._tokens: list[contextvars.Token[Context | None]] = []

    @property
    def device_typeid(self) -> int:
        """The MXNet integer code of the device type."""
        return _DEVTYPES[self.device_type]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Context) and self.device_type == other.device_type
                and self.device_id == other.device_id)

    def __hash__(self) -> int:
        return hash((self.device_type, self.device_id))

    def __repr__(self) -> str:
        return f"{self.device_type}({self.device_id})"

    __str__ = __repr__

    def __enter__(self) -> Context:
        self._tokens.append(_DEFAULT.set(self))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _DEFAULT.reset(self._tokens.pop())

    def __reduce__(self) -> tuple[type[Context], tuple[str, int]]:
        return (Context, (self.device_type, self.device_id))


def cpu(device_id: int = 0) -> Context:
    """Return a CPU context. ``mx.cpu(i)`` tags an array as living on CPU *i*."""
    return Context("cpu", device_id)


def cpu_pinned(device_id: int = 0) -> Context:
    """Return a pinned-memory CPU context (a tag, as everything is host memory here)."""
    return Context("cpu_pinned", device_id)


def gpu(device_id: int = 0) -> Context:
    """Return a GPU context.

    pskv's arrays live in host memory; the context tags them, so MXNet code that spreads
    gradients over ``[mx.gpu(i) for i in range(4)]`` runs unchanged.
    """
    return Context("gpu", device_id)


def num_gpus() -> int:
    """Return the number of GPUs pskv computes on: always 0 (arrays stay on the host)."""
    return 0


def current_context() -> Context:
    """Return the default context: the innermost ``with ctx:`` block's, else ``cpu(0)``."""
    ctx = _DEFAULT.get()
    return ctx if ctx is not None else Context("cpu", 0)
