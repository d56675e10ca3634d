"""Pure parts of the local cluster (e2e/local/localcluster): the kubelet's env and
command-line rules, endpoints and hosts files, pod phase, Prometheus targets, nodes."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from localcluster import nodes
from localcluster.podrunner import discovery, network, status
from localcluster.podrunner.envvars import (
    EnvError,
    command_line,
    container_env,
    expand,
    parse_quantity,
    resource_field_ref,
    service_links,
)
from localcluster.podrunner.pod import image_repository

Obj = dict[str, Any]


def pod(
    name: str = "p",
    *,
    labels: dict[str, str] | None = None,
    ip: str = "127.1.0.5",
    ready: bool = True,
    containers: list[Obj] | None = None,
    **spec: Any,
) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels or {}},
        "spec": {
            "nodeName": "gpu-0",
            "serviceAccountName": "default",
            "containers": containers or [{"name": "c", "image": "python"}],
            **spec,
        },
        "status": {
            "podIP": ip,
            "hostIP": "127.3.0.1",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def svc(
    name: str, *, ip: str = "127.2.0.9", ns: str = "ns", ports: list[Obj] | None = None, **spec: Any
) -> Obj:
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ip, "ports": ports or [{"port": 80}], "selector": {"app": "web"}, **spec},
    }


# Cases from kubernetes third_party/forked/golang/expansion/expand_test.go.
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(VAR_A)", "A"),
        ("___$(VAR_B)___", "___B___"),
        ("$(VAR_A)-$(VAR_A)", "A-A"),
        ("$$(VAR_B)", "$(VAR_B)"),
        ("$$$$$$(BIG_MONEY)", "$$$(BIG_MONEY)"),
        ("$(VAR_DNE)", "$(VAR_DNE)"),
        ("$(VAR_A", "$(VAR_A"),
        ("$VAR_A", "$VAR_A"),
        ("$()", "$()"),
        ("foo$", "foo$"),
        ("$(VAR_EMPTY)", ""),
        ("$(VAR_REF)", "$(VAR_A)"),  # values are not expanded again
    ],
)
def test_expand_matches_kubernetes(text: str, expected: str) -> None:
    assert expand(text, {"VAR_A": "A", "VAR_B": "B", "VAR_EMPTY": "", "VAR_REF": "$(VAR_A)"}) == expected


def test_service_links_are_the_kubelets() -> None:
    env = service_links(
        svc("web-svc", ports=[{"port": 80, "name": "http"}, {"port": 9090, "name": "metrics"}])
    )
    assert env == {
        "WEB_SVC_SERVICE_HOST": "127.2.0.9",
        "WEB_SVC_SERVICE_PORT": "80",
        "WEB_SVC_SERVICE_PORT_HTTP": "80",
        "WEB_SVC_SERVICE_PORT_METRICS": "9090",
        "WEB_SVC_PORT": "tcp://127.2.0.9:80",
        "WEB_SVC_PORT_80_TCP": "tcp://127.2.0.9:80",
        "WEB_SVC_PORT_80_TCP_PROTO": "tcp",
        "WEB_SVC_PORT_80_TCP_PORT": "80",
        "WEB_SVC_PORT_80_TCP_ADDR": "127.2.0.9",
        "WEB_SVC_PORT_9090_TCP": "tcp://127.2.0.9:9090",
        "WEB_SVC_PORT_9090_TCP_PROTO": "tcp",
        "WEB_SVC_PORT_9090_TCP_PORT": "9090",
        "WEB_SVC_PORT_9090_TCP_ADDR": "127.2.0.9",
    }


def test_container_env_order_sources_and_links() -> None:
    container = {
        "name": "c",
        "image": "python",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "CM_A", "value": "overridden"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
            {"name": "URL", "value": "http://$(IP):$(LATER)/$(WEB_SERVICE_HOST)"},
            {"name": "LATER", "value": "8000"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {
                "name": "OPT",
                "valueFrom": {"configMapKeyRef": {"name": "missing", "key": "k", "optional": True}},
            },
            {"name": "WEB_SERVICE_HOST", "value": "mine"},
        ],
    }
    env = container_env(
        pod(labels={"role": "decode"}, containers=[container]),
        container,
        services=[
            svc("web"),
            svc("other", ns="elsewhere"),
            svc("kubernetes", ip="127.2.0.1", ns="default", ports=[{"port": 443, "name": "https"}]),
        ],
        config_maps={"cm": {"data": {"A": "a", "B": "b"}}, "missing": None},
        secrets={"s": {"data": {"token": base64.b64encode(b"t0k").decode()}}},
    )
    assert env["CM_A"] == "overridden" and env["CM_B"] == "b"
    assert env["IP"] == "127.1.0.5" and env["ROLE"] == "decode"
    # Only variables defined before it (and Service links) expand; LATER comes after.
    assert env["URL"] == "http://127.1.0.5:$(LATER)/127.2.0.9"
    assert env["TOKEN"] == "t0k"
    assert "OPT" not in env
    assert env["WEB_SERVICE_HOST"] == "mine"
    assert env["KUBERNETES_SERVICE_HOST"] == "127.2.0.1" and env["KUBERNETES_SERVICE_PORT"] == "443"
    assert "OTHER_SERVICE_HOST" not in env


def test_missing_references_are_config_errors() -> None:
    container = {
        "name": "c",
        "image": "python",
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}],
    }
    with pytest.raises(EnvError, match="couldn't find key nope"):
        container_env(pod(), container, services=[], config_maps={}, secrets={"s": {"data": {}}})
    with pytest.raises(EnvError, match='secret "s" not found'):
        container_env(pod(), container, services=[], config_maps={}, secrets={"s": None})


def test_service_links_can_be_turned_off_except_the_masters() -> None:
    env = container_env(
        pod(enableServiceLinks=False),
        {"name": "c"},
        config_maps={},
        secrets={},
        services=[svc("web"), svc("kubernetes", ip="127.2.0.1", ns="default")],
    )
    assert "WEB_SERVICE_HOST" not in env and env["KUBERNETES_SERVICE_HOST"] == "127.2.0.1"


def test_command_line_follows_container_runtimes() -> None:
    env = {"POD_IP": "127.1.0.5"}
    entry, cmd = ["pdcluster-engine-sim"], ["serve", "m"]
    assert command_line(entry, cmd, {}, env) == ["pdcluster-engine-sim", "serve", "m"]
    assert command_line(entry, cmd, {"args": ["--host=$(POD_IP)"]}, env) == [
        "pdcluster-engine-sim",
        "--host=127.1.0.5",
    ]
    assert command_line(entry, cmd, {"command": ["mooncake_master"]}, env) == ["mooncake_master"]
    assert command_line([], ["python3"], {"args": ["python3", "-V"]}, env) == ["python3", "-V"]


def test_resource_field_refs_round_up_and_default_to_the_node() -> None:
    p = pod(containers=[{"name": "c", "resources": {"limits": {"cpu": "1500m", "memory": "1Gi"}}}])
    ref = resource_field_ref
    assert ref(p, "c", {"resource": "limits.cpu"}, {}) == "2"
    assert ref(p, "c", {"resource": "limits.cpu", "divisor": "1m"}, {}) == "1500"
    assert ref(p, "c", {"resource": "limits.memory", "divisor": "1Mi"}, {}) == "1024"
    assert ref(p, "c", {"resource": "limits.ephemeral-storage"}, {"ephemeral-storage": "2Ki"}) == "2048"
    assert ref(p, "c", {"resource": "requests.cpu"}, {}) == "2"  # requests default to limits
    assert parse_quantity("1e3") == 1000 and parse_quantity("2Ti") == 2 * 2**40


@pytest.mark.parametrize(
    ("image", "repository"),
    [
        ("pdcluster/router:0.1.0", "pdcluster/router"),
        ("registry.example:5000/pdcluster/engine-sim:1@sha256:abc", "pdcluster/engine-sim"),
        ("localhost/pdcluster/operator", "pdcluster/operator"),
        ("python:3.11", "python"),
        ("library/python", "python"),
        ("vllm/vllm-openai:v0.11.0", "vllm/vllm-openai"),
    ],
)
def test_image_repository(image: str, repository: str) -> None:
    assert image_repository(image) == repository


def test_endpoints_follow_readiness_selectors_and_named_ports() -> None:
    web = [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]
    pods = [
        pod("a", labels={"app": "web"}, ip="127.1.0.2", containers=web),
        pod("b", labels={"app": "web"}, ip="127.1.0.3", ready=False, containers=web),
        pod("c", labels={"app": "other"}, ip="127.1.0.4", containers=web),
        {
            **pod("d", labels={"app": "web"}, ip="127.1.0.5", containers=web),
            "metadata": {"name": "d", "namespace": "ns", "labels": {"app": "web"}, "deletionTimestamp": "x"},
        },
    ]
    port = {"port": 80, "targetPort": "http"}
    assert [(e.ip, e.port) for e in network.endpoints(svc("web"), port, pods)] == [("127.1.0.2", 8000)]
    not_ready_too = svc("web", publishNotReadyAddresses=True)
    assert [e.pod for e in network.endpoints(not_ready_too, port, pods)] == ["a", "b"]


def test_hosts_file_answers_like_cluster_dns() -> None:
    members = [
        pod(f"web-{i}", labels={"app": "web"}, ip=f"127.1.0.{i + 2}", hostname=f"web-{i}", subdomain="web")
        for i in range(2)
    ]
    services = [svc("web", ip="None"), svc("web-svc"), svc("api", ip="127.2.0.7", ns="other")]
    hosts = network.hosts_file(members[0], services, members).splitlines()
    assert "127.1.0.2\tweb-0.web.ns.svc.cluster.local web-0" in hosts
    assert "127.2.0.9\tweb-svc.ns.svc.cluster.local web-svc.ns.svc web-svc.ns web-svc" in hosts
    assert (
        "127.2.0.7\tapi.other.svc.cluster.local api.other.svc api.other" in hosts
    )  # no short name across namespaces
    assert "127.1.0.3\tweb-1.web.ns.svc.cluster.local web-1.web.ns.svc web-1.web.ns web-1.web" in hosts
    assert "127.1.0.3\tweb.ns.svc.cluster.local web.ns.svc web.ns web" in hosts


def _cs(name: str, state: Obj, last: Obj | None = None, ready: bool = False) -> Obj:
    return {"name": name, "state": state, "ready": ready, **({"lastState": last} if last else {})}


RUNNING = {"running": {}}
CRASHED = {"terminated": {"exitCode": 1}}
DONE = {"terminated": {"exitCode": 0}}
WAITING = {"waiting": {"reason": "ContainerCreating"}}


@pytest.mark.parametrize(
    ("policy", "statuses", "terminal", "expected"),
    [
        ("Always", [_cs("a", RUNNING), _cs("b", RUNNING)], False, "Running"),
        ("Always", [_cs("a", RUNNING), _cs("b", WAITING)], False, "Pending"),
        (
            "Always",
            [_cs("a", {"waiting": {"reason": "CrashLoopBackOff"}}, CRASHED), _cs("b", RUNNING)],
            False,
            "Running",
        ),
        ("Always", [_cs("a", CRASHED), _cs("b", CRASHED)], False, "Running"),
        ("Always", [_cs("a", CRASHED), _cs("b", DONE)], True, "Failed"),
        ("Always", [_cs("a", DONE), _cs("b", DONE)], True, "Succeeded"),
        ("Never", [_cs("a", DONE), _cs("b", CRASHED)], False, "Failed"),
        ("Never", [_cs("a", DONE), _cs("b", DONE)], False, "Succeeded"),
        ("OnFailure", [_cs("a", DONE), _cs("b", CRASHED)], False, "Running"),
    ],
)
def test_phase_is_the_kubelets(policy: str, statuses: list[Obj], terminal: bool, expected: str) -> None:
    spec = {"restartPolicy": policy, "containers": [{"name": "a"}, {"name": "b"}]}
    assert status.phase(spec, [], statuses, terminal=terminal) == expected


def test_failed_init_container_fails_a_never_pod_and_holds_others() -> None:
    spec = {"restartPolicy": "Never", "initContainers": [{"name": "i"}], "containers": [{"name": "a"}]}
    assert status.phase(spec, [_cs("i", CRASHED)], [_cs("a", WAITING)]) == "Failed"
    assert (
        status.phase({**spec, "restartPolicy": "Always"}, [_cs("i", RUNNING)], [_cs("a", WAITING)])
        == "Pending"
    )


def test_conditions_keep_transition_times_until_they_change() -> None:
    p = pod(containers=[{"name": "a"}])
    p["status"]["conditions"] = [{"type": "ContainersReady", "status": "True", "lastTransitionTime": "t0"}]
    conds = {c["type"]: c for c in status.conditions(p, [], [_cs("a", RUNNING, ready=True)], "Running", "t1")}
    assert conds["ContainersReady"] == {
        "type": "ContainersReady",
        "status": "True",
        "lastTransitionTime": "t0",
    }
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["lastTransitionTime"] == "t1"
    conds = {c["type"]: c for c in status.conditions(p, [], [_cs("a", RUNNING)], "Running", "t2")}
    assert (
        conds["Ready"]["status"] == "False"
        and conds["Ready"]["message"] == "containers with unready status: [a]"
    )


def test_prometheus_targets_carry_kubernetes_sd_meta_labels() -> None:
    p = pod(
        "exporter",
        labels={"pdcluster.io/role": "decode"},
        containers=[
            {"name": "c", "image": "python", "ports": [{"name": "metrics", "containerPort": 9100}]},
            {"name": "sidecar", "image": "python"},
        ],
    )
    p["metadata"]["annotations"] = {"prometheus.io/scrape": "true"}
    groups = discovery.pod_targets([p, pod("no-ip", ip="")])
    assert [g["targets"] for g in groups] == [["127.1.0.5:9100"], ["127.1.0.5"]]
    labels = groups[0]["labels"]
    assert labels["__meta_kubernetes_pod_label_pdcluster_io_role"] == "decode"
    assert labels["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] == "true"
    assert labels["__meta_kubernetes_pod_container_port_number"] == "9100"
    assert labels["__meta_kubernetes_pod_ready"] == "true" and labels["__meta_kubernetes_namespace"] == "ns"


def test_nodes_look_like_a_gpu_cluster() -> None:
    manifests = nodes.manifests(nodes.NodePool(gpu_nodes=2, gpus_per_node=8, cpu_nodes=1))
    assert [n["metadata"]["name"] for n in manifests] == ["gpu-0", "gpu-1", "cpu-0"]
    assert [n["spec"]["podCIDR"] for n in manifests] == ["127.1.0.0/24", "127.1.1.0/24", "127.1.2.0/24"]
    gpu, cpu = manifests[0], manifests[2]
    assert gpu["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert gpu["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert gpu["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert cpu["spec"]["taints"] == [] and "nvidia.com/gpu" not in cpu["status"]["capacity"]
