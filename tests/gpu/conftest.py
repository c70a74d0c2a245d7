"""tests/gpu: CUDA values in and out of every store, against the host path, bit for bit.

Every test here is skipped, with the reason, where torch or a CUDA device is missing
(tests/unit/test_device_io.py checks the refusals without one). JAX, if a test imports it,
must not take the GPU's memory ahead of torch.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
