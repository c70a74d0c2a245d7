"""Hypothesis properties of pskv.compression: error feedback and the dequantized values."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pskv.compression import GradientCompression, create

F32 = np.float32
EPS = float(np.finfo(F32).eps)

sizes = st.integers(min_value=0, max_value=200)
finite = st.floats(min_value=-1048576.0, max_value=1048576.0, allow_nan=False, allow_infinity=False,
                   width=32)
thresholds_2bit = st.floats(min_value=0.0009765625, max_value=1024.0, width=32)
thresholds_1bit = st.floats(min_value=-10, max_value=10, width=32)


@st.composite
def codecs(draw: st.DrawFn) -> GradientCompression:
    if draw(st.booleans()):
        gc = create({"type": "2bit", "threshold": draw(thresholds_2bit)})
    else:
        gc = create({"type": "1bit", "threshold": draw(thresholds_1bit)})
    assert gc is not None
    return gc


@st.composite
def pushes(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(grad, old residual) of one size."""
    n = draw(sizes)
    return (draw(arrays(F32, n, elements=finite)),
            draw(arrays(F32, n, elements=finite)))


def assert_error_feedback(gc: GradientCompression, grad: np.ndarray, old: np.ndarray,
                          deq: np.ndarray, new: np.ndarray) -> None:
    """decompress(compress(grad, old)) + new == grad + old, within float32 rounding."""
    lhs = deq.astype(np.float64) + new.astype(np.float64)
    rhs = grad.astype(np.float64) + old.astype(np.float64)
    # two float32 roundings: residual + grad, then minus the dequantized value
    scale = np.abs(grad) + np.abs(old) + np.abs(deq)
    np.testing.assert_array_less(np.abs(lhs - rhs), EPS * scale.astype(np.float64) + 1e-40)


@settings(deadline=None, max_examples=200)
@given(codecs(), pushes())
def test_error_feedback_identity(gc: GradientCompression,
                                 push: tuple[np.ndarray, np.ndarray]) -> None:
    grad, old = push
    residual = old.copy()
    packed = gc.compress(grad, residual)
    deq = gc.decompress(packed, grad.size)
    assert_error_feedback(gc, grad, old, deq, residual)


@settings(deadline=None, max_examples=200)
@given(codecs(), pushes())
def test_dequantized_values(gc: GradientCompression,
                            push: tuple[np.ndarray, np.ndarray]) -> None:
    grad, old = push
    deq = gc.roundtrip(grad, old.copy())
    t = F32(gc.threshold)
    s = old + grad
    if gc.type == "2bit":
        assert set(np.unique(deq).tolist()) <= {-float(t), 0.0, float(t)}
        np.testing.assert_array_equal(deq == t, s >= t)
        np.testing.assert_array_equal(deq == -t, s <= -t)
    else:
        assert set(np.unique(deq).tolist()) <= {-1.0, 1.0}
        np.testing.assert_array_equal(deq == 1, s > t)


@settings(deadline=None, max_examples=100)
@given(codecs(), pushes())
def test_roundtrip_equals_compress_then_decompress(gc: GradientCompression,
                                                   push: tuple[np.ndarray, np.ndarray]) -> None:
    grad, old = push
    r1, r2 = old.copy(), old.copy()
    packed = gc.compress(grad, r1)
    assert packed.shape == (gc.packed_size(grad.size),)
    deq = gc.roundtrip(grad, r2)
    np.testing.assert_array_equal(gc.decompress(packed, grad.size), deq)
    np.testing.assert_array_equal(r1, r2)
    # padding bits after the last value are zero
    bits = np.unpackbits(packed.view(np.uint8))
    used = grad.size * (2 if gc.type == "2bit" else 1)
    assert not bits[used:].any()


@settings(deadline=None, max_examples=50)
@given(codecs(), st.integers(1, 100), st.integers(1, 6), st.floats(0.01, 3.0))
def test_residual_stays_bounded_over_pushes(gc: GradientCompression, n: int, steps: int,
                                            scale: float) -> None:
    """Error feedback: the sum of what was sent tracks the sum of the gradients."""
    rng = np.random.default_rng(n * 31 + steps)
    residual = np.zeros(n, F32)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for _ in range(steps):
        grad = (rng.standard_normal(n) * scale).astype(F32)
        sent += gc.roundtrip(grad, residual)
        total += grad
    np.testing.assert_allclose(sent + residual, total, rtol=1e-4, atol=1e-4 * steps)
