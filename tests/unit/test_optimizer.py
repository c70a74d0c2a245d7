"""Each optimizer against a float64 NumPy oracle written from MXNet 1.9.1's formulas."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest

import pskv
from pskv.nd.sparse import row_sparse_array
from pskv.optimizer import _kernels

RG, WD, CLIP, LR = 0.5, 0.01, 0.8, 0.1
SHAPE = (7, 5)


def _clip(g: np.ndarray, c: float | None) -> np.ndarray:
    return g if c is None else np.clip(g, -c, c)


def sgd_oracle(w, g, s, t, momentum=0.0, lr=LR, wd=WD, rg=RG, clip=CLIP):
    grad = _clip(rg * g, clip) + wd * w
    if momentum:
        s["m"] = momentum * s.get("m", 0) - lr * grad
        return w + s["m"]
    return w - lr * grad


def nag_oracle(w, g, s, t, momentum=0.9, lr=LR, wd=WD, rg=RG, clip=CLIP):
    m = momentum * s.get("m", 0)
    gc = _clip(rg * g, clip)
    new_w = w - m + (momentum + 1) * (m - lr * (gc + wd * w))
    s["m"] = m - lr * (gc + wd * new_w)  # MXNet's in-place kernel reads the new weight
    return new_w


def adam_oracle(w, g, s, t, lr=LR, wd=WD, rg=RG, clip=CLIP, b1=0.9, b2=0.999, eps=1e-8):
    grad = _clip(rg * g + wd * w, clip)
    s["m"] = b1 * s.get("m", 0) + (1 - b1) * grad
    s["v"] = b2 * s.get("v", 0) + (1 - b2) * grad * grad
    lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return w - lr_t * s["m"] / (np.sqrt(s["v"]) + eps)


def adagrad_oracle(w, g, s, t, lr=LR, wd=WD, rg=RG, clip=CLIP, eps=1e-7):
    grad = _clip(rg * g, clip)
    s["h"] = s.get("h", 0) + grad * grad
    return w - lr * (grad / np.sqrt(s["h"] + eps) + wd * w)


def rmsprop_oracle(w, g, s, t, lr=LR, wd=WD, rg=RG, clip=CLIP, g1=0.9, eps=1e-8, cw=None):
    grad = _clip(rg * g + wd * w, clip)
    s["n"] = (1 - g1) * grad * grad + g1 * s.get("n", 0)
    return _clip(w - lr * grad / np.sqrt(s["n"] + eps), cw)


def rmsalex_oracle(w, g, s, t, lr=LR, wd=WD, rg=RG, clip=CLIP, g1=0.9, g2=0.9, eps=1e-8):
    grad = _clip(rg * g + wd * w, clip)
    s["n"] = (1 - g1) * grad * grad + g1 * s.get("n", 0)
    s["g"] = (1 - g1) * grad + g1 * s.get("g", 0)
    s["d"] = g2 * s.get("d", 0) - lr * grad / np.sqrt(s["n"] - s["g"] ** 2 + eps)
    return w + s["d"]


def adadelta_oracle(w, g, s, t, wd=WD, rg=RG, clip=CLIP, rho=0.9, eps=1e-5):
    grad = _clip(rg * g, clip)
    s["ag"] = rho * s.get("ag", 0) + (1 - rho) * grad * grad
    delta = np.sqrt(s.get("ad", 0) + eps) / np.sqrt(s["ag"] + eps) * grad
    s["ad"] = rho * s.get("ad", 0) + (1 - rho) * delta * delta
    return w - (delta + wd * w)


def signum_oracle(w, g, s, t, lr=LR, wd=WD, rg=RG, clip=CLIP, momentum=0.9, wd_lh=0.01):
    s["m"] = momentum * s.get("m", 0) - (1 - momentum) * (wd * w + _clip(rg * g, clip))
    return (1 - lr * wd_lh) * w + lr * np.sign(s["m"])


def signsgd_oracle(w, g, s, t, lr=LR, wd=WD, **_: Any):
    return (1 - lr * wd) * w - lr * np.sign(g)


def ftrl_oracle(w, g, s, t, lr=LR, wd=WD, rg=RG, clip=CLIP, l1=0.05, beta=1.0):
    grad = _clip(rg * g, clip)
    n = s.get("n", 0)
    s["z"] = s.get("z", 0) + grad - (np.sqrt(n + grad * grad) - np.sqrt(n)) * w / lr
    s["n"] = n + grad * grad
    z = s["z"]
    return (np.sign(z) * l1 - z) / ((beta + np.sqrt(s["n"])) / lr + wd) * (np.abs(z) > l1)


def test_oracle_(w, g, s, t, rg=RG, **_: Any):
    return w + rg * g


test_oracle_.__test__ = False  # type: ignore[attr-defined]

COMMON = dict(learning_rate=LR, wd=WD, rescale_grad=RG, clip_gradient=CLIP)
CASES: list[tuple[str, dict[str, Any], Callable[..., Any], dict[str, Any]]] = [
    ("sgd", {}, sgd_oracle, {}),
    ("sgd", {"momentum": 0.9}, sgd_oracle, {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "clip_gradient": None}, sgd_oracle,
     {"momentum": 0.9, "clip": None}),
    ("nag", {"momentum": 0.9}, nag_oracle, {}),
    ("nag", {}, sgd_oracle, {}),
    ("adam", {}, adam_oracle, {}),
    ("adagrad", {}, adagrad_oracle, {}),
    ("rmsprop", {"clip_weights": 0.9}, rmsprop_oracle, {"cw": 0.9}),
    ("rmsprop", {"centered": True}, rmsalex_oracle, {}),
    ("adadelta", {}, adadelta_oracle, {}),
    ("signum", {"wd_lh": 0.01}, signum_oracle, {}),
    ("signsgd", {}, signsgd_oracle, {}),
    ("ftrl", {"lamda1": 0.05}, ftrl_oracle, {}),
    ("test", {}, test_oracle_, {}),
]


def _run(name: str, kwargs: dict[str, Any], oracle: Callable[..., Any], okw: dict[str, Any],
         *, sparse_rows: list[np.ndarray] | None = None, steps: int = 4, seed: int = 0,
         shape: tuple[int, ...] = SHAPE) -> None:
    rs = np.random.RandomState(seed)
    opt = pskv.optimizer.create(name, **{**COMMON, **kwargs})
    upd = pskv.optimizer.get_updater(opt)
    w0 = rs.uniform(-1, 1, shape).astype(np.float32)
    weight = pskv.nd.array(w0)
    ref, state = w0.astype(np.float64), {}  # type: ignore[var-annotated]
    for t in range(1, steps + 1):
        g = rs.uniform(-2, 2, shape).astype(np.float32)
        if sparse_rows is None:
            upd(0, pskv.nd.array(g), weight)
            ref = oracle(ref, g.astype(np.float64), state, t, **okw)
        else:
            rows = sparse_rows[(t - 1) % len(sparse_rows)]
            upd(0, row_sparse_array((g[rows], rows), shape=shape), weight)
            sub = {k: (v[rows] if isinstance(v, np.ndarray) else v) for k, v in state.items()}
            new_rows = oracle(ref[rows], g[rows].astype(np.float64), sub, t, **okw)
            ref = ref.copy()
            ref[rows] = new_rows
            for k, v in sub.items():
                full = state.get(k)
                full = np.zeros(shape) if not isinstance(full, np.ndarray) else full
                full[rows] = v
                state[k] = full
    np.testing.assert_allclose(weight.asnumpy(), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,kwargs,oracle,okw", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_dense_against_oracle(name: str, kwargs: dict[str, Any], oracle: Any,
                              okw: dict[str, Any]) -> None:
    _run(name, kwargs, oracle, okw)


ROWS = [np.array([0, 3, 4]), np.array([1, 3, 6]), np.array([2])]


@pytest.mark.parametrize("name,kwargs,oracle,okw", [
    ("sgd", {}, sgd_oracle, {}),
    ("sgd", {"momentum": 0.9}, sgd_oracle, {"momentum": 0.9}),
    ("adam", {}, adam_oracle, {}),
    ("adagrad", {"wd": 0.0}, adagrad_oracle, {"wd": 0.0}),
    ("test", {}, test_oracle_, {}),
])
def test_row_sparse_lazy_updates_touch_only_grad_rows(name: str, kwargs: dict[str, Any],
                                                      oracle: Any, okw: dict[str, Any]) -> None:
    _run(name, kwargs, oracle, okw, sparse_rows=ROWS, steps=5)


def test_ftrl_lazy_only_with_row_sparse_weight() -> None:
    shape = (4, 3)
    g = np.ones(shape, np.float32)
    rows = np.array([1])
    for stype, untouched_changes in (("row_sparse", False), ("default", True)):
        opt = pskv.optimizer.create("ftrl", lamda1=0.0, wd=0.1)
        upd = pskv.optimizer.get_updater(opt)
        weight = pskv.nd.ones(shape).tostype(stype)
        upd(0, row_sparse_array((g[rows], rows), shape=shape), weight)
        w = weight.asnumpy()
        assert (not np.allclose(w[0], 1.0)) == untouched_changes


def test_sgd_lazy_update_false_decays_every_row() -> None:
    opt = pskv.optimizer.create("sgd", learning_rate=0.5, wd=0.1, lazy_update=False)
    weight = pskv.nd.ones((3, 2))
    opt.update(0, weight, row_sparse_array((np.ones((1, 2)), [1]), shape=(3, 2)), None)
    np.testing.assert_allclose(weight.asnumpy()[[0, 2]], 0.95)
    np.testing.assert_allclose(weight.asnumpy()[1], 0.45, rtol=1e-6)


def test_sparse_adagrad_rejects_wd() -> None:
    opt = pskv.optimizer.create("adagrad", wd=0.1)
    w = pskv.nd.ones((3, 2))
    with pytest.raises(pskv.UnsupportedError, match="wd"):
        opt.update(0, w, row_sparse_array((np.ones((1, 2)), [1]), shape=(3, 2)),
                   opt.create_state(0, w))


@pytest.mark.parametrize("name,kwargs", [("sgd", {"momentum": 0.9}), ("sgd", {}),
                                         ("nag", {"momentum": 0.9}), ("adam", {})])
def test_multi_precision_keeps_float32_master(name: str, kwargs: dict[str, Any]) -> None:
    rs = np.random.RandomState(3)
    w0 = rs.uniform(-1, 1, SHAPE).astype(np.float16)
    grads = [rs.uniform(-2, 2, SHAPE).astype(np.float16) for _ in range(3)]
    mp = pskv.optimizer.create(name, multi_precision=True, **COMMON, **kwargs)
    ref = pskv.optimizer.create(name, **COMMON, **kwargs)
    w16, w32 = pskv.nd.array(w0, dtype="float16"), pskv.nd.array(w0, dtype="float32")
    u_mp, u_ref = pskv.optimizer.get_updater(mp), pskv.optimizer.get_updater(ref)
    for g in grads:
        u_mp(0, pskv.nd.array(g, dtype="float16"), w16)
        u_ref(0, pskv.nd.array(g, dtype="float32"), w32)
    assert w16.dtype == np.float16
    master = [s for s in u_mp.states[0] if isinstance(s, pskv.nd.NDArray)
              and s.dtype == np.float32]
    np.testing.assert_allclose(w16.asnumpy(), w32.asnumpy().astype(np.float16), rtol=1e-3)
    assert any(np.allclose(m.asnumpy(), w32.asnumpy(), rtol=1e-6) for m in master)


def test_float16_without_multi_precision_warns() -> None:
    opt = pskv.optimizer.create("sgd")
    with pytest.warns(UserWarning, match="multi_precision"):
        opt.create_state_multi_precision(0, pskv.nd.ones((2,), dtype="float16"))


def test_blockwise_run_matches_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    rs = np.random.RandomState(1)
    w0, g = rs.randn(1000).astype(np.float32), rs.randn(1000).astype(np.float32)
    out = []
    for block in (7, 1 << 15):
        monkeypatch.setattr(_kernels, "BLOCK", block)
        opt = pskv.optimizer.create("adam", **COMMON)
        w = pskv.nd.array(w0)
        state = opt.create_state(0, w)
        for _ in range(3):
            opt.update(0, w, pskv.nd.array(g), state)
        out.append(w.asnumpy())
    np.testing.assert_array_equal(out[0], out[1])


def test_non_contiguous_weight_is_updated_in_place() -> None:
    base = np.ones((4, 6), np.float32)
    weight = pskv.nd.NDArray(base[:, ::2])
    pskv.optimizer.create("sgd", learning_rate=0.5).update(0, weight, pskv.nd.ones((4, 3)),
                                                            None)
    np.testing.assert_allclose(base[:, ::2], 0.5)
    np.testing.assert_allclose(base[:, 1::2], 1.0)


def test_row_sparse_weight_must_hold_every_row() -> None:
    opt = pskv.optimizer.create("sgd")
    partial = row_sparse_array((np.ones((1, 2)), [1]), shape=(3, 2))
    with pytest.raises(pskv.ShapeMismatchError, match="every row"):
        opt.update(0, partial, pskv.nd.ones((3, 2)), None)
