"""Backends from EndpointSlices and from static flags."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.router.discovery import Members, members_from_slices, parse_static


def endpoint_slice(role: str, endpoints: list[dict[str, Any]], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"c-{role}-x1",
            "labels": {"pdcluster.io/cluster": "c", "pdcluster.io/role": role},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    }


def ep(address: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [address], "conditions": conditions}


PREFILL_PORTS = [{"name": "bootstrap", "port": 8998, "protocol": "TCP"}, {"name": "http", "port": 8000}]


def test_ready_endpoints_become_backends() -> None:
    slices = [
        endpoint_slice(
            "prefill", [ep("127.1.0.1"), ep("127.1.0.2", ready=False), ep("127.1.0.3", None)], PREFILL_PORTS
        ),
        endpoint_slice(
            "decode", [ep("127.1.0.4"), ep("127.1.0.5", ready=False)], [{"name": "http", "port": 8001}]
        ),
    ]
    assert members_from_slices(slices) == Members(
        prefill={
            "http://127.1.0.1:8000": "http://127.1.0.1:8998",
            "http://127.1.0.3:8000": "http://127.1.0.3:8998",  # no condition means ready (API docs)
        },
        decode=frozenset({"http://127.1.0.4:8001"}),
    )


def test_slices_without_http_port_or_role_are_ignored() -> None:
    slices = [
        endpoint_slice("decode", [ep("127.1.0.4")], [{"name": "metrics", "port": 9000}]),
        endpoint_slice("router", [ep("127.1.0.6")], [{"name": "http", "port": 8000}]),
        {"metadata": {"name": "bare"}, "endpoints": None, "ports": None},
    ]
    assert members_from_slices(slices) == Members()


def test_bootstrap_port_defaults_and_ipv6() -> None:
    slices = [endpoint_slice("prefill", [ep("fd00::5")], [{"name": "http", "port": 8000}])]
    assert members_from_slices(slices).prefill == {"http://[fd00::5]:8000": "http://[fd00::5]:8998"}


def test_parse_static() -> None:
    members = parse_static(
        ["http://127.0.0.1:8100#bootstrap=9000", "http://127.0.0.2:8100/"], ["http://127.0.0.1:8200"]
    )
    assert members.prefill == {
        "http://127.0.0.1:8100": "http://127.0.0.1:9000",
        "http://127.0.0.2:8100": "http://127.0.0.2:8998",
    }
    assert members.decode == frozenset({"http://127.0.0.1:8200"})


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        (["http://h:1#bootstrap=x"], []),
        (["http://h:1#port=2"], []),
        (["h:1"], []),
        (["https://h:1"], []),
        ([], ["http://h"]),
    ],
)
def test_parse_static_rejects_bad_values(prefill: list[str], decode: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_static(prefill, decode)


def pod(
    name: str,
    role: str,
    ip: str | None,
    ready: bool,
    *,
    deleting: bool = False,
    ports: list[dict] | None = None,
) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": {"pdcluster.io/cluster": "c", "pdcluster.io/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "ports": ports or []}]},
        "status": {
            **({"podIP": ip} if ip else {}),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_ready_pods_become_backends() -> None:
    from pdcluster.router.discovery import members_from_pods

    named = [{"name": "http", "containerPort": 9000}, {"name": "bootstrap", "containerPort": 9998}]
    pods = [
        pod("p0", "prefill", "127.1.0.1", True, ports=named),
        pod("p1", "prefill", "127.1.0.2", True),  # no named ports: vLLM's defaults
        pod("p2", "prefill", "127.1.0.3", False),
        pod("p3", "prefill", "127.1.0.4", True, deleting=True),
        pod("d0", "decode", "127.1.0.5", True),
        pod("d1", "decode", None, True),
        pod("r0", "router", "127.1.0.6", True),
    ]
    pods[0]["metadata"]["labels"]["pdcluster.io/kv-revision"] = "3f2a9c81d0e4"
    assert members_from_pods(pods) == Members(
        prefill={
            "http://127.1.0.1:9000": "http://127.1.0.1:9998",
            "http://127.1.0.2:8000": "http://127.1.0.2:8998",
        },
        decode=frozenset({"http://127.1.0.5:8000"}),
        names={"http://127.1.0.1:9000": "p0", "http://127.1.0.2:8000": "p1", "http://127.1.0.5:8000": "d0"},
        revisions={
            "http://127.1.0.1:9000": "3f2a9c81d0e4",
            "http://127.1.0.2:8000": "",
            "http://127.1.0.5:8000": "",
        },
        routers=frozenset({"r0"}),
    )


def test_of_a_multi_node_group_only_the_leader_serves() -> None:
    from pdcluster.router.discovery import members_from_pods

    leader, worker = pod("p-0", "prefill", "127.1.0.1", True), pod("p-0-1", "prefill", "127.1.0.2", True)
    leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = "0"
    worker["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = "1"
    members = members_from_pods([leader, worker, pod("d0", "decode", "127.1.0.3", True)])
    assert list(members.prefill) == ["http://127.1.0.1:8000"]
    assert members.decode == frozenset({"http://127.1.0.3:8000"})


def test_colocated_engines_form_a_plain_pool() -> None:
    from pdcluster.router.discovery import members_from_pods

    slices = [
        endpoint_slice(
            "colocated", [ep("127.1.0.7"), ep("127.1.0.8", ready=False)], [{"name": "http", "port": 8000}]
        )
    ]
    assert members_from_slices(slices) == Members(colocated=frozenset({"http://127.1.0.7:8000"}))
    pods = [pod("e0", "colocated", "127.1.0.7", True), pod("e1", "colocated", "127.1.0.8", False)]
    members = members_from_pods(pods)
    assert (
        members.colocated == frozenset({"http://127.1.0.7:8000"})
        and not members.prefill
        and not members.decode
    )
    assert parse_static([], [], ["http://127.1.0.7:8000/"]) == Members(
        colocated=frozenset({"http://127.1.0.7:8000"})
    )


async def test_a_plain_pool_alone_is_ready() -> None:
    import aiohttp

    from pdcluster.router.membership import Pool

    async with aiohttp.ClientSession() as session:
        pool = Pool(session)
        assert not pool.ready
        pool.update(Members(decode=frozenset({"http://127.1.0.5:8000"})))
        assert not pool.ready  # a decode without a prefill serves nothing
        pool.update(Members(colocated=frozenset({"http://127.1.0.7:8000"})))
        assert pool.ready and [u.role for u in pool.colocated] == ["colocated"] and not pool.decode
        pool.update(Members())
        assert not pool.ready and not pool.colocated
