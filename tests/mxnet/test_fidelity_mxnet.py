"""Differential tests: what real MXNet programs rely on, under MXNet 1.9.1 and under pskv.

* unseeded ``mx.nd.random`` draws are the same in every fresh process (the stream of
  ``mx.random.seed(0)``), and a forked child goes on from its parent's state;
* MXNet's import forms (``mxnet.base.MXNetError``, ``mxnet.ndarray``, ``mxnet.kvstore``) and
  ``except MXNetError`` around the misuses MXNet raises it for;
* the ``teststore`` store type MXNet registers on import;
* ``set_optimizer`` with a hyperparameter of the wrong type (MXNet accepts it and then
  silently skips every update; pskv refuses it in ``set_optimizer``).

Each scenario runs in a fresh interpreter per library (:func:`harness.run_scenario`); the
exact random numbers differ between the libraries (docs/differences.md), the properties
compared here do not.
"""
from __future__ import annotations

import numpy as np
import pytest

from .harness import assert_results_close, run_both, run_scenario

pytestmark = pytest.mark.mxnet

DRAWS = """
result['uniform'] = mx.nd.random.uniform(shape=(3,))
result['normal'] = mx.nd.random.normal(shape=(2,))
result['top_level'] = mx.random.uniform(-1, 1, shape=(2,))
mx.random.seed(0)
result['seed0_uniform'] = mx.nd.random.uniform(shape=(3,))
"""


@pytest.mark.parametrize("library", ["mxnet", "pskv"])
def test_two_fresh_processes_draw_the_same_unseeded_numbers(library: str) -> None:
    runs = [run_scenario(DRAWS, use_mxnet=library == "mxnet") for _ in range(2)]
    for run in runs:
        assert run["__error__"] is None, run["__error__"]
    for name in ("uniform", "normal", "top_level"):
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)
    # the default stream is seed(0)'s, in both libraries
    np.testing.assert_array_equal(runs[0]["uniform"], runs[0]["seed0_uniform"])


def test_the_streams_themselves_differ_between_the_libraries() -> None:
    """Documented in docs/differences.md: the property matches, the numbers do not."""
    ref, got = run_both(DRAWS)
    assert ref["__error__"] is None and got["__error__"] is None
    assert not np.array_equal(ref["uniform"], got["uniform"])


FORK = """
import os
first = mx.nd.random.uniform(shape=(3,)).asnumpy()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, mx.nd.random.uniform(shape=(3,)).asnumpy().tobytes())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
child = np.frombuffer(os.read(r, 1024), dtype=np.float32)
result['child'] = child
result['parent_next'] = mx.nd.random.uniform(shape=(3,))
result['parent_first'] = first
"""


def test_a_forked_child_goes_on_from_its_parents_state() -> None:
    ref, got = run_both(FORK)
    for res in (ref, got):
        assert res["__error__"] is None, res["__error__"]
        np.testing.assert_array_equal(res["child"], res["parent_next"])
        assert not np.array_equal(res["child"], res["parent_first"])


IMPORTS = """
import importlib
lib = mx.__name__
MXNetError = importlib.import_module(lib + '.base').MXNetError
nd = importlib.import_module(lib + '.ndarray')
kvs = importlib.import_module(lib + '.kvstore')
ndarray = getattr(importlib.import_module(lib), 'ndarray')
result['mx_MXNetError_is_base'] = mx.MXNetError is MXNetError
result['ndarray_zeros'] = ndarray.zeros((2,)) + nd.ones((2,))
result['kvstore_create'] = kvs.create is mx.kvstore.create and kvs.create is mx.kv.create
kv = kvs.create('local')
kv.init(3, nd.ones((2,)))
caught = []
try:
    kv.init(3, nd.ones((2,)))
except MXNetError:
    caught.append('duplicate init')
try:
    out = nd.zeros((2,))
    kv.pull(9, out=out)
    out.wait_to_read()
except MXNetError:
    caught.append('uninitialized pull')
result['caught'] = caught
out = nd.zeros((2,))
kv.pull(3, out=out)
result['value'] = out
"""


def test_import_forms_and_mxnet_error() -> None:
    ref, got = run_both(IMPORTS)
    assert_results_close(ref, got)
    assert got["caught"] == ["duplicate init", "uninitialized pull"]
    assert got["mx_MXNetError_is_base"] and got["kvstore_create"]


TESTSTORE = """
kv = mx.kv.create('teststore')
result['type'], result['rank'], result['num_workers'] = kv.type, kv.rank, kv.num_workers
result['capable'] = kv.is_capable('optimizer')
result['registered'] = 'teststore' in mx.kv.KVStoreBase.kv_registry
outs = [mx.nd.zeros((2, 3)) for _ in range(2)]
kv.broadcast(3, mx.nd.ones((2, 3)) * 2, out=outs)
result['broadcast'] = np.array([o.asnumpy() for o in outs])
vals = [mx.nd.ones((2, 3)) * (i + 1) for i in range(3)]
kv.pushpull(3, vals)
result['pushpull_into_values'] = np.array([v.asnumpy() for v in vals])
out = mx.nd.zeros((2, 3))
kv.pushpull('w', [mx.nd.ones((2, 3)), mx.nd.ones((2, 3)) * 4], out=out)
result['pushpull_out'] = out
kv.pushpull('w', mx.nd.ones((2, 3)) * 7, out=[out])
result['pushpull_one'] = out
a = mx.nd.ones((2, 3))
kv.pushpull(3, a)
result['pushpull_one_no_out'] = a
raised = {}
for name, call in [('set_optimizer', lambda: kv.set_optimizer(mx.optimizer.SGD())),
                   ('save_optimizer_states', lambda: kv.save_optimizer_states('s')),
                   ('load_optimizer_states', lambda: kv.load_optimizer_states('s')),
                   ('is_capable', lambda: kv.is_capable('compression'))]:
    try:
        call()
        raised[name] = None
    except NotImplementedError:
        raised[name] = 'NotImplementedError'
    except ValueError:
        raised[name] = 'ValueError'
result['raised'] = raised
"""


def test_teststore_behaves_as_mxnets() -> None:
    ref, got = run_both(TESTSTORE)
    assert_results_close(ref, got)
    assert ref["type"] == "teststore" and ref["capable"] is False
    assert ref["raised"]["is_capable"] == "ValueError"


BAD_OPTIMIZER = """
kv = mx.kv.create('local')
kv.init(3, mx.nd.ones((2,)))
refused = []
for opt in (mx.optimizer.SGD(learning_rate='abc'), mx.optimizer.create('adam', beta1='x')):
    try:
        kv.set_optimizer(opt)
        refused.append(None)
    except Exception as err:
        refused.append([c.__name__ for c in type(err).__mro__])
kv.push(3, mx.nd.ones((2,)) * 5)
out = mx.nd.zeros((2,))
kv.pull(3, out=out)
result['refused'] = refused
result['after_push'] = out
"""


def test_bad_hyperparameters_mxnet_skips_updates_pskv_refuses() -> None:
    """MXNet 1.9.1 takes ``SGD(learning_rate='abc')``; every update then fails inside its
    C callback, the error is printed and ignored, and the stored value never changes.
    pskv refuses it in set_optimizer (ConfigError, a ValueError) and the store still assigns.
    Comparable: neither library ever applies the bad optimizer."""
    ref, got = run_both(BAD_OPTIMIZER)
    assert ref["__error__"] is None and got["__error__"] is None
    assert ref["refused"] == [None, None]                       # MXNet: accepted...
    np.testing.assert_array_equal(ref["after_push"], np.ones(2))  # ...and updates skipped
    for mro in got["refused"]:
        assert mro is not None and "ConfigError" in mro and "ValueError" in mro
    np.testing.assert_array_equal(got["after_push"], np.full(2, 5.0))   # assign, unchanged
