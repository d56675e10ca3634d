"""Every pod the project ships (the operator's from the chart; router, Mooncake master and
store, and engine pods from every example) checked against the Kubernetes Pod Security
Standards (kubernetes.io/docs/concepts/security/pod-security-standards/, "latest"), and
the project's own rules on top. The exceptions are in EXPECTED_LEVEL and, with their
reasons, in docs/reliability.md."""

from __future__ import annotations

import copy
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import paths
from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec, RDMAMode
from pdcluster.render import Owner, Replicas, render_all

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdcluster-operator"
FULL_VALUES = ROOT / "tests" / "fixtures" / "chart-values-full.yaml"

# ---------------------------------------------------------------------- the standard
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(key) or []]


def baseline_violations(meta: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    contexts = [("pod", psc)] + [(c["name"], c.get("securityContext") or {}) for c in _containers(pod)]
    for where, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess")
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount {sc['procMount']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: appArmorProfile {sc['appArmorProfile']['type']}")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions {se}")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            out.append(f"{where}: adds capabilities {sorted(added)}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"pod: {key}")
    out += [f"volume {v['name']}: hostPath" for v in pod.get("volumes") or [] if "hostPath" in v]
    for c in _containers(pod):
        out += [f"{c['name']}: hostPort {p['hostPort']}" for p in c.get("ports") or [] if p.get("hostPort")]
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"annotation {key}: {value}")
    out += [f"sysctl {s['name']}" for s in psc.get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]
    return out


def restricted_violations(meta: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    out = baseline_violations(meta, pod)
    psc = pod.get("securityContext") or {}
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for c in _containers(pod):
        sc, name = c.get("securityContext") or {}, c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities not dropping ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
    return out


def level(meta: dict[str, Any], pod: dict[str, Any]) -> str:
    if not restricted_violations(meta, pod):
        return "restricted"
    return "baseline" if not baseline_violations(meta, pod) else "privileged"


# ---------------------------------------------------------------------- what we ship
@cache
def helm() -> str:
    return str(paths.bin_dir() / "helm")


def chart_docs(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [helm(), "template", "pdc", str(CHART), "--namespace", "pdcluster-system", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def example_specs() -> dict[str, PDClusterSpec]:
    specs = {}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())["spec"]
        specs[path.stem] = PDClusterSpec.model_validate(raw)
        if not specs[path.stem].mooncake.store.replicas:
            # Store pods in every example's RDMA mode, too.
            raw = copy.deepcopy(raw)
            raw.setdefault("mooncake", {}).setdefault("store", {})["replicas"] = 2
            specs[path.stem + "+store"] = PDClusterSpec.model_validate(raw)
    return specs


def shipped_pods() -> list[tuple[str, str, RDMAMode | None, dict[str, Any]]]:
    """(where, role, rdma mode, pod template) of every workload we render."""
    pods = []
    for name, spec in example_specs().items():
        for obj in render_all(spec, Owner("x", "ns", "uid"), Replicas.choose(spec, None)):
            if obj["kind"] in ("StatefulSet", "Deployment"):
                role = obj["metadata"]["labels"][C.LABEL_ROLE]
                pods.append((name, role, spec.rdma.mode, obj["spec"]["template"]))
    for values in ([], ["-f", str(FULL_VALUES)]):
        for obj in chart_docs(*values):
            if obj["kind"] == "Deployment":
                pods.append(
                    ("chart" + (" full" if values else ""), "operator", None, obj["spec"]["template"])
                )
    return pods


PODS = shipped_pods()
IDS = [f"{where}/{role}" for where, role, _, _ in PODS]
ENGINES = (C.ROLE_PREFILL, C.ROLE_DECODE, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE)
ON_FABRIC = (*ENGINES, C.ROLE_MOONCAKE_STORE)  # pods that move KV over RDMA


def on_rdma(role: str, rdma: RDMAMode | None) -> bool:
    return role in ON_FABRIC and rdma not in (None, RDMAMode.none)


def expected_level(role: str, rdma: RDMAMode | None) -> str:
    """The exceptions, one line each (reasons in docs/reliability.md)."""
    if on_rdma(role, rdma):
        return "privileged"  # IPC_LOCK to pin RDMA memory; hostNetwork mode adds host network and /dev/infiniband
    if role not in ENGINES:
        return "restricted"
    return "baseline"  # vLLM images run as root and write caches: not restricted


@pytest.mark.parametrize(("where", "role", "rdma", "template"), PODS, ids=IDS)
def test_pod_security_level(where: str, role: str, rdma: RDMAMode | None, template: dict[str, Any]) -> None:
    meta, pod = template.get("metadata") or {}, template["spec"]
    want = expected_level(role, rdma)
    assert level(meta, pod) == want, {
        "restricted": restricted_violations(meta, pod),
        "baseline": baseline_violations(meta, pod),
    }


@pytest.mark.parametrize(("where", "role", "rdma", "template"), PODS, ids=IDS)
def test_project_rules(where: str, role: str, rdma: RDMAMode | None, template: dict[str, Any]) -> None:
    pod = template["spec"]
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        added = set((sc.get("capabilities") or {}).get("add") or [])
        # Only engines and store pods pin memory for RDMA, and only when an RDMA mode is on;
        # on the host's own devices they also need SYS_RESOURCE (render/rdma.py).
        assert ("IPC_LOCK" in added) == on_rdma(role, rdma), (c["name"], added)
        host_devices = on_rdma(role, rdma) and rdma == RDMAMode.host_network
        assert added <= ({"IPC_LOCK", "SYS_RESOURCE"} if host_devices else {"IPC_LOCK"}), added
        assert ("SYS_RESOURCE" in added) == host_devices, added
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert not sc.get("privileged"), c["name"]
        if role not in ENGINES:
            # Operator, router, Mooncake master: non-root, read-only root, no capabilities.
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
            if role != C.ROLE_MOONCAKE_STORE:  # the store writes its segment files to /tmp
                assert sc.get("readOnlyRootFilesystem") is True, c["name"]
    if role not in ENGINES and not on_rdma(role, rdma):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0


def test_every_component_is_checked() -> None:
    roles = {role for _, role, _, _ in PODS}
    assert roles == {
        "operator",
        *C.ENGINE_ROLES,
        C.ROLE_COLOCATED,
        C.ROLE_FLEXIBLE,
        C.ROLE_ROUTER,
        C.ROLE_MOONCAKE_MASTER,
        C.ROLE_MOONCAKE_STORE,
    }
    assert {rdma for _, role, rdma, _ in PODS if role in ENGINES} == set(RDMAMode)
    assert {rdma for _, role, rdma, _ in PODS if role == C.ROLE_MOONCAKE_STORE} == set(RDMAMode)


# ---------------------------------------------------------------------- the checker itself
RESTRICTED_POD = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "c",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    ],
}


@pytest.mark.parametrize(
    ("change", "want"),
    [
        ({}, "restricted"),
        ({"volumes": [{"name": "v", "nfs": {"server": "s", "path": "/"}}]}, "baseline"),
        ({"containers": [{"name": "c"}]}, "baseline"),
        ({"securityContext": {"runAsNonRoot": True}}, "baseline"),  # no seccomp profile
        ({"hostNetwork": True}, "privileged"),
        ({"hostIPC": True}, "privileged"),
        ({"volumes": [{"name": "v", "hostPath": {"path": "/dev"}}]}, "privileged"),
        ({"containers": [{"name": "c", "securityContext": {"privileged": True}}]}, "privileged"),
        (
            {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]},
            "privileged",
        ),
        ({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}]}]}, "privileged"),
        ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "privileged"),
        ({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}, "privileged"),
    ],
)
def test_the_checker_tells_the_levels_apart(change: dict[str, Any], want: str) -> None:
    assert level({}, {**copy.deepcopy(RESTRICTED_POD), **change}) == want
