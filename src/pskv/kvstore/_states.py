"""A dist store's optimizer-states file: one states blob (the format of
:func:`pskv.optimizer.updater.encode_states`) per server, in one ``.npz`` without pickles.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, OptimizerStateError
from ..nd._npz import BadArchive, SafeNpz

__all__ = ["read_states", "write_states"]


def write_states(fname: str, blobs: list[np.ndarray]) -> None:
    """Save each server's optimizer-states bytes (``np.savez``: no pickle)."""
    named: dict[str, Any] = {f"server_{i}": b for i, b in enumerate(blobs)}
    with open(fname, "wb") as f:
        np.savez(f, **named)


def read_states(fname: str, num_servers: int) -> list[np.ndarray]:
    """Each server's part of a file :func:`write_states` wrote.

    Raises ConfigError if the file cannot be read, and OptimizerStateError (the class a
    local store raises) if it is not a states file of a cluster with ``num_servers``.
    """
    try:   # a regular file, its members checked before read (nd._npz)
        with SafeNpz(fname, repr(fname)) as data:
            return [data[f"server_{i}"] for i in range(num_servers)]
    except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
        raise ConfigError(f"cannot read optimizer states from {fname!r}: {err}. "
                          "Check the path.") from err
    except (OSError, BadArchive) as err:
        raise OptimizerStateError(
            f"cannot load optimizer states from {fname!r}: {err}. Load a file saved "
            "by save_optimizer_states of a cluster with as many servers.") from err
