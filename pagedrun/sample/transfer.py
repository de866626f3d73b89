"""Small host lists onto the logits' device without stopping the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for every kernel
already queued on the stream: one such copy in the sampler and the host idles until the forward
is done. Here the values go through pinned memory (torch's caching host allocator, so after the
first steps no new pinning) and a non-blocking copy that is ordered on the stream like a kernel.
On the CPU it is plain torch.tensor.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a 1-D (or nested) tensor of dtype on device, without a host synchronisation."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on device through pinned memory (non-blocking on CUDA, itself on the CPU)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
