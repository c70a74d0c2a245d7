"""The kubernetes launcher's pod settings: every flag, the values file, precedence, bad input.

The manifests they produce are checked against the Kubernetes API's models in
test_k8s_schema.py; here each setting is followed from the command line (or the file) to
the field of the pod it lands in.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pskv._ps.config import ENV_CHECKPOINT_DIR
from pskv.errors import ConfigError
from pskv.launch import LaunchSpec, launch, parse_args
from pskv.launch._k8s_options import CHECKPOINT_MOUNT, PodOptions, pod_options
from pskv.launch._kubernetes import job_manifests

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


def test_claims_mount_existing_claims() -> None:
    ms = manifests("--claim", "datasets:/data:ro", "--claim", "worker:scratch:/scratch")
    mounts = container(ms, "j-worker-0")["volumeMounts"]
    assert mounts == [{"name": "datasets", "mountPath": "/data", "readOnly": True},
                      {"name": "scratch", "mountPath": "/scratch"}]
    assert pod(ms, "j-worker-0")["volumes"] == [
        {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}},
        {"name": "scratch", "persistentVolumeClaim": {"claimName": "scratch"}}]
    assert [v["name"] for v in pod(ms, "j-server-0")["volumes"]] == ["datasets"]


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


def test_a_role_flag_beats_an_every_pod_flag_in_any_order() -> None:
    ms = manifests("--requests", "worker:cpu=4", "--requests", "cpu=1")
    assert container(ms, "j-worker-0")["resources"]["requests"]["cpu"] == "4"
    assert container(ms, "j-server-0")["resources"]["requests"]["cpu"] == "1"


def test_launch_takes_the_values_as_a_mapping() -> None:
    opts = pod_options(values={"worker": {"nodeSelector": {"pool": "gpu"}}})
    assert opts is not None and opts.for_role("worker").node_selector == (("pool", "gpu"),)
    assert opts.for_role("server").node_selector == ()
    assert "kubernetes_values" in launch.__code__.co_varnames


def test_empty_values_file_is_no_settings(tmp_path: Path) -> None:
    path = tmp_path / "v.yaml"
    path.write_text("# nothing yet\n")
    pytest.importorskip("yaml", reason="PyYAML: pip install 'pskv[kubernetes]'")
    assert parse_args([*BASE, "--values", str(path), "x"], environ={}).pods is None


# -- bad input: a ConfigError naming the field and what to do ---------------------------
@pytest.mark.parametrize("values, match", [
    ({"pods": {"resources": {"requests": {"cpu": "abc"}}}},
     r"pods\.resources\.requests\.cpu='abc' is not a Kubernetes quantity.*500m"),
    ({"worker": {"resources": {"limits": {"memory": "-1Gi"}}}},
     r"worker\.resources\.limits\.memory='-1Gi' is not a Kubernetes quantity"),
    ({"pods": {"resources": {"requests": {"cpu": True}}}}, r"cpu=True is not a quantity"),
    ({"server": {"tolerations": [{"value": "x"}]}},
     r"server\.tolerations\[0\] has no key: give key .* or operator: Exists"),
    ({"pods": {"tolerations": [{"key": "a", "operator": "Maybe"}]}},
     r"tolerations\[0\]\.operator='Maybe': use Equal .* or Exists"),
    ({"pods": {"tolerations": [{"key": "a", "operator": "Exists", "value": "v"}]}},
     r"operator Exists takes no value"),
    ({"pods": {"tolerations": [{"key": "a", "effect": "NoRun"}]}}, r"effect='NoRun'"),
    ({"pods": {"tolerations": [{"key": "a", "tolerationSeconds": 5}]}},
     r"tolerationSeconds needs effect: NoExecute"),
    ({"restartPolicy": "Always"}, r"restartPolicy='Always': use Never or OnFailure"),
    ({"serviceAcountName": "x"}, r"serviceAcountName is not a setting .* did you mean "
                                 r"'serviceAccountName'"),
    ({"worker": {"nodeselector": {}}}, r"worker\.nodeselector .* did you mean 'nodeSelector'"),
    ({"pods": {"resources": {"request": {}}}}, r"did you mean 'requests'"),
    ({"labels": {"pskv.io/job": "x"}}, r"sets the label pskv\.io/job itself"),
    ({"labels": {"team": "has space"}}, r"labels\.team='has space' is not a label value"),
    ({"labels": {"bad key!": "x"}}, r"'bad key!' is not a Kubernetes key"),
    ({"pods": {"nodeSelector": {"pool": "a b"}}}, r"nodeSelector\.pool='a b'"),
    ({"pods": {"volumes": [{"claim": "c", "mountPath": "/d"}]}}, r"volumes\[0\] has no name"),
    ({"pods": {"volumes": [{"name": "d", "mountPath": "/d"}]}},
     r"needs exactly one source of claim, emptyDir"),
    ({"pods": {"volumes": [{"name": "d", "claim": "c", "hostPath": "/x",
                            "mountPath": "/d"}]}}, r"not claim, hostPath"),
    ({"pods": {"volumes": [{"name": "d", "claim": "c"}]}}, r"has no mountPath"),
    ({"pods": {"volumes": [{"name": "d", "claim": "c", "mountPath": "rel"}]}},
     r"mountPath='rel' must be an absolute path"),
    ({"pods": {"volumes": [{"name": "Bad_Name", "claim": "c", "mountPath": "/d"}]}},
     r"'Bad_Name' is not a volume name"),
    ({"pods": {"tolerations": {"key": "a"}}}, r"pods\.tolerations must be a list"),
    ({"pods": []}, r"pods must be a mapping"),
    ({"imagePullSecrets": ["UPPER"]}, r"imagePullSecrets\[0\]='UPPER' is not a Secret name"),
])
def test_bad_values(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PodOptions.from_values(values)


@pytest.mark.parametrize("flags, match", [
    (["--requests", "cpu=abc"], r"--requests cpu='abc' is not a Kubernetes quantity"),
    (["--limits", "worker:memory"], r"--limits 'memory': write \[ROLE:\]KEY=VALUE"),
    (["--toleration", "=x:NoSchedule"], r"has no key"),
    (["--toleration", "a:Never"], r"effect='Never'"),
    (["--label", "team"], r"--label 'team': write \[ROLE:\]KEY=VALUE"),
    (["--label", "pskv.io/role=x"], r"sets the label pskv\.io/role itself"),
    (["--node-selector", "pool"], r"--node-selector 'pool': write"),
    (["--claim", "only-a-claim"], r"--claim 'only-a-claim': write CLAIM:MOUNTPATH"),
    (["--claim", "c:/d:rx"], r"CLAIM:MOUNTPATH:ro"),
    (["--claim", "c:/d", "--claim", "e:/d"], r"two volumes at /d"),
    (["--service-account", "Not_OK"], r"--service-account='Not_OK' is not a service account"),
    (["--checkpoint-claim", "c", "--env", "PSKV_CHECKPOINT_DIR:rel"],
     r"PSKV_CHECKPOINT_DIR='rel': with --checkpoint-claim .* an absolute path"),
])
def test_bad_flags(flags: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        manifests(*flags)


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
    typo.write_text(json.dumps({"worker": {"resources": {"limits": {"cpu": "abc"}}}}))
    with pytest.raises(ConfigError, match=r"--values .*t\.json: worker\.resources\.limits\."
                                          r"cpu='abc'"):
        parse_args([*BASE, "--values", str(typo), "x"], environ={})


def test_pod_settings_need_the_kubernetes_launcher() -> None:
    with pytest.raises(ConfigError, match="only apply to --launcher kubernetes"):
        parse_args(["-n", "1", "--requests", "cpu=1", "x"], environ={})
    with pytest.raises(ConfigError, match="only apply to --launcher kubernetes"):
        LaunchSpec(("x",), 1, pods=PodOptions(service_account="a"))
