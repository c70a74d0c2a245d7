"""The kubernetes launcher's objects: a Secret, a headless Service and one Job per process.

Each process is a ``batch/v1`` Job of one pod that a ``restricted`` namespace accepts
(non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp, no
service-account token; _k8s_security.py), with resources, probes, a podFailurePolicy and a
time to live (tests/unit/test_k8s_restricted.py checks the Pod Security rules).

Invariant: `job_manifests` is pure (a LaunchSpec and names in, API dicts out), and every
dict it returns deserializes into the official client's model of its kind with no field
left over (tests/unit/test_k8s_schema.py checks that against the client's models).
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

from .._ps.config import (ENV_CHECKPOINT_DIR, ENV_CONNECT_TIMEOUT, ENV_MAX_RESTARTS,
                          ENV_METRICS_PORT, ENV_NODE_HOST, ENV_SECRET, Role)
from ..errors import ConfigError
from ._k8s_options import CHECKPOINT_MOUNT, PodOptions, RolePods, patched
from ._k8s_schema import check
from ._k8s_security import (CONTAINER_SECURITY, DEFAULT_LIMITS, DEFAULT_REQUESTS,
                            POD_SECURITY, probes, restricted_problem)
from ._env import cluster_env
from ._spec import DEFAULT_SERVER_COMMAND, LaunchSpec

__all__ = ["CONTAINER", "DEFAULT_PORT", "ENV_USE_KUBERNETES", "JOB_TTL", "LABEL_JOB", "LABEL_RANK", "LABEL_ROLE",
           "Manifest", "POD_COMMAND_SERVER", "RESTART_COUNT_FILE", "job_manifests",
           "restart_policy", "to_yaml"]

#: the scheduler's port inside its pod (Kubeflow's MXJob default port)
DEFAULT_PORT = 9091
#: ps-lite's switch: the scheduler binds 0.0.0.0 (Kubeflow's MXJob sets it to 1)
ENV_USE_KUBERNETES = "DMLC_USE_KUBERNETES"
#: the scheduler and servers in the image: the launcher's own sys.executable is no path there
POD_COMMAND_SERVER: tuple[str, ...] = ("python", "-m", "pskv.server")
#: with --max-restarts, a restarted container finds its restart count here: an emptyDir
#: survives a container's restart in its pod (the kubelet gives no restart count to it)
RESTART_DIR = "/var/run/pskv"
RESTART_COUNT_FILE = f"{RESTART_DIR}/restarts"
POD_ENTRY: tuple[str, ...] = ("python", "-m", "pskv.launch._pod_entry")
#: the pods' one container (the podFailurePolicy's rules name it)
CONTAINER = "pskv"
#: a finished Job the launcher did not delete (--dry-run | kubectl apply) goes after an hour
JOB_TTL = 3600
LABEL_JOB = "pskv.io/job"
LABEL_ROLE = "pskv.io/role"
LABEL_RANK = "pskv.io/rank"
_INSTALL = "Install the client with pip install 'pskv[kubernetes]'."
#: the kubelet's crash-loop back-off: 10 s, doubled after each restart, at most 300 s
_BACKOFF_FIRST, _BACKOFF_MAX = 10, 300

Manifest = dict[str, Any]


def restart_policy(spec: LaunchSpec) -> str:
    """The servers' and workers' ``restartPolicy`` (the scheduler's is always Never)."""
    chosen = spec.pods.restart_policy if spec.pods is not None else None
    return chosen or ("OnFailure" if spec.max_restarts else "Never")


def _connect_timeout(max_restarts: int) -> str:
    """Long enough for the scheduler to wait for the last restart's back-off."""
    backoff = min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** (max_restarts - 1))
    return str(60 + backoff)


def _env_list(env: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in env.items()]


def _resources(pods: RolePods) -> dict[str, dict[str, str]]:
    """The container's requests and limits: the defaults under the given ones. A default
    is left out for a resource given in either part (a default limit under a larger given
    request, or a default request over a smaller given limit, would be refused)."""
    given = pods.container.get("resources") or {}
    named = set(given.get("requests") or {}) | set(given.get("limits") or {})
    out = patched({"requests": {k: v for k, v in DEFAULT_REQUESTS if k not in named},
                   "limits": {k: v for k, v in DEFAULT_LIMITS if k not in named}}, given)
    return {part: amounts for part, amounts in out.items() if amounts}


def _job_spec(spec: LaunchSpec, policy: str) -> dict[str, Any]:
    """A node's Job around its pod: no retry but the kubelet's restarts (--max-restarts),
    deleted an hour after it finished if the launcher did not delete it first."""
    out: dict[str, Any] = {"backoffLimit": spec.max_restarts if policy == "OnFailure" else 0,
                           "ttlSecondsAfterFinished": JOB_TTL}
    if policy == "Never":
        # a pskv job cannot take back a node that the Job controller would replace (the
        # others declared it dead): any failure, a disruption too, fails the Job at once
        out["podFailurePolicy"] = {"rules": [
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget",
                                                       "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER,
                                                  "operator": "NotIn", "values": [0]}}]}
    if spec.timeout:
        out["activeDeadlineSeconds"] = max(1, math.ceil(spec.timeout))
    return out


def _job(name: str, role: Role, rank: int | None, spec: LaunchSpec,
         command: tuple[str, ...], env: Mapping[str, str], meta: Manifest,
         options: PodOptions, pods: RolePods, port: int) -> Manifest:
    labels = dict(meta["labels"])
    labels.update(pods.labels)
    labels[LABEL_ROLE] = role.value
    if rank is not None:
        labels[LABEL_RANK] = str(rank)
    env_list = _env_list(env)
    env_list.append({"name": ENV_SECRET, "valueFrom": {
        "secretKeyRef": {"name": meta["secret"], "key": "secret"}}})
    if role is not Role.SCHEDULER:
        # announce the pod's own IP; the scheduler binds 0.0.0.0 (DMLC_USE_KUBERNETES)
        env_list.append({"name": ENV_NODE_HOST, "valueFrom": {
            "fieldRef": {"fieldPath": "status.podIP"}}})
    policy = "Never" if role is Role.SCHEDULER else restart_policy(spec)
    own = []   # the launcher's own volumes: (V1Volume, V1VolumeMount)
    if policy == "OnFailure":
        command = (*POD_ENTRY, RESTART_COUNT_FILE, str(spec.max_restarts), "--", *command)
        own.append(({"name": "pskv-run", "emptyDir": {}},
                    {"name": "pskv-run", "mountPath": RESTART_DIR}))
    container: dict[str, Any] = {"name": CONTAINER, "image": spec.image,
                                 "command": list(command), "env": env_list}
    ports = []
    if role is Role.SCHEDULER:
        ports.append({"name": "scheduler", "containerPort": port, "protocol": "TCP"})
    metrics = env.get(ENV_METRICS_PORT, "")
    metrics_port = int(metrics) if metrics.isdigit() and 0 < int(metrics) < 65536 else None
    if metrics_port:
        ports.append({"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"})
    if ports:
        container["ports"] = ports
    container["resources"] = _resources(pods)
    container.update(probes(role.value, metrics_port))
    container["securityContext"] = CONTAINER_SECURITY
    container = patched(container, {k: v for k, v in pods.container.items()
                                    if k != "resources"})
    container = patched(container, {"volumeMounts": [m for _, m in own]} if own else {})
    paths = [m.get("mountPath") for m in container.get("volumeMounts", [])]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise ConfigError(f"the {role.value} pods would mount two volumes at "
                          f"{', '.join(twice)}. Give each volume its own mountPath.")
    metadata: dict[str, Any] = {"labels": labels}
    annotations = {**meta.get("annotations", {}), **dict(pods.annotations)}
    if annotations:
        metadata["annotations"] = annotations
    pod_spec: dict[str, Any] = {"restartPolicy": policy, "enableServiceLinks": False,
                                "automountServiceAccountToken": False}
    if options.service_account:
        pod_spec["serviceAccountName"] = options.service_account
    if options.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in options.image_pull_secrets]
    pod_spec["securityContext"] = POD_SECURITY
    pod_spec["containers"] = [container]
    pod_spec = patched(pod_spec, pods.pod)
    if own:
        pod_spec = patched(pod_spec, {"volumes": [v for v, _ in own]})
    _check_pod(pod_spec, role, options)
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": meta["namespace"], **metadata},
            "spec": {**_job_spec(spec, policy),
                     # a copy: shared dicts would print as YAML anchors (&id001)
                     "template": {"metadata": json.loads(json.dumps(metadata)),
                                  "spec": pod_spec}}}


def _check_pod(pod: Manifest, role: Role, options: PodOptions) -> None:
    """With pod settings, the pod spec they made, against the API's schema (the client's
    models) and the ``restricted`` level; ConfigError naming the role."""
    if options.is_empty():
        return   # the launcher's own fields: tests/unit/test_k8s_schema.py checks them
    where = f"the {role.value} pods' spec"
    problem = restricted_problem(pod)
    if problem:
        raise ConfigError(f"{where}: {problem}: a namespace at the restricted Pod Security "
                          "level refuses the pod. Drop that setting from --values (docs/"
                          "kubernetes.md, 'What the pods are allowed').")
    check(pod, "V1PodSpec", where)


def _checkpoint_volume(options: PodOptions, spec: LaunchSpec) -> RolePods | None:
    """The servers' mount of ``--checkpoint-claim`` at PSKV_CHECKPOINT_DIR."""
    if not options.checkpoint_claim:
        return None
    path = {**dict(spec.env), **dict(spec.env_server)}.get(ENV_CHECKPOINT_DIR,
                                                            CHECKPOINT_MOUNT)
    if not path.startswith("/"):
        raise ConfigError(f"{ENV_CHECKPOINT_DIR}={path!r}: with --checkpoint-claim it is "
                          "where the claim is mounted, an absolute path. Pass --env "
                          f"{ENV_CHECKPOINT_DIR}:/ckpt, or leave it out ({CHECKPOINT_MOUNT}).")
    return RolePods(pod={"volumes": [{"name": "pskv-checkpoints", "persistentVolumeClaim": {
        "claimName": options.checkpoint_claim}}]},
        container={"volumeMounts": [{"name": "pskv-checkpoints", "mountPath": path}]})


def job_manifests(spec: LaunchSpec, *, name: str, namespace: str, secret: str,
                  port: int | None = None) -> list[Manifest]:
    """The Secret, the scheduler's headless Service and every node's Job, as API dicts.

    Parameters
    ----------
    spec : LaunchSpec
        Its `image`, command, counts, ``--env`` settings and `pods` (PodOptions).
    name : str
        The job name: every object's name starts with it, and ``pskv.io/job`` is it.
    namespace : str
    secret : str
        The job secret (``stringData`` of the Secret; pods read it from there).
    port : int, optional
        The scheduler's port: ``spec.port``, else DEFAULT_PORT.

    Returns
    -------
    list of dict
        Secret, Service, the scheduler's Job, the servers', the workers'.

    Examples
    --------
    >>> spec = LaunchSpec(('python', 't.py'), 2, 1, launcher='kubernetes', image='img')
    >>> for m in job_manifests(spec, name='j', namespace='ns', secret='s'):
    ...     print(m['kind'], m['metadata']['name'])
    Secret j-secret
    Service j-scheduler
    Job j-scheduler
    Job j-server-0
    Job j-worker-0
    Job j-worker-1
    """
    if not spec.image:
        raise ConfigError("--launcher kubernetes needs --image IMAGE.")
    options = spec.pods or PodOptions()
    port = port or spec.port or DEFAULT_PORT
    secret_name, service = f"{name}-secret", f"{name}-scheduler"
    labels = {"app.kubernetes.io/name": "pskv", **dict(options.labels), LABEL_JOB: name}
    meta: Manifest = {"name": name, "namespace": namespace, "labels": labels,
                      "secret": secret_name}
    if options.annotations:
        meta["annotations"] = dict(options.annotations)

    def metadata(obj_name: str) -> dict[str, Any]:
        out = {"name": obj_name, "namespace": namespace, "labels": dict(labels)}
        if options.annotations:
            out["annotations"] = dict(options.annotations)
        return out

    out: list[Manifest] = [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": metadata(secret_name), "stringData": {"secret": secret}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(service),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                  "selector": {LABEL_JOB: name, LABEL_ROLE: Role.SCHEDULER.value},
                  "ports": [{"name": "scheduler", "port": port, "targetPort": port,
                             "protocol": "TCP"}]}},
    ]
    server_command = (POD_COMMAND_SERVER if spec.server_command == DEFAULT_SERVER_COMMAND
                      else spec.server_command)
    roles: list[tuple[Role, int | None, str, tuple[str, ...]]] = [
        (Role.SCHEDULER, None, service, server_command)]
    roles += [(Role.SERVER, i, f"{name}-server-{i}", server_command)
              for i in range(spec.num_servers or 0)]
    roles += [(Role.WORKER, i, f"{name}-worker-{i}", spec.command)
              for i in range(spec.num_workers)]
    checkpoints = _checkpoint_volume(options, spec)
    for role, rank, pod_name, command in roles:
        env = cluster_env(spec, role, root_uri=service, port=port, secret=None, rank=rank,
                          local=(0, 1))         # a pod per worker: LOCAL_RANK 0 of 1
        env.pop(ENV_SECRET, None)  # from --env PSKV_SECRET:...: pods read it from the Secret
        env[ENV_USE_KUBERNETES] = "1"
        if checkpoints is not None:
            env.setdefault(ENV_CHECKPOINT_DIR,
                           checkpoints.container["volumeMounts"][0]["mountPath"])
        if spec.max_restarts:
            # the scheduler waits for a dead node's restart (as pskv-launch's supervisor)
            env[ENV_MAX_RESTARTS] = str(spec.max_restarts)
            env.setdefault(ENV_CONNECT_TIMEOUT, _connect_timeout(spec.max_restarts))
        pods = options.for_role(role.value)
        if checkpoints is not None and role is Role.SERVER:
            pods = pods.merge(checkpoints)
        out.append(_job(pod_name, role, rank, spec, command, env, meta, options, pods, port))
    return out


def to_yaml(manifests: list[Manifest]) -> str:
    """The manifests as one YAML stream (``---`` between documents), for kubectl apply."""
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ConfigError(f"--dry-run prints YAML and needs PyYAML. {_INSTALL}") from None
    text: str = yaml.safe_dump_all(manifests, sort_keys=False, default_flow_style=False)
    return text
