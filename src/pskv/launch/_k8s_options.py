"""What the kubernetes launcher puts into its pods beyond pskv's own: `PodOptions`.

Pod settings come from a values file (YAML or JSON) and from flags (both read by
_k8s_input.py); `pod_options` turns them into patches of the pods: each flag is a small
one (``--requests worker:cpu=4`` is ``{resources: {requests: {cpu: '4'}}}`` for the
workers), and a section of the file (``pods:`` or a role's) is a patch of the PodSpec
itself, any field of it, with pskv's shorthands for the container (`SHORTHANDS`:
resources, volumes with their mounts, labels, annotations, containerSecurityContext). The fields are checked against the API's
schema by the official client's models (_k8s_schema.py); pskv checks only what the schema
cannot say and the launcher relies on: its own keys, its reserved labels, the restart
policies it supports, and (when the manifests are made) the ``restricted`` level.

Precedence: every flag beats the values file, and within each, a role's setting
(``worker:`` in a flag, the ``worker`` section of the file) beats the one for every pod.
Patches merge key by key (`patched`): maps merge, tolerations and image pull secrets add
up, a volume (and its mount) replaces one of the same name, any other list is replaced.
Invariant: PodOptions and RolePods are frozen and never mutated (`patched` copies), and
nothing here knows the job or talks to a cluster.
"""
from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from ..errors import ConfigError
from ._k8s_input import flag_section, load_values
from ._k8s_schema import INSTALL, at, check, client

__all__ = ["CHECKPOINT_MOUNT", "PodOptions", "RESTART_POLICIES", "ROLES", "RolePods",
           "SHORTHANDS", "TOP_KEYS", "load_values", "patched", "pod_options"]

ROLES: tuple[str, ...] = ("scheduler", "server", "worker")
RESTART_POLICIES: tuple[str, ...] = ("Never", "OnFailure")
#: where --checkpoint-claim is mounted (and PSKV_CHECKPOINT_DIR points) when no
#: PSKV_CHECKPOINT_DIR is given
CHECKPOINT_MOUNT = "/var/lib/pskv/checkpoints"
TOP_KEYS: tuple[str, ...] = ("restartPolicy", "serviceAccountName", "imagePullSecrets",
                             "labels", "annotations", "checkpointClaim", "securityContext",
                             "containerSecurityContext", "pods", *ROLES)
#: a section's keys that are pskv's, not the PodSpec's (``resources`` is the container's)
SHORTHANDS: tuple[str, ...] = ("resources", "volumes", "labels", "annotations",
                               "containerSecurityContext")
#: PodSpec fields the launcher writes itself, and what to do instead
_OWNED = {"containers": "give the container's settings with resources, volumes and "
                        "containerSecurityContext",
          "restartPolicy": "give restartPolicy at the top of the values file, or "
                           "--restart-policy"}
#: the launcher's own labels: a job is found, and its Service selects, by these
_RESERVED_LABELS = ("app.kubernetes.io/name", "pskv.io/job", "pskv.io/role", "pskv.io/rank")
#: a volume's shorthand source -> (the V1Volume field, the field its text fills)
_SOURCES = {"claim": ("persistentVolumeClaim", "claimName"), "hostPath": ("hostPath", "path"),
            "configMap": ("configMap", "name"), "secret": ("secret", "secretName")}
_ADD_UP = ("tolerations", "imagePullSecrets")
_BY_NAME = ("volumes", "volumeMounts")
_DOCS = "See docs/kubernetes.md."

Pairs = tuple[tuple[str, str], ...]


def patched(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on a copy of `base`: maps merge key by key (recursively), tolerations and
    image pull secrets add up, volumes and volume mounts replace ones of the same name,
    anything else replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        old, value = out.get(key), copy.deepcopy(value)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = patched(old, value)
        elif key in _ADD_UP and isinstance(old, list) and isinstance(value, list):
            out[key] = old + [v for v in value if v not in old]
        elif key in _BY_NAME and isinstance(old, list) and isinstance(value, list):
            named = {v.get("name"): v for v in old}
            named.update((v.get("name"), v) for v in value)
            out[key] = list(named.values())
        else:
            out[key] = value
    return out


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping (key: value), not "
                          f"{type(value).__name__}. {_DOCS}")
    return value


def _texts(value: object) -> Any:
    """A map's numbers as the strings the API wants (``cpu: 2``, ``version: 1``); anything
    else as it is, for the schema to accept or refuse."""
    if not isinstance(value, Mapping):
        return value
    return {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in value.items()}


def _labels(meta: Mapping[str, Any], where: str) -> tuple[Pairs, Pairs]:
    """A section's labels and annotations, checked as ``V1ObjectMeta`` fields."""
    body = {k: _texts(meta[k]) for k in ("labels", "annotations") if meta.get(k) is not None}
    check(body, "V1ObjectMeta", where)
    for name in body.get("labels", {}):
        if name in _RESERVED_LABELS:
            raise ConfigError(f"{at(where, 'labels.' + name)}: the launcher sets the label "
                              f"{name} itself (it finds the job's pods by it). Use another key.")
    return (tuple(body.get("labels", {}).items()), tuple(body.get("annotations", {}).items()))


def _volume(item: object, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A values file's volume: the pod's ``V1Volume`` and the container's ``V1VolumeMount``
    (its fields: mountPath, readOnly, ...); ``claim: NAME`` and the other shorthands of a
    source are expanded, a source written as the API writes it is kept."""
    body = dict(_mapping(item, where))
    mount_keys = set(client().V1VolumeMount.attribute_map.values()) - {"name"}
    mount = {"name": body.get("name"), **{k: body.pop(k) for k in list(body)
                                          if k in mount_keys}}
    if mount.get("readOnly") is False:
        del mount["readOnly"]
    for short, (source, key) in _SOURCES.items():
        if short in body and (short == "claim" or not isinstance(body[short], Mapping)):
            body[source] = {key: body.pop(short)}
    if "emptyDir" in body and body["emptyDir"] in (True, None):
        body["emptyDir"] = {}
    check(body, "V1Volume", where, extra=(*sorted(mount_keys), "claim"))
    check(mount, "V1VolumeMount", where)
    return body, mount


@dataclass(frozen=True, slots=True)
class RolePods:
    """What every pod, or one role's pods, get: patches of the PodSpec (`pod`) and of the
    pskv container (`container`), and labels and annotations for the Job and its pods."""

    pod: dict[str, Any] = field(default_factory=dict)
    container: dict[str, Any] = field(default_factory=dict)
    labels: Pairs = ()
    annotations: Pairs = ()

    @classmethod
    def from_api(cls, obj: object, where: str) -> RolePods:
        """A section of the values file (``pods:``, a role's); ConfigError naming the field."""
        body = dict(_mapping(obj, where))
        for key, instead in _OWNED.items():
            if key in body:
                raise ConfigError(f"{at(where, key)}: the launcher sets it; {instead}. {_DOCS}")
        container: dict[str, Any] = {}
        if body.get("resources") is not None:
            resources = {k: _texts(v) for k, v in _mapping(body.pop("resources"), at(
                where, "resources")).items()}
            check(resources, "V1ResourceRequirements", at(where, "resources"))
            container["resources"] = resources
        if body.get("containerSecurityContext") is not None:
            container["securityContext"] = body.pop("containerSecurityContext")
            check(container["securityContext"], "V1SecurityContext",
                  at(where, "containerSecurityContext"))
        labels, annotations = _labels({k: body.pop(k, None) for k in ("labels", "annotations")},
                                      where)
        volumes = body.pop("volumes", None)
        if "nodeSelector" in body:
            body["nodeSelector"] = _texts(body["nodeSelector"])
        check(body, "V1PodSpec", where, extra=SHORTHANDS, read={"containers": [], **body})
        if volumes is not None:
            if isinstance(volumes, (str, Mapping)) or not isinstance(volumes, Sequence):
                raise ConfigError(f"{at(where, 'volumes')} must be a list. {_DOCS}")
            pairs = [_volume(v, f"{at(where, 'volumes')}[{i}]") for i, v in enumerate(volumes)]
            body["volumes"] = [v for v, _ in pairs]
            container["volumeMounts"] = [m for _, m in pairs]
        # a copy through JSON: what YAML read (anchors, shared objects) is not kept
        return cls(json.loads(json.dumps(body)), json.loads(json.dumps(container)), labels,
                   annotations)

    def merge(self, over: RolePods) -> RolePods:
        """`over` layered on this (see `patched`; label maps merge, its keys win)."""
        return RolePods(patched(self.pod, over.pod), patched(self.container, over.container),
                        tuple({**dict(self.labels), **dict(over.labels)}.items()),
                        tuple({**dict(self.annotations), **dict(over.annotations)}.items()))


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
        for key in body:
            if key not in TOP_KEYS:
                near = difflib.get_close_matches(str(key), TOP_KEYS, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise ConfigError(f"{at(where, str(key))} is not a setting the kubernetes "
                                  f"launcher knows: {hint}use one of {', '.join(TOP_KEYS)}, "
                                  f"or put PodSpec fields in pods: or a role's section. {_DOCS}")
        kw: dict[str, Any] = {}
        if body.get("restartPolicy") is not None:
            kw["restart_policy"] = _restart_policy(body["restartPolicy"],
                                                   at(where, "restartPolicy"))
        secrets = body.get("imagePullSecrets") or []
        if isinstance(secrets, list):   # names, or {name: NAME} as the API writes them
            secrets = [{"name": s} if isinstance(s, str) else s for s in secrets]
        pod = {k: v for k, v in (("serviceAccountName", body.get("serviceAccountName")),
                                  ("imagePullSecrets", secrets)) if v}
        check(pod, "V1PodSpec", where, read={"containers": [], **pod})
        kw["service_account"] = pod.get("serviceAccountName")
        kw["image_pull_secrets"] = tuple(s["name"] for s in secrets if s.get("name"))
        kw["labels"], kw["annotations"] = _labels(body, where)
        if body.get("checkpointClaim") is not None:
            check({"claimName": body["checkpointClaim"]}, "V1PersistentVolumeClaimVolumeSource",
                  at(where, "checkpointClaim"))
            kw["checkpoint_claim"] = body["checkpointClaim"]
        # a top-level securityContext is every pod's, under the pods section's
        security = {k: body[k] for k in ("securityContext", "containerSecurityContext")
                    if body.get(k) is not None}
        layers: list[tuple[str | None, RolePods]] = [
            (None, RolePods.from_api(security, where)),
            (None, RolePods.from_api(body.get("pods", {}), at(where, "pods")))]
        layers += [(role, RolePods.from_api(body[role], at(where, role)))
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
    if value not in RESTART_POLICIES:
        raise ConfigError(f"{where}={value!r}: use Never or OnFailure (Always would restart "
                          "workers that finished).")
    return str(value)


def _split_role(text: str) -> tuple[str | None, str]:
    head, sep, rest = text.partition(":")
    return (head, rest) if sep and head in ROLES else (None, text)


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
    naming the flag or the file's field and what to write instead, and, when there are
    settings, one saying ``pip install 'pskv[kubernetes]'`` if the client is missing.

    Examples
    --------
    >>> opts = pod_options(values={'pods': {'resources': {'requests': {'cpu': 1}}}},
    ...                    requests=['worker:cpu=4,memory=8Gi'])
    >>> opts.for_role('worker').container, opts.for_role('server').container
    ({'resources': {'requests': {'cpu': '4', 'memory': '8Gi'}}}, {'resources': {'requests': {'cpu': '1'}}})
    """
    base = PodOptions()
    if values_file is not None:
        try:
            base = PodOptions.from_values(load_values(values_file), "")
        except ConfigError as err:
            if str(err).startswith(("--values", INSTALL)):
                raise
            raise ConfigError(f"--values {values_file}: {err}") from None
    if values is not None:
        base = base.over(PodOptions.from_values(values, ""))
    layers: list[tuple[str | None, RolePods]] = []
    top: dict[str, Pairs] = {"labels": (), "annotations": ()}
    for flag, items in (("--label", labels), ("--annotation", annotations),
                        ("--requests", requests), ("--limits", limits),
                        ("--node-selector", node_selectors), ("--toleration", tolerations),
                        ("--claim", claims)):
        for i, text in enumerate(items):
            role, rest = _split_role(text)
            where = f"{flag} {text!r}"
            layer = RolePods.from_api(flag_section(flag, rest, where, i), where)
            if role is None and flag in ("--label", "--annotation"):   # every object's
                top["labels"] += layer.labels
                top["annotations"] += layer.annotations
            else:
                layers.append((role, layer))
    if service_account is not None:   # over a section's serviceAccountName too
        layers.insert(0, (None, RolePods(pod={"serviceAccountName": service_account})))
    flags = PodOptions(
        restart_policy=None if restart_policy is None
        else _restart_policy(restart_policy, "--restart-policy"),
        service_account=service_account, image_pull_secrets=tuple(image_pull_secrets),
        labels=top["labels"], annotations=top["annotations"],
        checkpoint_claim=checkpoint_claim)
    # a role's flag beats an every-pod flag, wherever each stands on the command line
    ordered = [lay for lay in layers if lay[0] is None] + [lay for lay in layers if lay[0]]
    out = base.over(replace(flags, layers=tuple(ordered)))
    if out.is_empty():
        return None
    client()   # every pod setting is checked against the API's schema: the client is needed
    return out
