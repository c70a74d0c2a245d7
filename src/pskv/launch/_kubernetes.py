"""The kubernetes launcher: the job as Jobs (one pod each), a headless Service and a Secret.

``pskv-launch --launcher kubernetes --image IMAGE -n 2 -s 1 python train.py`` creates, in
the namespace (``--namespace``, else ``default``), with names prefixed by the job name
(``--job-name``, else ``pskv-`` and 8 random hex digits):

* a Secret ``NAME-secret`` holding the job secret (pods read it as ``PSKV_SECRET``);
* a headless Service ``NAME-scheduler`` that resolves to the scheduler pod, published before
  the pod is ready, so ``DMLC_PS_ROOT_URI=NAME-scheduler`` works from the first moment;
* the ``batch/v1`` Jobs ``NAME-scheduler``, ``NAME-server-I``, ``NAME-worker-I``, each
  running one pod that a ``restricted`` namespace accepts, with the cluster variables, ``DMLC_WORKER_ID``/``DMLC_SERVER_ID``, ``DMLC_USE_KUBERNETES=1`` as Kubeflow's
  MXJob sets it, (servers and workers) ``DMLC_NODE_HOST`` from the pod's IP, the address a
  server announces, and what `PodOptions` adds (resources, volumes, ...; _k8s_manifest.py).

Then it follows the Jobs' pods (bounded by ``--timeout``) until every worker has succeeded
or one pod (or Job) failed (with ``--max-restarts N``: failed again after its N-th restart by
the kubelet), prints each pod's log with the usual prefix, and deletes what it created (a
Job with its pods).
``--dry-run`` prints the manifests as YAML instead (``kubectl apply -f -`` takes them).

Uses the official client (``pip install 'pskv[kubernetes]'``: CoreV1Api, BatchV1Api),
configured from the pod's
service account inside a cluster, else from ``~/.kube/config``.
"""
from __future__ import annotations

import logging
import os
import secrets as _secrets
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from .._ps.config import Role
from ..errors import ConfigError
from ._k8s_manifest import (DEFAULT_PORT, ENV_USE_KUBERNETES, LABEL_JOB, LABEL_RANK,
                            LABEL_ROLE, POD_COMMAND_SERVER, Manifest, job_manifests,
                            restart_policy, to_yaml)
from ._env import get_secret
from ._spec import LaunchSpec, backed_up
from ._supervise import EXIT_TIMEOUT, LaunchResult, ProcessResult, exit_status

__all__ = ["DEFAULT_PORT", "ENV_USE_KUBERNETES", "KubernetesJob", "POD_COMMAND_SERVER",
           "job_manifests", "run_kubernetes", "to_yaml"]

logger = logging.getLogger(__name__)

_INSTALL = "Install the client with pip install 'pskv[kubernetes]'."


def _label(pod: Any) -> tuple[Role, int | None, str]:
    labels = pod.metadata.labels or {}
    role = Role(labels.get(LABEL_ROLE, "worker"))
    rank = labels.get(LABEL_RANK)
    the_rank = int(rank) if rank is not None else None
    label = "scheduler" if role is Role.SCHEDULER else f"{role.value} {the_rank}"
    return role, the_rank, label


def _exit_code(pod: Any) -> int | None:
    """The container's exit code once it terminated (or, waiting for its restart, the
    last run's), else None."""
    for status in pod.status.container_statuses or []:
        terminated = status.state.terminated if status.state is not None else None
        if terminated is None and status.last_state is not None \
                and status.state is not None and status.state.waiting is not None:
            terminated = status.last_state.terminated
        if terminated is not None:
            return int(terminated.exit_code)
    return None


def _restarts(pod: Any) -> int:
    return sum(int(s.restart_count or 0) for s in pod.status.container_statuses or [])


def _gave_up(pod: Any, max_restarts: int) -> bool:
    """With restartPolicy OnFailure: the run after the last allowed restart failed too
    (the kubelet would restart it again; the job's --max-restarts says no)."""
    if _restarts(pod) > max_restarts:
        return True
    code = _exit_code(pod)
    return _restarts(pod) == max_restarts and code is not None and code != 0


class KubernetesJob:
    """The objects of one job in one namespace: create, follow, print logs, delete.

    `core` is a ``kubernetes.client.CoreV1Api`` and `batch` a ``BatchV1Api`` (or anything
    with their methods: the tests pass one recorder as both; `batch` defaults to `core`).
    Invariant: `delete` removes everything `create` made, by name (a Job with its pods).
    """

    def __init__(self, core: Any, manifests: list[Manifest], namespace: str, name: str,
                 *, batch: Any = None, poll_interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, max_restarts: int = 0,
                 backed_up: bool = False) -> None:
        self.core, self.manifests, self.namespace, self.name = core, manifests, namespace, name
        self.batch = core if batch is None else batch
        #: restartPolicy OnFailure: how many restarts of each pod's container are allowed
        self.max_restarts = max_restarts
        #: PSKV_REPLICAS=1 with two servers or more: a dead server's backup serves its shard
        self.backed_up = backed_up
        self.survived: set[str] = set()  # failed server pods whose shards a backup serves
        self._seen: dict[str, int] = {}  # pod name -> restarts logged
        self.poll_interval, self.clock, self.sleep = poll_interval, clock, sleep
        self.created: list[tuple[str, str]] = []  # (kind, name), in creation order

    def create(self) -> None:
        """Create the Secret, the Service, then every node's Job."""
        calls = {"Secret": self.core.create_namespaced_secret,
                 "Service": self.core.create_namespaced_service,
                 "Job": self.batch.create_namespaced_job}
        for m in self.manifests:
            calls[m["kind"]](self.namespace, m)
            self.created.append((m["kind"], m["metadata"]["name"]))
            logger.debug("created %s %s/%s", m["kind"], self.namespace, m["metadata"]["name"])

    def _node(self, pod: Any) -> str:
        """The name of the Job (the pskv node) that `pod` runs for."""
        role, rank, _ = _label(pod)
        return f"{self.name}-{role.value}" + ("" if rank is None else f"-{rank}")

    def pods(self) -> list[Any]:
        """Each node's newest pod (a Job replaces an evicted one with a pod of another
        name), in the order listed."""
        listing = self.core.list_namespaced_pod(self.namespace,
                                                label_selector=f"{LABEL_JOB}={self.name}")
        newest: dict[str, Any] = {}
        for pod in listing.items:
            node = self._node(pod)
            old = newest.get(node)
            if old is None or _created(pod) >= _created(old):
                newest[node] = pod
        return list(newest.values())

    def failed_jobs(self) -> tuple[set[str], set[str]]:
        """The job's Jobs: those gone (deleted from outside) and those the Job controller
        marked Failed (podFailurePolicy, backoffLimit, activeDeadlineSeconds)."""
        listing = self.batch.list_namespaced_job(self.namespace,
                                                 label_selector=f"{LABEL_JOB}={self.name}")
        jobs = {j.metadata.name: j for j in listing.items}
        want = {m["metadata"]["name"] for m in self.manifests if m["kind"] == "Job"}
        failed = {n for n, j in jobs.items() if n in want and any(
            c.type == "Failed" and c.status == "True"
            for c in (j.status.conditions if j.status is not None else None) or [])}
        return want - set(jobs), failed

    def follow(self, timeout: float | None) -> tuple[str, Any | None, list[Any]]:
        """Poll until every worker succeeded ('ok'), a pod failed ('failed', the pod) or
        `timeout` passed ('timeout'); returns the reason, the failed pod and the pods."""
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            pods = self.pods()
            for pod in pods:
                if pod.metadata.name in self.survived:
                    continue
                gave_up = self.max_restarts and pod.status.phase != "Succeeded" \
                    and _gave_up(pod, self.max_restarts)
                if pod.status.phase == "Failed" or gave_up:
                    if self._taken_over(pod, pods):
                        continue
                    return "failed", pod, pods
                if self.max_restarts and pod.status.phase != "Succeeded":
                    self._log_restart(pod)
            gone, failed = self.failed_jobs()
            if gone:
                logger.error("Jobs %s of job %s are gone (deleted from outside?)",
                             ", ".join(sorted(gone)), self.name)
                return "failed", None, pods
            for node in sorted(failed):
                pod = next((p for p in pods if self._node(p) == node), None)
                if pod is not None and pod.metadata.name in self.survived:
                    continue
                if pod is None or not self._taken_over(pod, pods):
                    logger.error("Job %s of job %s failed (kubectl describe job %s says "
                                 "why)", node, self.name, node)
                    return "failed", pod, pods
            workers = [p for p in pods if _label(p)[0] is Role.WORKER]
            want = sum(1 for m in self.manifests if m["kind"] == "Job"
                       and m["metadata"]["labels"][LABEL_ROLE] == Role.WORKER.value)
            if len(workers) == want and all(p.status.phase == "Succeeded" for p in workers):
                return "ok", None, pods
            if deadline is not None and self.clock() >= deadline:
                return "timeout", None, pods
            self.sleep(self.poll_interval)

    def _taken_over(self, pod: Any, pods: list[Any]) -> bool:
        """Whether the job goes on without the failed `pod`: a server, with backups on,
        while another server pod runs to serve its shard (as the local launcher)."""
        if not self.backed_up or _label(pod)[0] is not Role.SERVER:
            return False
        servers = [p for p in pods if _label(p)[0] is Role.SERVER]
        alive = [p for p in servers if p is not pod and p.metadata.name not in self.survived
                 and p.status.phase not in ("Failed", "Succeeded")]
        if not alive:
            return False
        self.survived.add(pod.metadata.name)
        logger.warning("%s (pod %s) failed with status %s; its backup serves its shard "
                       "(PSKV_REPLICAS=1), so the job goes on with %d of %d servers",
                       _label(pod)[2], pod.metadata.name, _exit_code(pod), len(alive),
                       len(servers))
        return True

    def _log_restart(self, pod: Any) -> None:
        count = _restarts(pod)
        if count > self._seen.get(pod.metadata.name, 0):
            self._seen[pod.metadata.name] = count
            logger.warning("%s (pod %s) failed; Kubernetes restarted it (%d of %d)",
                           _label(pod)[2], pod.metadata.name, count, self.max_restarts)

    def print_logs(self, pods: list[Any], stdout: TextIO) -> None:
        """Each pod's log, every line prefixed ``[worker 1] `` (scheduler first)."""
        order = {Role.SCHEDULER: 0, Role.SERVER: 1, Role.WORKER: 2}
        for pod in sorted(pods, key=lambda p: (order[_label(p)[0]], _label(p)[1] or 0)):
            label = _label(pod)[2]
            try:
                text = self.core.read_namespaced_pod_log(pod.metadata.name, self.namespace)
            except Exception as err:  # the API's errors are many; a log is best effort
                logger.warning("cannot read the log of pod %s (%s): %s", pod.metadata.name,
                               label, err)
                continue
            for line in str(text or "").splitlines():
                stdout.write(f"[{label}] {line}\n")
        stdout.flush()

    def delete(self) -> None:
        """Delete what `create` made, Jobs first; a failure is logged, never raised."""
        calls = {"Secret": self.core.delete_namespaced_secret,
                 "Service": self.core.delete_namespaced_service,
                 # batch/v1 would orphan a Job's pods by default: delete them with it
                 "Job": lambda n, ns: self.batch.delete_namespaced_job(
                     n, ns, propagation_policy="Background")}
        for kind, name in reversed(self.created):
            try:
                calls[kind](name, self.namespace)
            except Exception as err:  # keep deleting the rest
                logger.warning("cannot delete %s %s/%s: %s. Delete it with kubectl delete "
                               "%s -l %s=%s.", kind, self.namespace, name, err, kind.lower(),
                               LABEL_JOB, self.name)
        self.created.clear()

    def result(self, reason: str, failed: Any | None, pods: list[Any]) -> LaunchResult:
        """The job's LaunchResult from the pods' last state."""
        results = []
        failed_result = None
        for pod in pods:
            role, rank, label = _label(pod)
            code = _exit_code(pod)
            killed = code is None
            pr = ProcessResult(role, rank, 0, 0 if code is None else code, killed, label,
                               pod.spec.node_name if pod.spec is not None else None)
            results.append(pr)
            if failed is not None and pod.metadata.name == failed.metadata.name:
                failed_result = pr
        if reason == "ok":
            return LaunchResult(0, tuple(results))
        if reason == "timeout":
            return LaunchResult(EXIT_TIMEOUT, tuple(results), None, "timeout")
        code = 1 if failed_result is None else (exit_status(failed_result.returncode) or 1)
        return LaunchResult(code, tuple(results), failed_result, "failed")


def _created(pod: Any) -> float:
    stamp = pod.metadata.creation_timestamp
    return stamp.timestamp() if hasattr(stamp, "timestamp") else 0.0


def _apis() -> tuple[Any, Any]:
    """CoreV1Api and BatchV1Api from the in-cluster service account, else the kubeconfig."""
    try:
        from kubernetes import client
        from kubernetes import config as config_module
    except ImportError:
        raise ConfigError(f"--launcher kubernetes needs the Kubernetes client. {_INSTALL}") \
            from None
    config: Any = config_module  # untyped
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as err:
            raise ConfigError(f"cannot configure the Kubernetes client: {err}. Run inside "
                              "a pod with a service account, or set KUBECONFIG / "
                              "~/.kube/config (kubectl get pods must work).") from err
    return client.CoreV1Api(), client.BatchV1Api()


def run_kubernetes(spec: LaunchSpec, *, core: Any = None, stdout: TextIO | None = None,
                   stderr: TextIO | None = None, environ: Mapping[str, str] | None = None,
                   poll_interval: float = 2.0) -> LaunchResult:
    """Create the job's objects, follow them, print the logs, delete them (see module doc).

    With ``spec.dry_run`` only prints the manifests as YAML to `stdout`. `core` replaces
    the CoreV1Api and BatchV1Api made from the cluster's configuration (the tests pass
    one recorder for both).
    """
    out = sys.stdout if stdout is None else stdout
    env = os.environ if environ is None else environ
    name = spec.job_name or f"pskv-{_secrets.token_hex(4)}"
    namespace = spec.namespace or "default"
    manifests = job_manifests(spec, name=name, namespace=namespace,
                              secret=get_secret(spec, env))
    if spec.dry_run:
        out.write(to_yaml(manifests))
        out.flush()
        return LaunchResult(0, ())
    core, batch = _apis() if core is None else (core, core)
    job = KubernetesJob(core, manifests, namespace, name, batch=batch,
                        poll_interval=poll_interval,
                        max_restarts=spec.max_restarts
                        if restart_policy(spec) == "OnFailure" else 0,
                        backed_up=backed_up(spec, {}))
    logger.info("creating job %s in namespace %s: %d Jobs", name, namespace,
                len(manifests) - 2)
    pods: list[Any] = []
    try:
        job.create()
        reason, failed, pods = job.follow(spec.timeout)
        if reason == "failed" and failed is not None:
            role, rank, label = _label(failed)
            code = _exit_code(failed)
            restarts = _restarts(failed)
            logger.error("%s (pod %s on %s) failed with status %s%s; stopping the others",
                         label, failed.metadata.name,
                         failed.spec.node_name if failed.spec is not None else "?",
                         "unknown" if code is None else exit_status(code),
                         f" after {restarts} restart{'s'[:restarts != 1]} (--max-restarts "
                         f"{spec.max_restarts})" if restarts else "")
        elif reason == "timeout":
            logger.error("timed out after %.3g s; deleting job %s", spec.timeout or 0, name)
        job.print_logs(pods, out)
        return job.result(reason, failed, pods)
    except KeyboardInterrupt:
        logger.warning("got SIGINT; deleting job %s", name)
        return LaunchResult(130, (), None, "signal")
    finally:
        job.delete()
