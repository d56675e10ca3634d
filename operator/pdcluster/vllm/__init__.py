"""The one place that knows vLLM: the version the project supports, its kv-transfer
vocabulary and its KV-events config. render, router, enginesim and sim import it."""
