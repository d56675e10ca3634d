"""The demo's replay-and-watch loop offline: a stand-in router that streams tokens, a
stand-in Prometheus, and the PDCluster in the in-memory apiserver."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import yaml
from aiohttp import web
from fakekube import FakeKube
from rich.console import Console

import demo
from pdcluster import constants as C
from pdcluster.api.v1alpha1 import AutoscalingSpec
from pddemo.observe import Observer
from pddemo.view import View
from pddemo.workload import ENGINES, Phase, Request

DECISION = {
    "time": "2026-01-02T10:11:12.345Z",
    "prefill": 2,
    "decode": 3,
    "action": "scale",
    "cause": "TTFTOverTarget",
    "summary": "prefill 1 -> 2, decode 2 -> 3: TTFT p90 3955 ms over 2000 ms",
    "reason": "the figures",
}


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] and body["ignore_eos"] and len(body["prompt"]) == 600
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(body["max_tokens"]):
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def prometheus(request: web.Request) -> web.Response:
    assert 'pdcluster="demo",namespace="demo"' in request.query["query"]
    return web.json_response(
        {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "0.5"]}]},
        }
    )


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_replay_is_answered_and_the_view_shows_the_cluster() -> None:
    router, prom = web.Application(), web.Application()
    router.router.add_post("/v1/completions", completions)
    prom.router.add_get("/api/v1/query", prometheus)
    engine = ENGINES["sim"]
    doc = yaml.safe_load(engine.example.read_text())
    kube = FakeKube()
    kube.put(
        {
            "apiVersion": C.API_VERSION,
            "kind": C.KIND,
            "metadata": {"name": "demo", "namespace": "demo"},
            "status": {"prefill": {"desired": 2, "ready": 2}, "autoscaling": {"lastDecision": DECISION}},
        }
    )
    requests = [Request(k * 0.05, 600, 4, (k, k + 1), salt=k) for k in range(5)]
    run = demo.ReplayPlan(engine, doc, [Phase(1, 1.0)], requests)
    console_out = io.StringIO()
    async with serving(router) as router_url, serving(prom) as prom_url:
        observer = Observer(kube, prom_url, "demo", "demo", AutoscalingSpec.model_validate(doc["spec"]["autoscaling"]), False)
        try:
            with View(Console(file=console_out, width=200), "demo", 5, True) as view:
                out = await demo.replay_while_watching(router_url, "m", run, observer, view, cooldown_s=0)
        finally:
            await observer.close()
    assert (out.sent, out.ok, out.failed, out.rejected) == (5, 5, 0, 0), out.last_error
    assert len(out.ttft_s) == 5 and len(out.itl_s) == 5
    reading = observer.snapshot.reading
    assert (reading.raw_ttft_ms, reading.ttft_ms, observer.snapshot.requests_rate) == (500.0, 500.0, 0.5)
    assert [d.time for d in observer.decisions] == [DECISION["time"]]
    assert "scale at 10:11:12: prefill 2, decode 3: prefill 1 -> 2" in console_out.getvalue()
