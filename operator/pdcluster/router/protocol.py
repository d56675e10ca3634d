"""The prefill/decode handshake of vLLM's in-tree MooncakeConnector (vLLM 0.32 and 0.33).

Everything the router must get exactly right about the connector lives here, so a
NIXL-style protocol (prefill returns the parameters for decode) can be added next to it.

The flow (vllm==0.33.0: vllm/distributed/kv_transfer/kv_connector/v1/mooncake/):
- each prefill instance serves `GET http://<ip>:<VLLM_MOONCAKE_BOOTSTRAP_PORT>/query`
  -> {"<dp_rank>": {"engine_id": ..., "worker_addr": {...}}} (mooncake_utils.py);
- the router sends the prefill request with kv_transfer_params {do_remote_decode: true,
  do_remote_prefill: false, transfer_id} and, concurrently, the decode request with
  {do_remote_prefill: true, do_remote_decode: false, remote_engine_id,
  remote_bootstrap_addr, transfer_id}; `transfer_id` joins the two. Prefill answers
  with kv_transfer_params null: decode's parameters come from the router alone.
- `X-data-parallel-rank` on the prefill request selects the DP rank whose engine_id
  decode is told about (vllm/entrypoints/generate/base/serving.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

KV_TRANSFER_PARAMS = "kv_transfer_params"


class BootstrapError(Exception):
    """The bootstrap server gave no usable engine map."""


@dataclass(frozen=True)
class PrefillEngine:
    """One DP rank of a prefill instance, as decode must name it."""

    engine_id: str
    dp_rank: int
    bootstrap_addr: str  # base URL; vLLM's decode side appends /query


class MooncakeProtocol:
    name = "mooncake"

    @staticmethod
    def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
        """The client's body, made into a prefill-only request."""
        out = dict(body)
        out["stream"] = False
        # vLLM rejects stream_options unless stream is true (completion/protocol.py).
        out.pop("stream_options", None)
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        # Prefill holds the KV for decode only when it stops by length
        # (request_finished: status == FINISHED_LENGTH_CAPPED); if its one token were
        # EOS or a stop token it would free the blocks at once and decode would wait
        # for KV that never comes. min_tokens=1 masks EOS and stop_token_ids for the
        # first token (MinTokensLogitsProcessor, vllm/v1/sample/logits_processor/
        # builtin.py) and defers stop strings past it (vllm/v1/engine/detokenizer.py),
        # so with max_tokens=1 the request always ends length-capped.
        out["min_tokens"] = 1
        out[KV_TRANSFER_PARAMS] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        return out

    @staticmethod
    def decode_body(body: dict[str, Any], transfer_id: str, engine: PrefillEngine) -> dict[str, Any]:
        out = dict(body)
        out[KV_TRANSFER_PARAMS] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine.engine_id,
            "remote_bootstrap_addr": engine.bootstrap_addr,
            "transfer_id": transfer_id,
        }
        return out

    @staticmethod
    def prefill_headers(request_id: str, engine: PrefillEngine) -> list[tuple[str, str]]:
        return [
            ("Content-Type", "application/json"),
            ("X-Request-Id", request_id),
            ("X-data-parallel-rank", str(engine.dp_rank)),
        ]

    @staticmethod
    def decode_headers(request_id: str) -> list[tuple[str, str]]:
        return [("Content-Type", "application/json"), ("X-Request-Id", request_id)]

    @staticmethod
    def parse_query(payload: Any, bootstrap_addr: str) -> list[PrefillEngine]:
        """Engines of a /query answer, by DP rank. Ranks appear as their workers
        register, so a starting instance may list only some of them."""
        if not isinstance(payload, dict):
            raise BootstrapError(f"/query answered {type(payload).__name__}, not an object")
        engines = []
        for rank, entry in payload.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("engine_id"), str):
                raise BootstrapError(f"/query entry for rank {rank!r} has no engine_id")
            try:
                dp_rank = int(rank)
            except ValueError:
                raise BootstrapError(f"/query rank {rank!r} is not an integer") from None
            engines.append(PrefillEngine(entry["engine_id"], dp_rank, bootstrap_addr))
        return sorted(engines, key=lambda e: e.dp_rank)

    @classmethod
    async def query(
        cls, session: aiohttp.ClientSession, bootstrap_addr: str, timeout: float = 5.0
    ) -> list[PrefillEngine]:
        try:
            async with session.get(
                f"{bootstrap_addr}/query", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                if resp.status != 200:
                    raise BootstrapError(f"{bootstrap_addr}/query answered HTTP {resp.status}")
                payload = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
            raise BootstrapError(f"{bootstrap_addr}/query failed: {e!r}") from e
        return cls.parse_query(payload, bootstrap_addr)
