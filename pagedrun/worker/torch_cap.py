"""Holding torch's CUDA caching allocator to the memory plan, and the one-line error when a step
still runs out of device memory.

The plan (worker/memory.py) sizes the KV cache from gpu_memory_utilization x total less what the
profile saw in use. Torch then keeps freed blocks of every step shape it meets; on an H200 that
took a run past the limit with no more live memory than the plan held
(docs/log/2026-11-26-h200-first-session.md). Capped at the plan's share, the allocator frees its
cached blocks and retries before it reports out of memory.
"""
from __future__ import annotations

import torch

from pagedrun.worker.memory import KVBudgetError, MemoryPlan, fmt_bytes
from pagedrun.worker.profiler import cuda_index


def step_out_of_memory(plan: MemoryPlan, num_tokens: int, error: BaseException) -> KVBudgetError:
    """A CUDA out-of-memory inside a model step as one line with the numbers and what to change
    (the outputs finished before it are already written)."""
    first = str(error).splitlines()[0][:160] if str(error) else "out of memory"
    held = (f"torch held to {fmt_bytes(plan.torch_cap_bytes)} (the limit less "
            f"{fmt_bytes(plan.profile.non_torch_bytes)} outside torch), " if plan.torch_cap_bytes and plan.profile
            else "")
    return KVBudgetError(
        f"cache.gpu_memory_utilization: a step of {num_tokens} tokens ran out of device memory with {held}"
        f"the KV cache {fmt_bytes(plan.kv_cache_bytes)} ({first}); lower scheduler.max_num_batched_tokens, "
        f"or raise cache.gpu_memory_utilization", plan)


def cap_torch_memory(plan: MemoryPlan, device: torch.device) -> None:
    """Hold torch's caching allocator to plan.torch_cap_bytes (after the cache is allocated): past
    the cap it frees the blocks it keeps cached and retries before it reports out of memory, so
    what it holds stays within gpu_memory_utilization beside what lives outside torch. A cap of
    0 lifts a previous engine's cap in this process (the profile pass lifts it too)."""
    if device.type != "cuda":
        return
    total = torch.cuda.mem_get_info(device)[1]
    fraction = plan.torch_cap_bytes / total if plan.torch_cap_bytes else 1.0
    torch.cuda.set_per_process_memory_fraction(min(max(fraction, 0.0), 1.0), cuda_index(device))


def count_cuda_graphs(plan: MemoryPlan, pool_bytes: int, device_bytes: int, device: torch.device) -> None:
    """After the decode graphs are captured (worker/cuda_graphs.py): what they took is in the plan
    (measured), and the part outside torch's allocator (graph objects: the device's share beyond
    torch's pool) comes off torch's cap, which is re-applied. The pool itself is torch's, under the cap."""
    plan.cuda_graph_measured_bytes = device_bytes
    if plan.torch_cap_bytes:
        plan.torch_cap_bytes = max(0, plan.torch_cap_bytes - max(0, device_bytes - pool_bytes))
        cap_torch_memory(plan, device)
