"""Differential tests: the local and device stores against real MXNet 1.9.1.

Each scenario is Python source run twice by :func:`harness.run_both`, once under MXNet 1.9.1
(its own interpreter, ``PSKV_MXNET_PYTHON``, ``MXNET_ENGINE_TYPE=NaiveEngine`` so errors
surface at the call that caused them) and once under pskv, and the ``result`` dicts are
compared. Scenarios use only the API both libraries share; where pskv deliberately differs
(docs/api.md: pull(out=None) returns, uninitialized keys and shape mismatches raise,
no aliasing) the test records what MXNet does and asserts pskv's documented behaviour.

``check_kvstore_semantics`` runs in both interpreters too. The MXNet interpreter has no
pskv, so the scenario loads ``src/pskv/testing.py`` *by path* with importlib
(``spec_from_file_location``): testing.py imports only NumPy and the standard library at
module level and takes the library under test as its ``mx`` argument, which is what makes
that possible.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .harness import assert_results_close, run_both, run_scenario

pytestmark = pytest.mark.mxnet

TESTING_PY = Path(__file__).resolve().parents[2] / "src" / "pskv" / "testing.py"


#: scenario helper: a list of arrays as one NumPy array (the harness stores NumPy arrays)
STACK = "def stack(xs):\n    return np.array([x.asnumpy() for x in xs])\n"


def both_ok(src: str, **tol: float) -> tuple[dict[str, Any], dict[str, Any]]:
    ref, got = run_both(STACK + src)
    assert_results_close(ref, got, **tol)
    return ref, got


# ---- check_kvstore_semantics under both libraries ------------------------------------------
@pytest.mark.parametrize("store_type", ["local", "device"])
def test_check_kvstore_semantics(store_type: str) -> None:
    src = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("pskv_testing", {str(TESTING_PY)!r})
testing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(testing)
result['names'] = testing.check_kvstore_semantics(mx, {store_type!r})
"""
    ref, got = both_ok(src)
    assert len(ref["names"]) >= 15 and ref["names"] == got["names"]


# ---- values ------------------------------------------------------------------------------------
def test_aggregation_lists_str_and_duplicate_keys() -> None:
    both_ok("""
S = (3, 4)
rs = np.random.RandomState(0)
def arr(ctx=0):
    return mx.nd.array(rs.uniform(-1, 1, S).astype(np.float32), ctx=mx.cpu(ctx))
kv = mx.kv.create('local')
kv.init(3, arr())
kv.push(3, [arr(i) for i in range(4)])
outs = [mx.nd.zeros(S, mx.cpu(i)) for i in range(3)]
kv.pull(3, out=outs)
result['multi_device'] = stack(outs)
kv.init([5, 7, 9], [arr(), arr(), arr()])
kv.push([9, 5, 7, 5], [arr(), [arr(0), arr(1)], arr(), arr(2)])
outs = [mx.nd.zeros(S) for _ in range(4)]
kv.pull([5, 7, 9, 5], out=outs)
result['key_list_dups'] = stack(outs)
lol = [[mx.nd.zeros(S, mx.cpu(d)) for d in range(2)] for _ in range(3)]
kv.push([5, 7, 9], [[arr(d) for d in range(2)] for _ in range(3)])
kv.pull([5, 7, 9], out=lol)
result['list_of_lists'] = stack([o for g in lol for o in g])
skv = mx.kv.create('device')
skv.init(['w1', 'b1', 'w0'], [arr(), arr(), arr()])
skv.push(['w0', 'w1', 'w0'], [arr(1), arr(2), arr(3)])
outs = [mx.nd.zeros(S) for _ in range(3)]
skv.pull(['w1', 'b1', 'w0'], out=outs)
result['str_keys'] = stack(outs)
kv.init(11, mx.nd.zeros(S))
kv.push(11, mx.nd.array(rs.uniform(-1, 1, S), dtype='float64'))
o = mx.nd.zeros(S); kv.pull(11, out=o); result['f64_into_f32'] = o
""")


def test_updaters() -> None:
    both_ok("""
S = (2, 5)
rs = np.random.RandomState(1)
def add2(key, inp, stored):
    stored += inp * 2
def sgdish(key, inp, stored):
    stored[:] = stored - 0.1 * inp + 0.01 * stored * stored
for name, upd in (('add2', add2), ('sgdish', sgdish)):
    for st, keys in (('local', [0, 1]), ('device', ['a', 'b'])):
        kv = mx.kv.create(st)
        kv.init(keys, [mx.nd.array(rs.uniform(-1, 1, S)) for _ in keys])
        kv._set_updater(upd)
        for step in range(4):
            kv.push(keys[0], [mx.nd.array(rs.uniform(-1, 1, S), ctx=mx.cpu(i))
                              for i in range(3)])
            kv.push(keys + [keys[0]], [mx.nd.array(rs.uniform(-1, 1, S)) for _ in range(3)])
        outs = [mx.nd.zeros(S) for _ in keys]
        kv.pull(keys, out=outs)
        result[name + st] = stack(outs)
""", rtol=1e-5, atol=1e-6)


def test_pushpull_and_broadcast() -> None:
    both_ok("""
S = (2, 3)
kv = mx.kv.create('local')
kv.init(2, mx.nd.ones(S) * 4)
kv._set_updater(lambda k, i, s: s.__iadd__(i * 2))
vals = [mx.nd.ones(S), mx.nd.ones(S) * 2]
kv.pushpull(2, vals)
result['pushpull_into_values'] = stack(vals)
outs = [mx.nd.zeros(S), mx.nd.zeros(S, mx.cpu(1))]
kv.pushpull(2, [mx.nd.ones(S)] * 2, out=outs)
result['pushpull_out'] = stack(outs)
kv2 = mx.kv.create('device')
bouts = [mx.nd.zeros(S, mx.cpu(i)) for i in range(3)]
kv2.broadcast('x', mx.nd.ones(S) * 7, out=bouts)
result['broadcast_outs'] = stack(bouts)
o1, o2 = mx.nd.zeros(S), mx.nd.zeros((4,))
kv2.broadcast(['y', 'z'], [mx.nd.ones(S) * 3, mx.nd.ones((4,)) * 5], out=[o1, o2])
result['broadcast_y'] = o1
result['broadcast_z'] = o2
kv2.push('x', mx.nd.ones(S))
o = mx.nd.zeros(S); kv2.pull('x', out=o); result['after_broadcast_push'] = o
""")


def test_row_sparse_push_and_pull() -> None:
    both_ok("""
shape = (8, 3)
rs = np.random.RandomState(2)
table = rs.uniform(-1, 1, shape).astype(np.float32)
def add2(key, inp, stored):
    stored += inp * 2
every = mx.nd.array(np.arange(8), dtype='int64')
for name, upd in (('assign', None), ('add2', add2)):
    kv = mx.kv.create('local')
    kv.init('emb', mx.nd.array(table).tostype('row_sparse'))
    if upd is not None:
        kv._set_updater(upd)
    for step in range(3):
        grads = []
        for dev in range(2):
            rows = np.sort(rs.choice(8, 3, replace=False))
            grads.append(mx.nd.sparse.row_sparse_array(
                (rs.uniform(-1, 1, (3, 3)).astype(np.float32), rows), shape=shape,
                ctx=mx.cpu(dev)))
        kv.push('emb', grads)
        out = mx.nd.sparse.zeros('row_sparse', shape)
        kv.row_sparse_pull('emb', out=out, row_ids=every)
        result[name + str(step)] = out.tostype('default')
    for rname, rows, dt in (('unsorted', [6, 1, 6, 3], 'int64'), ('float', [7.0, 0.0], 'float32'),
                            ('twod', [[5, 1], [1, 2]], 'int64'), ('empty', [], 'int64')):
        outs = [mx.nd.sparse.zeros('row_sparse', shape, mx.cpu(i)) for i in range(2)]
        kv.row_sparse_pull('emb', out=outs, row_ids=mx.nd.array(rows, dtype=dt))
        for i, o in enumerate(outs):
            result[name + rname + 'idx' + str(i)] = o.indices.asnumpy().astype(np.int64)
            result[name + rname + 'data' + str(i)] = o.data
    outs = [mx.nd.sparse.zeros('row_sparse', shape) for _ in range(2)]
    kv.row_sparse_pull('emb', out=outs, row_ids=[mx.nd.array([4, 2], dtype='int64'),
                                                 mx.nd.array([0], dtype='int64')])
    result[name + 'per_out0'] = outs[0].tostype('default')
    result[name + 'per_out1'] = outs[1].tostype('default')
""")


@pytest.mark.parametrize("name, kwargs", [
    ("sgd", "learning_rate=0.1, momentum=0.9, wd=0.001"),
    ("sgd", "learning_rate=0.05, rescale_grad=0.5, clip_gradient=0.3"),
    ("adam", "learning_rate=0.01, wd=0.001"),
])
def test_set_optimizer(name: str, kwargs: str) -> None:
    both_ok(f"""
S = (4, 3)
rs = np.random.RandomState(3)
kv = mx.kv.create('local')
keys = [0, 1]
kv.init(keys, [mx.nd.array(rs.uniform(-1, 1, S)) for _ in keys])
kv.set_optimizer(mx.optimizer.create({name!r}, {kwargs}))
for step in range(5):
    for k in keys:
        kv.push(k, [mx.nd.array(rs.uniform(-1, 1, S), ctx=mx.cpu(i)) for i in range(2)])
outs = [mx.nd.zeros(S) for _ in keys]
kv.pull(keys, out=outs)
result['weights'] = stack(outs)
""", rtol=1e-5, atol=1e-6)


def test_device_store_2bit_compression() -> None:
    both_ok("""
S = (5, 7)
rs = np.random.RandomState(4)
kv = mx.kv.create('device')
kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
kv.init(['w', 'b'], [mx.nd.zeros(S), mx.nd.ones(S)])
for step in range(6):
    kv.push('w', [mx.nd.array(rs.uniform(-1, 1, S), ctx=mx.cpu(i)) for i in range(3)])
    kv.push('b', mx.nd.array(rs.uniform(-2, 2, S)))
    outs = [mx.nd.zeros(S), mx.nd.zeros(S)]
    kv.pull(['w', 'b'], out=outs)
    result['w' + str(step)] = outs[0]
    result['b' + str(step)] = outs[1]
""")


# ---- where MXNet's own behaviour is surprising: recorded, pskv documented --------------------
def test_stored_value_aliases_merge_buffer_in_mxnet() -> None:
    # MXNet kvstore_local.h PushImpl: ASSIGN does `local = merged`, so the stored value
    # becomes the merge buffer; the next multi-device push overwrites it before the updater
    # reads it. pskv keeps its own copy (api.md: pskv never aliases).
    ref, got = run_both("""
S = (2, 3)
kv = mx.kv.create('local')
kv.init(2, mx.nd.zeros(S))
kv.push(2, [mx.nd.ones(S), mx.nd.ones(S) * 3])
kv._set_updater(lambda k, i, s: s.__iadd__(i * 2))
kv.push(2, [mx.nd.ones(S), mx.nd.ones(S)])
o = mx.nd.zeros(S); kv.pull(2, out=o); result['v'] = o
""")
    assert ref["__error__"] is None and got["__error__"] is None
    np.testing.assert_array_equal(ref["v"], np.full((2, 3), 6.0))  # 2 + 2 * 2
    np.testing.assert_array_equal(got["v"], np.full((2, 3), 8.0))  # 4 + 2 * 2


def test_updater_key_types() -> None:
    # MXNet 1.9.1 hands str keys to a _set_updater function as bytes; pskv passes str
    ref, got = run_both("""
kv = mx.kv.create('local')
kv.init('w', mx.nd.zeros((2,)))
seen = []
kv._set_updater(lambda k, i, s: seen.append(type(k).__name__))
kv.push('w', mx.nd.ones((2,)))
result['key_type'] = seen[0]
""")
    assert ref["key_type"] == "bytes"
    assert got["key_type"] == "str"


# ---- errors ------------------------------------------------------------------------------------
_ERROR_PRELUDE = """
S = (2, 3)
def fresh(name='local'):
    kv = mx.kv.create(name)
    kv.init(3, mx.nd.ones(S))
    return kv
def outcome(name, fn):
    try:
        fn()
        result[name] = ['ok', []]
    except Exception as e:
        result[name] = [type(e).__name__, [c.__name__ for c in type(e).__mro__]]
def rsp_store():
    kv = mx.kv.create('local')
    kv.init(7, mx.nd.array(np.arange(12).reshape(6, 2)).tostype('row_sparse'))
    return kv
def init_twice():
    kv = fresh(); kv.init(3, mx.nd.ones(S))
def broadcast_twice():
    kv = mx.kv.create()
    kv.broadcast(3, mx.nd.ones(S), out=mx.nd.zeros(S))
    kv.broadcast(3, mx.nd.ones(S), out=mx.nd.zeros(S))
def mixed_later():
    kv = fresh(); kv.init('a', mx.nd.ones(S))
def gc_after_init():
    kv = mx.kv.create('device'); kv.init(3, mx.nd.ones(S))
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
def wrong_shape_push():
    kv = fresh(); kv.push(3, mx.nd.ones((3, 3)))
"""

#: case -> (call, what MXNet 1.9.1 raises (class name; 'ok' when it does not raise))
ERROR_CASES: dict[str, tuple[str, str]] = {
    "pull_uninitialized": ("fresh().pull(9, out=mx.nd.zeros(S))", "MXNetError"),
    "push_uninitialized": ("fresh().push(9, mx.nd.ones(S))", "MXNetError"),
    "init_twice": ("init_twice()", "MXNetError"),
    "broadcast_twice": ("broadcast_twice()", "MXNetError"),
    "pull_wrong_shape": ("fresh().pull(3, out=mx.nd.zeros((3, 3)))", "MXNetError"),
    "mixed_keys_in_list": ("mx.kv.create().init([3, 'a'], [mx.nd.ones(S)] * 2)",
                           "AssertionError"),
    "mixed_keys_later": ("mixed_later()", "MXNetError"),
    "float_key": ("mx.kv.create().init(1.5, mx.nd.ones(S))", "AssertionError"),
    "lists_differ": ("fresh().push([3, 4], [mx.nd.ones(S)])", "AssertionError"),
    "push_none": ("fresh().push(3, None)", "TypeError"),
    "push_scalar": ("fresh().push(3, 1.0)", "TypeError"),
    "unknown_optimizer": ("mx.optimizer.create('no_such_optimizer')", "ValueError"),
    "unknown_capability": ("fresh().is_capable('teleport')", "ValueError"),
    "gc_on_local": ("mx.kv.create('local').set_gradient_compression("
                    "{'type': '2bit', 'threshold': 0.5})", "Exception"),
    "gc_unknown_type": ("mx.kv.create('device').set_gradient_compression({'type': '3bit'})",
                        "MXNetError"),
    "row_sparse_pull_without_row_ids": (
        "rsp_store().row_sparse_pull(7, out=mx.nd.sparse.zeros('row_sparse', (6, 2)))",
        "AssertionError"),
    "pull_out_none": ("fresh().pull(3)", "AssertionError"),
    # MXNet accepts these; pskv raises or accepts, as api.md documents
    "wrong_shape_push": ("wrong_shape_push()", "ok"),
    "gc_after_init": ("gc_after_init()", "ok"),
    "unknown_store_type": ("mx.kv.create('no_such_store')", "ok"),
    "bool_key": ("mx.kv.create().init(True, mx.nd.ones(S))", "ok"),
    "numpy_int_key": ("mx.kv.create().init(np.int64(3), mx.nd.ones(S))", "AssertionError"),
    "numpy_value": ("fresh().push(3, np.ones(S, np.float32))", "AssertionError"),
    "updater_not_callable": ("fresh()._set_updater(3)", "ok"),
    "empty_value_list": ("fresh().push(3, [])", "ok"),
}

#: what pskv does where it deliberately differs (api.md); None: pskv accepts the call
PSKV_DIFFERS: dict[str, tuple[str, str] | None] = {
    "wrong_shape_push": ("ShapeMismatchError", "ValueError"),
    "gc_after_init": ("UnsupportedError", "NotImplementedError"),
    "unknown_store_type": ("ConfigError", "ValueError"),
    "bool_key": ("KeyTypeError", "TypeError"),
    "numpy_int_key": None,
    "numpy_value": None,
    "pull_out_none": None,
    "updater_not_callable": ("ValueTypeError", "TypeError"),
    "empty_value_list": ("ValueTypeError", "TypeError"),
}


@pytest.fixture(scope="module")
def error_outcomes() -> tuple[dict[str, Any], dict[str, Any]]:
    """Every error case, run once under each library: {case: [class, mro names]}."""
    body = "\n".join(f"outcome({name!r}, lambda: {call})"
                     for name, (call, _) in ERROR_CASES.items())
    ref, got = run_both(_ERROR_PRELUDE + body)
    assert ref["__error__"] is None, ref["__error__"]
    assert got["__error__"] is None, got["__error__"]
    return ref, got


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_case(case: str, error_outcomes: tuple[dict[str, Any], dict[str, Any]]) -> None:
    ref, got = error_outcomes
    mx_cls, mx_mro = ref[case]
    pskv_cls, pskv_mro = got[case]
    assert mx_cls == ERROR_CASES[case][1], f"MXNet 1.9.1 now gives {mx_cls} for {case}"
    if case in PSKV_DIFFERS:
        want = PSKV_DIFFERS[case]
        if want is None:
            assert pskv_cls == "ok", f"pskv raised {pskv_cls} for {case}"
        else:
            assert pskv_cls == want[0] and want[1] in pskv_mro, (pskv_cls, pskv_mro)
        return
    assert pskv_cls != "ok", f"MXNet raises {mx_cls} for {case}, pskv does not"
    assert "KVStoreError" in pskv_mro, f"pskv raised {pskv_cls}, not a KVStoreError"
    for builtin in ("ValueError", "TypeError", "KeyError"):
        if builtin in mx_mro:
            assert builtin in pskv_mro, f"MXNet raises a {builtin}, pskv a {pskv_cls}"


def test_key_list_with_one_array_crashes_mxnet() -> None:
    # MXNet 1.9.1 (NaiveEngine) dies with a segmentation fault; pskv raises a TypeError
    src = _ERROR_PRELUDE + "fresh().push([3, 4], mx.nd.ones(S))\n"
    with pytest.raises(AssertionError, match="Segmentation fault|rc=-11|rc=255"):
        run_scenario(src, use_mxnet=True)
    got = run_scenario(src, use_mxnet=False)
    assert got["__error__"][0] == "ValueTypeError" and "TypeError" in got["__error__"][1]


def test_store_still_works_after_errors() -> None:
    src = _ERROR_PRELUDE + """
kv = fresh()
for bad in (lambda: kv.pull(9, out=mx.nd.zeros(S)), lambda: kv.init(3, mx.nd.ones(S) * 5),
            lambda: kv.pull(3, out=mx.nd.zeros((3, 3))), lambda: kv.init('a', mx.nd.ones(S))):
    try:
        bad()
    except Exception:
        pass
kv.push(3, [mx.nd.ones(S), mx.nd.ones(S) * 2])
o = mx.nd.zeros(S); kv.pull(3, out=o); result['v'] = o
"""
    both_ok(src)


def test_harness_reports_pskv_errors() -> None:
    got = run_scenario("mx.kv.create('local').pull(0, out=mx.nd.zeros((1,)))",
                       use_mxnet=False)
    assert got["__error__"][0] == "KeyNotInitializedError"
