"""The KV hand-off between a prefill and a decode simulator, as vLLM's MooncakeConnector
(vllm==0.33.0: .../kv_connector/v1/mooncake/) does it.

- transfers.py: prefill side, the KV kept for decode until it is pulled or expires;
- side_channel.py: prefill side, the bootstrap route and the side channel that serves pulls;
- puller.py: decode side, resolving a prefill engine and pulling from it;
- json_lines.py: the side channel's wire format, shared by both sides;
- mooncake_client.py: the optional real Mooncake store the push also goes through.
"""
