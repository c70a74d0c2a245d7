"""The kubernetes launcher's pod settings as the user writes them: a values file read
into a mapping (`load_values`), a flag's value as a section of one (`flag_section`).

Only the forms are checked here (``KEY=VALUE``, ``CLAIM:MOUNTPATH[:ro]``, a mapping at the
top of the file); what the sections hold is _k8s_options.py's, and the schema's, to check.
Invariant: pure but for reading the file; nothing here talks to a cluster.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["flag_section", "load_values"]

_DOCS = "See docs/kubernetes.md."


def load_values(path: str) -> dict[str, Any]:
    """Read a values file: JSON when it ends in ``.json``, else YAML (needs PyYAML)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"--values {path}: cannot read it ({err.strerror or err}). Pass a "
                          "YAML or JSON file.") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            try:
                import yaml  # type: ignore[import-untyped,unused-ignore]
            except ImportError:
                raise ConfigError(f"--values {path} is YAML and needs PyYAML. Install it "
                                  "with pip install 'pskv[kubernetes]', or write the file "
                                  "as JSON (NAME.json).") from None
            data = yaml.safe_load(text)
    except ConfigError:
        raise
    except Exception as err:  # json.JSONDecodeError, yaml.YAMLError: both say where
        raise ConfigError(f"--values {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                          f"{err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--values {path} must hold a mapping of settings, not "
                          f"{type(data).__name__}. {_DOCS}")
    return data


def _key_values(text: str, flag: str, example: str, many: bool = True) -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE...]`` (one pair unless `many`: a value may hold commas)."""
    out = {}
    for part in text.split(",") if many else [text]:
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{flag} {text!r}: write [ROLE:]KEY=VALUE, e.g. {flag} {example}.")
        out[key.strip()] = value.strip()
    return out


def _toleration(text: str, where: str) -> dict[str, str]:
    """``KEY[=VALUE][:EFFECT]``: with a value operator Equal, without it Exists."""
    rest, _, effect = text.partition(":")
    key, eq, value = rest.partition("=")
    if not key:
        raise ConfigError(f"{where} has no key. Write KEY=VALUE:EFFECT, KEY:EFFECT or KEY "
                          "(any value), e.g. gpu=true:NoSchedule.")
    out = {"key": key, "operator": "Equal" if eq else "Exists"}
    out.update({"value": value} if eq else {})
    out.update({"effect": effect} if effect else {})
    return out


def _claim(text: str, where: str, index: int) -> dict[str, Any]:
    """``CLAIM:MOUNTPATH[:ro]``: mount an existing PersistentVolumeClaim."""
    claim, _, rest = text.partition(":")
    path, _, mode = rest.partition(":")
    if not claim or not path or mode not in ("", "ro", "rw"):
        raise ConfigError(f"{where}: write CLAIM:MOUNTPATH or CLAIM:MOUNTPATH:ro, e.g. "
                          "data-pvc:/data:ro.")
    # the volume is named after the claim when the claim's name is a volume name
    name = claim if re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", claim) \
        else f"claim-{index}"
    return {"name": name, "claim": claim, "mountPath": path, "readOnly": mode == "ro"}


#: a KEY=VALUE flag -> where its pairs go in a section, an example, whether it takes several
_PAIR_FLAGS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "--label": (("labels",), "team=ml", False),
    "--annotation": (("annotations",), "owner=alice", False),
    "--requests": (("resources", "requests"), "worker:cpu=4,memory=16Gi", True),
    "--limits": (("resources", "limits"), "worker:nvidia.com/gpu=1", True),
    "--node-selector": (("nodeSelector",), "worker:nvidia.com/gpu.present=true", False)}


def flag_section(flag: str, rest: str, where: str, index: int) -> dict[str, Any]:
    """One flag's value (its role taken off) as a section of the values file."""
    if flag == "--toleration":
        return {"tolerations": [_toleration(rest, where)]}
    if flag == "--claim":
        return {"volumes": [_claim(rest, where, index)]}
    path, example, many = _PAIR_FLAGS[flag]
    body: dict[str, Any] = _key_values(rest, flag, example, many)
    for key in reversed(path):
        body = {key: body}
    return body
