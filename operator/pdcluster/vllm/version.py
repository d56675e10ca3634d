"""The vLLM version the project supports: the default engine image's, and the one the
real-engine tests (tests/e2e/test_vllm.py) run. Comments that cite 0.33 name where a fact
was read; 0.33 speaks the same MooncakeConnector protocol, flags and metrics as 0.32 (both
wheels' source read side by side)."""

VLLM_VERSION = "0.32.0"
