"""CacheEngine: the physical KV cache tensors, the CPU swap space, and the block moves between them.

Per layer the attention backends see (key_cache, value_cache), each
[num_blocks, block_size, num_kv_heads, head_size] (pagedrun/attention/backend.py). Here all of them
are views of ONE tensor per device, [num_slots (layers; kv/groups.py), 2 (K/V), num_blocks, block_size, kv_heads, head_size]:
every view is still contiguous (it fixes the two leading indices), and a swap or a copy-on-write
batch becomes a single gather + scatter along the block dimension for all layers at once, instead
of a Python loop over layers and blocks (vLLM's swap_blocks / copy_blocks kernels do the same job).

The manager decides which blocks move; this class only moves bytes.
"""
from __future__ import annotations

from typing import Callable, Union

import torch

from pagedrun.attention.kv_cache_spec import KVCacheSpec, kv_cache_spec
from pagedrun.errors import PagedrunError

BlockMapping = list[tuple[int, int]]  # (src_block, dst_block)


def _as_dtype(dtype: Union[torch.dtype, str]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: Union[torch.dtype, str],
        device: Union[torch.device, str],
        kv_spec: KVCacheSpec | None = None,
        fp8_scales: tuple[float | None, float | None] = (None, None),
        layer_slots: list[int] | None = None,
    ):
        """dtype: the model's; kv_spec (attention/kv_cache_spec.py): how the cache stores K/V (default: in dtype).
        fp8_scales: the recipe's k_scale / v_scale for every layer (None: calibrated on first write).
        layer_slots: the tensor slot of every layer when KV cache groups share slots (kv/groups.py:
        a block id then holds one layer of each slot, for whichever group owns the block); None:
        a slot per layer."""
        self.num_layers = num_layers
        self.layer_slots = list(layer_slots) if layer_slots is not None else list(range(num_layers))
        if len(self.layer_slots) != num_layers:
            raise ValueError(f"{len(self.layer_slots)} layer slots for {num_layers} layers")
        self.num_slots = max(self.layer_slots) + 1
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.dtype = _as_dtype(dtype)
        self.device = torch.device(device)
        self.spec = kv_spec or kv_cache_spec("auto", self.dtype)
        shape = (self.num_slots, 2)
        block_shape = (block_size, num_kv_heads, head_size)
        # Uninitialised on purpose: a slot is only read after the step that wrote it.
        self.gpu_kv_cache = allocate_cache(shape + (num_gpu_blocks,) + block_shape, self.spec.storage, self.device)
        # Pinned host memory makes host<->device copies DMA transfers that need no staging copy.
        pin = self.device.type == "cuda"
        self.cpu_kv_cache = torch.empty(shape + (num_cpu_blocks,) + block_shape, dtype=self.spec.storage,
                                        pin_memory=pin)
        # int8: a scale per (slot, kv head) beside the blocks, moved with them (same block index).
        self.gpu_kv_scales: torch.Tensor | None = None
        self.cpu_kv_scales: torch.Tensor | None = None
        if self.spec.is_int8:
            self.gpu_kv_scales = allocate_cache(shape + (num_gpu_blocks, block_size, num_kv_heads), torch.float32,
                                                self.device)
            self.cpu_kv_scales = torch.empty(shape + (num_cpu_blocks, block_size, num_kv_heads), dtype=torch.float32,
                                             pin_memory=pin)
        # fp8: one scale per layer for K and V, on the host (read without a device sync); 0 = not
        # calibrated yet (the first write of the layer sets it, kv_quant.calibrate_fp8_).
        self.layer_scales: torch.Tensor | None = None
        if self.spec.is_fp8:
            self.layer_scales = torch.zeros(num_layers, 2, dtype=torch.float32)
            for kv, value in enumerate(fp8_scales):
                if value is not None:
                    self.layer_scales[:, kv] = value
        self.gpu_cache = [self._layer(self.gpu_kv_cache, self.gpu_kv_scales, i) for i in range(num_layers)]
        self.cpu_cache = [self._layer(self.cpu_kv_cache, self.cpu_kv_scales, i) for i in range(num_layers)]

    def _layer(self, cache: torch.Tensor, scales: torch.Tensor | None, i: int) -> tuple[torch.Tensor, ...]:
        """What layer i's attention gets: (key_cache, value_cache), plus (k_scale, v_scale) when quantized."""
        s = self.layer_slots[i]
        if self.layer_scales is not None:  # fp8: a scale per layer, whatever slot it shares
            return cache[s, 0], cache[s, 1], self.layer_scales[i, 0], self.layer_scales[i, 1]
        if scales is not None:
            return cache[s, 0], cache[s, 1], scales[s, 0], scales[s, 1]
        return cache[s, 0], cache[s, 1]

    @property
    def block_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) pairs of tensors whose dim 2 is the block: the cache, and the int8 scales."""
        pairs = [(self.gpu_kv_cache, self.cpu_kv_cache)]
        if self.gpu_kv_scales is not None:
            pairs.append((self.gpu_kv_scales, self.cpu_kv_scales))
        return pairs

    @staticmethod
    def block_bytes(num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                    dtype: Union[torch.dtype, str]) -> int:
        """Bytes one block occupies across all layers, K and V: 2 * L * H * D * block_size * elem."""
        elem = torch.empty((), dtype=_as_dtype(dtype)).element_size()
        return 2 * num_layers * num_kv_heads * head_size * block_size * elem

    # ------------------------------------------------------------------ moves
    @staticmethod
    def _split(mapping: BlockMapping, src_limit: int, dst_limit: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        src = [s for s, _ in mapping]
        dst = [d for _, d in mapping]
        if len(set(dst)) != len(dst):
            raise ValueError(f"block mapping writes a destination twice: {mapping}")
        if min(src) < 0 or max(src) >= src_limit or min(dst) < 0 or max(dst) >= dst_limit:
            raise IndexError(f"block mapping {mapping} outside [0, {src_limit}) -> [0, {dst_limit})")
        return torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)

    def swap_in(self, mapping: BlockMapping) -> None:
        """CPU -> GPU, [(cpu_block, gpu_block)]."""
        if not mapping:
            return
        src, dst = self._split(mapping, self.num_cpu_blocks, self.num_gpu_blocks)
        for gpu, cpu in self.block_tensors:
            staged = cpu.index_select(2, src)
            if self.device.type == "cuda":
                staged = staged.pin_memory()
            gpu.index_copy_(2, dst.to(self.device), staged.to(self.device, non_blocking=True))

    def swap_out(self, mapping: BlockMapping) -> None:
        """GPU -> CPU, [(gpu_block, cpu_block)]. Synchronous: the GPU blocks may be reused next step."""
        if not mapping:
            return
        src, dst = self._split(mapping, self.num_gpu_blocks, self.num_cpu_blocks)
        for gpu, cpu in self.block_tensors:
            cpu.index_copy_(2, dst, gpu.index_select(2, src.to(self.device)).to("cpu"))

    def copy(self, pairs: BlockMapping) -> None:
        """Copy-on-write on the GPU cache, every layer, K and V (and their int8 scales)."""
        if not pairs:
            return
        src, dst = self._split(pairs, self.num_gpu_blocks, self.num_gpu_blocks)
        src, dst = src.to(self.device), dst.to(self.device)
        # Gather before scatter, so a destination that is also a source reads the old bytes.
        for gpu, _ in self.block_tensors:
            gpu.index_copy_(2, dst, gpu.index_select(2, src))


# torch.OutOfMemoryError is torch >= 2.5; torch.cuda's name for it is older
CUDA_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


class KVAllocationError(PagedrunError):
    """The planned KV cache does not fit the device at allocation time (one line, with the numbers)."""


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def allocate_cache(shape: tuple, dtype: torch.dtype, device: torch.device,
                   mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None,
                   empty: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
    """torch.empty, on CUDA after checking that the device still has the room the plan counted on
    (another process may have taken it since the profile), and with a CUDA out-of-memory turned
    into one line naming the bytes and the recipe field, instead of a traceback."""
    if device.type != "cuda":
        return empty(shape, dtype=dtype, device=device)
    need = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    fix = "lower cache.gpu_memory_utilization (or cache.num_blocks), or free the device"
    if need > free:
        raise KVAllocationError(
            f"cache.gpu_memory_utilization: the KV cache needs {_gib(need)} but {device} has {_gib(free)} free of "
            f"{_gib(total)} now (less than at the memory profile: another process?); {fix}")
    try:
        return empty(shape, dtype=dtype, device=device)
    except CUDA_OOM as e:
        free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
        first = str(e).splitlines()[0][:160] if str(e) else "out of memory"
        raise KVAllocationError(
            f"cache.gpu_memory_utilization: allocating the KV cache ({_gib(need)}) on {device} failed with "
            f"{free / (1 << 30):.2f} of {_gib(total)} free ({first}); {fix}") from None
