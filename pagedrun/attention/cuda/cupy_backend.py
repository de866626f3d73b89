"""Paged attention on an NVIDIA GPU: the kernels/cuda/*.cu sources through cupy.RawModule (NVRTC).

Tensors stay torch CUDA tensors owned by the engine; each call wraps them as CuPy arrays through
DLPack (zero copy, bf16 as an int16 view since the kernels only need the address, strides taken
from torch) and launches on torch's current stream, so ordering with the model's own kernels needs
no synchronisation. Every device allocation (v2 scratch, the step's index arrays) comes from
torch's caching allocator, so the memory plan and torch's accounting see all of it.

- forward: reshape_and_cache, then the paged kernels (v1 or v2 by vLLM's rule) for decode tokens
  and one varlen prefill kernel launch for every prefilling sequence, reading its new and cached
  tokens in place (prefill="sdpa": torch SDPA per sequence instead). The step's kernel inputs are
  built by the first layer and reused by the others (paged_step.py).
- kv_cache_dtype: fp8_e4m3 / fp8_e5m2 (uint8 caches, k_scale / v_scale per layer) or int8 (int8
  caches, a scale per row beside each block); prefill then runs through the kernels, which
  dequantize (SDPA would read the raw codes).
Copy-on-write, swap in and swap out are the cache engine's (worker/cache_engine.py: one indexed
copy per cache tensor, every layer at once), the same on every backend.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import numpy as np
import torch

from pagedrun.attention import kv_cache_spec as kv_quant
from pagedrun.attention.cuda import kernels as K
from pagedrun.attention.cuda import paged_step
from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.errors import PagedrunError

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses


def as_cupy(t: torch.Tensor):
    """A CuPy array sharing t's memory, with t's own strides (bf16 as an int16 view).

    Built from t's address, shape and strides (from_pointer): DLPack is slow per call (torch's
    __dlpack__ looks up the current stream and device each time), and at 6 calls per layer and step
    it was a large share of a host-bound GPU run (docs/log/2026-11-26-h200-first-session.md). The
    first CHECKED_WRAPS calls of a process compare it with the DLPack import and keep DLPack for good
    if any differs."""
    global _pointer_wraps_ok, _checked
    import cupy

    t = kernel_bits(t.detach())
    if _pointer_wraps_ok and t.dtype in _NP_DTYPES:
        arr = from_pointer(t, cupy)
        if _checked >= CHECKED_WRAPS:
            return arr
        ref = from_dlpack(t, cupy)
        _checked += 1
        if not same_view(arr, ref):
            _pointer_wraps_ok = False
            warnings.warn(f"cupy backend: a pointer-built view of a {tuple(t.shape)} {t.dtype} tensor differs from "
                          f"its DLPack import; DLPack from here on", RuntimeWarning, stacklevel=2)
        return ref
    return from_dlpack(t, cupy)


# torch dtypes the kernels take (bf16 travels as int16), and the pointer-built views' self-check
_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int16: np.int16, torch.int32: np.int32,
              torch.int64: np.int64, torch.uint8: np.uint8, torch.int8: np.int8}
CHECKED_WRAPS = 32
_pointer_wraps_ok = True
_checked = 0


_ITSELF = object()  # from_pointer's default owner: the tensor


def kernel_bits(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels take it: bf16 through its 16-bit pattern (an int16 view), else itself."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def from_pointer(t: torch.Tensor, xp, owner: object = _ITSELF):
    """The CuPy view DLPack would give, from t's address, shape and strides. t stays its owner,
    unless `owner` names another (None: nobody; the caller keeps t alive while the view is used)."""
    item = t.element_size()
    extent = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * item if t.numel() else 0
    mem = xp.cuda.UnownedMemory(t.data_ptr(), extent, t if owner is _ITSELF else owner, t.device.index or 0)
    return xp.ndarray(tuple(t.shape), _NP_DTYPES[t.dtype], xp.cuda.MemoryPointer(mem, 0),
                      tuple(int(s) * item for s in t.stride()))


def from_dlpack(t: torch.Tensor, xp):
    return torch_strided(xp.from_dlpack(t), t, xp)


def same_view(a, b) -> bool:
    return (a.data.ptr == b.data.ptr and tuple(a.shape) == tuple(b.shape) and tuple(a.strides) == tuple(b.strides)
            and a.dtype == b.dtype)


def torch_strided(arr, t: torch.Tensor, xp):
    """arr (a DLPack import of t) viewed with t's strides in bytes, where they differ."""
    want = tuple(int(s) * t.element_size() for s in t.stride())
    if tuple(arr.strides) == want or t.numel() == 0:
        return arr
    return xp.lib.stride_tricks.as_strided(arr, shape=tuple(arr.shape), strides=want)


def torch_alloc(device: torch.device):
    """v2 scratch from torch's caching allocator (seen by its accounting and the memory profile,
    reused across steps), wrapped as CuPy arrays. The DLPack capsule keeps the tensor alive."""
    dtypes = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}

    def alloc(shape: tuple, dtype) -> object:
        return as_cupy(torch.empty(shape, dtype=dtypes[np.dtype(dtype)], device=device))

    return alloc


class CupyAttentionBackend:
    name = "cupy"
    # Decode-only steps may run on static buffers with a prebuilt PagedStep (worker/decode_buffers.py)
    # and be captured in CUDA graphs (worker/cuda_graphs.py); `wrap` makes their device arrays.
    static_decode = True
    wrap = staticmethod(as_cupy)

    def __init__(self, prefill: str = "varlen", kv_cache_dtype: str = "auto") -> None:
        """prefill: "varlen" (default) runs every prefilling sequence through one launch of the varlen
        prefill kernel per layer and the paged kernels for decode; "sdpa" runs prefill through torch's
        scaled_dot_product_attention, one call per sequence; "kernel" runs prefill tokens through the
        paged decode kernels as pseudo-sequences (GPU tests compare the three)."""
        import cupy

        if not cupy.is_available():
            raise PagedrunError("attention_backend: cupy needs a CUDA GPU; use auto or torch")
        if prefill not in paged_step.PREFILL_MODES:
            raise ValueError(f"cupy backend: prefill {prefill!r}: one of {', '.join(paged_step.PREFILL_MODES)}")
        self.prefill = prefill
        self.kv_cache_dtype = K.kv_dtype_name(kv_cache_dtype)
        self._model_dtype: torch.dtype | None = None  # from the first forward: the variant of a later call that names none
        self._num_heads: int | None = None  # the query's heads, from the first forward (the variant's group)
        self.last_version: str | None = None
        # Per-call host work that does not change between layers and steps (a GPU step is bound by
        # its Python and launches: docs/log/2026-11-26-h100-second-session.md): each layer's cache
        # views, and torch's stream as CuPy's, keyed by what they wrap.
        self._cache_views: dict[int, tuple[weakref.ref, object]] = {}
        self._streams: dict[int, object] = {}

    def kernels(self, cache: torch.Tensor, model_dtype: torch.dtype | None = None) -> K.PagedKernels:
        """model_dtype: the query's (default: the cache's own, or the last forward's when quantized).
        The variant's group comes from the query heads of the last forward (one module per model)."""
        if model_dtype is None:
            model_dtype = cache.dtype if self.kv_cache_dtype == "auto" else self._model_dtype or torch.float32
        variant = paged_step.kv_variant(model_dtype, cache, self.kv_cache_dtype, self._num_heads)
        return K.cupy_kernels(variant, cache.device.index or 0)

    @contextlib.contextmanager
    def _stream(self, device: torch.device):
        import cupy

        ptr = torch.cuda.current_stream(device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = cupy.cuda.ExternalStream(ptr)
        with cupy.cuda.Device(device.index or 0):
            with stream:
                yield

    def _cache_view(self, cache: torch.Tensor):
        """A KV cache's CuPy view, made once per cache tensor. The view does not own the tensor
        (a kept view would keep a freed cache's memory alive, e.g. the memory profile's); the entry
        is checked against the live tensor by identity, address and shape."""
        hit = self._cache_views.get(id(cache))
        if hit is not None:
            ref, view = hit
            if (ref() is cache and view.data.ptr == cache.data_ptr()
                    and tuple(view.shape) == tuple(cache.shape)):
                return view
        bits = kernel_bits(cache)
        if not (_pointer_wraps_ok and _checked >= CHECKED_WRAPS) or bits.dtype not in _NP_DTYPES:
            return as_cupy(cache)  # a DLPack import owns its tensor: not kept
        import cupy

        view = from_pointer(bits, cupy, owner=None)
        self._cache_views[id(cache)] = (weakref.ref(cache), view)
        return view

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
        if key_cache.device.type != "cuda":
            raise ValueError(f"cupy backend: KV caches must be CUDA tensors, got {key_cache.device}")
        self._model_dtype, self._num_heads = query.dtype, int(query.shape[1])
        ker = self.kernels(key_cache, query.dtype)
        device = key_cache.device
        if ker.variant.kv_dtype in kv_quant.FP8_TORCH:  # a layer's fp8 scale from its first write
            kv_quant.calibrate_fp8_(k_scale, key, ker.variant.kv_dtype)
            kv_quant.calibrate_fp8_(v_scale, value, ker.variant.kv_dtype)
        ks, vs = paged_step.scale_tensors(ker.variant, key_cache, k_scale, v_scale)
        with self._stream(device):
            step = paged_step.cached(meta, device, as_cupy, paged_step.prefill_mode(self.prefill, ker.variant), self.name)
            out, version = paged_step.forward(ker, step, as_cupy, query, key, value, key_cache, value_cache,
                                              meta, scale, alloc=torch_alloc(device), k_scales=ks, v_scales=vs,
                                              cache_views=(self._cache_view(key_cache),
                                                           self._cache_view(value_cache)),
                                              window=window, softcap=softcap, sinks=sinks,
                                              cache_written=cache_written)
        if version != "none":
            self.last_version = version
        return out

    def written_slots(self, meta: AttentionMetadata, key_cache: torch.Tensor, query: torch.Tensor
                      ) -> torch.Tensor | None:
        """The step's slot mapping for a model that writes this layer's K/V with its RoPE (one fused
        launch) and then calls forward(..., cache_written=True); None: forward must write them."""
        self._model_dtype, self._num_heads = query.dtype, int(query.shape[1])
        ker = self.kernels(key_cache, query.dtype)
        with self._stream(key_cache.device):
            return paged_step.written_slots(ker, meta, key_cache.device, as_cupy, self.prefill, self.name)

    def load_decode_kernels(self, key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype) -> None:
        """Both decode kernels launched once, so that the memory profile counts their code
        (worker/profiler.py run_profile; paged_step.launch_each_version)."""
        with self._stream(key_cache.device):
            paged_step.launch_each_version(self.kernels(key_cache, dtype), as_cupy, key_cache, value_cache, dtype,
                                           alloc=torch_alloc(key_cache.device))

