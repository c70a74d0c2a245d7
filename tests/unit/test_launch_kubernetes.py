"""The kubernetes launcher without a cluster: manifests, --dry-run, and the create path.

The manifests are checked against the official client's models (deserialized into V1Job,
V1Service, V1Secret by its ApiClient, and serialized back unchanged). The create/follow/
delete path runs against `FakeCoreV1Api`, which records every call (CoreV1Api's and
BatchV1Api's), makes each Job's pod from its template and plays a scripted sequence of pod
states; nothing opens a socket.
"""
from __future__ import annotations

import inspect
import io
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pskv._ps.config import (ENV_NODE_HOST, ENV_NUM_SERVER, ENV_NUM_WORKER, ENV_ROLE,
                             ENV_ROOT_PORT, ENV_ROOT_URI, ENV_SECRET, ENV_SERVER_ID,
                             ENV_WORKER_ID, ClusterConfig, Role)
from pskv.errors import ConfigError
from pskv.launch import LaunchSpec, main, parse_args
from pskv.launch._kubernetes import (DEFAULT_PORT, ENV_USE_KUBERNETES, POD_COMMAND_SERVER,
                                    job_manifests, run_kubernetes, to_yaml)

try:
    # imported with the module, not in a test: urllib3 probes for IPv6 with a socket on import
    from kubernetes import client as k8s_client
except ImportError:
    k8s_client = None

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pip install 'pskv[kubernetes]'")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def spec(**kw: Any) -> LaunchSpec:
    args: dict[str, Any] = dict(launcher="kubernetes", image="registry/pskv:1",
                                job_name="j", env=(("A", "1"),))
    args.update(kw)
    servers = args.pop("num_servers", 1)
    return LaunchSpec(("python", "train.py"), 2, servers, **args)


def to_model(obj: dict[str, Any], kind: str) -> Any:
    """Deserialize an API dict with the client's ApiClient (old and new signatures)."""
    if k8s_client is None:
        pytest.skip("the Kubernetes client is not installed: pip install 'pskv[kubernetes]'")
    api = k8s_client.ApiClient()
    params = inspect.signature(api.deserialize).parameters
    if "content_type" in params:
        return api.deserialize(json.dumps(obj), kind, "application/json")
    return api.deserialize(SimpleNamespace(data=json.dumps(obj)), kind)


def to_dict(model: Any) -> Any:
    if k8s_client is None:
        pytest.skip("the Kubernetes client is not installed: pip install 'pskv[kubernetes]'")
    return k8s_client.ApiClient().sanitize_for_serialization(model)


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in pod_spec(pod)["containers"][0]["env"]}


def pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a node's Job."""
    return job["spec"]["template"]["spec"]


# -- manifests --------------------------------------------------------------------------
def test_manifests_are_valid_client_objects() -> None:
    ms = job_manifests(spec(), name="j", namespace="ns", secret="sekrit")
    kinds = {"Secret": "V1Secret", "Service": "V1Service", "Job": "V1Job"}
    for m in ms:
        model = to_model(m, kinds[m["kind"]])
        assert type(model).__name__ == kinds[m["kind"]]
        assert to_dict(model) == m  # every field is one the API knows, spelled its way


def test_pods_ranks_env_and_secret() -> None:
    ms = job_manifests(spec(), name="j", namespace="ns", secret="sekrit")
    pods = [m for m in ms if m["kind"] == "Job"]
    assert [p["metadata"]["name"] for p in pods] == ["j-scheduler", "j-server-0",
                                                     "j-worker-0", "j-worker-1"]
    for pod in pods:
        env = env_of(pod)
        role = pod["metadata"]["labels"]["pskv.io/role"]
        assert env[ENV_ROLE] == role
        assert env[ENV_ROOT_URI] == "j-scheduler"          # the headless Service's name
        assert env[ENV_ROOT_PORT] == str(DEFAULT_PORT)
        assert (env[ENV_NUM_WORKER], env[ENV_NUM_SERVER]) == ("2", "1")
        assert env[ENV_USE_KUBERNETES] == "1" and env["A"] == "1"
        assert env[ENV_SECRET] == {"secretKeyRef": {"name": "j-secret", "key": "secret"}}
        assert "sekrit" not in json.dumps(pod)             # only the Secret holds it
        assert pod_spec(pod)["restartPolicy"] == "Never"
        assert pod["metadata"]["namespace"] == "ns"
        if role == "scheduler":
            assert ENV_NODE_HOST not in env
            assert pod_spec(pod)["containers"][0]["command"] == list(POD_COMMAND_SERVER)
        else:
            assert env[ENV_NODE_HOST] == {"fieldRef": {"fieldPath": "status.podIP"}}
            rank = pod["metadata"]["labels"]["pskv.io/rank"]
            assert env[ENV_WORKER_ID if role == "worker" else ENV_SERVER_ID] == rank
    assert pod_spec(pods[-1])["containers"][0]["command"] == ["python", "train.py"]
    secret = ms[0]
    assert secret["kind"] == "Secret" and secret["stringData"] == {"secret": "sekrit"}


def test_service_is_headless_and_selects_the_scheduler() -> None:
    ms = job_manifests(spec(port=9999), name="j", namespace="ns", secret="s")
    service = next(m for m in ms if m["kind"] == "Service")
    sched = next(m for m in ms if m["kind"] == "Job"
                 and m["metadata"]["labels"]["pskv.io/role"] == "scheduler")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # resolves before ready
    labels = sched["spec"]["template"]["metadata"]["labels"]   # the pod's
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    pods = [m for m in ms if m["kind"] == "Job"]
    matching = [p for p in pods if all(p["spec"]["template"]["metadata"]["labels"].get(k) == v
                                       for k, v in service["spec"]["selector"].items())]
    assert matching == [sched]
    assert service["spec"]["ports"][0]["port"] == 9999
    assert pod_spec(sched)["containers"][0]["ports"][0]["containerPort"] == 9999


def test_scheduler_env_in_a_pod_binds_all_interfaces() -> None:
    # what ClusterConfig makes of each pod's env, once Kubernetes filled in the references
    ms = job_manifests(spec(), name="j", namespace="ns", secret="s")
    for pod in (m for m in ms if m["kind"] == "Job"):
        env = {k: v for k, v in env_of(pod).items() if isinstance(v, str)}
        env[ENV_SECRET] = "s"
        if ENV_NODE_HOST in env_of(pod):
            env[ENV_NODE_HOST] = "10.1.2.3"  # status.podIP
        cfg = ClusterConfig.from_env(env)
        assert cfg.root_uri == "j-scheduler"
        assert cfg.node_host == ("0.0.0.0" if cfg.role is Role.SCHEDULER else "10.1.2.3")


# -- flags and dry run ------------------------------------------------------------------
def test_flags() -> None:
    s = parse_args(["--launcher", "kubernetes", "--image", "img", "--namespace", "ml",
                    "--job-name", "run-1", "--dry-run", "-n", "2", "python", "t.py"],
                   environ={})
    assert (s.launcher, s.image, s.namespace, s.job_name, s.dry_run) == \
        ("kubernetes", "img", "ml", "run-1", True)


@pytest.mark.parametrize("kw, match", [
    (dict(image=None), "--image"),
    (dict(job_name="Bad_Name"), "not a Kubernetes name"),
    (dict(namespace="x" * 41), "not a Kubernetes name"),
])
def test_bad_kubernetes_options(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        spec(**kw)


def test_kubernetes_options_need_the_kubernetes_launcher() -> None:
    with pytest.raises(ConfigError, match="only apply to --launcher kubernetes"):
        LaunchSpec(("x",), 1, dry_run=True)


def test_dry_run_prints_the_manifests(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--launcher", "kubernetes", "--image", "img", "--job-name", "demo",
               "--dry-run", "-n", "2", "-s", "1", "--env", "PSKV_SECRET:abc", "python",
               "train.py"])
    assert rc == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    want = job_manifests(spec(image="img", job_name="demo", env=(("PSKV_SECRET", "abc"),)),
                         name="demo", namespace="default", secret="abc")
    assert docs == want


def test_to_yaml_round_trips() -> None:
    ms = job_manifests(spec(), name="j", namespace="ns", secret="s")
    assert list(yaml.safe_load_all(to_yaml(ms))) == ms
    assert "&id" not in to_yaml(ms)   # no YAML anchors: each object reads on its own


# -- the create path, against a recorder ------------------------------------------------
def pod_state(manifest: dict[str, Any], phase: str, exit_code: int | None = None,
              node: str = "node-a") -> Any:
    status: dict[str, Any] = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [{
            "name": "pskv", "image": "img", "imageID": "", "ready": False,
            "restartCount": 0, "state": {"terminated": {"exitCode": exit_code}}}]
    return to_model({**manifest, "spec": {**manifest["spec"], "nodeName": node},
                     "status": status}, "V1Pod")


def pod_of(job: dict[str, Any]) -> dict[str, Any]:
    """The pod the Job controller makes from a Job's template (a generated name)."""
    template = job["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": job["metadata"]["name"] + "-x7k2p",
                         "namespace": job["metadata"]["namespace"]},
            "spec": template["spec"]}


class FakeCoreV1Api:
    """CoreV1Api's and BatchV1Api's surface the launcher uses; `script(pods, n)` gives the
    pods at poll n (keyed by their Job's name); `failed_jobs` are marked Failed."""

    def __init__(self, script: Any) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.script = script
        self.pods: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.failed_jobs: set[str] = set()
        self.polls = 0

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        to_model(body, "V1Secret")
        self._record("create_namespaced_secret", namespace, body["metadata"]["name"])

    def create_namespaced_service(self, namespace: str, body: dict[str, Any]) -> None:
        to_model(body, "V1Service")
        self._record("create_namespaced_service", namespace, body["metadata"]["name"])

    def create_namespaced_job(self, namespace: str, body: dict[str, Any]) -> None:
        to_model(body, "V1Job")
        self.jobs[body["metadata"]["name"]] = body
        self.pods[body["metadata"]["name"]] = pod_of(body)
        self._record("create_namespaced_job", namespace, body["metadata"]["name"])

    def list_namespaced_job(self, namespace: str, label_selector: str = "") -> Any:
        self._record("list_namespaced_job", namespace, label_selector=label_selector)
        failed = {"conditions": [{"type": "Failed", "status": "True"}]}
        return to_model({"items": [{**job, "status": failed if name in self.failed_jobs
                                    else {}} for name, job in self.jobs.items()]},
                        "V1JobList")

    def list_namespaced_pod(self, namespace: str, label_selector: str = "") -> Any:
        self._record("list_namespaced_pod", namespace, label_selector=label_selector)
        self.polls += 1
        items = self.script(self.pods, self.polls)
        return to_model({"items": [to_dict(p) for p in items]}, "V1PodList")

    def read_namespaced_pod_log(self, name: str, namespace: str) -> str:
        self._record("read_namespaced_pod_log", name, namespace)
        return f"hello from {name}\nbye\n"

    def delete_namespaced_job(self, name: str, namespace: str,
                              propagation_policy: str | None = None) -> None:
        assert propagation_policy == "Background"   # else the Job's pods stay behind
        self._record("delete_namespaced_job", name, namespace)

    def delete_namespaced_service(self, name: str, namespace: str) -> None:
        self._record("delete_namespaced_service", name, namespace)

    def delete_namespaced_secret(self, name: str, namespace: str) -> None:
        self._record("delete_namespaced_secret", name, namespace)

    def names(self, prefix: str) -> list[Any]:
        return [c[1][0] if c[0].startswith("delete") else c[1][1] for c in self.calls
                if c[0].startswith(prefix)]


def all_deleted(api: FakeCoreV1Api) -> bool:
    made = api.names("create")
    return sorted(api.names("delete")) == sorted(made) and len(made) == 6


def run(api: FakeCoreV1Api, **kw: Any) -> tuple[Any, str]:
    out = io.StringIO()
    result = run_kubernetes(spec(**kw), core=api, stdout=out, environ={},
                            poll_interval=0.0)
    return result, out.getvalue()


def test_create_follow_logs_delete() -> None:
    def script(pods: dict[str, Any], n: int) -> list[Any]:
        done = n >= 3
        return [pod_state(m, ("Succeeded" if done and "worker" in name else "Running"),
                          0 if done and "worker" in name else None)
                for name, m in pods.items()]

    api = FakeCoreV1Api(script)
    result, out = run(api, namespace="ml")
    assert result.returncode == 0 and result.reason == "ok"
    assert [c[0] for c in api.calls[:6]] == ["create_namespaced_secret",
                                              "create_namespaced_service"] + \
        ["create_namespaced_job"] * 4
    assert all(c[1][0] == "ml" for c in api.calls[:6])
    assert api.polls == 3
    assert api.calls[6][2] == {"label_selector": "pskv.io/job=j"}
    assert "[worker 1] hello from j-worker-1-x7k2p\n" in out and "[scheduler] bye\n" in out
    assert all_deleted(api)
    # pods first, the Secret last
    deletes = [c[0] for c in api.calls if c[0].startswith("delete")]
    assert deletes[-1] == "delete_namespaced_secret"
    labels = [p.label for p in result.processes]
    assert sorted(labels) == ["scheduler", "server 0", "worker 0", "worker 1"]


def test_a_failed_pod_stops_the_job_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    def script(pods: dict[str, Any], n: int) -> list[Any]:
        return [pod_state(m, "Failed", 3, node="node-7") if name == "j-worker-1"
                else pod_state(m, "Running") for name, m in pods.items()]

    api = FakeCoreV1Api(script)
    with caplog.at_level(logging.ERROR, logger="pskv.launch._kubernetes"):
        result, out = run(api)
    assert result.returncode == 3 and result.reason == "failed"
    assert result.failed is not None
    assert (result.failed.label, result.failed.host) == ("worker 1", "node-7")
    assert re.search(r"worker 1 \(pod j-worker-1-x7k2p on node-7\) failed with status 3",
                     caplog.text)
    assert "[worker 1] hello from j-worker-1-x7k2p" in out
    assert all_deleted(api)


def test_follow_is_bounded_by_timeout() -> None:
    api = FakeCoreV1Api(lambda pods, n: [pod_state(m, "Pending") for m in pods.values()])
    result, _ = run(api, timeout=0.05)
    assert result.returncode == 124 and result.reason == "timeout"
    assert all_deleted(api)


def test_a_job_deleted_from_outside_fails_the_job() -> None:
    def script(pods: dict[str, Any], n: int) -> list[Any]:
        api.jobs.pop("j-server-0", None)
        return [pod_state(m, "Running") for name, m in pods.items() if name != "j-server-0"]

    api = FakeCoreV1Api(script)
    result, _ = run(api, timeout=5)
    assert result.returncode == 1 and result.reason == "failed"
    assert all_deleted(api)


# -- the MXJob manifest in docs/kubernetes.md --------------------------------------------
def doc_yaml_blocks() -> list[Any]:
    text = DOCS.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [d for b in blocks for d in yaml.safe_load_all(b)]


def test_docs_mxjob_manifest_parses_and_runs_pskv() -> None:
    mxjobs = [d for d in doc_yaml_blocks() if d.get("kind") == "MXJob"]
    assert len(mxjobs) == 1
    job = mxjobs[0]
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["mxReplicaSpecs"]
    assert set(specs) == {"Scheduler", "Server", "Worker"}
    assert specs["Scheduler"]["replicas"] == 1
    for rtype, rspec in specs.items():
        template = to_model(rspec["template"], "V1PodTemplateSpec")
        container = template.spec.containers[0]
        # the operator finds the port by this name (Kubeflow's default: mxjob-port)
        assert any(p.name == "mxjob-port" for p in container.ports or [])
        argv = list(container.command or []) + list(container.args or [])
        if rtype == "Worker":
            assert "python" in argv[0]
        else:
            assert argv[-2:] == ["-m", "pskv.server"]
        # the variables the operator sets, as it sets them, read by pskv
        names = {e.name: e for e in container.env or []}
        assert ENV_SECRET in names and names[ENV_SECRET].value_from is not None
        env = {ENV_ROLE: rtype.lower(), ENV_ROOT_URI: f"{job['metadata']['name']}-scheduler-0",
               ENV_ROOT_PORT: "9091", ENV_NUM_SERVER: str(specs["Server"]["replicas"]),
               ENV_NUM_WORKER: str(specs["Worker"]["replicas"]), ENV_USE_KUBERNETES: "1"}
        cfg = ClusterConfig.from_env(env)
        assert cfg.node_host == "0.0.0.0"  # a name as URI: bind every interface


def test_with_replicas_a_failed_server_pod_leaves_the_job_running(
        caplog: pytest.LogCaptureFixture) -> None:
    """PSKV_REPLICAS=1 and two servers: server 1's pod fails, its backup serves its shard,
    one WARNING, and the job ends with the workers' status; without replicas it fails."""
    def script(pods: dict[str, Any], n: int) -> list[Any]:
        done = n >= 4
        return [pod_state(m, "Failed", 137) if name == "j-server-1" and n >= 2
                else pod_state(m, "Succeeded" if done and "worker" in name else "Running",
                               0 if done and "worker" in name else None)
                for name, m in pods.items()]

    api = FakeCoreV1Api(script)
    with caplog.at_level(logging.WARNING, logger="pskv.launch._kubernetes"):
        result, _ = run(api, num_servers=2, env=(("PSKV_REPLICAS", "1"),))
    assert result.returncode == 0 and result.reason == "ok", caplog.text
    assert caplog.text.count("its backup serves its shard") == 1
    assert "server 1 (pod j-server-1-x7k2p) failed with status 137" in caplog.text
    api = FakeCoreV1Api(script)
    result, _ = run(api, num_servers=2)
    assert result.returncode == 137 and result.failed is not None
    assert result.failed.label == "server 1"


# -- Jobs: pods the controller has not made yet, a Job it marked Failed -------------------
def test_a_job_whose_pod_is_not_made_yet_is_waited_for() -> None:
    """The Job controller makes the pods after create returns: no pod is no failure."""
    def script(pods: dict[str, Any], n: int) -> list[Any]:
        if n == 1:
            return []
        done = n >= 3
        return [pod_state(m, "Succeeded" if done and "worker" in name else "Running",
                          0 if done and "worker" in name else None)
                for name, m in pods.items() if n > 2 or name != "j-worker-1"]

    api = FakeCoreV1Api(script)
    result, _ = run(api)
    assert result.returncode == 0 and result.reason == "ok" and api.polls == 3
    assert all_deleted(api)


def test_a_job_the_controller_failed_fails_the_launch(caplog: pytest.LogCaptureFixture) -> None:
    """activeDeadlineSeconds or the podFailurePolicy: the Job is Failed (its pod may be
    gone), and the launch fails naming it."""
    def script(pods: dict[str, Any], n: int) -> list[Any]:
        if n >= 2:
            api.failed_jobs.add("j-server-0")
        return [pod_state(m, "Running") for name, m in pods.items() if name != "j-server-0"
                or n < 2]

    api = FakeCoreV1Api(script)
    with caplog.at_level(logging.ERROR, logger="pskv.launch._kubernetes"):
        result, _ = run(api, timeout=5)
    assert result.returncode == 1 and result.reason == "failed"
    assert "Job j-server-0 of job j failed" in caplog.text
    assert all_deleted(api)
