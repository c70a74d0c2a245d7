"""A two-layer perceptron in NumPy: fc1 -> ReLU -> fc2 -> softmax cross-entropy.

Weights follow MXNet's FullyConnected layout, ``(out_features, in_features)``; parameter
names are MXNet's (``fc1_weight``, ``fc1_bias``, ...). Everything is float32.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["PARAM_NAMES", "accuracy", "gradients", "init_params", "logits", "loss"]

#: the parameters, in the order they are pushed and pulled
PARAM_NAMES = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")

Params = Mapping[str, np.ndarray]


def init_params(num_features: int, hidden: int, num_classes: int, seed: int
                ) -> dict[str, np.ndarray]:
    """Xavier-uniform weights (MXNet's ``mx.init.Xavier()`` default) and zero biases."""
    rng = np.random.default_rng(seed)

    def xavier(fan_out: int, fan_in: int) -> np.ndarray:
        scale = np.sqrt(3.0 / ((fan_in + fan_out) / 2.0))
        return rng.uniform(-scale, scale, size=(fan_out, fan_in)).astype(np.float32)

    return {"fc1_weight": xavier(hidden, num_features),
            "fc1_bias": np.zeros(hidden, np.float32),
            "fc2_weight": xavier(num_classes, hidden),
            "fc2_bias": np.zeros(num_classes, np.float32)}


def _forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hidden = np.maximum(x @ params["fc1_weight"].T + params["fc1_bias"], 0.0)
    return hidden, hidden @ params["fc2_weight"].T + params["fc2_bias"]


def logits(params: Params, x: np.ndarray) -> np.ndarray:
    """The class scores of ``x`` (samples by features)."""
    return _forward(params, x)[1]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    out: np.ndarray = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return out


def loss(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy over the samples."""
    logp = _log_softmax(logits(params, x))
    return float(-logp[np.arange(len(y)), y].mean())


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    """The share of samples whose highest score is their label."""
    return float((logits(params, x).argmax(axis=1) == y).mean())


def gradients(params: Params, x: np.ndarray, y: np.ndarray, divisor: float
              ) -> tuple[dict[str, np.ndarray], float]:
    """The sum over the samples of each parameter's loss gradient, divided by ``divisor``.

    Also returns the summed loss of the samples. With ``divisor`` the global batch size,
    the gradients pushed by every device of every worker add up to the gradient of the mean
    loss over the global batch.
    """
    hidden, z = _forward(params, x)
    logp = _log_softmax(z)
    total = float(-logp[np.arange(len(y)), y].sum())
    dz = np.exp(logp)                       # softmax; d(sum of losses)/dz = p - onehot(y)
    dz[np.arange(len(y)), y] -= 1.0
    dz /= np.float32(divisor)
    dhidden = dz @ params["fc2_weight"]
    dhidden[hidden <= 0] = 0.0
    grads = {"fc1_weight": dhidden.T @ x, "fc1_bias": dhidden.sum(axis=0),
             "fc2_weight": dz.T @ hidden, "fc2_bias": dz.sum(axis=0)}
    return {k: v.astype(np.float32, copy=False) for k, v in grads.items()}, total
