"""pskv.testing.InprocCluster: a whole cluster in one process, on ZeroMQ inproc endpoints.

The same dist semantics as over sockets (sums across workers, big keys split across
servers, row_sparse, optimizers, errors that keep their class), with no port and no file.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pskv as mx
from pskv.errors import ConfigError, KeyAlreadyInitializedError, KVStoreError
from pskv.testing import InprocCluster

pytestmark = pytest.mark.timeout(60)


def test_sync_rounds_big_keys_and_row_sparse() -> None:
    def fn(kv: Any) -> Any:
        kv.init(["small", "big"], [mx.nd.zeros((3,)), mx.nd.zeros((40,))])
        kv.init("emb", mx.nd.zeros((6, 2)).tostype("row_sparse"))
        for _ in range(3):
            kv.push(["small", "big"], [mx.nd.ones((3,)) * (kv.rank + 1),
                                       mx.nd.ones((40,)) * (kv.rank + 1)])
        grad = mx.nd.sparse.row_sparse_array(
            (np.full((1, 2), kv.rank + 1.0, np.float32), [kv.rank * 2]), shape=(6, 2))
        kv.push("emb", grad)
        out = mx.nd.sparse.zeros("row_sparse", (6, 2))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([0, 2, 5]))
        segments = [(s.server, s.start, s.stop) for s in kv._store["big"].segments]
        return (kv.pull("small").asnumpy(), kv.pull("big").asnumpy(), segments,
                out.indices.asnumpy().tolist(), out.data.asnumpy().tolist())

    with InprocCluster(num_workers=2, num_servers=2, bigarray_bound=16) as cluster:
        results = cluster.run(fn)
    assert cluster.codes == {"scheduler": 0, "server 0": 0, "server 1": 0}
    for rank, got in results.items():
        assert not isinstance(got, BaseException), (rank, got)
        small, big, segments, rows, data = got
        np.testing.assert_array_equal(small, np.full(3, 3.0))       # assign: 1 + 2
        np.testing.assert_array_equal(big, np.full(40, 3.0))
        assert segments == [(0, 0, 20), (1, 20, 40)]
        assert rows == [0, 2, 5] and data == [[1, 1], [2, 2], [0, 0]]


def test_optimizer_and_error_classes() -> None:
    def fn(kv: Any) -> Any:
        kv.init(0, mx.nd.ones((2,)))
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
        kv.push(0, mx.nd.ones((2,)))
        value = kv.pull(0).asnumpy()
        try:
            kv.init(0, mx.nd.ones((2,)))
        except KVStoreError as err:
            return value, err
        return value, None

    with InprocCluster(num_workers=2) as cluster:
        results = cluster.run(fn)
    for value, err in results.values():
        np.testing.assert_allclose(value, np.full(2, 0.0))   # 1 - 0.5 * (1 + 1)
        assert isinstance(err, KeyAlreadyInitializedError), err


def test_inproc_is_not_an_environment_setting() -> None:
    from pskv._ps.config import ClusterConfig
    env = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "PSKV_TRANSPORT": "inproc"}
    with pytest.raises(ConfigError, match="inside one process"):
        ClusterConfig.from_env(env)
