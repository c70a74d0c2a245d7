"""Deliberate differences of the dist stores from MXNet that no other test pins down."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx


def test_set_updater_in_a_dist_store_raises(run_threads: Any) -> None:
    def body(kv: Any) -> Any:
        kv.init(0, mx.nd.zeros((2,)))
        with pytest.raises(mx.UnsupportedError, match="set_optimizer"):
            kv.set_updater(lambda key, inp, stored: None)
        with pytest.raises(NotImplementedError):
            kv._set_updater(lambda key, inp, stored: None)
        kv.push(0, mx.nd.ones((2,)))
        return kv.pull(0).asnumpy()

    results = run_threads(body, num_workers=1)
    np.testing.assert_array_equal(results[0], [1.0, 1.0])   # still assigns
