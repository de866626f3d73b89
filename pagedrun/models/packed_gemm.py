"""The model's GEMMs on packed weights: linear, the MLP's gate/up with the activation fused, the MoE
block's experts.

Each runs the C++ kernel of kernels/cpu/model_ops_cpu.cpp (the library, the switches and the
dispatch of pagedrun.models.ops) on float32 or bfloat16 CPU tensors it supports, and plain torch
on the unpacked weight otherwise.

Why the linear op has a kernel: torch's CPU matmul is fast for the thousands of rows of a prefill
step but slow for the 1-128 rows of a decode step, where it reached a fraction of its prefill rate
(docs/log/2026-11-21-decode-gemm-fused-elementwise.md). The model's weights are packed once after loading
(`pack_weight`) and `linear_packed` runs every product on them, decode and prefill alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedrun.models import ops


def packing_panel(dtype: torch.dtype, device: torch.device) -> int | None:
    """The panel width pack_weight would pack a weight of this dtype on this device with, or None
    where it would keep it plain (kernels off or unavailable, not float32 / bfloat16, not the CPU).
    For weights packed as they are loaded (FusedMoE's experts)."""
    if not ops.kernels_enabled() or dtype not in (torch.float32, torch.bfloat16) or device.type != "cpu":
        return None
    kern = ops.load()
    return None if kern is None else kern.panel


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] in the packed GEMM's layout; None where the kernel cannot take it (not float32
    or bfloat16 on the CPU, an odd K in bfloat16, kernels off or unavailable): keep it as it is.

    float32: [ceil(N / panel), K, panel] with packed[q, k, j] = weight[q * panel + j, k].
    bfloat16: [ceil(N / panel), K / 2, panel, 2], k in pairs, so that one 32-bit word holds the two
    weights one bf16 dot-product lane multiplies (packed[q, p, j] = weight[q * panel + j, 2p:2p+2]).
    Zero rows pad the last panel. Packed once after loading
    (LlamaForCausalLM.process_weights_after_loading), in place of the original: same bytes, plus the
    padding when N is not a multiple of the panel."""
    kern = ops._kernels_for(weight)
    if kern is None or weight.dim() != 2 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2):
        return None
    n, k = weight.shape
    panels = -(-n // kern.panel)
    if n % kern.panel:  # one transient copy of the weight, not two, when no padding is needed
        weight = F.pad(weight, (0, 0, 0, panels * kern.panel - n))
    if weight.dtype == torch.bfloat16:
        return weight.view(panels, kern.panel, k // 2, 2).transpose(1, 2).contiguous()
    return weight.view(panels, kern.panel, k).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_weight's inverse: the [out_features, K] weight."""
    if packed.dim() == 4:
        panels, k2, panel, _ = packed.shape
        return packed.transpose(1, 2).reshape(panels * panel, 2 * k2)[:out_features]
    panels, k, panel = packed.shape
    return packed.transpose(1, 2).reshape(panels * panel, k)[:out_features]


def packed_in_features(packed: torch.Tensor) -> int:
    return packed.shape[1] * (2 if packed.dim() == 4 else 1)


def _packed_operands(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[ops.CpuModelOps | None, torch.Tensor]:
    """(the kernels, x with contiguous rows) where the packed GEMMs can take x, the packed weight and
    the bias; (None, x) where torch must."""
    kern = ops._kernels_for(x, packed)
    if kern is None:
        return None, x
    if x.dim() == 2 and not ops._rows(x):
        x = x.contiguous()
    ok = (ops._rows(x) and x.shape[1] == packed_in_features(packed)
          and packed.dim() == (4 if x.dtype is torch.bfloat16 else 3)
          and (bias is None or (bias.dtype is x.dtype and bias.is_contiguous())))
    return (kern if ok else None), x


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias) with the weight packed by pack_weight: the packed GEMM kernel for
    every M (it keeps up with torch's at prefill sizes and beats it at decode sizes,
    docs/design/cpu-kernels.md). With the kernels switched off since packing (torch_only(), tests), torch
    on the unpacked weight: right, and slow."""
    kern, x = _packed_operands(x, packed, bias)
    if kern is not None:
        m = x.shape[0]
        out = torch.empty(m, out_features, dtype=x.dtype)
        if m == 0:
            return out
        fn = kern.lib.linear_packed_bf16 if x.dtype == torch.bfloat16 else kern.lib.linear_packed_f32
        rc = fn(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), m,
                out_features, x.shape[1], x.stride(0), out_features, torch.get_num_threads())
        if rc == 0:
            return out
    return F.linear(x, unpack_weight(packed, out_features), bias)


def pack_gate_up(weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The MLP's stacked [gate; up] weight [2I, K] (and bias [2I]) packed for gate_up_silu: rows
    interleaved a panel at a time (packed panel 2j = gate's columns [j*P, (j+1)*P), panel 2j+1 up's
    same columns, P = the panel width), then pack_weight. None where the kernel cannot take it
    (pack_weight's reasons, or I not a multiple of P): keep the plain layout then."""
    kern = ops._kernels_for(weight)
    if kern is None or weight.dim() != 2 or weight.shape[0] % (2 * kern.panel):
        return None
    if bias is not None and (bias.dtype != weight.dtype or bias.dim() != 1):
        return None
    packed = pack_weight(ops._interleave(weight, kern.panel).contiguous())
    if packed is None:
        return None
    return packed, None if bias is None else ops._interleave(bias, kern.panel).contiguous()


def _fused_gate_up(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, intermediate: int,
                   op: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """act(gate) * up by the kernel `op` (the packed GEMM with the activation fused), or None where
    it does not run; and x as the kernel takes it."""
    kern, x = _packed_operands(x, packed, bias)
    if kern is None:
        return None, x
    m = x.shape[0]
    out = torch.empty(m, intermediate, dtype=x.dtype)
    if m == 0 or kern.op(op, x.dtype)(
            x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), m,
            intermediate, x.shape[1], x.stride(0), intermediate, torch.get_num_threads()) == 0:
        return out, x
    return None, x


def gate_up_silu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 intermediate: int) -> torch.Tensor:
    """silu(gate) * up [M, I] with [gate | up] = x @ weight^T (+ bias), the weight and bias packed
    by pack_gate_up: one kernel call, the activation fused into the GEMM where it runs on AMX tiles
    (kernels/cpu/model_ops_cpu.cpp, linear_packed_silu). Torch on the unpacked weight otherwise."""
    out, x = _fused_gate_up(x, packed, bias, intermediate, "linear_packed_silu")
    if out is not None:
        return out
    panel = packed.shape[2]
    weight = ops._deinterleave(unpack_weight(packed, 2 * intermediate), panel)
    return ops.silu_and_mul(F.linear(x, weight, None if bias is None else ops._deinterleave(bias, panel)))


def gate_up_gelu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 intermediate: int) -> torch.Tensor:
    """gelu_tanh(gate) * up [M, I] (Gemma's GeGLU) with [gate | up] = x @ weight^T (+ bias), the
    weight and bias packed by pack_gate_up: one kernel call (linear_packed_gelu: the packed GEMM,
    then gelu_tanh_and_mul on its interleaved panels). Torch on the unpacked weight otherwise."""
    out, x = _fused_gate_up(x, packed, bias, intermediate, "linear_packed_gelu")
    if out is not None:
        return out
    return ops.gelu_tanh_and_mul(linear_packed(x, packed, bias, 2 * intermediate), block=packed.shape[2])


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                b13: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                intermediate: int) -> torch.Tensor | None:
    """The MoE block's experts in one kernel call (model_ops_cpu.cpp, moe_experts): x [T, H], each
    token's k expert ids [T, k] (ascending) and weights [T, k] (float32, or the model's dtype: then
    rounded so before the product), every expert's w13 and w2 packed as a dense layer's
    (pack_gate_up, pack_weight) and stacked [E, ...]. None where the kernel does not run (torch
    then: FusedMoE.torch_experts)."""
    kern = ops._kernels_for(x, w13, w2)
    if (kern is None or not ops._rows(x) or w13.dim() != w2.dim()
            or w13.dim() != (5 if x.dtype is torch.bfloat16 else 4)):
        return None
    if not (w13.is_contiguous() and w2.is_contiguous() and expert_ids.dtype is torch.long and expert_ids.is_cpu):
        return None
    for b in (b13, b2):
        if b is not None and (b.dtype is not x.dtype or not b.is_contiguous()):
            return None
    t, h = x.shape
    k = expert_ids.shape[1]
    ids = expert_ids.contiguous()
    w = weights.float().contiguous()
    words = 2 if x.dtype is torch.bfloat16 else 1  # the kernel steps bf16 weights in 32-bit pairs
    out = torch.empty(t, h, dtype=x.dtype)
    rc = kern.op("moe_experts", x.dtype)(
        x.data_ptr(), x.stride(0), t, h, ids.data_ptr(), w.data_ptr(), k, w13.shape[0], w13.data_ptr(),
        0 if b13 is None else b13.data_ptr(), w13.stride(0) // words, w2.data_ptr(),
        0 if b2 is None else b2.data_ptr(), w2.stride(0) // words, intermediate, int(weights.dtype is torch.float32), out.data_ptr(), h, torch.get_num_threads())
    return out if rc == 0 else None
