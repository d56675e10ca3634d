"""Fixes for vLLM 0.32 bugs that prefill/decode with the Mooncake store runs into, each
gone once vLLM has the upstream fix:

1. MultiConnector with MooncakeConnector and MooncakeStoreConnector (what the operator
   renders with `mooncake.store.enabled`) kills the API server on the first successful KV
   hand-off: MooncakeConnector reports transfer stats but registers no Prometheus
   metrics, and MultiKVConnectorPromMetrics.observe asserts that every child that
   reported stats has them ("MooncakeConnector is not contained in the list of
   registered connectors with Prometheus metrics support", vllm/distributed/kv_transfer/
   kv_connector/v1/multi_connector.py; vllm-project/vllm#43828, fixed by #43836). As
   that fix does, stats of a child without Prometheus metrics are skipped.
"""

from __future__ import annotations

from typing import Any


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    metrics = multi_connector.MultiKVConnectorPromMetrics
    if getattr(metrics.observe, "_skips_unregistered", False):
        return
    original = metrics.observe

    def observe(self: Any, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        registered = {k: v for k, v in transfer_stats_data.items() if k in self._prom_metrics}
        original(self, registered, engine_idx)

    observe._skips_unregistered = True  # type: ignore[attr-defined]
    metrics.observe = observe
