"""vLLM's kv-transfer vocabulary (vllm/config/kv_transfer.py, KVTransferConfig) and its
KV events config (config/kv_events.py, KVEventsConfig), as the engines are launched with
them and as the engine simulator reads them back."""

from __future__ import annotations

KV_PRODUCER = "kv_producer"
KV_CONSUMER = "kv_consumer"
KV_BOTH = "kv_both"
KV_ROLES = (KV_PRODUCER, KV_CONSUMER, KV_BOTH)

# The keys of a --kv-transfer-config, and of a MultiConnector's list of children.
CONNECTOR_KEY = "kv_connector"
ROLE_KEY = "kv_role"
EXTRA_KEY = "kv_connector_extra_config"
CHILDREN_KEY = "connectors"

HANDOFF_CONNECTOR = "MooncakeConnector"
STORE_CONNECTOR = "MooncakeStoreConnector"
MULTI_CONNECTOR = "MultiConnector"

# A store connector in these roles writes the blocks it computes, in these it loads.
WRITING_ROLES = (KV_BOTH, KV_PRODUCER)
LOADING_ROLES = (KV_BOTH, KV_CONSUMER)


def kv_events_config(port: int, replay_port: int) -> dict[str, object]:
    """`--kv-events-config` of an engine that publishes on ZMQ, all interfaces."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
