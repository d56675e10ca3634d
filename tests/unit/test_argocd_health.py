"""The Argo CD health check we ship (charts/pdcluster-operator/files/argocd-health.lua),
run in a real Lua interpreter on the statuses reconcile writes (against fakekube)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fakekube import FakeKube
from test_reconcile import pdcluster, run

lupa = pytest.importorskip("lupa")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "charts" / "pdcluster-operator" / "files" / "argocd-health.lua"


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """What Argo CD would show: the script runs with the object as the global `obj`."""
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def table(value: Any) -> Any:
        if isinstance(value, dict):
            return lua.table_from({k: table(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([table(v) for v in value])
        return value

    lua.globals().obj = table(obj)
    hs = lua.execute(SCRIPT.read_text())
    return hs["status"], hs["message"]


def ready_workloads(kube: FakeKube) -> None:
    """Every workload's pods ready, as the controllers would report them."""
    for (kind, _, _), stored in kube.objects.items():
        if kind in ("StatefulSet", "Deployment"):
            n = stored.applied["spec"]["replicas"]
            stored.status = {
                "replicas": n, "readyReplicas": n, "updatedReplicas": n,
                "observedGeneration": stored.meta["generation"], "currentRevision": "r1", "updateRevision": "r1",
            }  # fmt: skip


async def test_the_docs_show_the_shipped_script() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    shown = re.search(r"```lua\n(.*?)```", doc, re.S)
    assert shown and shown.group(1) in SCRIPT.read_text()


async def test_health_through_a_pdcluster_s_life() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    assert health(body)[0] == "Progressing"  # no status yet
    body = await run(kube, body)
    status, message = health(body)
    assert status == "Progressing" and message.startswith("waiting for prefill, decode")
    ready_workloads(kube)
    body = await run(kube, body)
    assert health(body)[0] == "Healthy", body["status"]["conditions"]
    body["metadata"]["generation"] = 2  # a new spec the operator has not seen
    assert health(body) == ("Progressing", "the operator has not seen the latest spec yet")


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ({"suspend": True}, "Suspended"),
        ({"paused": True}, "Suspended"),
        ({"engine": {"hfTokenSecret": {"name": "missing"}}}, "Degraded"),
    ],
    ids=["suspended", "paused", "missing secret"],
)
async def test_health_of_states_a_user_asked_for_or_must_fix(spec: dict, want: str) -> None:
    kube = FakeKube()
    body = await run(kube, pdcluster(kube, **spec))
    ready_workloads(kube)
    body = await run(kube, body)
    status, message = health(body)
    assert status == want, (status, message)
    if want == "Degraded":
        assert "SecretNotFound" in message
