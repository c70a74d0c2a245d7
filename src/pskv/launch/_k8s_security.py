"""What makes the kubernetes launcher's pods acceptable to a ``restricted`` namespace.

The Pod Security Standards' ``restricted`` profile (kubernetes.io/docs/concepts/security/
pod-security-standards) refuses a pod unless it runs as a non-root user, with no privilege
escalation, every capability dropped and the runtime's default seccomp profile. The
defaults here satisfy it; a values file's ``securityContext`` (the pod's) and
``containerSecurityContext`` (the container's) merge over them key by key, and are read
into the official client's models when it is installed, so a misspelt field is refused
before anything is created. Also here: the default resources and the probes.

Invariant: every function is pure; nothing here knows the job or talks to a cluster.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["CONTAINER_SECURITY", "DEFAULT_LIMITS", "DEFAULT_REQUESTS", "POD_SECURITY",
           "RUN_AS_USER", "check_security", "merged", "probes"]

#: the uid and gid the pods run as unless a values file says otherwise (restricted needs
#: a non-root user; 65532 is the distroless images' "nonroot")
RUN_AS_USER = 65532
#: the pod's securityContext: restricted's pod-level fields
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}}
#: the container's securityContext: restricted's container-level fields
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
#: every container's resources unless --requests/--limits or a values file say otherwise
DEFAULT_REQUESTS: tuple[tuple[str, str], ...] = (("cpu", "1"), ("memory", "1Gi"))
DEFAULT_LIMITS: tuple[tuple[str, str], ...] = (("memory", "8Gi"),)
#: the probes' timing: the scheduler gets two minutes to listen, then three missed checks
_TIMING = {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}
_STARTUP = {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 24}
_MODELS = {"securityContext": "V1PodSecurityContext",
           "containerSecurityContext": "V1SecurityContext"}


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on `base`: mappings merge key by key (recursively), anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = merged(old, value) if isinstance(old, Mapping) and \
            isinstance(value, Mapping) else value
    return out


def check_security(value: object, where: str, field: str) -> str:
    """A values file's `field` (``securityContext`` or ``containerSecurityContext``) as
    canonical JSON; raises ConfigError when it is no mapping or a field is unknown to the
    API's schema (read with the official client's model, when it is installed)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping of {_MODELS[field][2:]} fields (e.g. "
                          "runAsUser: 1000), not "f"{type(value).__name__}. See "
                          "docs/kubernetes.md.")
    body = json.loads(json.dumps(value))
    try:
        from kubernetes import client
    except ImportError:  # the launcher needs the client to create anything anyway
        return json.dumps(body, sort_keys=True)
    api: Any = client.ApiClient()
    try:
        model = api._ApiClient__deserialize(body, _MODELS[field])
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where} is not a valid {_MODELS[field][2:]}: {err}. See "
                          "docs/kubernetes.md.") from None
    back = api.sanitize_for_serialization(model)
    lost = _lost(body, back, where)
    if lost:
        raise ConfigError(f"{lost} is not a field of {_MODELS[field][2:]} (Kubernetes API): "
                          "check its spelling and nesting (e.g. capabilities: {drop: "
                          "[ALL]}). See docs/kubernetes.md.")
    return json.dumps(body, sort_keys=True)


def _lost(body: Any, back: Any, where: str) -> str | None:
    """The first field of `body` that the model's round trip dropped or changed."""
    if isinstance(body, Mapping):
        for key, value in body.items():
            if not isinstance(back, Mapping) or key not in back:
                return f"{where}.{key}"
            inner = _lost(value, back[key], f"{where}.{key}")
            if inner:
                return inner
        return None
    if isinstance(body, list):
        if not isinstance(back, list) or len(back) != len(body):
            return where
        for i, (a, b) in enumerate(zip(body, back)):
            inner = _lost(a, b, f"{where}[{i}]")
            if inner:
                return inner
        return None
    return None if body == back else where


def probes(role: str, metrics_port: int | None) -> dict[str, Any]:
    """The container's probes: the scheduler's port, else the metrics endpoint, else none.

    The scheduler listens on its port (the container port named ``scheduler``) from its
    start, so a TCP connect checks that it starts (startupProbe), is up (readinessProbe)
    and stays up (livenessProbe). A server or worker listens on ports the OS picks; with
    PSKV_METRICS_PORT it serves ``/metrics`` there (a pod of its own: the first port is
    free), but only once the whole cluster has formed, which takes as long as the slowest
    pod takes to be scheduled: a TCP connect there is its readinessProbe, and a liveness
    check that could kill a node still waiting for the others is left out.
    """
    if role == "scheduler":  # a dict each: shared ones would print as YAML anchors
        return {"startupProbe": {"tcpSocket": {"port": "scheduler"}, **_STARTUP},
                "readinessProbe": {"tcpSocket": {"port": "scheduler"}, **_TIMING},
                "livenessProbe": {"tcpSocket": {"port": "scheduler"}, **_TIMING}}
    if metrics_port:
        # a TCP connect, not a GET: with PSKV_METRICS_TOKEN a GET without the token is
        # answered 401, and the token does not belong in the manifest
        return {"readinessProbe": {"tcpSocket": {"port": "metrics"}, **_TIMING}}
    return {}
