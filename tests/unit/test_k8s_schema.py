"""The kubernetes launcher's manifests against the Kubernetes API's own models (issue #20).

The official client (``pip install 'pskv[kubernetes]'``) ships one model class per API
object, generated from the API's OpenAPI schema: every field with its type, the required
ones, and the enumerations the client checks. Each manifest is read into its model
(``V1Secret``, ``V1Service``, ``V1Job`` with its pod template) and written back: a misspelt or misplaced field
does not survive the trip (the models drop what the schema does not have), a wrong type
or a missing required field raises. So "the manifests are equal after the trip" is "every
field the launcher writes is one the API server knows, where it knows it".
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pskv.launch import parse_args
from pskv.launch._kubernetes import job_manifests

client = pytest.importorskip(
    "kubernetes.client",
    reason="the Kubernetes client is not installed: pip install 'pskv[kubernetes]'")

BASE = ["--launcher", "kubernetes", "--image", "registry.example.com/train:1",
        "--job-name", "j", "-n", "2", "-s", "2"]

#: every pod setting at once, from flags and a values file
EVERYTHING = [
    "--requests", "cpu=1,memory=2Gi", "--requests", "worker:cpu=4",
    "--limits", "worker:nvidia.com/gpu=1,memory=16Gi",
    "--node-selector", "pool=train", "--node-selector", "server:disk=ssd",
    "--toleration", "dedicated=ml:NoSchedule", "--toleration", "worker:gpu",
    "--claim", "worker:data:/data:ro", "--checkpoint-claim", "ckpt",
    "--service-account", "trainer", "--image-pull-secret", "regcred",
    "--label", "team=ml", "--label", "worker:tier=gpu", "--annotation", "owner=alice",
    "--restart-policy", "OnFailure", "--max-restarts", "3",
]

VALUES = """\
securityContext: {runAsUser: 1000, supplementalGroups: [5]}
containerSecurityContext: {readOnlyRootFilesystem: true}
pods:
  resources: {requests: {ephemeral-storage: 1Gi}}
  volumes:
    - {name: scratch, emptyDir: {}, mountPath: /scratch}
server:
  tolerations:
    - {key: spot, operator: Exists, effect: NoExecute}
"""


def _model_name(manifest: dict[str, Any]) -> str:
    return f"{manifest['apiVersion'].split('/')[-1].upper()}{manifest['kind']}"


def round_trip(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest read into the client's model of its kind, and written back."""
    api = client.ApiClient()
    model = api._ApiClient__deserialize(manifest, _model_name(manifest))  # the client's reader
    assert type(model).__name__ == _model_name(manifest)
    return api.sanitize_for_serialization(model)


def job(flags: list[str], tmp_path: Path) -> list[dict[str, Any]]:
    values = tmp_path / "values.yaml"
    values.write_text(VALUES)
    env = {"PSKV_CHECKPOINT_EVERY": "10"}
    spec = parse_args([*BASE, *flags, "--values", str(values), "--env",
                       "PSKV_CHECKPOINT_EVERY:10", "python", "train.py"], environ=env)
    return job_manifests(spec, name="j", namespace="ns", secret="s3cret")


@pytest.mark.parametrize("flags", [[], EVERYTHING], ids=["plain", "every-setting"])
def test_every_object_is_what_the_api_schema_says(flags: list[str], tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="PyYAML is not installed: pip install 'pskv[kubernetes]'")
    manifests = job(flags, tmp_path)
    assert [m["kind"] for m in manifests].count("Job") == 5      # scheduler, 2 servers, 2 workers
    for m in manifests:
        assert round_trip(m) == m, m["metadata"]["name"]


def test_the_check_finds_a_field_the_schema_does_not_have(tmp_path: Path) -> None:
    """The round trip is a check that can fail: a misplaced field is lost on the way."""
    pod = next(m for m in job([], tmp_path) if m["kind"] == "Job")
    pod["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"cpu": "1"}}
    assert round_trip(pod) != pod                                        # not 'resources'
    bad = next(m for m in job([], tmp_path) if m["kind"] == "Job")
    del bad["spec"]["template"]["spec"]["containers"][0]["name"]         # required
    with pytest.raises(ValueError, match="name"):
        round_trip(bad)


def test_the_settings_reach_the_objects(tmp_path: Path) -> None:
    """What the schema check read is the full job: the settings really are in it."""
    pytest.importorskip("yaml", reason="PyYAML is not installed: pip install 'pskv[kubernetes]'")
    pods = {m["metadata"]["name"]: m["spec"]["template"] for m in job(EVERYTHING, tmp_path)
            if m["kind"] == "Job"}
    worker = pods["j-worker-1"]["spec"]
    assert worker["serviceAccountName"] == "trainer"
    assert worker["imagePullSecrets"] == [{"name": "regcred"}]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {v["name"] for v in worker["volumes"]} >= {"scratch"}
    assert pods["j-server-1"]["spec"]["restartPolicy"] == "OnFailure"
    assert pods["j-scheduler"]["spec"]["restartPolicy"] == "Never"
    assert any(t.get("key") == "spot" for t in pods["j-server-0"]["spec"]["tolerations"])
