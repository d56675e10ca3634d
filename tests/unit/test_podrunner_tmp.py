"""A checkout under /tmp (a fresh clone there) stays visible to containers, whose /tmp
is private: the launch script binds the host's /tmp aside first, then binds the needed
entries back over the private /tmp."""

from __future__ import annotations

from pathlib import Path

from localcluster.podrunner import volumes


def test_only_entries_under_tmp_are_kept() -> None:
    needed = [
        Path("/tmp/pdc-demo"),
        Path("/tmp/pdc-demo/.venv/bin"),
        Path("/tmp/cold/cache/shim.so"),
        Path("/home/user/x"),
    ]
    assert volumes.host_tmp_paths(needed) == ["/tmp/cold", "/tmp/pdc-demo"]
    assert volumes.host_tmp_paths([Path("/srv/checkout"), Path("/tmp")]) == []


def test_kept_paths_are_bound_back_after_the_private_tmp() -> None:
    mounts = volumes.with_private_dirs([], tmp=Path("/run/pods/p/tmp/c"), shm=Path("/dev/shm/x"))
    script = volumes.launch_script(
        mounts,
        hosts_file=Path("/run/pods/p/hosts"),
        hostname="p",
        workdir="/",
        keep_host_tmp=["/tmp/pdc-demo"],
        host_tmp_view=Path("/run/pods/p/host-tmp"),
    ).splitlines()
    aside = script.index("mount --bind /tmp /run/pods/p/host-tmp")
    private = script.index("mount --bind /run/pods/p/tmp/c /tmp")
    back = script.index("mount --bind /run/pods/p/host-tmp/pdc-demo /tmp/pdc-demo")
    assert aside < private < back < script.index('exec "$@"')


def test_nothing_extra_without_paths_under_tmp() -> None:
    script = volumes.launch_script([], hosts_file=Path("/h"), hostname="p", workdir="/")
    assert "host-tmp" not in script and "mount --bind /tmp " not in script
