"""The kubernetes launcher's pod settings: every flag, the values file, precedence, bad input.

The manifests they produce are checked against the Kubernetes API's models in
test_k8s_schema.py; here each setting is followed from the command line (or the file) to
the field of the pod it lands in.
"""
from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from pskv._ps.config import ENV_CHECKPOINT_DIR
from pskv.errors import ConfigError
from pskv.launch import LaunchSpec, launch, parse_args
from pskv.launch._k8s_options import CHECKPOINT_MOUNT, PodOptions, pod_options
from pskv.launch._kubernetes import job_manifests, run_kubernetes

from _k8s_client import needs_client

BASE = ["--launcher", "kubernetes", "--image", "img", "--job-name", "j", "-n", "2", "-s", "1"]


def manifests(*flags: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The job's pods by name, its Secret and Service by kind, from pskv-launch's flags."""
    spec = parse_args([*BASE, *flags, "python", "train.py"], environ=env or {})
    ms = job_manifests(spec, name="j", namespace="ns", secret="s")
    return {m["metadata"]["name"] if m["kind"] == "Job" else m["kind"]: m for m in ms}


def pod(ms: dict[str, Any], name: str) -> dict[str, Any]:
    """The pod spec of node `name`'s Job."""
    return ms[name]["spec"]["template"]["spec"]


def container(ms: dict[str, Any], name: str) -> dict[str, Any]:
    return pod(ms, name)["containers"][0]


def env_of(ms: dict[str, Any], name: str) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container(ms, name)["env"]}


PODS = ("j-scheduler", "j-server-0", "j-worker-0", "j-worker-1")


# -- each flag, and where it lands -------------------------------------------------------
def test_without_settings_the_pods_get_only_the_defaults() -> None:
    ms = manifests()
    for name in PODS:
        assert set(pod(ms, name)) == {"restartPolicy", "enableServiceLinks", "containers",
                                      "automountServiceAccountToken", "securityContext"}
        assert pod(ms, name)["restartPolicy"] == "Never"
        assert set(container(ms, name)) <= {"name", "image", "command", "env", "ports",
                                            "resources", "securityContext", "startupProbe",
                                            "readinessProbe", "livenessProbe"}
    assert parse_args([*BASE, "x"], environ={}).pods is None


@needs_client
def test_requests_and_limits_per_role() -> None:
    ms = manifests("--requests", "cpu=1,memory=2Gi", "--requests", "worker:cpu=4",
                   "--limits", "worker:nvidia.com/gpu=1,memory=16Gi")
    assert container(ms, "j-worker-1")["resources"] == {
        "requests": {"cpu": "4", "memory": "2Gi"},
        "limits": {"nvidia.com/gpu": "1", "memory": "16Gi"}}
    # a default limit is left out for a resource given a request (it could be below it)
    assert container(ms, "j-server-0")["resources"] == {"requests": {"cpu": "1",
                                                                     "memory": "2Gi"}}
    assert container(ms, "j-scheduler")["resources"] == {"requests": {"cpu": "1",
                                                                      "memory": "2Gi"}}


@needs_client
def test_node_selector_and_tolerations() -> None:
    ms = manifests("--node-selector", "pool=train", "--node-selector",
                   "worker:nvidia.com/gpu.present=true", "--toleration",
                   "dedicated=ml:NoSchedule", "--toleration", "server:spot:NoExecute",
                   "--toleration", "gpu")
    assert pod(ms, "j-worker-0")["nodeSelector"] == {"pool": "train",
                                                     "nvidia.com/gpu.present": "true"}
    assert pod(ms, "j-server-0")["nodeSelector"] == {"pool": "train"}
    every = [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
             {"key": "gpu", "operator": "Exists"}]
    assert pod(ms, "j-worker-0")["tolerations"] == every
    assert pod(ms, "j-server-0")["tolerations"] == every + [
        {"key": "spot", "operator": "Exists", "effect": "NoExecute"}]


@needs_client
def test_service_account_pull_secrets_labels_annotations() -> None:
    ms = manifests("--service-account", "trainer", "--image-pull-secret", "regcred",
                   "--image-pull-secret", "mirror", "--label", "team=ml", "--label",
                   "worker:tier=gpu", "--annotation", "example.com/owner=alice",
                   "--annotation", "server:note=keeps the model")
    for name in PODS:
        assert pod(ms, name)["serviceAccountName"] == "trainer"
        assert pod(ms, name)["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    for name in ("Secret", "Service", *PODS):  # every object: the Secret, the Service
        assert ms[name]["metadata"]["labels"]["team"] == "ml"
        assert ms[name]["metadata"]["annotations"]["example.com/owner"] == "alice"
        assert ms[name]["metadata"]["labels"]["pskv.io/job"] == "j"
    assert ms["j-worker-1"]["metadata"]["labels"]["tier"] == "gpu"
    assert "tier" not in ms["j-server-0"]["metadata"]["labels"]
    assert ms["j-server-0"]["metadata"]["annotations"]["note"] == "keeps the model"
    # the Service still selects the scheduler pod alone
    sel = ms["Service"]["spec"]["selector"]
    matching = [n for n in PODS if all(ms[n]["metadata"]["labels"].get(k) == v
                                       for k, v in sel.items())]
    assert matching == ["j-scheduler"]


@needs_client
def test_claims_mount_existing_claims() -> None:
    ms = manifests("--claim", "datasets:/data:ro", "--claim", "worker:scratch:/scratch")
    mounts = container(ms, "j-worker-0")["volumeMounts"]
    assert mounts == [{"name": "datasets", "mountPath": "/data", "readOnly": True},
                      {"name": "scratch", "mountPath": "/scratch"}]
    assert pod(ms, "j-worker-0")["volumes"] == [
        {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}},
        {"name": "scratch", "persistentVolumeClaim": {"claimName": "scratch"}}]
    assert [v["name"] for v in pod(ms, "j-server-0")["volumes"]] == ["datasets"]


@needs_client
def test_checkpoint_claim_is_mounted_on_the_servers_at_the_checkpoint_dir() -> None:
    ms = manifests("--checkpoint-claim", "pskv-ckpt")
    server = container(ms, "j-server-0")
    assert server["volumeMounts"] == [{"name": "pskv-checkpoints",
                                       "mountPath": CHECKPOINT_MOUNT}]
    assert pod(ms, "j-server-0")["volumes"] == [
        {"name": "pskv-checkpoints", "persistentVolumeClaim": {"claimName": "pskv-ckpt"}}]
    for name in PODS:  # every process reads the same setting
        assert env_of(ms, name)[ENV_CHECKPOINT_DIR] == CHECKPOINT_MOUNT
    assert "volumes" not in pod(ms, "j-worker-0")
    ms = manifests("--checkpoint-claim", "pskv-ckpt", "--env", "PSKV_CHECKPOINT_DIR:/ckpt")
    assert container(ms, "j-server-0")["volumeMounts"][0]["mountPath"] == "/ckpt"
    assert env_of(ms, "j-worker-0")[ENV_CHECKPOINT_DIR] == "/ckpt"


@needs_client
def test_restart_policy_flag() -> None:
    spec = parse_args([*BASE, "--restart-policy", "Never", "x"], environ={})
    assert spec.pods is not None and spec.pods.restart_policy == "Never"
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_args([*BASE, "--restart-policy", "Always", "x"], environ={})


# -- the values file ---------------------------------------------------------------------
VALUES = {
    "serviceAccountName": "trainer",
    "imagePullSecrets": ["regcred", {"name": "mirror"}],
    "labels": {"team": "ml"},
    "annotations": {"example.com/owner": "alice"},
    "checkpointClaim": "pskv-ckpt",
    "pods": {"resources": {"requests": {"cpu": 1, "memory": "2Gi"}},
             "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                              "effect": "NoSchedule"}]},
    "worker": {"resources": {"requests": {"cpu": 0.5}, "limits": {"nvidia.com/gpu": 1}},
               "nodeSelector": {"pool": "gpu"},
               "volumes": [{"name": "data", "claim": "datasets", "mountPath": "/data",
                            "readOnly": True},
                           {"name": "tmp", "emptyDir": True, "mountPath": "/tmp/x"}],
               "labels": {"tier": "gpu"}},
    "server": {"volumes": [{"name": "cfg", "configMap": "train-config",
                            "mountPath": "/etc/train"}]},
}


@needs_client
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_values_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"values{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(VALUES))
    else:
        yaml = pytest.importorskip("yaml", reason="PyYAML: pip install 'pskv[kubernetes]'")
        path.write_text(yaml.safe_dump(VALUES))
    ms = manifests("--values", str(path))
    worker, server = container(ms, "j-worker-0"), container(ms, "j-server-0")
    assert worker["resources"] == {"requests": {"cpu": "0.5", "memory": "2Gi"},
                                   "limits": {"nvidia.com/gpu": "1"}}
    assert server["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert pod(ms, "j-worker-0")["nodeSelector"] == {"pool": "gpu"}
    assert pod(ms, "j-worker-0")["imagePullSecrets"] == [{"name": "regcred"},
                                                         {"name": "mirror"}]
    assert [v["name"] for v in pod(ms, "j-worker-0")["volumes"]] == ["data", "tmp"]
    assert pod(ms, "j-worker-0")["volumes"][1] == {"name": "tmp", "emptyDir": {}}
    assert [v["name"] for v in pod(ms, "j-server-0")["volumes"]] == ["cfg",
                                                                     "pskv-checkpoints"]
    assert ms["Secret"]["metadata"]["labels"]["team"] == "ml"
    assert ms["j-worker-0"]["metadata"]["labels"]["tier"] == "gpu"
    assert pod(ms, "j-scheduler")["serviceAccountName"] == "trainer"


@needs_client
def test_flags_override_the_values_file(tmp_path: Path) -> None:
    path = tmp_path / "v.json"
    path.write_text(json.dumps({
        "serviceAccountName": "from-file", "labels": {"team": "file", "keep": "yes"},
        "pods": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        "worker": {"resources": {"requests": {"cpu": "8"}},
                   "volumes": [{"name": "data", "claim": "old", "mountPath": "/data"}]}}))
    ms = manifests("--values", str(path), "--service-account", "from-flag", "--label",
                   "team=flag", "--requests", "cpu=2", "--claim", "worker:data:/data")
    assert pod(ms, "j-worker-0")["serviceAccountName"] == "from-flag"
    assert ms["j-worker-0"]["metadata"]["labels"]["team"] == "flag"
    assert ms["j-worker-0"]["metadata"]["labels"]["keep"] == "yes"   # maps merge
    # every flag beats the file, even the file's worker section
    assert container(ms, "j-worker-0")["resources"]["requests"] == {"cpu": "2",
                                                                    "memory": "1Gi"}
    # a volume of the same name is replaced
    assert pod(ms, "j-worker-0")["volumes"] == [
        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]


@needs_client
def test_a_role_flag_beats_an_every_pod_flag_in_any_order() -> None:
    ms = manifests("--requests", "worker:cpu=4", "--requests", "cpu=1")
    assert container(ms, "j-worker-0")["resources"]["requests"]["cpu"] == "4"
    assert container(ms, "j-server-0")["resources"]["requests"]["cpu"] == "1"


@needs_client
def test_launch_takes_the_values_as_a_mapping() -> None:
    opts = pod_options(values={"worker": {"nodeSelector": {"pool": "gpu"}}})
    assert opts is not None and opts.for_role("worker").pod == {"nodeSelector": {"pool": "gpu"}}
    assert opts.for_role("server").pod == {}
    assert "kubernetes_values" in launch.__code__.co_varnames


@needs_client
def test_a_section_is_a_pod_spec_patch(tmp_path: Path) -> None:
    """Any PodSpec field passes through to that role's pods (docs: "A raw pod spec")."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}}
    path = tmp_path / "v.json"
    path.write_text(json.dumps({
        "pods": {"priorityClassName": "batch", "terminationGracePeriodSeconds": 60},
        "worker": {"affinity": affinity, "nodeSelector": {"pool": "gpu"},
                   "serviceAccountName": "from-file",
                   "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"},
                                "mountPath": "/dev/shm"},
                               {"name": "nfs", "nfs": {"server": "fs", "path": "/x"},
                                "mountPath": "/nfs", "readOnly": True}]}}))
    ms = manifests("--values", str(path), "--node-selector", "worker:disk=ssd",
                   "--service-account", "from-flag")
    worker, server = pod(ms, "j-worker-0"), pod(ms, "j-server-0")
    assert worker["affinity"] == affinity and "affinity" not in server
    assert worker["priorityClassName"] == server["priorityClassName"] == "batch"
    assert worker["terminationGracePeriodSeconds"] == 60
    assert worker["nodeSelector"] == {"pool": "gpu", "disk": "ssd"}   # a flag merges in
    assert worker["serviceAccountName"] == "from-flag"                 # and wins
    assert worker["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory"}},
                                 {"name": "nfs", "nfs": {"server": "fs", "path": "/x"}}]
    assert container(ms, "j-worker-0")["volumeMounts"] == [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "nfs", "mountPath": "/nfs", "readOnly": True}]
    # the launcher's own fields stay
    assert worker["restartPolicy"] == "Never" and worker["containers"][0]["name"] == "pskv"


def test_without_the_client_pod_settings_say_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod settings are checked by the client's models: without it, a ConfigError saying
    what to install; a job without pod settings still makes its manifests (--dry-run)."""
    monkeypatch.setitem(__import__("sys").modules, "kubernetes", None)   # import fails
    with pytest.raises(ConfigError, match=r"pip install 'pskv\[kubernetes\]'"):
        manifests("--requests", "worker:cpu=4")
    with pytest.raises(ConfigError, match=r"pip install 'pskv\[kubernetes\]'"):
        pod_options(values={"worker": {"nodeSelector": {"pool": "gpu"}}})
    ms = manifests()
    assert container(ms, "j-worker-0")["resources"]["requests"] == {"cpu": "1",
                                                                    "memory": "1Gi"}
    yaml = pytest.importorskip("yaml", reason="--dry-run prints YAML: PyYAML")
    out = io.StringIO()
    spec = parse_args([*BASE, "--dry-run", "python", "train.py"], environ={})
    assert run_kubernetes(spec, stdout=out, environ={"PSKV_SECRET": "s"}).returncode == 0
    printed = list(yaml.safe_load_all(out.getvalue()))
    assert [m["kind"] for m in printed] == ["Secret", "Service"] + ["Job"] * 4


def test_empty_values_file_is_no_settings(tmp_path: Path) -> None:
    path = tmp_path / "v.yaml"
    path.write_text("# nothing yet\n")
    pytest.importorskip("yaml", reason="PyYAML: pip install 'pskv[kubernetes]'")
    assert parse_args([*BASE, "--values", str(path), "x"], environ={}).pods is None


# -- bad input: a ConfigError naming the field and what to do ---------------------------
# What the client's models of the API schema catch (unknown fields, wrong types, missing
# required fields) and what pskv itself keeps (its own keys, reserved labels, restartPolicy,
# the restricted level); names and quantities are the API server's to check.
@pytest.mark.parametrize("values, match", [
    ({"worker": {"nodeselector": {"pool": "gpu"}}},
     r"worker\.nodeselector is not a field of the Kubernetes PodSpec.*did you mean "
     r"'nodeSelector'"),
    ({"pods": {"tolerations": [{"key": "a", "efect": "NoSchedule"}]}},
     r"pods\.tolerations\[0\]\.efect is not a field of the Kubernetes Toleration.*did you "
     r"mean 'effect'"),
    ({"server": {"affinity": {"nodeAfinity": {}}}},
     r"server\.affinity\.nodeAfinity .* did you mean 'nodeAffinity'"),
    ({"pods": {"resources": {"request": {}}}}, r"pods\.resources\.request .*did you mean "
                                              r"'requests'"),
    ({"serviceAcountName": "x"}, r"serviceAcountName is not a setting .* did you mean "
                                 r"'serviceAccountName'"),
    ({"pods": {"resources": {"requests": {"cpu": True}}}},
     r"pods\.resources\.requests\.cpu=True must be a string"),
    ({"pods": {"resources": {"requests": {"cpu": [1]}}}}, r"requests\.cpu=\[1\] must be a string"),
    ({"pods": {"tolerations": {"key": "a"}}}, r"pods\.tolerations must be a list"),
    ({"pods": {"tolerations": [{"key": "a", "tolerationSeconds": "5"}]}},
     r"tolerationSeconds='5' must be an integer"),
    ({"worker": {"nodeSelector": ["pool=gpu"]}}, r"worker\.nodeSelector must be a mapping"),
    ({"pods": {"hostNetwork": "yes"}}, r"pods\.hostNetwork='yes' must be true or false"),
    ({"pods": []}, r"pods must be a mapping"),
    ({"pods": {"volumes": [{"name": "d", "claim": "c"}]}},
     r"pods\.volumes\[0\].*mount_?[pP]ath"),
    ({"pods": {"volumes": [{"claim": "c", "mountPath": "/d"}]}},
     r"pods\.volumes\[0\].*name"),
    ({"restartPolicy": "Always"}, r"restartPolicy='Always': use Never or OnFailure"),
    ({"worker": {"restartPolicy": "Never"}}, r"worker\.restartPolicy: the launcher sets it"),
    ({"worker": {"containers": []}}, r"worker\.containers: the launcher sets it"),
    ({"labels": {"pskv.io/job": "x"}}, r"sets the label pskv\.io/job itself"),
    ({"worker": {"labels": {"app.kubernetes.io/name": "x"}}},
     r"sets the label app\.kubernetes\.io/name itself"),
    ({"labels": {"team": True}}, r"labels\.team=True must be a string.*[Qq]uote"),
])
@needs_client
def test_bad_values(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PodOptions.from_values(values)


@pytest.mark.parametrize("values, match", [
    ({"containerSecurityContext": {"privileged": True}}, r"privileged"),
    ({"worker": {"containerSecurityContext": {"allowPrivilegeEscalation": True}}},
     r"the worker pods.*allowPrivilegeEscalation.*restricted"),
    ({"securityContext": {"runAsUser": 0}}, r"runAsUser.*0"),
    ({"securityContext": {"runAsNonRoot": False}}, r"runAsNonRoot"),
    ({"containerSecurityContext": {"runAsNonRoot": False}}, r"runAsNonRoot is not true"),
    ({"containerSecurityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}, r"SYS_ADMIN"),
    ({"server": {"hostNetwork": True}}, r"the server pods.*hostNetwork"),
    ({"pods": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
     r"Unconfined"),
])
@needs_client
def test_settings_that_break_the_restricted_level_are_refused(
        tmp_path: Path, values: dict[str, Any], match: str) -> None:
    path = tmp_path / "v.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError, match=match):
        manifests("--values", str(path))


@needs_client
def test_names_and_quantities_are_left_to_the_api_server() -> None:
    """The client's models have no patterns: a bad quantity or name reaches the manifest
    as written (the API server refuses it at create; --dry-run shows it)."""
    ms = manifests("--requests", "cpu=abc", "--service-account", "Not_OK")
    assert container(ms, "j-worker-0")["resources"]["requests"]["cpu"] == "abc"
    assert pod(ms, "j-worker-0")["serviceAccountName"] == "Not_OK"


@pytest.mark.parametrize("flags, match", [
    (["--limits", "worker:memory"], r"--limits 'memory': write \[ROLE:\]KEY=VALUE"),
    (["--toleration", "=x:NoSchedule"], r"has no key"),
    (["--label", "team"], r"--label 'team': write \[ROLE:\]KEY=VALUE"),
    (["--label", "pskv.io/role=x"], r"sets the label pskv\.io/role itself"),
    (["--node-selector", "pool"], r"--node-selector 'pool': write"),
    (["--claim", "only-a-claim"], r"--claim 'only-a-claim': write CLAIM:MOUNTPATH"),
    (["--claim", "c:/d:rx"], r"CLAIM:MOUNTPATH:ro"),
    (["--claim", "c:/d", "--claim", "e:/d"], r"two volumes at /d"),
    (["--checkpoint-claim", "c", "--env", "PSKV_CHECKPOINT_DIR:rel"],
     r"PSKV_CHECKPOINT_DIR='rel': with --checkpoint-claim .* an absolute path"),
])
@needs_client
def test_bad_flags(flags: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        manifests(*flags)


@needs_client
def test_bad_values_file(tmp_path: Path) -> None:
    bad = tmp_path / "v.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"--values .*v\.json is not valid JSON"):
        parse_args([*BASE, "--values", str(bad), "x"], environ={})
    with pytest.raises(ConfigError, match=r"--values .*missing\.yaml: cannot read it"):
        parse_args([*BASE, "--values", str(tmp_path / "missing.yaml"), "x"], environ={})
    listing = tmp_path / "l.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a mapping of settings, not list"):
        parse_args([*BASE, "--values", str(listing), "x"], environ={})
    typo = tmp_path / "t.json"
    typo.write_text(json.dumps({"worker": {"resources": {"limits": {"cpu": False}}}}))
    with pytest.raises(ConfigError, match=r"--values .*t\.json: worker\.resources\.limits\."
                                          r"cpu=False"):
        parse_args([*BASE, "--values", str(typo), "x"], environ={})


@needs_client
def test_pod_settings_need_the_kubernetes_launcher() -> None:
    with pytest.raises(ConfigError, match="only apply to --launcher kubernetes"):
        parse_args(["-n", "1", "--requests", "cpu=1", "x"], environ={})
    with pytest.raises(ConfigError, match="only apply to --launcher kubernetes"):
        LaunchSpec(("x",), 1, pods=PodOptions(service_account="a"))


# -- docs/kubernetes.md's examples are what the launcher does ----------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def _doc_block(first_line: str) -> str:
    blocks = re.findall(r"```(?:yaml|bash)\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    found = [b for b in blocks if first_line in b]
    assert len(found) == 1, first_line
    return str(found[0])


@needs_client
def test_docs_pod_settings_examples_are_true(tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="PyYAML: pip install 'pskv[kubernetes]'")
    values = tmp_path / "pods.yaml"
    values.write_text(_doc_block("# pods.yaml: the same fields, by role"))
    command = shlex.split(_doc_block("--values pods.yaml").replace("\\\n", " "))
    assert command[0] == "pskv-launch"
    spec = parse_args([str(values) if a == "pods.yaml" else a for a in command[1:]],
                      environ={})
    ms = {m["metadata"]["name"]: m for m in job_manifests(spec, name="j", namespace="ns",
                                                          secret="s")}
    worker, server = (ms[n]["spec"]["template"]["spec"] for n in ("j-worker-0", "j-server-0"))
    assert worker["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "1"}}
    assert worker["nodeSelector"] == {"pool": "train"} and worker["restartPolicy"] == "OnFailure"
    assert worker["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                      "effect": "NoSchedule"}]
    assert [v["name"] for v in worker["volumes"]] == ["scratch", "data", "pskv-run"]
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in \
        worker["containers"][0]["volumeMounts"]
    assert [v["name"] for v in server["volumes"]] == ["scratch", "pskv-checkpoints", "pskv-run"]
    assert ms["j-worker-0"]["metadata"]["annotations"] == {"owner": "alice"}
    more = tmp_path / "more.yaml"
    more.write_text(_doc_block("# more.yaml"))
    ms = manifests("--values", str(more))
    assert pod(ms, "j-worker-0")["affinity"]["nodeAffinity"]
    assert "affinity" not in pod(ms, "j-server-0")
    assert {pod(ms, n)["priorityClassName"] for n in PODS} == {"batch"}
