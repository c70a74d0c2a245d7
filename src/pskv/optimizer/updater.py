"""The KVStore updater: per-key optimizer states, and their safe save / load format.

States are saved as an ``.npz`` archive (``np.savez``, no pickle) holding one array per state
array plus ``__meta__``, a UTF-8 JSON document::

    {"format": "pskv.optimizer.states", "version": 1,
     "states": [{"key": 3, "state": {"tuple": [{"array": "a0"}, null]}}, ...],
     "optimizer": null or Optimizer.to_spec()}

Keys keep their JSON type (int or str). Loading checks every part and raises
:class:`OptimizerStateError` for anything else, pickles included.
"""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ..errors import ConfigError, OptimizerStateError
from ..nd._npz import BadArchive, SafeNpz
from ..nd.ndarray import NDArray
from ..nd.sparse import RowSparseNDArray
from .base import Optimizer, from_spec

__all__ = ["OptimizerStateError", "Updater", "decode_states", "encode_states", "get_updater"]

_FORMAT = "pskv.optimizer.states"
_VERSION = 1
_META = "__meta__"


class Updater:
    """Updater for kvstore: ``updater(index, grad, weight)`` runs the optimizer on a key.

    States are created lazily, the first time a key is updated.

    Parameters
    ----------
    optimizer : Optimizer
        The optimizer to run.

    Examples
    --------
    >>> import pskv
    >>> updater = pskv.optimizer.get_updater(pskv.optimizer.create('sgd', momentum=0.9))
    >>> w = pskv.nd.ones((2,))
    >>> updater(0, pskv.nd.ones((2,)), w)
    >>> w.asnumpy().tolist()
    [0.9900000095367432, 0.9900000095367432]
    >>> restored = pskv.optimizer.get_updater(pskv.optimizer.create('sgd', momentum=0.9))
    >>> restored.set_states(updater.get_states())
    >>> restored.states[0].asnumpy().tolist()
    [-0.009999999776482582, -0.009999999776482582]
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.states: dict[Any, Any] = {}
        self.states_synced: dict[Any, bool] = {}

    def __call__(self, index: Any, grad: Any, weight: Any) -> None:
        """Update ``weight`` (in place) with ``grad``; ``index`` may be a list of keys."""
        if isinstance(index, (list, tuple)):
            indices, grads, weights = list(index), list(grad), list(weight)
        else:
            indices, grads, weights = [index], [grad], [weight]
        if weights:
            self.optimizer._set_current_context(weights[0].context.device_id)
        for i, idx in enumerate(indices):
            if isinstance(idx, bytes):
                idx = indices[i] = idx.decode()
            elif isinstance(idx, np.integer):
                idx = indices[i] = int(idx)
            if idx not in self.states:
                self.states[idx] = self.optimizer.create_state_multi_precision(idx, weights[i])
                self.states_synced[idx] = True
            elif not self.states_synced[idx]:
                self.states[idx] = self.sync_state_context(self.states[idx],
                                                           weights[i].context)
                self.states_synced[idx] = True
        for idx, w, g in zip(indices, weights, grads):
            self.optimizer.update_multi_precision(idx, w, g, self.states[idx])

    def sync_state_context(self, state: Any, context: Any) -> Any:
        """Return ``state`` with its arrays on ``context``."""
        if isinstance(state, NDArray):
            return state.as_in_context(context)
        if isinstance(state, (tuple, list)):
            synced = [self.sync_state_context(s, context) for s in state]
            return tuple(synced) if isinstance(state, tuple) else synced
        return state

    # ---- save / load ----------------------------------------------------------------------
    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """Serialize the states (and the optimizer if ``dump_optimizer``) to bytes.

        Parameters
        ----------
        dump_optimizer : bool, default False
            Also save the optimizer: its arguments, learning rate schedule and update
            counts, as :meth:`Optimizer.to_spec`.
        """
        return encode_states(self.states,
                             self.optimizer.to_spec() if dump_optimizer else None)

    def set_states(self, states: bytes) -> None:
        """Load states saved by :meth:`get_states` (and the optimizer, if it was saved).

        Raises
        ------
        OptimizerStateError
            If ``states`` is not a pskv optimizer-states archive (MXNet's pickles included).
        """
        new_states, spec = decode_states(states)
        optimizer = self.optimizer
        if spec is not None:
            try:
                optimizer = from_spec(spec)
            except ConfigError as err:
                raise OptimizerStateError(f"the saved optimizer cannot be rebuilt: {err}") \
                    from err
        self.optimizer = optimizer
        self.states = new_states
        self.states_synced = dict.fromkeys(self.states, False)


def encode_states(states: dict[Any, Any], optimizer_spec: dict[str, Any] | None = None) -> bytes:
    """Per-key optimizer states (and an optimizer spec) as the bytes of the states format
    (the module docstring): what :meth:`Updater.get_states` returns and
    :func:`decode_states` reads; also how a server's checkpoint and its backup copies carry
    an engine's states."""
    arrays: dict[str, np.ndarray] = {}

    def encode(state: Any) -> Any:
        if state is None:
            return None
        if isinstance(state, RowSparseNDArray):
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(state._data)
            arrays[name + "_idx"] = np.ascontiguousarray(state._indices)
            return {"row_sparse": name, "shape": list(state.shape)}
        if isinstance(state, NDArray):
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(state._data)
            return {"array": name}
        if isinstance(state, (tuple, list)):
            kind = "tuple" if isinstance(state, tuple) else "list"
            return {kind: [encode(s) for s in state]}
        if isinstance(state, (bool, int, float, str)):
            return {"value": state}
        raise ConfigError(f"cannot save an optimizer state of type {type(state).__name__};"
                          " states must be NDArrays, numbers, None or tuples of them.")

    entries = []
    for key, state in states.items():
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, str)):
            raise ConfigError(f"cannot save the state of key {key!r}: keys must be int or "
                              "str.")
        entries.append({"key": key, "state": encode(state)})
    meta = {"format": _FORMAT, "version": _VERSION, "states": entries,
            "optimizer": optimizer_spec}
    arrays[_META] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def _bad(why: str) -> OptimizerStateError:
    return OptimizerStateError(
        f"not a pskv optimizer-states file: {why}. Load only what "
        "kv.save_optimizer_states() / Updater.get_states() of pskv wrote; MXNet's pickled "
        "states cannot be loaded.")


def decode_states(blob: Any) -> tuple[dict[Any, Any], Any]:
    """The per-key states and the optimizer spec (or None) in bytes :func:`encode_states`
    wrote; OptimizerStateError for anything else (MXNet's pickles included)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _bad(f"expected bytes, got {type(blob).__name__}")
    try:   # checked before read: stored members, shapes that fit them (no inflating)
        with SafeNpz(bytes(blob), "the states archive") as data:
            arrays = {name: data[name] for name in data.files}
    except BadArchive as err:
        raise _bad(f"it is not a NumPy .npz archive without pickles ({err})") from err
    meta_raw = arrays.pop(_META, None)
    if meta_raw is None or meta_raw.dtype != np.uint8 or meta_raw.ndim != 1:
        raise _bad(f"the {_META} entry is missing")
    try:
        meta = json.loads(meta_raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise _bad(f"{_META} is not JSON ({err})") from err
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise _bad("the format tag is missing")
    if meta.get("version") != _VERSION:
        raise _bad(f"version {meta.get('version')!r} is not supported (this pskv reads "
                   f"version {_VERSION})")
    entries = meta.get("states")
    if not isinstance(entries, list):
        raise _bad("'states' is not a list")

    def decode(node: Any) -> Any:
        if node is None:
            return None
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise _bad(f"bad state node {node!r}")
        if "array" in node:
            arr = arrays.get(node["array"]) if isinstance(node["array"], str) else None
            if arr is None or arr.dtype.kind not in "biuf":
                raise _bad(f"state array {node['array']!r} is missing or not numeric")
            return NDArray(np.array(arr))
        if "row_sparse" in node:
            name, shape = node["row_sparse"], node.get("shape")
            data = arrays.get(name) if isinstance(name, str) else None
            idx = arrays.get(name + "_idx") if isinstance(name, str) else None
            if data is None or idx is None or not isinstance(shape, list) \
                    or idx.dtype.kind not in "iu" or data.shape[:1] != idx.shape:
                raise _bad(f"row_sparse state {name!r} is incomplete")
            return RowSparseNDArray(np.array(data), idx.astype(np.int64),
                                    tuple(int(s) for s in shape))
        if "tuple" in node and isinstance(node["tuple"], list):
            return tuple(decode(n) for n in node["tuple"])
        if "list" in node and isinstance(node["list"], list):
            return [decode(n) for n in node["list"]]
        if "value" in node and isinstance(node["value"], (bool, int, float, str)):
            return node["value"]
        raise _bad(f"bad state node {node!r}")

    states: dict[Any, Any] = {}
    for entry in entries:
        if not isinstance(entry, dict) or "key" not in entry or "state" not in entry:
            raise _bad(f"bad state entry {entry!r}")
        key = entry["key"]
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise _bad(f"key {key!r} is neither int nor str")
        states[key] = decode(entry["state"])
    spec = meta.get("optimizer")
    if spec is not None and not isinstance(spec, dict):
        raise _bad("'optimizer' is not a spec")
    return states, spec


def get_updater(optimizer: Optimizer) -> Updater:
    """Return the updater (``updater(index, grad, weight)``) that runs ``optimizer``.

    Parameters
    ----------
    optimizer : Optimizer
        The optimizer.
    """
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"get_updater() takes an Optimizer, got {type(optimizer).__name__}. "
                          "Create one with mx.optimizer.create('sgd', ...).")
    return Updater(optimizer)
