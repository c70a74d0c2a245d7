"""Differential tests: pskv's optimizers and updater against real MXNet 1.9.1.

Each test runs one scenario (several cases, several steps each) under both libraries through
the shared API only: ``mx.nd.array``, ``mx.nd.sparse.row_sparse_array``,
``mx.optimizer.create``, ``mx.optimizer.get_updater``, ``updater(key, grad, weight)``,
``mx.lr_scheduler.*`` and ``.asnumpy()``. Weights and every state array must agree to 1e-6
relative (fp32); float16 weights to one float16 ulp.
"""
from __future__ import annotations

import pytest

from .harness import assert_results_close, run_both

pytestmark = pytest.mark.mxnet

_PRELUDE = '''
def _state_arrays(state, out, prefix):
    if state is None:
        return
    if isinstance(state, (tuple, list)):
        for i, s in enumerate(state):
            _state_arrays(s, out, prefix + "_" + str(i))
        return
    out[prefix] = state.asnumpy()

def case(prefix, name, kwargs, seed, shape=(6, 5), steps=4, grad="dense", weight="dense",
         dtype="float32", keys=(0, 1), nrows=3):
    rs = np.random.RandomState(seed)
    opt = mx.optimizer.create(name, **kwargs)
    upd = mx.optimizer.get_updater(opt)
    weights = {}
    for k in keys:
        w = mx.nd.array(rs.uniform(-1, 1, shape).astype(dtype), dtype=dtype)
        weights[k] = w.tostype("row_sparse") if weight == "row_sparse" else w
    for step in range(steps):
        for k in keys:
            g = rs.uniform(-2, 2, shape).astype(dtype)
            if grad == "row_sparse":
                rows = np.sort(rs.choice(shape[0], nrows, replace=False))
                if step == steps - 1:
                    rows = np.arange(shape[0])
                gr = mx.nd.sparse.row_sparse_array((g[rows], rows), shape=shape)
            else:
                gr = mx.nd.array(g, dtype=dtype)
            upd(k, gr, weights[k])
    for k in keys:
        result[prefix + "_w" + str(k)] = weights[k].asnumpy()
        _state_arrays(upd.states[k], result, prefix + "_s" + str(k))
    result[prefix + "_num_update"] = opt.num_update
    result[prefix + "_lr"] = float(opt.learning_rate)
'''

_COMMON = "learning_rate=0.1, wd=0.01, rescale_grad=0.5, clip_gradient=0.8"


def _check(cases: list[str], *, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    source = _PRELUDE + "\n".join(cases)
    ref, got = run_both(source, timeout=300)
    assert_results_close(ref, got, rtol=rtol, atol=atol)


def test_sgd() -> None:
    _check([
        f"case('plain', 'sgd', dict({_COMMON}), 1)",
        "case('noclip', 'sgd', dict(learning_rate=0.2, wd=0.03, rescale_grad=1.5), 2)",
        "case('nowd', 'sgd', dict(learning_rate=0.2, rescale_grad=0.25), 3)",
        f"case('mom', 'sgd', dict(momentum=0.9, {_COMMON}), 4)",
        "case('mom_noclip', 'sgd', dict(momentum=0.7, learning_rate=0.05, wd=0.1), 5)",
        f"case('rsp_lazy', 'sgd', dict({_COMMON}), 6, grad='row_sparse')",
        f"case('rsp_std', 'sgd', dict(lazy_update=False, {_COMMON}), 7, grad='row_sparse')",
        f"case('rsp_mom_lazy', 'sgd', dict(momentum=0.9, {_COMMON}), 8, grad='row_sparse')",
        f"case('rsp_mom_std', 'sgd', dict(momentum=0.9, lazy_update=False, {_COMMON}), 9,"
        " grad='row_sparse')",
        f"case('rspw_mom_lazy', 'sgd', dict(momentum=0.9, {_COMMON}), 10, grad='row_sparse',"
        " weight='row_sparse')",
        f"case('rspw_lazy', 'sgd', dict({_COMMON}), 11, grad='row_sparse', weight='row_sparse')",
        "case('ccsgd', 'ccsgd', dict(momentum=0.5, learning_rate=0.3), 12)",
    ])


def test_sgd_multi_precision() -> None:
    _check([
        f"case('mp', 'sgd', dict(multi_precision=True, {_COMMON}), 1, dtype='float16')",
        f"case('mp_mom', 'sgd', dict(multi_precision=True, momentum=0.9, {_COMMON}), 2,"
        " dtype='float16')",
        "case('mp_mom_noclip', 'sgd', dict(multi_precision=True, momentum=0.9, wd=0.1), 3,"
        " dtype='float16')",
        f"case('mp_rsp', 'sgd', dict(multi_precision=True, momentum=0.9, {_COMMON}), 4,"
        " dtype='float16', grad='row_sparse')",
        f"case('mp_rsp_nomom', 'sgd', dict(multi_precision=True, {_COMMON}), 5,"
        " dtype='float16', grad='row_sparse')",
        f"case('nag_mp', 'nag', dict(multi_precision=True, momentum=0.9, {_COMMON}), 6,"
        " dtype='float16')",
        f"case('adam_mp', 'adam', dict(multi_precision=True, {_COMMON}), 7, dtype='float16')",
    ], rtol=1e-3, atol=1e-3)


def test_nag_signum() -> None:
    _check([
        f"case('nag', 'nag', dict(momentum=0.9, {_COMMON}), 1)",
        "case('nag_noclip', 'nag', dict(momentum=0.8, learning_rate=0.05, wd=0.2), 2)",
        f"case('nag_nomom', 'nag', dict({_COMMON}), 3)",
        f"case('nag_rsp', 'nag', dict(momentum=0.9, {_COMMON}), 4, grad='row_sparse')",
        f"case('nag_nomom_rsp', 'nag', dict({_COMMON}), 5, grad='row_sparse')",
        f"case('signum', 'signum', dict(momentum=0.9, wd_lh=0.01, {_COMMON}), 6)",
        "case('signum_noclip', 'signum', dict(momentum=0.8, wd=0.05, rescale_grad=2.0), 7)",
        f"case('signsgd', 'signum', dict(momentum=0.0, {_COMMON}), 8)",
        f"case('signum_rsp', 'signum', dict({_COMMON}), 9, grad='row_sparse')",
    ])


def test_adam() -> None:
    _check([
        f"case('adam', 'adam', dict({_COMMON}), 1, steps=6)",
        "case('adam_noclip', 'adam', dict(learning_rate=0.01, wd=0.1, beta1=0.8), 2)",
        f"case('rsp_lazy', 'adam', dict({_COMMON}), 3, grad='row_sparse')",
        "case('rsp_lazy_noclip', 'adam', dict(learning_rate=0.01, wd=0.1), 4,"
        " grad='row_sparse')",
        f"case('rsp_std', 'adam', dict(lazy_update=False, {_COMMON}), 5, grad='row_sparse')",
        f"case('rspw_lazy', 'adam', dict({_COMMON}), 6, grad='row_sparse', weight='row_sparse')",
        f"case('rspw_std', 'adam', dict(lazy_update=False, {_COMMON}), 7, grad='row_sparse',"
        " weight='row_sparse')",
    ])


def test_adagrad_adadelta() -> None:
    _check([
        f"case('adagrad', 'adagrad', dict({_COMMON}), 1)",
        "case('adagrad_noclip', 'adagrad', dict(learning_rate=0.3, eps=1e-5, wd=0.1), 2)",
        "case('adagrad_rsp', 'adagrad', dict(learning_rate=0.1, rescale_grad=0.5,"
        " clip_gradient=0.8), 3, grad='row_sparse')",
        "case('adagrad_rspw', 'adagrad', dict(learning_rate=0.1), 4, grad='row_sparse',"
        " weight='row_sparse')",
        f"case('adadelta', 'adadelta', dict({_COMMON}), 5)",
        "case('adadelta_noclip', 'adadelta', dict(rho=0.8, epsilon=1e-4, wd=0.1,"
        " rescale_grad=2.0), 6)",
    ])


def test_rmsprop() -> None:
    _check([
        f"case('plain', 'rmsprop', dict({_COMMON}), 1)",
        "case('plain_cw', 'rmsprop', dict(learning_rate=0.05, clip_weights=0.5, wd=0.1), 2)",
        f"case('centered', 'rmsprop', dict(centered=True, {_COMMON}), 3)",
        "case('centered_cw', 'rmsprop', dict(centered=True, gamma1=0.8, gamma2=0.7,"
        " clip_weights=0.6, learning_rate=0.02), 4)",
        f"case('rsp', 'rmsprop', dict(centered=True, {_COMMON}), 5, grad='row_sparse')",
    ])


def test_ftrl_and_test() -> None:
    _check([
        f"case('ftrl', 'ftrl', dict(lamda1=0.05, {_COMMON}), 1)",
        "case('ftrl_default', 'ftrl', dict(wd=0.1), 2)",
        "case('ftrl_rspw', 'ftrl', dict(lamda1=0.02, rescale_grad=0.5, clip_gradient=0.8),"
        " 3, grad='row_sparse', weight='row_sparse')",
        "case('ftrl_rsp_dense_w', 'ftrl', dict(lamda1=0.02, wd=0.1), 4, grad='row_sparse')",
        "case('test', 'test', dict(rescale_grad=0.5), 5)",
        "case('test_rsp', 'test', dict(rescale_grad=0.5), 6, grad='row_sparse')",
    ])


def test_lr_schedulers_and_mults() -> None:
    s = "mx.lr_scheduler"
    _check([
        f"case('factor', 'sgd', dict(lr_scheduler={s}.FactorScheduler(step=2, factor=0.5,"
        " base_lr=0.3), momentum=0.9), 1, steps=7)",
        f"case('factor_warm', 'adam', dict(lr_scheduler={s}.FactorScheduler(step=2,"
        " factor=0.5, base_lr=0.3, warmup_steps=3, warmup_begin_lr=0.01)), 2, steps=7)",
        f"case('multi', 'sgd', dict(lr_scheduler={s}.MultiFactorScheduler(step=[2, 5],"
        " factor=0.1, base_lr=0.5)), 3, steps=7)",
        f"case('poly', 'rmsprop', dict(lr_scheduler={s}.PolyScheduler(max_update=5,"
        " base_lr=0.1, pwr=2, final_lr=0.001, warmup_steps=2, warmup_mode='constant',"
        " warmup_begin_lr=0.01)), 4, steps=8)",
        f"case('cosine', 'nag', dict(momentum=0.9, lr_scheduler={s}.CosineScheduler("
        "max_update=6, base_lr=0.2, final_lr=0.01, warmup_steps=2)), 5, steps=8)",
        f"case('override', 'sgd', dict(learning_rate=0.05, lr_scheduler={s}.FactorScheduler("
        "step=1, factor=0.9)), 6, steps=4)",
        "case('idx2name', 'sgd', dict(learning_rate=0.1, wd=0.1, param_idx2name={0: 'fc_weight',"
        " 1: 'fc_bias'}), 7)",
        "case('begin', 'adam', dict(begin_num_update=5, learning_rate=0.01), 8)",
        "case('strkeys', 'adam', dict(learning_rate=0.01, wd=0.01), 9, keys=('a', 'b'))",
        "o = mx.optimizer.create('sgd', learning_rate=0.1, wd=0.1)\n"
        "o.set_lr_mult({0: 0.5})\no.set_wd_mult({1: 3.0})\n"
        "u = mx.optimizer.get_updater(o)\n"
        "ws = [mx.nd.ones((3,)) for _ in range(2)]\n"
        "for _ in range(3):\n"
        "    for k in range(2):\n"
        "        u(k, mx.nd.ones((3,)) * (k + 1), ws[k])\n"
        "result['mult_w0'] = ws[0]\nresult['mult_w1'] = ws[1]\n"
        "result['mult_lr'] = [o._get_lr(0), o._get_lr(1), o._get_wd(0), o._get_wd(1)]",
    ])


def test_errors_match_builtin_classes() -> None:
    """Where MXNet raises, pskv's error is an instance of the same builtin classes."""
    ref, got = run_both('''
for label, fn in [
        ("unknown", lambda: mx.optimizer.create("no-such-optimizer")),
        ("badarg", lambda: mx.optimizer.create("sgd", no_such_arg=1)),
        ("step", lambda: mx.lr_scheduler.FactorScheduler(step=0)),
        ("factor", lambda: mx.lr_scheduler.MultiFactorScheduler(step=[3, 2])),
        ("warmup", lambda: mx.lr_scheduler.PolyScheduler(max_update=5, warmup_mode="x")),
        ("set_lr", lambda: mx.optimizer.create("sgd", lr_scheduler=
                                               mx.lr_scheduler.FactorScheduler(step=2))
                                               .set_learning_rate(0.1))]:
    try:
        fn()
        result[label] = "no error"
    except Exception as e:
        result[label] = [isinstance(e, ValueError), isinstance(e, TypeError),
                         isinstance(e, UserWarning)]
''')
    assert ref["__error__"] is None and got["__error__"] is None
    for label, want in ref.items():
        if label == "__error__":
            continue
        assert want != "no error", label
        assert all(g or not w for w, g in zip(want, got[label])), (label, want, got[label])
