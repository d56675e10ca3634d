"""Pod volumes as directories on the host, and the script that mounts them, together
with the pod's hosts file and hostname, in the container's private mount namespace."""

from __future__ import annotations

import base64
import os
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localcluster.kubeconfig import request_token
from localcluster.podrunner.envvars import EnvError, expand, field_ref, resource_field_ref
from pdcluster.io.kube import Kube

Obj = dict[str, Any]
Files = dict[str, tuple[bytes, int]]  # relative path -> (content, mode)


class VolumeError(Exception):
    """The kubelet's FailedMount: a volume could not be set up (yet)."""


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


async def _object(kube: Kube, kind: str, name: str, namespace: str, optional: bool) -> Obj | None:
    obj = await kube.get("v1", kind, name, namespace)
    if obj is None and not optional:
        raise VolumeError(f'{kind.lower()} "{name}" not found')
    return obj


def _key_files(data: dict[str, bytes], source: Obj, default_mode: int, what: str) -> Files:
    items = source.get("items")
    if not items:
        return {k: (v, default_mode) for k, v in data.items()}
    files: Files = {}
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise VolumeError(f"{what} has no key {item['key']!r}")
        files[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    return files


async def _config_map_files(kube: Kube, ns: str, source: Obj, mode: int) -> Files:
    obj = await _object(kube, "ConfigMap", source["name"], ns, source.get("optional", False))
    if obj is None:
        return {}
    data = {k: v.encode() for k, v in obj.get("data", {}).items()}
    data |= {k: base64.b64decode(v) for k, v in obj.get("binaryData", {}).items()}
    return _key_files(data, source, mode, f"configmap {source['name']!r}")


async def _secret_files(kube: Kube, ns: str, source: Obj, mode: int) -> Files:
    name = source.get("secretName") or source["name"]
    obj = await _object(kube, "Secret", name, ns, source.get("optional", False))
    if obj is None:
        return {}
    data = {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()}
    return _key_files(data, source, mode, f"secret {name!r}")


def _downward_files(pod: Obj, source: Obj, mode: int, allocatable: dict[str, str]) -> Files:
    files: Files = {}
    for item in source.get("items", []):
        try:
            if "fieldRef" in item:
                value = field_ref(pod, item["fieldRef"]["fieldPath"])
            else:
                ref = item["resourceFieldRef"]
                value = resource_field_ref(pod, ref.get("containerName", ""), ref, allocatable)
        except (EnvError, StopIteration) as e:
            raise VolumeError(f"downwardAPI {item['path']}: {e}") from e
        files[item["path"]] = (value.encode(), item.get("mode", mode))
    return files


async def _token_file(kube: Kube, pod: Obj, source: Obj, mode: int) -> Files:
    audience = source.get("audience")
    token = await request_token(
        kube, pod["metadata"]["namespace"], pod["spec"].get("serviceAccountName", "default"),
        expiration_seconds=source.get("expirationSeconds", 3600), audiences=[audience] if audience else None,
        bound_pod=pod,
    )
    return {source["path"]: (token.encode(), mode)}


async def _files(kube: Kube, pod: Obj, volume: Obj, allocatable: dict[str, str]) -> Files:
    ns = pod["metadata"]["namespace"]
    if "configMap" in volume:
        src = volume["configMap"]
        return await _config_map_files(kube, ns, src, src.get("defaultMode", 0o644))
    if "secret" in volume:
        src = volume["secret"]
        return await _secret_files(kube, ns, src, src.get("defaultMode", 0o644))
    if "downwardAPI" in volume:
        src = volume["downwardAPI"]
        return _downward_files(pod, src, src.get("defaultMode", 0o644), allocatable)
    projected = volume["projected"]
    mode = projected.get("defaultMode", 0o644)
    files: Files = {}
    for source in projected.get("sources", []):
        if "serviceAccountToken" in source:
            files |= await _token_file(kube, pod, source["serviceAccountToken"], mode)
        elif "configMap" in source:
            files |= await _config_map_files(kube, ns, source["configMap"], mode)
        elif "secret" in source:
            files |= await _secret_files(kube, ns, source["secret"], mode)
        elif "downwardAPI" in source:
            files |= _downward_files(pod, source["downwardAPI"], mode, allocatable)
        else:
            raise VolumeError(f"projected source {sorted(source)} is not supported by the local pod runner")
    return files


def _host_path(volume: Obj) -> Path:
    src = volume["hostPath"]
    path, kind = Path(src["path"]), src.get("type", "")
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    elif kind == "Directory" and not path.is_dir():
        raise VolumeError(f"hostPath type check failed: {path} is not a directory")
    elif kind == "File" and not path.is_file():
        raise VolumeError(f"hostPath type check failed: {path} is not a file")
    elif kind in ("Socket", "CharDevice", "BlockDevice") and not path.exists():
        raise VolumeError(f"hostPath type check failed: {path} does not exist")
    return path


async def _claim_path(kube: Kube, namespace: str, claim: str) -> Path:
    """A claim's volume on the host: the hostPath (or local path) of the PersistentVolume
    it is bound to. No provisioner runs here: the PV is created beside the claim (the PV
    controller binds them), and a claim not bound yet is a mount to retry, as a kubelet's."""
    pvc = await _object(kube, "PersistentVolumeClaim", claim, namespace, False)
    assert pvc is not None
    volume = (pvc.get("spec") or {}).get("volumeName")
    if not volume or (pvc.get("status") or {}).get("phase") != "Bound":
        raise VolumeError(f'persistentvolumeclaim "{claim}" is not bound')
    pv = await kube.get("v1", "PersistentVolume", volume)
    source = (pv or {}).get("spec") or {}
    if "hostPath" in source:
        return _host_path(source)  # its type too (DirectoryOrCreate ...), as for a pod's hostPath
    if "local" in source:
        return Path(source["local"]["path"])
    raise VolumeError(f"persistentvolume {volume!r}: only hostPath and local volumes are supported here")


async def prepare(kube: Kube, pod: Obj, volumes_dir: Path, memory_dir: Path, allocatable: dict[str, str]) -> dict[str, Path]:
    """Materialises every volume of the pod; returns volume name -> host path."""
    paths: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes", []):
        name = volume["name"]
        if "emptyDir" in volume:
            medium = volume["emptyDir"].get("medium")
            path = (memory_dir if medium == "Memory" else volumes_dir) / name
            path.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            path = _host_path(volume)
        elif "persistentVolumeClaim" in volume:
            path = await _claim_path(kube, pod["metadata"]["namespace"], volume["persistentVolumeClaim"]["claimName"])
        elif {"configMap", "secret", "downwardAPI", "projected"} & volume.keys():
            files = await _files(kube, pod, volume, allocatable)
            path = volumes_dir / name
            shutil.rmtree(path, ignore_errors=True)
            for rel, (content, mode) in files.items():
                target = path / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                os.chmod(target, mode)
            path.mkdir(parents=True, exist_ok=True)
        else:
            kinds = sorted(volume.keys() - {"name"})
            raise VolumeError(f"volume {name!r}: type {kinds} is not supported by the local pod runner")
        paths[name] = path
    return paths


def mounts(container: Obj, volumes: dict[str, Path], env: dict[str, str]) -> list[Mount]:
    """The container's volumeMounts as host binds, parents before children."""
    result = []
    for vm in container.get("volumeMounts", []):
        source = volumes[vm["name"]]
        sub = vm.get("subPath") or (expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else "")
        if sub:
            source = source / sub
            if not source.exists():
                source.mkdir(parents=True)
        result.append(Mount(str(source), vm["mountPath"], bool(vm.get("readOnly"))))
    return sorted(result, key=lambda m: len(Path(m.target).parts))


def host_path(mounts_: list[Mount], path: str) -> Path:
    """Where a path of the container's lies on the host: under the deepest mount that
    holds it, else the host's own (the rest of the filesystem is the host's)."""
    for m in sorted(mounts_, key=lambda m: len(Path(m.target).parts), reverse=True):
        if Path(path).is_relative_to(m.target):
            return Path(m.source) / Path(path).relative_to(m.target)
    return Path(path)


def termination_message(container: Obj, mounts_: list[Mount], code: int, log_path: Path) -> str:
    """The kubelet's: the file at terminationMessagePath (4 KiB at most); for a failure
    with FallbackToLogsOnError and no such file, the log's last 80 lines."""
    message = ""
    path = container.get("terminationMessagePath")
    if path and (found := host_path(mounts_, path)).is_file():
        message = found.read_text(errors="replace")[-4096:]
    if not message and code and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        message = "\n".join(log_path.read_text(errors="replace").splitlines()[-80:])[-4096:]
    return message


def with_private_dirs(mounts_: list[Mount], *, tmp: Path, shm: Path) -> list[Mount]:
    """A container has its own /tmp and its pod its own /dev/shm, as with a container
    runtime, unless a volume is mounted there."""
    taken = {m.target.rstrip("/") for m in mounts_}
    private = [Mount(str(tmp), "/tmp"), Mount(str(shm), "/dev/shm")]
    return sorted(mounts_ + [m for m in private if m.target not in taken], key=lambda m: len(Path(m.target).parts))


def host_tmp_paths(needed: list[Path]) -> list[str]:
    """The entries of the host's /tmp that hold what a container needs (a checkout or a
    cache under /tmp): the container's private /tmp would hide them."""
    tmp = Path("/tmp")
    return sorted({str(tmp / p.relative_to(tmp).parts[0]) for p in needed if p.is_relative_to(tmp) and p != tmp})


def launch_script(
    mounts_: list[Mount], *, hosts_file: Path, hostname: str, workdir: str,
    keep_host_tmp: Sequence[str] = (), host_tmp_view: Path | None = None,
) -> str:
    """sh script run by `unshare --mount --uts` before exec'ing the container command.
    Missing mount points are created on the host (empty directories or files), as a
    container runtime creates them in the image's filesystem. `keep_host_tmp` stay visible
    through the private /tmp: the host's /tmp is bound to `host_tmp_view` (outside /tmp)
    first, and those paths are bound back from there once /tmp is replaced."""
    q = shlex.quote
    lines = [f"hostname {q(hostname)}", f"mount --bind {q(str(hosts_file))} /etc/hosts"]
    if keep_host_tmp:
        assert host_tmp_view is not None
        lines += [f"mkdir -p {q(str(host_tmp_view))}", f"mount --bind /tmp {q(str(host_tmp_view))}"]
    for m in mounts_:
        if Path(m.source).is_dir():
            lines.append(f"mkdir -p {q(m.target)}")
        else:
            lines.append(f"[ -e {q(m.target)} ] || {{ mkdir -p {q(str(Path(m.target).parent))} && touch {q(m.target)}; }}")
        lines.append(f"mount --bind {q(m.source)} {q(m.target)}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {q(m.target)}")
    for path in keep_host_tmp:
        source = host_tmp_view / Path(path).relative_to("/tmp")
        lines += [f"mkdir -p {q(path)}", f"mount --bind {q(str(source))} {q(path)}"]
    lines += [f"mkdir -p {q(workdir)}", f"cd {q(workdir)}", 'exec "$@"']
    return "\n".join(lines)
