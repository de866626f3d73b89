"""The CuPy backend's kernels, run on the CPU through the CUDA emulator (pagedrun.build.cudaemu).

Same .cu sources, same launch helpers (pagedrun.attention.cuda.kernels), same grids: only the module
comes from EmuModule and device arrays are numpy views of the torch CPU tensors (no copies for the
caches, which the kernels write in place). It is slow (every CUDA thread is a fiber) and exists so
that CI without a GPU runs the real kernels end to end, e.g. greedy tokens vs the torch backend.
kv_cache_dtype (auto | fp8 | fp8_e4m3 | fp8_e5m2 | int8) says how a uint8 / int8 cache is to be read.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pagedrun.attention import kv_cache_spec as kv_quant
from pagedrun.attention.cuda import kernels as K
from pagedrun.attention.cuda import paged_step
from pagedrun.attention.metadata import AttentionMetadata


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing t's memory (bf16 as uint16, which numpy lacks)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError(f"emulated backend: tensors must be on the CPU, got {t.device}")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()  # uint8 (fp8 bit patterns) and int8 caches are plain numpy dtypes


class EmulatedAttentionBackend:
    name = "emulated"
    static_decode = True  # the CuPy backend's static-buffer decode path, run on the CPU (worker/decode_buffers.py)
    wrap = staticmethod(as_numpy)

    def __init__(
        self,
        schedule: str = "round_robin",
        kernels: Callable[[K.KernelVariant], K.PagedKernels] | None = None,
        prefill: str = "kernel",
        kv_cache_dtype: str = "auto",
    ):
        """prefill: "kernel" runs prefill tokens through the paged kernels as pseudo-sequences (what
        CI checks the decode kernels on); "varlen" is the CuPy backend's default path on a GPU (one
        varlen prefill kernel launch per layer, the decode kernels for decode tokens); "sdpa" its
        other one (prefill through torch SDPA), run here so CI checks that path's host logic."""
        self.schedule = schedule
        self.prefill = prefill
        self.kv_cache_dtype = K.kv_dtype_name(kv_cache_dtype)
        self._model_dtype: torch.dtype | None = None  # from the first forward: the variant of a later call that names none
        self._num_heads: int | None = None  # the query's heads, from the first forward (the variant's group)
        # Tests hand in kernels from a module they already compiled (emulator builds cost seconds).
        self._kernels = kernels or (lambda variant: K.emulated_kernels(variant, schedule))
        self.last_version: str | None = None  # "v1" / "v2" of the latest attention launch (tests)

    def kernels(self, cache: torch.Tensor, model_dtype: torch.dtype | None = None) -> K.PagedKernels:
        """model_dtype: the query's (default: the cache's own, or the last forward's when quantized).
        The variant's group comes from the query heads of the last forward (one module per model)."""
        if model_dtype is None:
            model_dtype = cache.dtype if self.kv_cache_dtype == "auto" else self._model_dtype or torch.float32
        return self._kernels(paged_step.kv_variant(model_dtype, cache, self.kv_cache_dtype, self._num_heads))

    def written_slots(self, meta: AttentionMetadata, key_cache: torch.Tensor, query: torch.Tensor
                      ) -> torch.Tensor | None:
        """As the CuPy backend's: the step's slot mapping for a fused RoPE + cache write."""
        self._model_dtype, self._num_heads = query.dtype, int(query.shape[1])
        ker = self.kernels(key_cache, query.dtype)
        return paged_step.written_slots(ker, meta, key_cache.device, as_numpy, self.prefill, self.name)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale=None,
        v_scale=None,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        cache_written: bool = False,
    ) -> torch.Tensor:
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("emulated backend: KV caches must be contiguous (they are written in place)")
        self._model_dtype, self._num_heads = query.dtype, int(query.shape[1])
        ker = self.kernels(key_cache, query.dtype)
        if ker.variant.kv_dtype in kv_quant.FP8_TORCH:  # a layer's fp8 scale from its first write
            kv_quant.calibrate_fp8_(k_scale, key, ker.variant.kv_dtype)
            kv_quant.calibrate_fp8_(v_scale, value, ker.variant.kv_dtype)
        ks, vs = paged_step.scale_tensors(ker.variant, key_cache, k_scale, v_scale)
        prefill = paged_step.prefill_mode(self.prefill, ker.variant)
        step = paged_step.cached(meta, key_cache.device, as_numpy, prefill, self.name)
        out, version = paged_step.forward(ker, step, as_numpy, query, key, value, key_cache, value_cache, meta, scale,
                                          k_scales=ks, v_scales=vs, window=window, softcap=softcap,
                                          sinks=sinks, cache_written=cache_written)
        if version != "none":
            self.last_version = version
        return out

