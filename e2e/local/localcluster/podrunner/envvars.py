"""A container's environment and command line, computed as the kubelet does
(pkg/kubelet/kubelet_pods.go makeEnvironmentVariables, pkg/kubelet/envvars,
third_party/forked/golang/expansion in kubernetes v1.36). Pure: the caller fetches the
ConfigMaps and Secrets a container refers to and passes them in."""

from __future__ import annotations

import base64
import math
import re
from fractions import Fraction
from typing import Any

from pdcluster.api.base import quantity

Obj = dict[str, Any]


class EnvError(Exception):
    """The kubelet's CreateContainerConfigError: a referenced object or key is missing."""


# --- $(VAR) expansion -------------------------------------------------------------------

def expand(text: str, *contexts: dict[str, str]) -> str:
    """`$(VAR)` becomes the first context's value for VAR, `$$` becomes `$`; references to
    unknown variables and anything malformed are kept as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            out.append(next((c[name] for c in contexts if name in c), f"$({name})"))
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


# --- Service links ------------------------------------------------------------------------

def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def service_links(service: Obj) -> dict[str, str]:
    """FOO_SERVICE_HOST, FOO_SERVICE_PORT[_NAME] and the Docker-style FOO_PORT_* variables."""
    prefix = _env_name(service["metadata"]["name"])
    spec = service["spec"]
    ip = spec["clusterIP"]
    ports = spec.get("ports", [])
    env = {f"{prefix}_SERVICE_HOST": ip, f"{prefix}_SERVICE_PORT": str(ports[0]["port"])}
    for p in ports:
        if p.get("name"):
            env[f"{prefix}_SERVICE_PORT_{_env_name(p['name'])}"] = str(p["port"])
    for i, p in enumerate(ports):
        proto = p.get("protocol") or "TCP"
        url = f"{proto.lower()}://{ip}:{p['port']}"
        if i == 0:
            env[f"{prefix}_PORT"] = url
        port_prefix = f"{prefix}_PORT_{p['port']}_{proto.upper()}"
        env[port_prefix] = url
        env[f"{port_prefix}_PROTO"] = proto.lower()
        env[f"{port_prefix}_PORT"] = str(p["port"])
        env[f"{port_prefix}_ADDR"] = ip
    return env


def service_env(namespace: str, services: list[Obj], enable_service_links: bool) -> dict[str, str]:
    """The default/kubernetes Service always; the pod namespace's Services if links are on."""
    env: dict[str, str] = {}
    for svc in services:
        meta, ip = svc["metadata"], svc["spec"].get("clusterIP")
        if not ip or ip == "None" or not svc["spec"].get("ports"):
            continue
        is_master = meta["namespace"] == "default" and meta["name"] == "kubernetes"
        if is_master or (meta["namespace"] == namespace and enable_service_links):
            env.update(service_links(svc))
    return env


# --- Downward API ---------------------------------------------------------------------

_MAP_FIELD = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_ref(pod: Obj, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs", [])) or status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs", [])) or status.get("hostIP", ""),
    }
    if path in simple:
        return simple[path]
    if path in ("metadata.labels", "metadata.annotations"):  # downward API volumes only
        values = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
    if m := _MAP_FIELD.match(path):
        return meta.get(m.group(1), {}).get(m.group(2), "")
    raise EnvError(f"unsupported fieldPath {path!r}")


def parse_quantity(text: str | int | float) -> Fraction:
    """A Kubernetes quantity, exactly (the project's one parser, pdcluster.api.base)."""
    value = quantity(text.strip() if isinstance(text, str) else text)
    if value is None:
        raise ValueError(f"not a quantity: {text!r}")
    return Fraction(value)


def resource_field_ref(pod: Obj, container_name: str, ref: Obj, node_allocatable: dict[str, str]) -> str:
    """limits.* default to the node's allocatable; CPU rounds up to the divisor (default 1
    core), memory and storage to the divisor in bytes (default 1)."""
    name = ref.get("containerName") or container_name
    container = next(c for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []) if c["name"] == name)
    kind, _, resource = ref["resource"].partition(".")
    resources = container.get("resources", {})
    value = resources.get(kind, {}).get(resource)
    if value is None and kind == "limits":
        value = node_allocatable.get(resource)
    if value is None and kind == "requests":
        value = resources.get("limits", {}).get(resource, "0")
    divisor = parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        divisor = Fraction(1)
    return str(math.ceil(parse_quantity(value or "0") / divisor))


# --- The whole environment -----------------------------------------------------------

def referenced_objects(container: Obj) -> tuple[set[str], set[str]]:
    """Names of the ConfigMaps and Secrets the container's env/envFrom refer to."""
    config_maps, secrets = set(), set()
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            config_maps.add(src["configMapRef"]["name"])
        if "secretRef" in src:
            secrets.add(src["secretRef"]["name"])
    for var in container.get("env", []):
        value_from = var.get("valueFrom", {})
        if "configMapKeyRef" in value_from:
            config_maps.add(value_from["configMapKeyRef"]["name"])
        if "secretKeyRef" in value_from:
            secrets.add(value_from["secretKeyRef"]["name"])
    return config_maps, secrets


def _object_data(kind: str, obj: Obj | None, name: str, namespace: str, optional: bool) -> dict[str, str] | None:
    if obj is None:
        if optional:
            return None
        raise EnvError(f'{kind.lower()} "{name}" not found')
    if kind == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return dict(obj.get("data", {}))


def container_env(
    pod: Obj,
    container: Obj,
    *,
    services: list[Obj],
    config_maps: dict[str, Obj | None],
    secrets: dict[str, Obj | None],
    node_allocatable: dict[str, str] | None = None,
) -> dict[str, str]:
    """envFrom, then env in order (each value expanded against the variables before it and
    the Service links), then the Service links not overridden."""
    ns = pod["metadata"]["namespace"]
    links = service_env(ns, services, pod["spec"].get("enableServiceLinks", True))
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
        store = config_maps if kind == "ConfigMap" else secrets
        data = _object_data(kind, store.get(ref["name"]), ref["name"], ns, ref.get("optional", False))
        for k, v in (data or {}).items():
            env[src.get("prefix", "") + k] = v
    for var in container.get("env", []):
        value_from = var.get("valueFrom")
        if "value" in var or not value_from:
            env[var["name"]] = expand(var.get("value", ""), env, links)
            continue
        if "fieldRef" in value_from:
            env[var["name"]] = field_ref(pod, value_from["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in value_from:
            env[var["name"]] = resource_field_ref(pod, container["name"], value_from["resourceFieldRef"],
                                                  node_allocatable or {})
        elif "configMapKeyRef" in value_from or "secretKeyRef" in value_from:
            kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
            ref = value_from["configMapKeyRef" if kind == "ConfigMap" else "secretKeyRef"]
            store = config_maps if kind == "ConfigMap" else secrets
            optional = ref.get("optional", False)
            data = _object_data(kind, store.get(ref["name"]), ref["name"], ns, optional)
            if data is None:
                continue
            if ref["key"] not in data:
                if optional:
                    continue
                raise EnvError(f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
            env[var["name"]] = data[ref["key"]]
        else:
            raise EnvError(f"unsupported valueFrom for {var['name']}: {sorted(value_from)}")
    return {**links, **env}


def command_line(entrypoint: list[str], default_args: list[str], container: Obj, env: dict[str, str]) -> list[str]:
    """Container command/args over the image's entrypoint/cmd, as container runtimes combine
    them: a command replaces the entrypoint and drops the image's args."""
    command = [expand(c, env) for c in container.get("command", [])]
    args = [expand(a, env) for a in container.get("args", [])]
    if command:
        return command + args
    return entrypoint + (args if container.get("args") else default_args)
