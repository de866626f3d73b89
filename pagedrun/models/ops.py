"""The model's elementwise ops: RMSNorm (with the residual add), RoPE, SiLU * up, GELU-tanh * up; and
the C++ library, switches and fused-kernel dispatch they share with the GEMMs of packed_gemm.py.

Each op runs the C++ kernel of kernels/cpu/model_ops_cpu.cpp (built by pagedrun.build.cpu, called
through ctypes) when its inputs are float32 or bfloat16 CPU tensors it supports, and plain torch
otherwise (GPU tensors, fp16, odd strides, no compiler). bf16 ops compute in fp32 and round to bf16
where the torch op they replace would. Both paths follow transformers' op order; they differ
only in reduction order, so greedy outputs match HF either way (tests/models/test_model_ops.py,
tests/engine/test_engine.py). CUDA tensors take the fused kernels of pagedrun.models.cuda_ops
(rms_norm, rope, silu_and_mul, gelu_tanh_and_mul: one launch each) where CuPy is importable.

The elementwise ops replace chains of 3-14 torch passes over the activations with one (the packed
GEMMs and why they exist: packed_gemm.py).

PAGEDRUN_CPU_MODEL_OPS=0 (or set_enabled(False)) turns the kernels off, for A/B comparisons.
"""
from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from pagedrun.build import cpu as cpu_build
from pagedrun.build.cache import load_library
from pagedrun.models import cuda_ops

SOURCE = cpu_build.KERNEL_DIR / "model_ops_cpu.cpp"
_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_enabled = True
_load_error: str | None = None
_fused_on_cpu: cuda_ops.FusedOps | None = None  # fused_ops_on_cpu()


class CpuModelOps:
    """The loaded library; each method returns the kernel's status (0 = done, < 0 = refused)."""

    def __init__(self, so_path) -> None:
        lib = load_library(so_path)  # the very file the cache checked (build/cache.py)
        lib.linear_packed_f32.restype = _int
        lib.linear_packed_f32.argtypes = [_ptr] * 4 + [_i64] * 5 + [_int]
        lib.packed_panel_width.restype = _int
        lib.packed_panel_width.argtypes = []
        self.panel = lib.packed_panel_width()
        lib.linear_packed_bf16.restype = _int
        lib.linear_packed_bf16.argtypes = [_ptr] * 4 + [_i64] * 5 + [_int]
        # Off the AMX tiles: vdpbf16ps where the CPU has avx512_bf16 and it beats fp32 FMAs on
        # widened bf16 (timed once: the same bits either way), the widened FMAs otherwise.
        lib.packed_gemm_bf16_dot.restype = _int
        lib.packed_gemm_bf16_dot.argtypes = [_int]
        self.bf16_dot = bool(lib.packed_gemm_bf16_dot(-1))
        # AMX tiles for bf16 GEMMs where the CPU has them (kernels/cpu/amx_bf16.h).
        lib.packed_gemm_amx.restype = _int
        lib.packed_gemm_amx.argtypes = [_int]
        self.amx = bool(lib.packed_gemm_amx(-1))
        # The float32 and bfloat16 variant of each elementwise op, looked up once (ops are called per layer).
        self._ops = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            for name, argtypes in (("rms_norm", [_ptr] * 4 + [_i64] * 5 + [_f32, _int]),
                                   ("head_rms_norm", [_ptr] * 3 + [_i64] * 5 + [_f32, _int]),
                                   ("rope", [_ptr] * 4 + [_i64] * 5 + [_int]),
                                   ("rope_partial", [_ptr] * 4 + [_i64] * 5 + [_int, _i64]),
                                   ("silu_and_mul", [_ptr] * 2 + [_i64] * 5 + [_int]),
                                   ("gelu_tanh_and_mul", [_ptr] * 2 + [_i64] * 5 + [_int]),
                                   ("linear_packed_silu", [_ptr] * 4 + [_i64] * 5 + [_int]),
                                   ("linear_packed_gelu", [_ptr] * 4 + [_i64] * 5 + [_int])):
                fn = getattr(lib, f"{name}_{suffix}")
                fn.restype, fn.argtypes = _int, argtypes
                self._ops[name, dtype] = fn
        # The MoE block's experts (models/moe.py): dispatch, both GEMMs per active expert, weighted sum.
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"moe_experts_{suffix}")
            fn.restype = _int
            fn.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64,
                           _int, _ptr, _i64, _int]
            self._ops["moe_experts", torch.float32 if suffix == "f32" else torch.bfloat16] = fn
        # Gemma's norms on bf16 rows with a float32 weight (1 + w): the product rounded once.
        for name, argtypes in (("rms_norm", [_ptr] * 4 + [_i64] * 5 + [_f32, _int]),
                               ("head_rms_norm", [_ptr] * 3 + [_i64] * 5 + [_f32, _int])):
            fn = getattr(lib, f"{name}_bf16_w32")
            fn.restype, fn.argtypes = _int, argtypes
            self._ops[name + "_w32", torch.bfloat16] = fn
        self.lib = lib

    def op(self, name: str, dtype: torch.dtype):
        """The float32 or bfloat16 variant of an elementwise op."""
        return self._ops[name, dtype]


def load_error() -> str | None:
    """Why `load()` returned None (None when it has not failed)."""
    return _load_error


@functools.lru_cache(maxsize=1)
def load() -> CpuModelOps | None:
    """Build (once per machine and source) and load the kernels; None if that is impossible."""
    global _load_error
    # No FMA contraction: the elementwise ops round like torch's (the GEMM asks for FMAs itself).
    lib, _load_error = cpu_build.load("PAGEDRUN_CPU_MODEL_OPS", SOURCE, CpuModelOps, ("-ffp-contract=off",))
    return lib


def kernels_enabled() -> bool:
    """False inside torch_only() or after set_enabled(False)."""
    return _enabled


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


@contextmanager
def torch_only():
    """Run the ops in plain torch inside the block (the reference path of the tests)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def fused_for(t: torch.Tensor) -> cuda_ops.FusedOps | None:
    """The fused CUDA kernels t's ops take: a CUDA tensor's device's (None where CuPy is missing),
    a CPU tensor's only inside fused_ops_on_cpu(); None under torch_only() (torch then)."""
    if not _enabled:
        return None
    return cuda_ops.for_device(t.device) if t.is_cuda else _fused_on_cpu


@contextmanager
def fused_ops_on_cpu(fused: cuda_ops.FusedOps):
    """CPU tensors through `fused` (cuda_ops.emulated(): the CUDA kernels under the emulator) in the
    block, by the very dispatch CUDA tensors take: how the tests run a model the GPU's way."""
    global _fused_on_cpu
    before, _fused_on_cpu = _fused_on_cpu, fused
    try:
        yield
    finally:
        _fused_on_cpu = before


def _kernels_for(*tensors: torch.Tensor) -> CpuModelOps | None:
    """The kernels for CPU tensors all of float32, or all of bfloat16 (the ops round like torch's bf16
    ops: in fp32, to bf16 at the end of each op), else None (torch then). A plain loop: this runs
    some 250 times per decode step, and the generator it replaced was slower per call
    (docs/log/2026-11-27-figures-from-code-comments.md)."""
    if not _enabled or not tensors:
        return None
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return None
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
            return None
    return load()


def _rows(x: torch.Tensor) -> bool:
    """2-D with contiguous rows: the layout every kernel takes (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * (h / sqrt(mean(h^2) + eps)) with h = x, or h = x + residual: then (normed, h), and
    the kernel writes h into residual's memory (the residual stream is the caller's to update).

    A float32 weight on lower-precision rows is Gemma's norm ((1 + w) folded into the weight at
    load time): the product is taken in float32 and rounded once, as transformers computes it,
    where the Llama norm rounds the normed rows to the model's dtype before the product."""
    fused = fused_for(x)
    done = None if fused is None else fused.rms_norm(x, weight, eps, residual)
    if done is not None:
        return done
    name = "rms_norm"
    if weight.dtype is torch.float32 and x.dtype is not torch.float32:
        kern = _kernels_for(x) if x.dtype is torch.bfloat16 and weight.is_cpu else None
        name = "rms_norm_w32"
    else:
        kern = _kernels_for(x, weight)
    if (kern is not None and _rows(x) and weight.is_contiguous()
            and (residual is None or (_rows(residual) and residual.dtype == x.dtype and residual.shape == x.shape))):
        m, h = x.shape
        out = torch.empty(m, h, dtype=x.dtype)
        rc = kern.op(name, x.dtype)(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                                          weight.data_ptr(), out.data_ptr(), m, h, x.stride(0),
                                          0 if residual is None else residual.stride(0), h, eps,
                                          torch.get_num_threads())
        if rc == 0:
            return out if residual is None else (out, residual)
    if kern is not None and residual is None and _heads_ok(x) and weight.is_contiguous():
        # [T, heads, hd] with each token's heads contiguous (Qwen3's q and k, views into the qkv
        # projection's output): every head normalised over hd, into a new [T, heads, hd].
        t, heads, hd = x.shape
        out = torch.empty(t, heads, hd, dtype=x.dtype)
        rc = kern.op("head_" + name, x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), t, heads, hd,
                                              x.stride(0), heads * hd, eps, torch.get_num_threads())
        if rc == 0:
            return out
    if residual is not None:
        x = x + residual
        return _rms_norm_torch(x, weight, eps), x
    return _rms_norm_torch(x, weight, eps)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32 even for bf16/fp16 activations, then back: HF's exact order.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != dtype:  # Gemma's: the product in float32, rounded once (rms_norm)
        return (x32 * weight).to(dtype)
    return weight * x32.to(dtype)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor, memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, hd] and k [T, kv_heads, hd] by their tokens' positions ("rotate half"
    layout; cos/sin tables [max_pos, rotary_dim/2] in float32). The kernel rotates q and k in place.
    With tables narrower than the head (partial rotary, rotary_dim < hd) only the first rotary_dim
    dims of each head rotate, the rest pass through, as HF's apply_rotary_pos_emb does.
    memo: where the torch path keeps the step's rows of the tables for the next layer (rope_rows)."""
    rotary_dim = 2 * cos.shape[-1]
    fused = fused_for(q)
    if fused is not None and fused.rope(positions, q, k, cos, sin):
        return q, k
    kern = _kernels_for(q, k)
    if (kern is not None and positions.dtype == torch.long and positions.is_contiguous()
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous() and _heads_ok(q) and _heads_ok(k)):
        threads = torch.get_num_threads()
        if rotary_dim == q.shape[2]:
            ok = all(
                kern.op("rope", x.dtype)(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                         x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.shape[0], threads) == 0
                for x in (q, k)
            )
        else:
            ok = all(
                kern.op("rope_partial", x.dtype)(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                                 x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.shape[0],
                                                 threads, rotary_dim) == 0
                for x in (q, k)
            )
        if ok:
            return q, k
        # Refused before writing anything (a position outside the table): torch raises on it below.
    c, s = rope_rows(positions, cos, sin, q.dtype, memo)
    if rotary_dim == q.shape[-1]:
        return _rotate(q, c, s), _rotate(k, c, s)
    # HF: cat([rotate(x[..., :rotary_dim]), x[..., rotary_dim:]])
    return (torch.cat((_rotate(q[..., :rotary_dim], c, s), q[..., rotary_dim:]), dim=-1),
            torch.cat((_rotate(k[..., :rotary_dim], c, s), k[..., rotary_dim:]), dim=-1))


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> bool:
    """rope (q and k rotated in place) and k, v written into the paged caches at slot_mapping, in one
    fused launch (models/cuda_ops.py: CUDA tensors, or the emulator under fused_ops_on_cpu). False:
    not taken, nothing written; the caller rotates with rope() and lets the backend write the cache."""
    fused = fused_for(q)
    return fused is not None and fused.rope_and_cache(positions, q, k, v, cos, sin, key_cache, value_cache,
                                                      slot_mapping)


def rope_rows(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
              memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's factors [T, 1, hd] in the model's dtype: cat(cos, cos) and cat(-sin, sin)
    at each token's position (HF's cos and sin, with rotate_half's sign moved onto sin: negation is
    exact, so the products are the same bits). Every layer of a step rotates by the same rows: with
    a memo (the model's rotary module keeps one, emptied at each forward) they are gathered by the
    first layer and reused while the positions tensor is the same one. On a GPU that is 7 launches
    a step instead of 4 a layer."""
    if memo is not None:
        if memo.get("positions") is not positions:
            memo.clear()
            memo["positions"] = positions
        rows = memo.get(dtype)
        if rows is not None:
            return rows
    c, s = cos[positions], sin[positions]
    rows = (torch.cat((c, c), dim=-1).to(dtype)[:, None, :], torch.cat((-s, s), dim=-1).to(dtype)[:, None, :])
    if memo is not None:
        memo[dtype] = rows
    return rows


def _heads_ok(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[0] > 0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's x * cos + rotate_half(x) * sin with rotate_half's sign in `sin` (rope_rows): the halves
    # swapped by one roll, so the same float ops as HF's in 4 launches instead of 7.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] holding gate then up -> silu(gate) * up [M, I]."""
    out = _fused_act(gate_up, "silu")
    if out is not None:
        return out
    kern = _kernels_for(gate_up)
    if kern is not None and _rows(gate_up) and gate_up.shape[1] % 2 == 0:
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, i, dtype=gate_up.dtype)
        if kern.op("silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), m, i, gate_up.stride(0), i,
                                                  i, torch.get_num_threads()) == 0:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """[M, 2I] holding gate then up (or, with `block`, gate and up interleaved `block` columns at a
    time: what a gate/up weight packed by pack_gate_up gives) -> gelu_tanh(gate) * up [M, I]: the
    GeGLU of Gemma's MLP (transformers' gelu_pytorch_tanh)."""
    i = gate_up.shape[-1] // 2
    block = block or i
    out = _fused_act(gate_up, "gelu_tanh") if block == i else None
    if out is not None:
        return out
    kern = _kernels_for(gate_up)
    if kern is not None and _rows(gate_up) and gate_up.shape[1] % 2 == 0 and i % block == 0:
        m = gate_up.shape[0]
        out = torch.empty(m, i, dtype=gate_up.dtype)
        if kern.op("gelu_tanh_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), m, i, gate_up.stride(0),
                                                       i, block, torch.get_num_threads()) == 0:
            return out
    if block != i:
        gate_up = _deinterleave(gate_up.transpose(0, -1), block).transpose(0, -1)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _fused_act(gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    fused = fused_for(gate_up)
    return None if fused is None else fused.act_and_mul(gate_up, act)


def _interleave(t: torch.Tensor, block: int) -> torch.Tensor:
    """Rows [gate (I) | up (I)] -> gate's first `block`, up's first `block`, gate's next, ..."""
    i = t.shape[0] // 2
    return t.reshape(2, i // block, block, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _deinterleave(t: torch.Tensor, block: int) -> torch.Tensor:
    """_interleave's inverse."""
    i = t.shape[0] // 2
    return t.reshape(i // block, 2, block, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
