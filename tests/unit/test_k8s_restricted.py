"""The kubernetes launcher's objects against the Pod Security Standards' ``restricted`` level.

`violations` is a checker of the rules the Pod Security admission applies to a pod at the
``baseline`` and ``restricted`` levels (kubernetes.io/docs/concepts/security/
pod-security-standards): what it returns is what a namespace labelled
``pod-security.kubernetes.io/enforce: restricted`` would refuse. Every node's Job is
checked with it (the admission checks the pods the Job controller makes from the
template), with the launcher's defaults and with every setting on; the Job's own fields
(backoffLimit, podFailurePolicy, ...) and what `--values` adds are checked here too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pskv.errors import ConfigError
from pskv.launch import parse_args
from pskv.launch._k8s_options import PodOptions
from pskv.launch._kubernetes import job_manifests

from _k8s_client import needs_client

BASE = ["--launcher", "kubernetes", "--image", "img", "--job-name", "j", "-n", "2", "-s", "2"]
#: baseline: the capabilities a container may add (restricted: NET_BIND_SERVICE alone)
_BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                  "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
#: restricted: the only volume sources
_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
            "persistentVolumeClaim", "projected", "secret", "image"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                 "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                 "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                 "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}


def violations(pod: dict[str, Any]) -> list[str]:
    """What the ``restricted`` level (baseline's rules included) finds wrong in a pod spec."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = [*pod.get("containers", []), *pod.get("initContainers", []),
                  *pod.get("ephemeralContainers", [])]
    # -- baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} is set")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess pod")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in _SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not a safe one")
    for sc, where in [(psc, "pod"), *((c.get("securityContext") or {}, c["name"])
                                      for c in containers)]:
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type") not in (None, "", "container_t", "container_init_t",
                                       "container_kvm_t", "container_engine_t") \
                or selinux.get("user") or selinux.get("role"):
            out.append(f"{where}: seLinuxOptions {selinux}")
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault",
                                                                  "Localhost"):
            out.append(f"{where}: appArmorProfile {sc['appArmorProfile']}")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")                           # restricted
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{name}: hostPort {port['hostPort']}")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - _BASELINE_CAPS:
            out.append(f"{name}: adds capabilities {sorted(added - _BASELINE_CAPS)}")
        # -- restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities beyond NET_BIND_SERVICE")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot is not true (pod or container)")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: no RuntimeDefault or Localhost seccompProfile")
    for volume in pod.get("volumes") or []:
        source = set(volume) - {"name"}
        if not source <= _VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(source)} is not allowed")
    return out


def jobs(*flags: str, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    spec = parse_args([*BASE, *flags, "python", "train.py"], environ=env or {})
    return {m["metadata"]["name"]: m for m in job_manifests(spec, name="j", namespace="ns",
                                                           secret="s")
            if m["kind"] not in ("Secret", "Service")}


def template(job: dict[str, Any]) -> dict[str, Any]:
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    return job["spec"]["template"]["spec"]


NODES = ("j-scheduler", "j-server-0", "j-server-1", "j-worker-0", "j-worker-1")
EVERYTHING = ["--requests", "worker:cpu=4", "--limits", "worker:nvidia.com/gpu=1",
              "--claim", "worker:data:/data:ro", "--checkpoint-claim", "ckpt",
              "--service-account", "trainer", "--max-restarts", "2",
              "--env", "PSKV_CHECKPOINT_EVERY:10", "--env", "PSKV_METRICS_PORT:9400"]


# -- the checker, and what it says of the launcher's pods -------------------------------
@pytest.mark.parametrize("flags", [[], pytest.param(EVERYTHING, marks=needs_client)],
                         ids=["plain", "every-setting"])
def test_every_pod_passes_the_restricted_level(flags: list[str]) -> None:
    made = jobs(*flags)
    assert sorted(made) == sorted(NODES)
    for name, job in made.items():
        pod = template(job)
        assert violations(pod) == [], name
        assert pod["automountServiceAccountToken"] is False   # no token in the pod


def test_the_checker_refuses_what_restricted_refuses() -> None:
    """A plain pod (what the launcher made before) and a few bad settings fail the check."""
    plain = {"restartPolicy": "Never", "containers": [{"name": "pskv", "image": "img"}]}
    found = " | ".join(violations(plain))
    for rule in ("allowPrivilegeEscalation", "drop ALL", "runAsNonRoot", "seccompProfile"):
        assert rule in found
    pod = template(jobs()["j-worker-0"])
    assert violations(pod) == []
    for change in ({"hostNetwork": True},
                   {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
                   {"securityContext": {**pod["securityContext"], "runAsUser": 0}},
                   {"containers": [{**pod["containers"][0], "securityContext": {
                       **pod["containers"][0]["securityContext"],
                       "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}}]}):
        assert violations({**pod, **change}), change


# -- the Job around each pod ------------------------------------------------------------
def test_each_node_is_a_job_with_a_pod_failure_policy() -> None:
    made = jobs("--timeout", "600")
    for name in NODES:
        spec = made[name]["spec"]
        assert spec["backoffLimit"] == 0 and spec["ttlSecondsAfterFinished"] > 0
        assert spec["activeDeadlineSeconds"] == 600                  # --timeout
        assert template(made[name])["restartPolicy"] == "Never"     # podFailurePolicy needs it
        rules = spec["podFailurePolicy"]["rules"]
        assert {"action": "FailJob", "onPodConditions": [
            {"type": "DisruptionTarget", "status": "True"}]} in rules
        codes = [r["onExitCodes"] for r in rules if "onExitCodes" in r]
        assert codes == [{"containerName": "pskv", "operator": "NotIn", "values": [0]}]
        assert template(made[name])["containers"][0]["name"] == "pskv"


def test_with_max_restarts_the_kubelet_restarts_and_the_job_counts() -> None:
    made = jobs("--max-restarts", "3", "--env", "PSKV_REPLICAS:1")
    worker, scheduler = made["j-worker-0"]["spec"], made["j-scheduler"]["spec"]
    assert template(made["j-worker-0"])["restartPolicy"] == "OnFailure"
    assert worker["backoffLimit"] == 3 and "podFailurePolicy" not in worker
    assert scheduler["backoffLimit"] == 0 and "podFailurePolicy" in scheduler


# -- resources and probes ---------------------------------------------------------------
@needs_client
def test_resources_by_default_and_given_ones_win() -> None:
    made = jobs("--requests", "worker:memory=32Gi")
    res = template(made["j-server-0"])["containers"][0]["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    worker = template(made["j-worker-0"])["containers"][0]["resources"]
    assert worker["requests"]["memory"] == "32Gi"
    assert "memory" not in worker.get("limits", {})   # no default limit under the request


def test_probes_check_ports_the_container_declares() -> None:
    made = jobs()
    sched = template(made["j-scheduler"])["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in sched["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sched[kind]["tcpSocket"]["port"] in ports
    assert "livenessProbe" not in template(made["j-worker-0"])["containers"][0]
    made = jobs("--env", "PSKV_METRICS_PORT:9400")
    for name in NODES:
        c = template(made[name])["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == 9400
        if name != "j-scheduler":
            assert c["readinessProbe"]["tcpSocket"] == {"port": "metrics"}


# -- --values: a securityContext merged over the defaults -------------------------------
@needs_client
def test_values_security_context_merges(tmp_path: Path) -> None:
    path = tmp_path / "v.json"
    path.write_text(json.dumps({
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
        "containerSecurityContext": {"readOnlyRootFilesystem": True},
        "worker": {"securityContext": {"fsGroup": 2000}}}))
    made = jobs("--values", str(path))
    for name in NODES:
        pod = template(made[name])
        assert pod["securityContext"]["runAsUser"] == 1000
        assert pod["securityContext"]["runAsNonRoot"] is True            # kept
        container = pod["containers"][0]["securityContext"]
        assert container["readOnlyRootFilesystem"] is True
        assert container["capabilities"] == {"drop": ["ALL"]}            # kept
        assert violations(pod) == []
    assert template(made["j-worker-0"])["securityContext"]["fsGroup"] == 2000
    assert template(made["j-server-0"])["securityContext"]["fsGroup"] != 2000


@pytest.mark.parametrize("values, match", [
    ({"securityContext": {"runAsUsr": 1000}}, r"securityContext\.runAsUsr is not a field of "
                                              r"the Kubernetes PodSecurityContext"),
    ({"worker": {"containerSecurityContext": {"capabilities": {"dropp": ["ALL"]}}}},
     r"worker\.containerSecurityContext\.capabilities\.dropp is not a field"),
    ({"pods": {"securityContext": "root"}}, r"pods\.securityContext must be a mapping"),
])
@needs_client
def test_bad_security_context(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PodOptions.from_values(values)


# -- docs/kubernetes.md shows what the launcher writes -----------------------------------
def _doc_yaml() -> list[Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML: pip install 'pskv[kubernetes]'")
    text = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def test_docs_job_is_the_launchers() -> None:
    shown = [d for d in _doc_yaml() if isinstance(d, dict) and d.get("kind") == "Job"]
    assert len(shown) == 1
    spec = parse_args(["--launcher", "kubernetes", "--image", "registry.example.com/train:1",
                       "--job-name", "demo", "-n", "2", "-s", "1", "python", "train.py"],
                      environ={})
    made = job_manifests(spec, name="demo", namespace="default", secret="x")
    assert shown[0] == next(m for m in made if m["metadata"]["name"] == "demo-worker-0")
    assert violations(template(shown[0])) == []


@needs_client
def test_docs_security_values_are_read() -> None:
    values = [d for d in _doc_yaml() if isinstance(d, dict) and "containerSecurityContext" in d]
    assert len(values) == 1
    opts = PodOptions.from_values(values[0])
    assert opts.for_role("worker").pod["securityContext"] == {
        "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "supplementalGroups": [44]}
