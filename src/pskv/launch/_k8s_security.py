"""What makes the kubernetes launcher's pods acceptable to a ``restricted`` namespace.

The Pod Security Standards' ``restricted`` profile (kubernetes.io/docs/concepts/security/
pod-security-standards) refuses a pod unless it runs as a non-root user, with no privilege
escalation, every capability dropped and the runtime's default seccomp profile. The
defaults here satisfy it; a values file's ``securityContext`` (the pod's) and
``containerSecurityContext`` (the container's) merge over them key by key (their fields
are checked by the client's models, _k8s_schema.py), and `restricted_problem` refuses a
pod they would take out of the level. Also here: the default resources and the probes.

Invariant: every function is pure; nothing here knows the job or talks to a cluster.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["CONTAINER_SECURITY", "DEFAULT_LIMITS", "DEFAULT_REQUESTS", "POD_SECURITY",
           "RUN_AS_USER", "probes", "restricted_problem"]

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


def restricted_problem(pod: Mapping[str, Any]) -> str | None:
    """The first setting of a pod spec that the ``restricted`` level refuses, or None.

    The pod's and each container's securityContext (with the defaults above under the
    values file's) and the host namespaces: what a values file can change. Volumes are the
    user's to choose (a ``hostPath`` one is refused by a restricted namespace itself)."""
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            return f"{field}: true (the pod would share the node's namespaces)"
    if psc.get("runAsNonRoot") is False or psc.get("runAsUser") == 0:
        return "securityContext runAsNonRoot: false or runAsUser: 0 (root)"
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if pod_seccomp not in ("RuntimeDefault", "Localhost"):
        return f"securityContext seccompProfile type {pod_seccomp} (use RuntimeDefault)"
    for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        sc = c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        added = sorted(set(caps.get("add") or []) - {"NET_BIND_SERVICE"})
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        for bad, what in (
                (sc.get("privileged"), "containerSecurityContext privileged: true"),
                (sc.get("allowPrivilegeEscalation") is not False,
                 "containerSecurityContext allowPrivilegeEscalation is not false"),
                ("ALL" not in (caps.get("drop") or []),
                 "containerSecurityContext capabilities.drop has no ALL"),
                (added, f"containerSecurityContext capabilities.add {added} (only "
                        "NET_BIND_SERVICE is allowed)"),
                (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True,
                 "runAsNonRoot is not true"),
                (sc.get("runAsUser") == 0, "runAsUser: 0 (root)"),
                (seccomp not in ("RuntimeDefault", "Localhost"),
                 f"seccompProfile type {seccomp} (use RuntimeDefault or Localhost)")):
            if bad:
                return what if c.get("name") == "pskv" else f"container {c.get('name')}: {what}"
    return None


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
