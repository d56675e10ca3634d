"""Flexible mode with real vLLM (CPU, MooncakeConnector kv_both over TCP) behind the
operator: three engines of one configuration, one acting as prefill and two as decode;
then the split changes to two and one under streaming load. The flipped engine is not
restarted, no request fails, KV still moves from prefill to decode, and the answers equal
a plain request's token for token. The time from the spec change to the routers applying
the new roles is printed (a figure, not a bound)."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import yaml
from harness import StreamLoad, counter, install_crd, settled, start_operator
from test_vllm import EXAMPLE, REQUEST_TIMEOUT, poll

from pdcluster import constants as C
from pdcluster.io.kube import Kube, KubeConfig

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]

NAME = "agile"
STARTUP_S = 900
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def flexible_example() -> dict[str, Any]:
    """The real-vLLM example as a flexible pool of three engines: one prefill, two decode."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["mode"] = "flexible"
    spec["mooncake"] = {"store": {"enabled": False}}
    spec["autoscaling"] = {"enabled": False}
    spec["router"].update(policy="least-loaded", kvProbe={"intervalSeconds": 3600})
    spec["router"].pop("storeHits", None)
    spec["prefill"] = {"replicas": 1, "maxReplicas": 3}
    spec["decode"] = {"replicas": 2, "maxReplicas": 3}
    doc["metadata"]["name"] = NAME
    return doc


@dataclass
class Pool:
    kube: Kube
    namespace: str
    router: str
    model: str

    async def engines(self) -> list[dict[str, Any]]:
        pods = await self.kube.list(
            "v1", "Pod", self.namespace, label_selector=f"{C.LABEL_CLUSTER}={NAME},{C.LABEL_ROLE}={C.ROLE_FLEXIBLE}"
        )
        return sorted(pods, key=lambda p: int(p["metadata"]["name"].rsplit("-", 1)[1]))

    async def urls(self) -> list[str]:
        return [f"http://{p['status']['podIP']}:8000" for p in await self.engines()]

    async def roles(self, http: aiohttp.ClientSession) -> dict[str, str]:
        async with http.get(f"{self.router}/backends") as r:
            return (await r.json())["flexible"]["roles"]


@pytest.fixture(scope="module")
async def pool(vllm_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pool]:
    doc = flexible_example()
    namespace = f"flex-{uuid.uuid4().hex[:5]}"
    async with Kube(KubeConfig.from_file(vllm_cluster.kubeconfig)) as kube:
        await install_crd(kube)
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        await poll(lambda: kube.get("v1", "ServiceAccount", "default", namespace), 30, "default ServiceAccount")
        log = tmp_path_factory.mktemp("flexible") / "operator.log"
        operator = start_operator(vllm_cluster.kubeconfig, namespace, log)
        try:
            doc["metadata"]["namespace"] = namespace
            await kube.apply(doc, field_manager="kubectl-test")

            async def up() -> bool:
                body = await kube.get(C.API_VERSION, C.KIND, NAME, namespace)
                verified = any(
                    c["type"] == "KVTransfer" and c["status"] == "True"
                    for c in ((body or {}).get("status") or {}).get("conditions", [])
                )
                return settled(body) and verified

            await poll(up, STARTUP_S, "flexible PDCluster Ready with its KV hand-off verified", interval=2)
            svc = await kube.get("v1", "Service", f"{NAME}-router", namespace)
            yield Pool(kube, namespace, f"http://{svc['spec']['clusterIP']}:8000", doc["spec"]["model"]["servedModelName"])
        finally:
            operator.kill(signal.SIGTERM)
            await kube.delete("v1", "Namespace", namespace)
            await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods")
        failures = operator.failures()
        assert not failures, failures[:5]


def answered(load: StreamLoad, count: int) -> Callable[[], Awaitable[bool]]:
    async def enough() -> bool:
        return len(load.outcomes) >= count

    return enough


async def completion(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with http.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        answer = await r.json()
        assert r.status == 200, answer
    return answer["choices"][0]["text"]


async def by_source(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    return {s: counter(text, BY_SOURCE, source=s) for s in ("local_compute", "external_kv_transfer")}


async def test_a_flip_under_load_keeps_every_request_and_the_same_answers(pool: Pool) -> None:
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    body = {"model": pool.model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        urls = await pool.urls()
        uids = [p["metadata"]["uid"] for p in await pool.engines()]
        assert await pool.roles(http) == {urls[0]: "prefill", urls[1]: "decode", urls[2]: "decode"}
        body_ = await pool.kube.get(C.API_VERSION, C.KIND, NAME, pool.namespace)
        assert body_["status"]["ratio"] == "1:2"
        plain = await completion(http, urls[1], body)  # one engine, no hand-off: the reference
        assert await completion(http, pool.router, body) == plain

        async with StreamLoad(pool.router, concurrency=3, max_tokens=16) as load:
            await poll(answered(load, 3), 120, "load flowing")
            before = [await by_source(http, u) for u in urls]
            changed = time.monotonic()
            await pool.kube.merge_patch(
                C.API_VERSION, C.KIND, NAME, pool.namespace,
                {"spec": {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}},
            )  # fmt: skip

            async def flipped() -> bool:
                return (await pool.roles(http)).get(urls[1]) == "prefill"

            await poll(flipped, 60, "the routers apply the new split", interval=0.1)
            print(f"\nflip: spec change to roles applied by the router in {time.monotonic() - changed:.2f} s")
            sent = len(load.outcomes)
            await poll(answered(load, sent + 6), 180, "load after the flip")
        assert load.failures() == [], load.failures()[:3]

        after = [await by_source(http, u) for u in urls]
        # Engine 1 now prefills (computes prompts) and engine 2 still receives the KV.
        assert after[1]["local_compute"] > before[1]["local_compute"]
        assert after[2]["external_kv_transfer"] > before[2]["external_kv_transfer"]
        assert await completion(http, pool.router, body) == plain
        pods = await pool.engines()
        assert [p["metadata"]["uid"] for p in pods] == uids, "no engine was replaced"
        assert all(cs["restartCount"] == 0 for p in pods for cs in p["status"]["containerStatuses"])

        async def ratio() -> bool:
            live = await pool.kube.get(C.API_VERSION, C.KIND, NAME, pool.namespace)
            return live["status"].get("ratio") == "2:1"

        await poll(ratio, 60, "status.ratio says 2:1")
