"""FusedMoE: the mixture-of-experts block (vLLM's name for it) that takes a decoder layer's MLP place.

router GEMM [T, E] -> scores and top-k per token (route(), each family's op order, float32 as HF)
-> dispatch: the step's T * k (token, slot) pairs sorted by expert into contiguous groups -> per
active expert one GEMM over its rows with the activation fused (w13: gate then up, [E, 2I, H]), then
one through w2 ([E, H, I]) -> the k outputs of each token weighted and added, in ascending expert
order and in the model's dtype (what HF's index_add_ loop computes) -> plus the shared expert, scaled
by sigmoid(shared_expert_gate(x)) (Qwen2-MoE).

On the CPU with float32 or bfloat16 weights the experts run in one C++ call (packed_gemm.moe_experts:
each active expert's packed weights read once per step, its rows through the same packed GEMM
kernels as a dense layer's); elsewhere (CUDA, fp16, swigluoai) torch runs them, grouped the same way:
one torch._grouped_mm through w13 and one through w2 for all experts at once, the group ends computed
on the device (no host sync, no shape that depends on the routing: what a CUDA graph needs); where
_grouped_mm cannot take the operands, one matmul pair per active expert. docs/design/moe.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedrun.errors import PagedrunError
from pagedrun.models import ops, packed_gemm
from pagedrun.models.config import ModelConfig
from pagedrun.models.llama import DirectCall, Linear, LlamaMLP
from pagedrun.models.moe_config import MoEConfig

_worst_case = False


@contextlib.contextmanager
def worst_case_routing():
    """Inside the block every MoE layer sends slot j of token t to expert (t * k + j) % E instead of
    its router's choice: every expert active once a step has E / k tokens, and each token's k experts
    distinct. The profile pass runs so (worker/profiler.py): the memory it measures and the time it
    takes are then the worst any step's routing can bring, not what random weights happen to pick."""
    global _worst_case
    before, _worst_case = _worst_case, True
    try:
        yield
    finally:
        _worst_case = before


def route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (the model's dtype) -> (weights [T, k], expert ids [T, k] int64), each
    token's k slots in ascending expert order. The weights are float32 where the family keeps them
    so (Mixtral), else in the logits' dtype, as transformers 5.24's routers return them."""
    k = cfg.top_k
    if _worst_case:
        t = logits.shape[0]
        ids = (torch.arange(t * k, device=logits.device) % cfg.num_experts).view(t, k)
        ids = ids.sort(dim=1).values
        return torch.full((t, k), 1.0 / k, dtype=logits.dtype, device=logits.device), ids
    if cfg.scoring == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
    else:  # top-k on the logits, softmax over the k (GraniteMoE, GPT-OSS)
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
    if not cfg.weights_in_float32:
        weights = weights.to(logits.dtype)
    # HF adds the experts' outputs in ascending expert order (its loop over experts): so do we.
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


def swigluoai(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's activation on [M, 2I] (gate then up): (up + 1) * gate * sigmoid(alpha * gate), gate
    clamped to at most limit and up to [-limit, limit] (HF GptOssExperts, vLLM SwigluOAIAndMul)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@functools.lru_cache(maxsize=None)
def _native_grouped_mm(device: torch.device) -> bool:
    """Whether torch runs bf16 _grouped_mm on this CUDA device in one kernel (CUTLASS): compute
    capability 9.x or 10.x (torch's GroupedBlas.cpp, _scaled_mm_allowed_device(sm90, sm100)). On
    any other GPU, and for float32 / float16 on any GPU, torch's _grouped_mm_fallback copies the
    group ends to the host (a sync) and runs one mm per group, idle groups included."""
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def host_free_on(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether every FusedMoE of these widths runs grouped_experts on device in dtype, i.e. reads
    nothing back to the host (what CUDA graph capture needs): the conditions of grouped_mm_takes
    known before any weight is loaded."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype is not torch.bfloat16:
        return False
    if (hidden * 2) % 16 or (intermediate * 2) % 16:
        return False
    return _native_grouped_mm(device)


def grouped_mm_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether grouped_experts runs on these operands: torch._grouped_mm exists, the weights are
    plain (not the CPU kernels' packed layout) and contiguous [E, 2I, H] / [E, H, I], every row
    stride (H and I elements) a multiple of 16 bytes (_grouped_mm checks it: TMA), and the device
    runs it without a host sync: the CPU (float32, bfloat16, float16: checked with torch 2.13) or
    a CUDA device with the native bf16 kernel. Elsewhere FusedMoE keeps the per-expert loop,
    which syncs once as torch's own fallback would, but skips idle experts."""
    if not hasattr(torch, "_grouped_mm") or w13.dim() != 3 or w2.dim() != 3:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if w13.dtype is not x.dtype or w2.dtype is not x.dtype or not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    size = x.element_size()
    if (w13.shape[2] * size) % 16 or (w2.shape[2] * size) % 16:
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and x.dtype is torch.bfloat16 and _native_grouped_mm(x.device)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    b13: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                    act) -> torch.Tensor:
    """The experts of x [T, H] in two torch._grouped_mm calls: the T * k (token, slot) pairs sorted
    by expert (stable), each expert's group end counted on the device, w13 ([E, 2I, H], taken
    transposed as a view: [E, H, 2I]) over all groups, + each row's expert bias, act, w2 likewise,
    the rows put back in (token, slot) order and summed as _weighted_sum does. No .item / .tolist
    and no shape that depends on the routing (grouped_mm_takes says where)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)  # each sorted row's expert, ascending
    # offs[e] = rows of experts 0..e: the group ends _grouped_mm wants. searchsorted and not
    # bincount: bincount on CUDA reads the maximum back to size its output (a sync).
    offs = torch.searchsorted(expert, torch.arange(w13.shape[0], device=x.device, dtype=expert.dtype),
                              right=True, out_int32=True)
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs)
    if b13 is not None:  # _grouped_mm takes no bias (torch 2.13); added after, as HF's x @ W + b
        gate_up = gate_up + b13.index_select(0, expert)
    ys = torch._grouped_mm(act(gate_up), w2.transpose(1, 2), offs)
    if b2 is not None:
        ys = ys + b2.index_select(0, expert)
    return _weighted_sum(torch.empty_like(ys).index_copy_(0, order, ys), weights, x.dtype)


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T * k, H] in (token, slot) order -> sum over slots of weight * y [T, H]: each product
    rounded to the model's dtype, then added slot by slot in it (HF's index_add_ order)."""
    t, k = weights.shape
    y = (y.view(t, k, -1) * weights[:, :, None]).to(dtype)
    out = y[:, 0]
    for j in range(1, k):  # k <= 8 or so: a loop over slots, not tokens
        out = out + y[:, j]
    return out


class FusedMoE(DirectCall, nn.Module):
    """The experts of one layer stacked per projection: w13 [E, 2I, H] (gate rows, then up rows),
    w2 [E, H, I]; the router `gate` [E, H]; optionally shared_expert (+ shared_expert_gate [1, H]).
    Where the CPU kernels run, each expert's w13 and w2 are stored packed instead, as a dense
    layer's are (w13 as packed_gemm.pack_gate_up packs gate/up), stacked: [E, ...packed shape];
    load_expert writes each arriving tensor into its place in either layout."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config.moe
        assert cfg is not None
        self.cfg = cfg
        e, h, i = cfg.num_experts, config.hidden_size, cfg.intermediate_size
        self.hidden_size, self.intermediate_size, self.num_experts = h, i, e
        self.gate = Linear(h, e, bias=cfg.router_bias, dtype=dtype)
        # Packed as they load (load_expert), in the layout packed_gemm.pack_gate_up / pack_weight give
        # a dense layer's gate/up and down weights: packing after loading would hold every expert
        # twice for a moment, and experts are most of an MoE model's bytes.
        p = packed_gemm.packing_panel(dtype, torch.empty(0).device) if cfg.activation == "silu" else None
        if p is not None and (i % p or (dtype is torch.bfloat16 and (h % 2 or i % 2))):
            p = None
        self.panel, self.packed = p, p is not None
        if p is None:
            w13, w2 = torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype)
        else:
            pair = (2,) if dtype is torch.bfloat16 else ()  # bf16: k in pairs (packed_gemm.pack_weight)
            div = 2 if pair else 1
            np2 = -(-h // p)
            w13 = torch.empty(e, 2 * i // p, h // div, p, *pair, dtype=dtype)
            alloc = torch.zeros if h % p else torch.empty  # the last panel's padding columns stay 0
            w2 = alloc(e, np2, i // div, p, *pair, dtype=dtype)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.w13_bias = self.w2_bias = None
        if cfg.expert_bias:  # w13's bias interleaved as its rows are (packed_gemm.pack_gate_up) when packed
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(config, intermediate_size=cfg.shared_expert_intermediate_size,
                                         mlp_bias=False)
            self.shared_expert = LlamaMLP(shared, dtype)
        if cfg.shared_expert_gate:
            self.shared_expert_gate = Linear(h, 1, bias=False, dtype=dtype)

    def load_expert(self, e: int, part: str, tensor: torch.Tensor) -> None:
        """Expert e's "gate" or "up" ([I, H]), "down" ([H, I]) weight, or "gate_bias", "up_bias"
        ([I]), "down_bias" ([H]), into its place in w13 / w2 (packed or plain). A shape mismatch
        raises a PagedrunError (the caller adds the tensor's name)."""
        i, h, p = self.intermediate_size, self.hidden_size, self.panel
        want = {"gate": (i, h), "up": (i, h), "down": (h, i), "gate_bias": (i,), "up_bias": (i,), "down_bias": (h,)}
        if part not in want or (part.endswith("_bias") and self.w13_bias is None):
            raise PagedrunError(f"unexpected tensor ({part} of expert {e}: the block has none)")
        if tuple(tensor.shape) != want[part]:
            raise PagedrunError(f"shape mismatch: model expects {list(want[part])}, checkpoint has "
                                f"{list(tensor.shape)}")
        half = 0 if part.startswith("gate") else 1
        with torch.no_grad():
            if part == "down_bias":
                self.w2_bias.data[e].copy_(tensor)
            elif part.endswith("_bias"):
                dst = self.w13_bias.data[e]
                if p is None:
                    dst[half * i:(half + 1) * i].copy_(tensor)
                else:
                    dst.view(2 * i // p, p)[half::2].copy_(tensor.reshape(i // p, p))
            elif p is None:
                dst = self.w2.data[e] if part == "down" else self.w13.data[e, half * i:(half + 1) * i]
                dst.copy_(tensor)
            else:
                # packed_gemm.pack_weight's layout: packed[q, k, j] = w[q * p + j, k] (bf16: k in pairs);
                # pack_gate_up's panel 2j is gate's columns [j * p, (j + 1) * p), 2j + 1 up's.
                if part == "down":
                    dst, rows = self.w2.data[e], self.w2.shape[1] * p
                    tensor = F.pad(tensor, (0, 0, 0, rows - h)) if rows != h else tensor
                else:
                    dst = self.w13.data[e][half::2]
                n, k = tensor.shape
                if self.w13.dim() == 5:  # bf16
                    dst.copy_(tensor.reshape(n // p, p, k // 2, 2).transpose(1, 2))
                else:
                    dst.copy_(tensor.reshape(n // p, p, k).transpose(1, 2))

    def process_weights_after_loading(self) -> None:
        """Nothing left to do: load_expert packed the experts (the router and the shared expert
        are Linears, which the model packs)."""

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Expert e's (w13 [2I, H] gate then up, its bias, w2 [H, I], its bias), unpacked if packed."""
        w13, w2 = self.w13[e], self.w2[e]
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = None if self.w2_bias is None else self.w2_bias[e]
        if not self.packed:
            return w13, b13, w2, b2
        panel = self.panel
        w13 = ops._deinterleave(packed_gemm.unpack_weight(w13, 2 * self.intermediate_size), panel)
        if b13 is not None:
            b13 = ops._deinterleave(b13, panel)
        return w13, b13, packed_gemm.unpack_weight(w2, self.hidden_size), b2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]."""
        weights, ids = route(self.gate(x), self.cfg)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k slots (ascending expert) of weight * expert(x): the C++ kernel
        where it runs, else torch_experts."""
        if self.packed and x.shape[0]:
            out = packed_gemm.moe_experts(x, ids, weights, self.w13, self.w13_bias, self.w2, self.w2_bias,
                                  self.intermediate_size)
            if out is not None:
                return out
        return self.torch_experts(x, weights, ids)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation == "swigluoai":
            return swigluoai(gate_up, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return ops.silu_and_mul(gate_up)

    def torch_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts in torch: grouped_experts where _grouped_mm takes the operands (CUDA bf16 on
        sm90 / sm100, the CPU), else loop_experts."""
        if ids.shape[0] == 0:
            return torch.zeros_like(x)
        if not self.packed and grouped_mm_takes(x, self.w13, self.w2):
            return grouped_experts(x, weights, ids, self.w13, self.w13_bias, self.w2, self.w2_bias, self._act)
        return self.loop_experts(x, weights, ids)

    def loop_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The fallback and reference: the T * k (token, slot) pairs sorted by expert, one matmul
        pair per active expert over its contiguous rows (the expert counts read back to the host:
        a sync on a GPU), the outputs back in (token, slot) order, weighted and added as
        _weighted_sum does. Runs where grouped_mm_takes is false: packed weights (the CPU kernels'
        layout, unpacked here expert by expert: ops.torch_only() on a packed model), row strides
        not 16-byte multiples, CUDA without the native bf16 _grouped_mm (float32 / float16, or
        compute capability other than 9.x / 10.x)."""
        t, k = ids.shape
        if t == 0:
            return torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[order // k]
        ys = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):  # the active experts only; nothing is looped per token
            if n == 0:
                continue
            w13, b13, w2, b2 = self.expert_weights(e)
            gate_up = F.linear(xs[start:start + n], w13)
            if b13 is not None:  # HF's x @ W + b: the bias added after the product is rounded
                gate_up = gate_up + b13
            y = F.linear(self._act(gate_up), w2)
            ys[start:start + n] = y if b2 is None else y + b2
            start += n
        y = torch.empty_like(ys)
        y[order] = ys
        return _weighted_sum(y, weights, x.dtype)
