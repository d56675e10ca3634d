"""The vLLM version the project supports: the default engine image's, and the one the
real-engine tests (tests/e2e/test_vllm.py) run; 0.33 speaks the same protocol
(../shared/research/upstream-audit-2026-12.md, row 12)."""

VLLM_VERSION = "0.32.0"
