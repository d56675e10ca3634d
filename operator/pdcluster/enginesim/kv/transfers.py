"""Prefill side of the KV hand-off: the KV kept for decode, keyed by transfer id.

As in vLLM's MooncakeConnector, a pull that arrives before the prefill waits for it up to
VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT; KV nobody pulls is freed after the same timeout and
counted in vllm:mooncake_num_kv_expired_reqs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class NotProcessed(Exception):
    """The prefill ended without keeping its KV (stop, abort, error)."""


@dataclass
class _Transfer:
    ready: asyncio.Future[int]
    engine: int = 0  # DP rank that prefilled it
    release: Callable[[], None] | None = None
    expiry: asyncio.TimerHandle | None = None
    pulling: bool = False


@dataclass
class TransferTable:
    """Prefill side: KV kept for decode, keyed by transfer_id."""

    abort_timeout_s: float
    on_expired: Callable[[int], None] = lambda engine: None
    _entries: dict[str, _Transfer] = field(default_factory=dict)

    def _entry(self, transfer_id: str) -> _Transfer:
        entry = self._entries.get(transfer_id)
        if entry is None:
            entry = _Transfer(asyncio.get_running_loop().create_future())
            self._entries[transfer_id] = entry
        return entry

    def prefilled(
        self, transfer_id: str, engine: int, tokens: int, release: Callable[[], None] | None
    ) -> None:
        """`release` frees the held KV; None when the prefill kept nothing."""
        entry = self._entry(transfer_id)
        entry.engine = engine
        entry.release = release
        if not entry.ready.done():
            if release is None:
                entry.ready.set_exception(NotProcessed(transfer_id))
                entry.ready.exception()  # retrieved: nobody may ever pull it
            else:
                entry.ready.set_result(tokens)
        loop = asyncio.get_running_loop()
        entry.expiry = loop.call_later(self.abort_timeout_s, self._expire, transfer_id)

    def _expire(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id, None)
        if entry is None:
            return
        if entry.release is not None:
            log.warning(
                "Request %s timed out after %d seconds without being sent. Freeing its blocks on the producer side.",
                transfer_id,
                self.abort_timeout_s,
            )
            entry.release()
            self.on_expired(entry.engine)
        if not entry.ready.done():
            entry.ready.set_exception(NotProcessed(transfer_id))
            entry.ready.exception()

    async def wait(self, transfer_id: str) -> tuple[int, int]:
        """(engine, tokens) once prefilled; raises NotProcessed or TimeoutError."""
        entry = self._entry(transfer_id)
        if entry.pulling:
            raise NotProcessed(f"{transfer_id} is already being pulled")
        if not entry.ready.done():  # the pull came first: wait for the prefill
            try:
                await asyncio.wait_for(asyncio.shield(entry.ready), self.abort_timeout_s)
            except TimeoutError:
                if not entry.ready.done():
                    self._entries.pop(transfer_id, None)
                raise
        tokens = entry.ready.result()
        entry.pulling = True
        return entry.engine, tokens

    def pulled(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id, None)
        if entry is None:
            return
        if entry.expiry is not None:
            entry.expiry.cancel()
        if entry.release is not None:
            entry.release()
