"""Quantized KV cache (`cache.kv_cache_dtype`): what a block stores, and the reference quantization.

| kv_cache_dtype       | stored as | scales                                  | bytes per element |
|----------------------|-----------|-----------------------------------------|-------------------|
| auto                 | model's   | -                                       | 4 / 2             |
| float32 / bfloat16 / float16 | that | -                                   | 4 / 2 / 2         |
| fp8 (= fp8_e4m3), fp8_e5m2 | uint8 (fp8 bits) | one float32 per layer for K, one for V | 1  |
| int8                 | int8      | one float32 per (token, kv head) for K and for V | 1 + 4/head_size |

fp8 is vLLM's scheme: q = fp8(x / scale), rounded to nearest even and saturated to the format's
finite range (e4m3fn +-448, e5m2 +-57344, CUDA's __NV_SATFINITE), read back as float(q) * scale.
The layer's scale comes from the recipe (`cache.k_scale` / `cache.v_scale`) or, left unset, from
the first write to the layer, which the worker makes at start-up with a fixed prompt (so the
scale depends on the model only, never on which requests come first): absmax / (fp8 max / 2), so
values up to twice the calibration prompt's largest still fit (e4m3 keeps 3 mantissa bits at
every magnitude down to 2^-6 of its max, so the headroom costs precision only on tiny values).
int8 needs no calibration: each (token, head) row gets scale = absmax / 127 and
q = round-half-even(x / scale), stored beside the block (one scale tensor indexed by the same block
id), so a block stays self-contained when it is copied on write, swapped or reused from the prefix
cache.

Every attention path dequantizes on read and computes in float32; this module is the reference the
C++ and CUDA kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrun.config.checks import KV_CACHE_DTYPES  # noqa: F401  (re-exported: the names in one place)
from pagedrun.errors import PagedrunError

FP8_TORCH = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
INT8_MAX = 127.0
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSpec:
    """How the cache stores K/V for a model dtype: the resolved name, the tensor dtype, the scales."""
    name: str  # float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2 | int8
    storage: torch.dtype

    @property
    def is_fp8(self) -> bool:
        return self.name in FP8_TORCH

    @property
    def is_int8(self) -> bool:
        return self.name == "int8"

    @property
    def quantized(self) -> bool:
        return self.is_fp8 or self.is_int8

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_size: int) -> int:
        """K and V of one token in every layer, the int8 scales included."""
        elem = torch.empty((), dtype=self.storage).element_size()
        per_head = head_size * elem + (4 if self.is_int8 else 0)
        return 2 * num_layers * num_kv_heads * per_head


def kv_cache_spec(name: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """The spec for `cache.kv_cache_dtype` (already checked to be one of KV_CACHE_DTYPES)."""
    if name == "auto":
        return KVCacheSpec(str(model_dtype).removeprefix("torch."), model_dtype)
    if name == "fp8":
        name = "fp8_e4m3"  # vLLM's alias
    if name in FP8_TORCH:
        return KVCacheSpec(name, torch.uint8)
    if name == "int8":
        return KVCacheSpec(name, torch.int8)
    return KVCacheSpec(name, _FLOAT[name])


# ---------------------------------------------------------------- fp8: one scale per layer

def fp8_scale_from(x: torch.Tensor, fmt: str) -> float:
    """The calibrated scale for a layer whose first written K (or V) is x: absmax / (max / 2)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / (FP8_MAX[fmt] / 2) if amax > 0 else 1.0


def calibrate_fp8_(scale: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Set a layer's scale (a host 0-dim tensor) from its first write, if it is still 0 (unset)."""
    if isinstance(scale, torch.Tensor) and float(scale) == 0.0:  # a float is the caller's fixed scale
        scale.fill_(fp8_scale_from(x, fmt))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """x (any float dtype) -> uint8 fp8 bit patterns of x / scale, RNE, saturated to the finite range."""
    m = FP8_MAX[fmt]
    y = (x.float() / scale).clamp_(-m, m)  # NaN stays NaN, as CUDA's conversion keeps it
    return y.to(FP8_TORCH[fmt]).view(torch.uint8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    return q.view(FP8_TORCH[fmt]).float() * scale


def fp8_table(fmt: str) -> torch.Tensor:
    """The 256 float32 values of the format's codes (the C++ kernel's lookup table, before scaling)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_TORCH[fmt]).float()


# ---------------------------------------------------------------- int8: one scale per (token, head)

def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_size] -> (int8 [..., head_size], float32 scales [...]), a scale per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)  # torch.round: half to even
    q = torch.where((scale > 0).unsqueeze(-1), q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def check_scales(scales: torch.Tensor, what: str) -> None:
    """Refuse a layer scale that is 0, negative or not finite, naming the layer ([layers, 2] tensor)."""
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        layer, kv = (int(i) for i in bad.nonzero()[0])
        raise PagedrunError(f"cache.kv_cache_dtype: layer {layer}'s {'KV'[kv]} scale is {float(scales[layer, kv])} "
                            f"({what}); a scale must be finite and > 0")
