"""What the kubernetes launcher puts into its pods beyond pskv's own: `PodOptions`.

Resources, node selectors, tolerations, volumes and claims, image pull secrets, the
service account, labels and annotations come from a values file (YAML or JSON) and from
flags; `pod_options` reads both, checks every field the way the Kubernetes API would, and
merges them. Invariant: a PodOptions is frozen and valid, so the manifests made from it are
accepted by the API server; nothing here knows the job or talks to a cluster.

Precedence: every flag beats the values file, and within each, a role's setting
(``worker:`` in a flag, the ``worker`` section of the file) beats the one for every pod.
Maps (requests, limits, node selectors, labels, annotations) merge key by key, later
winning; tolerations and image pull secrets add up; a volume replaces one of the same name.

Over 500 lines because it holds the pod settings a user may pass and their checks, one
table per Kubernetes object kind; the next step is validating them with the official
schemas (issue #30 item 5, not done).
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import ConfigError
from ._k8s_security import check_security, merged

__all__ = ["CHECKPOINT_MOUNT", "POD_KEYS", "PodOptions", "RESTART_POLICIES", "ROLES",
           "RolePods", "TOP_KEYS", "Toleration", "Volume", "load_values", "pod_options"]

ROLES: tuple[str, ...] = ("scheduler", "server", "worker")
RESTART_POLICIES: tuple[str, ...] = ("Never", "OnFailure")
#: where --checkpoint-claim is mounted (and PSKV_CHECKPOINT_DIR points) when no
#: PSKV_CHECKPOINT_DIR is given
CHECKPOINT_MOUNT = "/var/lib/pskv/checkpoints"
TOP_KEYS: tuple[str, ...] = ("restartPolicy", "serviceAccountName", "imagePullSecrets",
                             "labels", "annotations", "checkpointClaim", "securityContext",
                             "containerSecurityContext", "pods", *ROLES)
POD_KEYS: tuple[str, ...] = ("resources", "nodeSelector", "tolerations", "volumes", "labels",
                             "annotations", "securityContext", "containerSecurityContext")
_VOLUME_SOURCES: tuple[str, ...] = ("claim", "emptyDir", "hostPath", "configMap", "secret")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_DOCS = "See docs/kubernetes.md."

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL + r"\Z")
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*\Z")
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
#: a resource.Quantity without a sign: 1, 0.5, 500m, 2Gi, 1e3
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?\d+)?\Z")
#: the launcher's own labels: a job is found, and its Service selects, by these
_RESERVED_LABELS = ("app.kubernetes.io/name", "pskv.io/job", "pskv.io/role", "pskv.io/rank")

Pairs = tuple[tuple[str, str], ...]


# -- one field at a time, as the API server checks them ---------------------------------
def _where(where: str, key: str) -> str:
    if where.startswith("--"):
        return f"{where} {key}"   # a flag: --label team
    return f"{where}.{key}" if where else key


def _string(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}={value!r} must be a string. Quote it in the values file. "
                          f"{_DOCS}")
    return str(value)


def _check_name(value: object, where: str, pattern: re.Pattern[str], limit: int,
                what: str) -> str:
    text = _string(value, where)
    if len(text) > limit or not pattern.match(text):
        raise ConfigError(f"{where}={text!r} is not {what}: use at most {limit} lowercase "
                          "letters, digits, '-' (and '.' between parts), starting and ending "
                          "with a letter or digit.")
    return text


def _qualified(value: object, where: str) -> str:
    """A label, annotation, selector or resource key: ``[prefix/]name``."""
    text = _string(value, where)
    prefix, _, name = text.rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) \
            or len(name) > 63 or not _NAME.match(name):
        raise ConfigError(f"{where}: {text!r} is not a Kubernetes key. Use an optional DNS "
                          "prefix and '/', then at most 63 letters, digits, '-', '_' or '.', "
                          "e.g. example.com/team.")
    return text


def _label_value(value: object, where: str) -> str:
    text = _string(value, where)
    if text and (len(text) > 63 or not _NAME.match(text)):
        raise ConfigError(f"{where}={text!r} is not a label value: use at most 63 letters, "
                          "digits, '-', '_' or '.', starting and ending with a letter or "
                          "digit (an annotation takes any text).")
    return text


def _quantity(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}={value!r} is not a quantity. Write e.g. 2, 500m, 4Gi. "
                          f"{_DOCS}")
    text = str(value)
    if not _QUANTITY.match(text):
        raise ConfigError(f"{where}={text!r} is not a Kubernetes quantity. Write a number "
                          "with an optional suffix: cpu as 2 or 500m, memory as 4Gi or 512Mi.")
    return text


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping (key: value), not "
                          f"{type(value).__name__}. {_DOCS}")
    return value


def _sequence(value: object, where: str) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"{where} must be a list, not {type(value).__name__}. {_DOCS}")
    return value


def _only(obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{_where(where, str(key))} is not a setting the kubernetes "
                              f"launcher knows: {hint}use one of {', '.join(allowed)}. "
                              f"{_DOCS}")


def _labels(value: object, where: str, *, label: bool) -> Pairs:
    out = []
    for key, val in _mapping(value, where).items():
        name = _qualified(key, where)
        if label and name in _RESERVED_LABELS:
            raise ConfigError(f"{_where(where, name)}: the launcher sets the label {name} "
                              "itself (it finds the job's pods by it). Use another key.")
        out.append((name, _label_value(val, _where(where, name)) if label
                    else _string(val, _where(where, name))))
    return tuple(out)


# -- tolerations and volumes ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Toleration:
    """One ``V1Toleration``: key and value (operator Equal), or key alone (Exists)."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    seconds: int | None = None

    @classmethod
    def from_api(cls, obj: object, where: str) -> Toleration:
        body = _mapping(obj, where)
        _only(body, ("key", "operator", "value", "effect", "tolerationSeconds"), where)
        key = None if body.get("key") in (None, "") else _qualified(body["key"], where + ".key")
        value = None if body.get("value") is None else _string(body["value"], where + ".value")
        operator = _string(body.get("operator", "Equal"), where + ".operator")
        if operator not in ("Equal", "Exists"):
            raise ConfigError(f"{where}.operator={operator!r}: use Equal (key and value) or "
                              "Exists (key alone, or no key to tolerate every taint).")
        if operator == "Equal" and key is None:
            raise ConfigError(f"{where} has no key: give key (and value) to tolerate one "
                              "taint, or operator: Exists to tolerate every taint.")
        if operator == "Exists" and value:
            raise ConfigError(f"{where}: operator Exists takes no value ({value!r}). Drop "
                              "the value, or use operator: Equal.")
        effect = None if body.get("effect") in (None, "") else _string(body["effect"],
                                                                      where + ".effect")
        if effect is not None and effect not in _EFFECTS:
            raise ConfigError(f"{where}.effect={effect!r}: use {', '.join(_EFFECTS)}, or "
                              "leave it out for every effect.")
        seconds = body.get("tolerationSeconds")
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, int):
                raise ConfigError(f"{where}.tolerationSeconds={seconds!r} must be an integer.")
            if effect != "NoExecute":
                raise ConfigError(f"{where}.tolerationSeconds needs effect: NoExecute.")
        return cls(key, operator, value, effect, seconds)

    @classmethod
    def from_flag(cls, text: str, where: str) -> Toleration:
        """``KEY[=VALUE][:EFFECT]``: with a value operator Equal, without it Exists."""
        rest, _, effect = text.partition(":")
        key, eq, value = rest.partition("=")
        if not key:
            raise ConfigError(f"{where} {text!r} has no key. Write KEY=VALUE:EFFECT, KEY:EFFECT "
                              "or KEY (any value), e.g. gpu=true:NoSchedule.")
        body: dict[str, Any] = {"key": key, "operator": "Equal" if eq else "Exists"}
        if eq:
            body["value"] = value
        if effect:
            body["effect"] = effect
        return cls.from_api(body, f"{where} {text!r}")

    def to_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.key is not None:
            out["key"] = self.key
        out["operator"] = self.operator
        if self.value is not None:
            out["value"] = self.value
        if self.effect is not None:
            out["effect"] = self.effect
        if self.seconds is not None:
            out["tolerationSeconds"] = self.seconds
        return out


@dataclass(frozen=True, slots=True)
class Volume:
    """A volume and where the pod's container mounts it.

    `source` is ``claim`` (an existing PersistentVolumeClaim), ``emptyDir``,
    ``hostPath``, ``configMap`` or ``secret``; `ref` the claim, path, map or Secret name.
    """

    name: str
    source: str
    ref: str
    mount_path: str
    read_only: bool = False

    @classmethod
    def from_api(cls, obj: object, where: str) -> Volume:
        body = _mapping(obj, where)
        _only(body, ("name", "mountPath", "readOnly", *_VOLUME_SOURCES), where)
        if "name" not in body:
            raise ConfigError(f"{where} has no name. Give it one (lowercase letters, digits, "
                              "'-'), e.g. name: data.")
        name = _check_name(body["name"], where + ".name", _DNS_LABEL, 63, "a volume name")
        sources = [s for s in _VOLUME_SOURCES if s in body]
        if len(sources) != 1:
            raise ConfigError(f"{where} ({name}) needs exactly one source of "
                              f"{', '.join(_VOLUME_SOURCES)}, not "
                              f"{', '.join(sources) or 'none'}. E.g. claim: my-pvc.")
        source = sources[0]
        raw = body[source]
        if source == "emptyDir":
            if raw not in (True, None, {}):
                raise ConfigError(f"{where}.emptyDir takes true (an empty directory the pod "
                                  "keeps while it lives).")
            ref = ""
        elif source == "hostPath":
            ref = _path(raw, f"{where}.hostPath")
        else:
            ref = _check_name(raw, f"{where}.{source}", _DNS_SUBDOMAIN, 253,
                              f"a {source} name")
        if "mountPath" not in body:
            raise ConfigError(f"{where} ({name}) has no mountPath. Give the absolute path "
                              "where the container sees it, e.g. mountPath: /data.")
        read_only = body.get("readOnly", False)
        if not isinstance(read_only, bool):
            raise ConfigError(f"{where}.readOnly={read_only!r} must be true or false.")
        return cls(name, source, ref, _path(body["mountPath"], f"{where}.mountPath"),
                   read_only)

    @classmethod
    def claim_flag(cls, text: str, where: str, index: int) -> Volume:
        """``CLAIM:MOUNTPATH[:ro]``: mount an existing PersistentVolumeClaim."""
        claim, _, rest = text.partition(":")
        path, _, mode = rest.partition(":")
        if not claim or not path or mode not in ("", "ro", "rw"):
            raise ConfigError(f"{where} {text!r}: write CLAIM:MOUNTPATH or CLAIM:MOUNTPATH:ro, "
                              "e.g. data-pvc:/data:ro.")
        name = claim if len(claim) <= 63 and _DNS_LABEL.match(claim) else f"claim-{index}"
        return cls.from_api({"name": name, "claim": claim, "mountPath": path,
                             "readOnly": mode == "ro"}, f"{where} {text!r}")

    def to_api(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The pod's ``V1Volume`` and the container's ``V1VolumeMount``."""
        sources: dict[str, dict[str, Any]] = {
            "claim": {"persistentVolumeClaim": {"claimName": self.ref}},
            "emptyDir": {"emptyDir": {}},
            "hostPath": {"hostPath": {"path": self.ref}},
            "configMap": {"configMap": {"name": self.ref}},
            "secret": {"secret": {"secretName": self.ref}},
        }
        source = sources[self.source]
        mount: dict[str, Any] = {"name": self.name, "mountPath": self.mount_path}
        if self.read_only:
            mount["readOnly"] = True
        return {"name": self.name, **source}, mount


def _path(value: object, where: str) -> str:
    text = _string(value, where)
    if not text.startswith("/"):
        raise ConfigError(f"{where}={text!r} must be an absolute path, e.g. /data.")
    return text


# -- what one role's pods get, and the whole set ----------------------------------------
@dataclass(frozen=True, slots=True)
class RolePods:
    """What every pod, or one role's pods, get; `merge` layers one over another."""

    requests: Pairs = ()
    limits: Pairs = ()
    node_selector: Pairs = ()
    tolerations: tuple[Toleration, ...] = ()
    volumes: tuple[Volume, ...] = ()
    labels: Pairs = ()
    annotations: Pairs = ()
    #: the pod's and the container's securityContext overrides, as canonical JSON ("": none)
    pod_security: str = ""
    container_security: str = ""

    @classmethod
    def from_api(cls, obj: object, where: str) -> RolePods:
        body = _mapping(obj, where)
        _only(body, POD_KEYS, where)
        resources = _mapping(body.get("resources", {}), _where(where, "resources"))
        _only(resources, ("requests", "limits"), _where(where, "resources"))
        kw: dict[str, Any] = {}
        for part in ("requests", "limits"):
            at = _where(where, f"resources.{part}")
            kw[part] = tuple((_qualified(k, at), _quantity(v, f"{at}.{k}"))
                             for k, v in _mapping(resources.get(part, {}), at).items())
        at = _where(where, "nodeSelector")
        kw["node_selector"] = _labels(body.get("nodeSelector", {}), at, label=False)
        for key, val in kw["node_selector"]:
            _label_value(val, f"{at}.{key}")
        at = _where(where, "tolerations")
        kw["tolerations"] = tuple(Toleration.from_api(t, f"{at}[{i}]")
                                  for i, t in enumerate(_sequence(body.get("tolerations", []),
                                                                  at)))
        at = _where(where, "volumes")
        kw["volumes"] = tuple(Volume.from_api(v, f"{at}[{i}]")
                              for i, v in enumerate(_sequence(body.get("volumes", []), at)))
        kw["labels"] = _labels(body.get("labels", {}), _where(where, "labels"), label=True)
        kw["annotations"] = _labels(body.get("annotations", {}), _where(where, "annotations"),
                                    label=False)
        for key, attr in (("securityContext", "pod_security"),
                          ("containerSecurityContext", "container_security")):
            if body.get(key) is not None:
                kw[attr] = check_security(body[key], _where(where, key), key)
        return cls(**kw)

    def merge(self, over: RolePods) -> RolePods:
        """`over` layered on this: maps merge (its keys win), tolerations add up, its
        volumes replace ones of the same name."""
        def pairs(a: Pairs, b: Pairs) -> Pairs:
            return tuple({**dict(a), **dict(b)}.items())

        def deep(a: str, b: str) -> str:
            if not a or not b:
                return b or a
            return json.dumps(merged(json.loads(a), json.loads(b)), sort_keys=True)
        volumes = {v.name: v for v in self.volumes}
        volumes.update((v.name, v) for v in over.volumes)
        tolerations = list(self.tolerations)
        tolerations += [t for t in over.tolerations if t not in tolerations]
        return RolePods(pairs(self.requests, over.requests), pairs(self.limits, over.limits),
                        pairs(self.node_selector, over.node_selector), tuple(tolerations),
                        tuple(volumes.values()), pairs(self.labels, over.labels),
                        pairs(self.annotations, over.annotations),
                        deep(self.pod_security, over.pod_security),
                        deep(self.container_security, over.container_security))


@dataclass(frozen=True, slots=True)
class PodOptions:
    """Everything the kubernetes launcher adds to its objects (see docs/kubernetes.md).

    Attributes
    ----------
    restart_policy : {'Never', 'OnFailure'} or None
        The servers' and workers' ``restartPolicy``; None: OnFailure with --max-restarts,
        else Never (the scheduler's is always Never).
    service_account : str or None
        ``serviceAccountName`` of every pod.
    image_pull_secrets : tuple of str
        Secrets with the registry's credentials, for every pod.
    labels, annotations : tuple of (key, value)
        On every object the launcher creates.
    checkpoint_claim : str or None
        A PersistentVolumeClaim mounted on the servers at ``PSKV_CHECKPOINT_DIR``.
    layers : tuple of (role or None, RolePods)
        For every pod (None) or one role's pods, in the order they apply (later wins).
    """

    restart_policy: str | None = None
    service_account: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    labels: Pairs = ()
    annotations: Pairs = ()
    checkpoint_claim: str | None = None
    layers: tuple[tuple[str | None, RolePods], ...] = ()

    def for_role(self, role: str) -> RolePods:
        """What `role`'s pods get: every layer for every pod or for `role`, in order."""
        out = RolePods()
        for name, layer in self.layers:
            if name is None or name == role:
                out = out.merge(layer)
        return out

    @classmethod
    def from_values(cls, values: Mapping[str, Any], where: str = "") -> PodOptions:
        """Read a values mapping (the file's format); raises ConfigError naming the field."""
        body = _mapping(values, where or "the values")
        _only(body, TOP_KEYS, where)
        kw: dict[str, Any] = {}
        if body.get("restartPolicy") is not None:
            kw["restart_policy"] = _restart_policy(body["restartPolicy"],
                                                   _where(where, "restartPolicy"))
        if body.get("serviceAccountName") is not None:
            kw["service_account"] = _check_name(
                body["serviceAccountName"], _where(where, "serviceAccountName"),
                _DNS_SUBDOMAIN, 253, "a service account name")
        at = _where(where, "imagePullSecrets")
        kw["image_pull_secrets"] = tuple(
            _check_name(s.get("name") if isinstance(s, Mapping) else s, f"{at}[{i}]",
                        _DNS_SUBDOMAIN, 253, "a Secret name")
            for i, s in enumerate(_sequence(body.get("imagePullSecrets", []), at)))
        kw["labels"] = _labels(body.get("labels", {}), _where(where, "labels"), label=True)
        kw["annotations"] = _labels(body.get("annotations", {}), _where(where, "annotations"),
                                    label=False)
        if body.get("checkpointClaim") is not None:
            kw["checkpoint_claim"] = _check_name(
                body["checkpointClaim"], _where(where, "checkpointClaim"), _DNS_SUBDOMAIN,
                253, "a PersistentVolumeClaim name")
        # a top-level securityContext is every pod's, under the pods section's
        security = {k: body[k] for k in ("securityContext", "containerSecurityContext")
                    if body.get(k) is not None}
        layers: list[tuple[str | None, RolePods]] = [
            (None, RolePods.from_api(security, where)),
            (None, RolePods.from_api(body.get("pods", {}), _where(where, "pods")))]
        layers += [(role, RolePods.from_api(body[role], _where(where, role)))
                   for role in ROLES if role in body]
        kw["layers"] = tuple((r, layer) for r, layer in layers if layer != RolePods())
        return cls(**kw)

    def over(self, other: PodOptions) -> PodOptions:
        """`other` layered on this one (other's scalars win when set)."""
        secrets = list(self.image_pull_secrets)
        secrets += [s for s in other.image_pull_secrets if s not in secrets]
        return PodOptions(
            other.restart_policy or self.restart_policy,
            other.service_account or self.service_account, tuple(secrets),
            tuple({**dict(self.labels), **dict(other.labels)}.items()),
            tuple({**dict(self.annotations), **dict(other.annotations)}.items()),
            other.checkpoint_claim or self.checkpoint_claim, self.layers + other.layers)

    def is_empty(self) -> bool:
        return self == PodOptions()


def _restart_policy(value: object, where: str) -> str:
    text = _string(value, where)
    if text not in RESTART_POLICIES:
        raise ConfigError(f"{where}={text!r}: use Never or OnFailure (Always would restart "
                          "workers that finished).")
    return text


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


def _split_role(text: str) -> tuple[str | None, str]:
    head, sep, rest = text.partition(":")
    return (head, rest) if sep and head in ROLES else (None, text)


def _key_values(text: str, flag: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ConfigError(f"{flag} {text!r}: write [ROLE:]KEY=VALUE[,KEY=VALUE...], e.g. "
                              f"{flag} worker:cpu=4,memory=16Gi.")
        out.append((key.strip(), value.strip()))
    return out


def pod_options(values_file: str | None = None, *, values: Mapping[str, Any] | None = None,
                restart_policy: str | None = None, service_account: str | None = None,
                image_pull_secrets: Iterable[str] = (), labels: Iterable[str] = (),
                annotations: Iterable[str] = (), requests: Iterable[str] = (),
                limits: Iterable[str] = (), node_selectors: Iterable[str] = (),
                tolerations: Iterable[str] = (), claims: Iterable[str] = (),
                checkpoint_claim: str | None = None) -> PodOptions | None:
    """The PodOptions of a values file (or mapping) with the flags over it; None if none.

    Each flag value may start with a role (``worker:cpu=4``) to apply to that role only;
    ``--label``/``--annotation`` without one apply to every object. Raises ConfigError
    naming the flag or the file's field and what to write instead.

    Examples
    --------
    >>> opts = pod_options(values={'pods': {'resources': {'requests': {'cpu': 1}}}},
    ...                    requests=['worker:cpu=4,memory=8Gi'])
    >>> opts.for_role('worker').requests, opts.for_role('server').requests
    ((('cpu', '4'), ('memory', '8Gi')), (('cpu', '1'),))
    """
    base = PodOptions()
    if values_file is not None:
        try:
            base = PodOptions.from_values(load_values(values_file), "")
        except ConfigError as err:
            if str(err).startswith("--values"):
                raise
            raise ConfigError(f"--values {values_file}: {err}") from None
    if values is not None:
        base = base.over(PodOptions.from_values(values, ""))
    layers: list[tuple[str | None, RolePods]] = []
    top: dict[str, Pairs] = {"labels": (), "annotations": ()}
    for flag, items, kind in (("--label", labels, "labels"),
                              ("--annotation", annotations, "annotations")):
        for text in items:
            role, rest = _split_role(text)
            key, eq, value = rest.partition("=")
            if not eq or not key:
                raise ConfigError(f"{flag} {text!r}: write [ROLE:]KEY=VALUE, e.g. {flag} "
                                  "team=ml.")
            pairs = _labels({key: value}, flag, label=kind == "labels")
            if role is None:
                top[kind] += pairs
            else:
                one: dict[str, Any] = {kind: pairs}
                layers.append((role, RolePods(**one)))
    for flag, items, part in (("--requests", requests, "requests"),
                              ("--limits", limits, "limits")):
        for text in items:
            role, rest = _split_role(text)
            amounts: dict[str, Any] = {part: tuple(
                (_qualified(k, flag), _quantity(v, f"{flag} {k}"))
                for k, v in _key_values(rest, flag))}
            layers.append((role, RolePods(**amounts)))
    for text in node_selectors:
        role, rest = _split_role(text)
        key, eq, value = rest.partition("=")
        if not eq or not key:
            raise ConfigError(f"--node-selector {text!r}: write [ROLE:]KEY=VALUE, e.g. "
                              "--node-selector worker:nvidia.com/gpu.present=true.")
        layers.append((role, RolePods(node_selector=(
            (_qualified(key, "--node-selector"), _label_value(value, f"--node-selector {key}")),
        ))))
    for text in tolerations:
        role, rest = _split_role(text)
        layers.append((role, RolePods(tolerations=(Toleration.from_flag(rest, "--toleration"),))))
    for i, text in enumerate(claims):
        role, rest = _split_role(text)
        layers.append((role, RolePods(volumes=(Volume.claim_flag(rest, "--claim", i),))))
    flags = PodOptions(
        restart_policy=None if restart_policy is None
        else _restart_policy(restart_policy, "--restart-policy"),
        service_account=None if service_account is None else _check_name(
            service_account, "--service-account", _DNS_SUBDOMAIN, 253, "a service account name"),
        image_pull_secrets=tuple(_check_name(s, "--image-pull-secret", _DNS_SUBDOMAIN, 253,
                                             "a Secret name") for s in image_pull_secrets),
        labels=top["labels"], annotations=top["annotations"],
        checkpoint_claim=None if checkpoint_claim is None else _check_name(
            checkpoint_claim, "--checkpoint-claim", _DNS_SUBDOMAIN, 253,
            "a PersistentVolumeClaim name"))
    # a role's flag beats an every-pod flag, wherever each stands on the command line
    ordered = [lay for lay in layers if lay[0] is None] + [lay for lay in layers if lay[0]]
    out = base.over(replace(flags, layers=tuple(ordered)))
    return None if out.is_empty() else out
