"""Helpers of tests/gpu: the skip marks, and host or CUDA arrays made from NumPy.

Every test of tests/gpu imports this first. tests/gpu has no conftest.py: beside
tests/dist's, a second top-level ``conftest`` module fails collection under
``--doctest-modules``.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import pytest

try:
    import torch
except ImportError:          # the marks below skip every test
    torch = None

# JAX, if a test imports it, must not take the GPU's memory ahead of torch
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

HAVE_CUDA = torch is not None and torch.cuda.is_available()
HAVE_TWO = HAVE_CUDA and torch.cuda.device_count() >= 2

#: every test of tests/gpu: skipped without CUDA; warnings of the CUDA stack (torch's,
#: CuPy's or JAX's deprecations on a newer stack) are not pskv's and do not fail a test
MARKS = [
    pytest.mark.skipif(torch is None, reason="tests/gpu need torch (with CUDA)"),
    pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device: torch.cuda.is_available() "
                                             "is False"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def host(x: np.ndarray) -> np.ndarray:
    """The host path's array: a NumPy copy."""
    return np.array(x, copy=True)


def cuda(x: np.ndarray, device: str = "cuda:0") -> Any:
    """A CUDA tensor holding ``x``."""
    assert torch is not None
    return torch.from_numpy(np.array(x, copy=True)).to(device)


def read(a: Any) -> np.ndarray:
    """What ``a`` holds, as NumPy (a CUDA tensor is copied after its stream's work)."""
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy().copy()
    if hasattr(a, "asnumpy"):
        return np.array(a.asnumpy(), copy=True)
    return np.array(a, copy=True)


def same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Equal arrays, bit for bit (NaN included), in the same order."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape)
        assert g.tobytes() == w.tobytes(), f"result {i} differs: {g} != {w}"


Make = Callable[[np.ndarray], Any]


class FakeDevice:
    """An array that says it lives on CUDA device ``index`` (and has no memory)."""

    def __init__(self, shape: tuple[int, ...], index: int) -> None:
        self.shape = shape
        self.dtype = np.dtype("float32")
        self._index = index

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self._index)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("a fake: no memory behind it")
