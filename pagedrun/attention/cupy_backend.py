"""Paged attention on an NVIDIA GPU: the kernels/*.cu sources through cupy.RawModule (NVRTC).

Tensors stay torch CUDA tensors owned by the engine; each call wraps them as CuPy arrays through
DLPack (zero copy, bf16 as an int16 view since the kernels only need the address) and launches on
torch's current stream, so ordering with the model's own kernels needs no synchronisation.

- forward: reshape_and_cache, then one paged-attention launch (v1 or v2 by vLLM's rule) over
  "pseudo-sequences": decode tokens are themselves, prefill token j of sequence i is a decode query
  of length context_i + j + 1 on sequence i's block table (docs/kernels.md, "Prefill").
- copy_blocks: all layers in one launch through int64 arrays of layer base addresses.
- swap_blocks: one async cudaMemcpy per block between device and (pinned) host caches.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from pagedrun.attention import kernels as K
from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.errors import PagedrunError

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses


def as_cupy(t: torch.Tensor):
    import cupy

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


class CupyAttentionBackend:
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        if not cupy.is_available():
            raise PagedrunError("attention_backend: cupy needs a CUDA GPU; use auto or torch")
        self.last_version: str | None = None

    def kernels(self, cache: torch.Tensor) -> K.PagedKernels:
        _, block_size, _, head_size = cache.shape
        return K.cupy_kernels(K.KernelVariant(K.dtype_name(cache.dtype), int(head_size), int(block_size)))

    @contextlib.contextmanager
    def _stream(self, device: torch.device):
        import cupy

        with cupy.cuda.Device(device.index or 0):
            with cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
                yield

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        import cupy

        if key_cache.device.type != "cuda":
            raise ValueError(f"cupy backend: KV caches must be CUDA tensors, got {key_cache.device}")
        ker = self.kernels(key_cache)
        device = key_cache.device
        out = torch.zeros_like(query, memory_format=torch.contiguous_format)
        num_real = sum(meta.query_lens_list)
        with self._stream(device):
            kc, vc = as_cupy(key_cache), as_cupy(value_cache)
            ker.reshape_and_cache(
                as_cupy(key.contiguous()), as_cupy(value.contiguous()), kc, vc,
                as_cupy(meta.slot_mapping.to(device=device, dtype=torch.int64).contiguous()),
            )
            if num_real == 0:
                return out
            q = as_cupy(query[:num_real].contiguous())
            block_tables = as_cupy(meta.block_tables.to(device=device, dtype=torch.int32).contiguous())
            if meta.is_decode_only and num_real == meta.num_seqs:
                seq_lens_np = np.asarray(meta.seq_lens_list, dtype=np.int32)
            else:
                token_to_seq, seq_lens_np = K.pseudo_sequences(meta.query_lens_list, meta.seq_lens_list)
                block_tables = cupy.ascontiguousarray(block_tables[cupy.asarray(token_to_seq)])
            seq_lens = cupy.asarray(seq_lens_np)
            o = as_cupy(out)[:num_real]
            self.last_version = ker.paged_attention(
                o, q, kc, vc, block_tables, seq_lens, int(seq_lens_np.max()), float(scale)
            )
        return out

    def copy_blocks(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]
    ) -> None:
        import cupy

        if not kv_caches or not pairs:
            return
        first = kv_caches[0][0]
        ker = self.kernels(first)
        with self._stream(first.device):
            key_ptrs = cupy.asarray(np.array([k.data_ptr() for k, _ in kv_caches], dtype=np.int64))
            value_ptrs = cupy.asarray(np.array([v.data_ptr() for _, v in kv_caches], dtype=np.int64))
            mapping = cupy.asarray(np.asarray(pairs, dtype=np.int64).reshape(-1, 2))
            ker.copy_blocks(key_ptrs, value_ptrs, mapping, int(np.prod(first.shape[1:])))

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
        """Swap out (GPU -> pinned CPU) or in (CPU -> GPU): one async copy per (src_block, dst_block).

        The host side should be pinned (torch.empty(..., pin_memory=True)) for the copies to be
        truly asynchronous; pageable memory still works, cudaMemcpyAsync just stages it.
        """
        import cupy

        if not mapping:
            return
        gpu = src if src.device.type == "cuda" else dst
        block_bytes = src[0].numel() * src.element_size()
        with self._stream(gpu.device):
            stream = cupy.cuda.get_current_stream()
            for s, d in mapping:
                cupy.cuda.runtime.memcpyAsync(
                    dst.data_ptr() + d * block_bytes, src.data_ptr() + s * block_bytes,
                    block_bytes, _MEMCPY_DEFAULT, stream.ptr,
                )
