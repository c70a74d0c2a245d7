"""Pod settings against the Kubernetes API's own schema: the official client's models.

The client (``pip install 'pskv[kubernetes]'``) ships one class per API object, generated
from the API's OpenAPI schema: its fields (`attribute_map`: Python name -> API name) and
their types (`openapi_types`: a class, ``List[...]``, ``Dict[str, ...]``, or a primitive).
`check` walks a piece of a manifest along those tables, so an unknown field is named with
the nearest real one ("did you mean 'nodeSelector'?") and a wrong type with the type the
schema wants; then the client's own reader takes it, which refuses a missing required
field. What the models have no rule for (name patterns, quantities, enumerations) is the
API server's to refuse. Invariant: pure, and nothing here talks to a cluster.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Mapping, Sequence

from ..errors import ConfigError

__all__ = ["INSTALL", "at", "check", "client"]

INSTALL = ("Pod settings (--values, --requests, --claim, ...) are checked against the "
           "Kubernetes API's schema with the official client: pip install 'pskv[kubernetes]'.")
_DOCS = "See docs/kubernetes.md."
_LIST = re.compile(r"list\[(.*)\]\Z", re.I)
_DICT = re.compile(r"dict[\[(]str, ?(.*)[\])]\Z", re.I)
_PRIMITIVE: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), "a string"), "int": ((int,), "an integer"),
    "bool": ((bool,), "true or false"), "float": ((int, float), "a number")}


def client() -> Any:
    """The client's ``kubernetes.client`` module; ConfigError saying what to install."""
    try:
        from kubernetes import client as models
    except ImportError:
        raise ConfigError(INSTALL) from None
    return models


def at(where: str, key: str) -> str:
    """The path of `key` under `where`: ``worker.nodeSelector``; after a flag's quoted
    value, a space: ``--requests 'cpu=abc' resources``."""
    if not where:
        return key
    return f"{where} {key}" if where.endswith("'") else f"{where}.{key}"


def _name(model: str) -> str:
    """``V1PodSpec`` -> ``PodSpec``, as the API's documentation names it."""
    return re.sub(r"\A(Core)?V\d+((alpha|beta)\d+)?", "", model)


def _walk(value: Any, kind: str, where: str, models: Any, extra: Sequence[str]) -> None:
    """Raise ConfigError at the first field of `value` that the schema's `kind` lacks or
    types otherwise. `extra`: pskv's own keys at this level, offered as spellings too."""
    if value is None or kind == "object":
        return
    inner = _LIST.match(kind)
    if inner:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ConfigError(f"{where} must be a list, not {type(value).__name__}. {_DOCS}")
        for i, item in enumerate(value):
            _walk(item, inner.group(1), f"{where}[{i}]", models, ())
        return
    inner = _DICT.match(kind)
    if inner or hasattr(models, kind):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping (key: value), not "
                              f"{type(value).__name__}. {_DOCS}")
    if inner:
        for key, item in value.items():
            _walk(item, inner.group(1), at(where, str(key)), models, ())
        return
    if kind in _PRIMITIVE:
        types, what = _PRIMITIVE[kind]
        if isinstance(value, bool) != (kind == "bool") or not isinstance(value, types):
            hint = " Quote it in the values file." if kind == "str" else ""
            raise ConfigError(f"{where}={value!r} must be {what}.{hint} {_DOCS}")
        return
    model = getattr(models, kind, None)
    if model is None:   # datetime, date: the launcher's settings have none
        return
    fields = {api: attr for attr, api in model.attribute_map.items()}
    for key, item in value.items():
        path = at(where, str(key))
        if key not in fields and key not in extra:
            near = difflib.get_close_matches(str(key), [*fields, *extra], n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{path} is not a field of the Kubernetes {_name(kind)}: {hint}"
                              f"check its spelling and nesting. {_DOCS}")
        if key in fields:
            _walk(item, model.openapi_types[fields[key]], path, models, ())


def check(value: Any, kind: str, where: str, *, extra: Sequence[str] = (),
          read: Mapping[str, Any] | None = None) -> None:
    """Check `value` against the API's `kind` (``V1PodSpec``, ``V1Toleration``, ...);
    ConfigError naming `where` and the field. `read`: what the client's reader is given
    instead (a patch completed with the fields the launcher fills in)."""
    if not value:
        return   # nothing given, nothing to check (and no client needed)
    models = client()
    _walk(value, kind, where, models, extra)
    try:
        models.ApiClient()._ApiClient__deserialize(dict(read or value), kind)
    except (TypeError, ValueError) as err:   # pydantic's ValidationError is a ValueError
        raise ConfigError(_reader_error(err, where, kind)) from None


def _reader_error(err: Exception, where: str, kind: str) -> str:
    """The client's refusal, with the field's path when it says which (pydantic does)."""
    errors = getattr(err, "errors", None)
    first = errors()[0] if callable(errors) and errors() else {}
    if not first.get("loc"):
        text = " ".join(re.sub(r"For further information visit \S+", "", str(err)).split())
        return f"{where} is not a valid {_name(kind)}: {text[:300]}. {_DOCS}"
    path = at(where, ".".join(str(p) for p in first["loc"]))
    if first.get("input") is None:
        return f"{path} is missing: a Kubernetes {_name(kind)} needs it. {_DOCS}"
    return f"{path}={first['input']!r}: {first.get('msg')} (Kubernetes {_name(kind)}). {_DOCS}"
