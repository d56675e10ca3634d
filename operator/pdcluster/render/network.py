"""NetworkPolicies (`spec.networkPolicy.enabled`): for each component, ingress from exactly
the pods and ports that need it; egress is not restricted.

The ports and where they come from:
- engine API (`engine.port`): the router, and `scrapeFrom` for /metrics;
- with the precise-prefix policy, vLLM's KV events publisher and its replay socket (5557
  and 5657, plus the DP rank): the router;
- the prefill bootstrap server (VLLM_MOONCAKE_BOOTSTRAP_PORT): the router (`GET /query`)
  and decode engines (vLLM mooncake_connector.py);
- vLLM's KV side channel: a ZMQ socket the sender binds with `bind_to_random_port`, in
  pyzmq's default 49152-65535, between engines;
- the transfer engine's handshake RPC (`kvTransfer.rpcPortMin`-`rpcPortMax`, rendered as
  MC_MIN_RPC_PORT / MC_MAX_RPC_PORT), between engines and store pods;
- with the store: each Mooncake client's segment port, in MC_STORE_CLIENT_MIN_PORT -
  MC_STORE_CLIENT_MAX_PORT (12300-14300 by default, Mooncake client docs), between engines
  and store pods; the master's RPC port from both, its metrics port from the router
  (store lookups) and `scrapeFrom`, its HTTP metadata server from both when enabled.

- a role spanning nodes: any port between its pods (the ranks of each group).

RDMA verbs bypass the kernel's network stack, and host-network pods are outside any
NetworkPolicy: these policies govern the TCP paths only.
"""

from __future__ import annotations

from typing import Any

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec, RouterPolicy
from pdcluster.render.names import Owner, metadata, selector

ZMQ_RANDOM_PORTS = (49152, 65535)  # pyzmq Socket.bind_to_random_port defaults
STORE_CLIENT_PORTS = (12300, 14300)  # Mooncake MC_STORE_CLIENT_MIN_PORT / MAX_PORT defaults


def _port(port: int, end: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"protocol": "TCP", "port": port}
    if end is not None and end != port:
        out["endPort"] = end
    return out


def _pods(owner: Owner, *roles: str) -> dict[str, Any]:
    if len(roles) == 1:
        return {"podSelector": {"matchLabels": selector(owner, roles[0])}}
    expressions = [{"key": C.LABEL_ROLE, "operator": "In", "values": sorted(roles)}]
    return {"podSelector": {"matchLabels": {C.LABEL_CLUSTER: owner.name}, "matchExpressions": expressions}}


def _policy(owner: Owner, role: str, pods: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, role),
        "spec": {**pods, "policyTypes": ["Ingress"], "ingress": rules},
    }


def build_network_policies(spec: PDClusterSpec, owner: Owner) -> list[dict[str, Any]]:
    if not spec.network_policy.enabled:
        return []
    kv = spec.kv_transfer
    engines = spec.engine_roles
    store = spec.mooncake.store.enabled
    peers = [_pods(owner, *engines)] + ([_pods(owner, C.ROLE_MOONCAKE_STORE)] if store else [])
    router = [_pods(owner, C.ROLE_ROUTER)]
    scrape = list(spec.network_policy.scrape_from)
    transfer = [_port(kv.rpc_port_min, kv.rpc_port_max)] + ([_port(*STORE_CLIENT_PORTS)] if store else [])

    api = [_port(spec.engine.port)]
    engine_rules = [{"from": router + scrape, "ports": api}]
    if spec.hands_off_kv:
        bootstrap = [_port(kv.bootstrap_port)]
        engine_rules += [
            {"from": router, "ports": bootstrap},
            {"from": [_pods(owner, *engines)], "ports": [*bootstrap, _port(*ZMQ_RANDOM_PORTS)]},
        ]
    engine_rules.append({"from": peers, "ports": transfer})
    if spec.router.policy == RouterPolicy.precise_prefix:
        # The router subscribes to the engines' KV events and asks their replay sockets
        # for what it missed: DP rank r on each port + r.
        last = max(spec.role(role).data_parallel_size for role in engines) - 1
        events = [_port(C.KV_EVENTS_PORT, C.KV_EVENTS_PORT + last)]
        events.append(_port(C.KV_EVENTS_REPLAY_PORT, C.KV_EVENTS_REPLAY_PORT + last))
        engine_rules.append({"from": router, "ports": events})
    if spanning := [role for role in engines if spec.role(role).nodes > 1]:
        # A group's ranks meet on torch.distributed's store at the leader and then talk
        # over sockets each picks (NCCL or Gloo, vLLM's message queue): any port.
        engine_rules.append({"from": [_pods(owner, *spanning)]})
    policies = [
        _policy(owner, "engines", _pods(owner, *engines), engine_rules),
        # Clients come from anywhere the router's Service is reachable from.
        _policy(owner, C.ROLE_ROUTER, _pods(owner, C.ROLE_ROUTER), [{"ports": [_port(spec.router.port)]}]),
    ]
    m = spec.mooncake
    master_rules = [
        {"from": peers, "ports": [_port(m.rpc_port)]},
        {"from": router + scrape, "ports": [_port(m.metrics_port)]},
    ]
    if m.http_metadata_server:
        master_rules.append({"from": peers, "ports": [_port(m.http_metadata_port)]})
    policies.append(
        _policy(owner, C.ROLE_MOONCAKE_MASTER, _pods(owner, C.ROLE_MOONCAKE_MASTER), master_rules)
    )
    if store and m.store.replicas:
        store_rules = [{"from": peers, "ports": [*transfer, _port(m.store.port)]}]
        policies.append(
            _policy(owner, C.ROLE_MOONCAKE_STORE, _pods(owner, C.ROLE_MOONCAKE_STORE), store_rules)
        )
    return policies
