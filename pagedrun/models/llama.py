"""The Llama family in one file: Llama 2/3 (GQA, RoPE scaling), Qwen2 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm), Mistral; tied or untied embeddings. A layer's sliding window is the config's
(ModelConfig.window_of); the attention backend applies it.

Reads like the paper: embed -> N x (RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU MLP ->
residual) -> RMSNorm -> lm_head. Tokens of all sequences in a step arrive flattened ([T]); the only
thing that knows about sequences is the attention backend, through AttentionMetadata and the paged
KV cache. Numerics follow transformers' op order (float32 RMSNorm variance, float32 RoPE tables) so
greedy decoding matches HF generate token for token in float32.

q/k/v live in one Linear and gate/up in another: one GEMM instead of three (two) per layer, which is
what matters on a CPU. load_weights() stitches the HF tensors into them. The residual add is fused
into the next RMSNorm (vLLM's `norm(x, residual)` form). The arithmetic itself is in
pagedrun.models.ops: C++ kernels for float32 on the CPU, torch everywhere else.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedrun.attention.backend import AttentionBackend
from pagedrun.attention.metadata import AttentionMetadata, StepMetadata, per_layer
from pagedrun.errors import PagedrunError
from pagedrun.models import ops, packed_gemm
from pagedrun.models.config import ModelConfig
from pagedrun.models.layer_runner import LayerRunner
from pagedrun.models.rope import RotaryEmbedding


class DirectCall:
    """For the modules inside a decoder layer: calling one runs its forward directly. nn.Module's
    __call__ checks for hooks first, some 250 calls per step: a measurable part of a decode step on
    2 cores (docs/log/2026-11-26-python-between-kernels.md,
    docs/log/2026-11-27-figures-from-code-comments.md). These modules take no hooks; the decoder
    layers, called as usual, do."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(DirectCall, nn.Linear):
    """nn.Linear whose weight, once packed after loading, is in the CPU GEMM kernel's panel layout
    ([N / 16, K, 16] instead of [N, K]: the weight tensor's shape says which)."""

    def reset_parameters(self) -> None:
        # Deliberately empty: load_weights() sets every weight (and fails on a missing one), so
        # torch's random init would be work thrown away, most of the default model's construction
        # time (docs/log/2026-11-25-amx-gemm-prefetch.md).
        pass

    def process_weights_after_loading(self) -> None:
        packed = packed_gemm.pack_weight(self.weight.data)
        if packed is not None:
            self.weight.data = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() >= 3:
            return packed_gemm.linear_packed(x, self.weight, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)


class GateUpLinear(Linear):
    """The MLP's gate_proj and up_proj stacked in one Linear ([gate; up], 2I outputs) whose forward
    is the activation's input and output at once: silu(gate) * up, [..., I]. Packed after loading
    with gate and up interleaved a panel at a time (packed_gemm.pack_gate_up), so that the CPU kernel computes
    both halves of each output column block together and applies the activation in the GEMM's
    epilogue: no [T, 2I] tensor, one call instead of two."""

    def process_weights_after_loading(self) -> None:
        packed = packed_gemm.pack_gate_up(self.weight.data, None if self.bias is None else self.bias.data)
        if packed is not None:
            self.weight.data = packed[0]
            if self.bias is not None:
                self.bias.data = packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() >= 3:
            return packed_gemm.gate_up_silu(x, self.weight, self.bias, self.out_features // 2)
        return ops.silu_and_mul(F.linear(x, self.weight, self.bias))


class VocabEmbedding(DirectCall, nn.Embedding):
    """nn.Embedding whose table may be packed like a Linear weight ([V / 16, H, 16]): with tied
    embeddings the table is also the LM head, and the head's GEMM wants it packed. A lookup then
    gathers token v's row from its panel: packed[v // panel, :, v % panel], the same values."""

    def reset_parameters(self) -> None:
        pass  # as Linear's: load_weights() sets the table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() >= 3:  # [V/panel, H, panel] or, bf16, [V/panel, H/2, panel, 2]
            panel = self.weight.shape[2]
            rows = self.weight[ids // panel, :, ids % panel]
            return rows.reshape(*ids.shape, -1)
        return super().forward(ids)


class RMSNorm(DirectCall, nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: h = x + residual, then (norm(h), h)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def fused_rope_and_cache(backend, rotary, positions, q, k, v, key_cache, value_cache, meta, kv_scales) -> bool:
    """RoPE and the K/V cache write as one launch where the backend lets the model write the cache
    (written_slots: the CuPy kernels, unquantized caches) and the fused kernels run (CUDA): q and k
    rotated in place, k and v in the cache; the backend then only attends. False: nothing done."""
    written_slots = getattr(backend, "written_slots", None)
    rope_and_cache = getattr(rotary, "rope_and_cache", None)
    if written_slots is None or rope_and_cache is None or kv_scales or ops.fused_for(q) is None:
        return False
    slots = written_slots(meta, key_cache, q)
    return slots is not None and rope_and_cache(positions, q, k, v, key_cache, value_cache, slots)


class LlamaAttention(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        # The layer's attention variant (pagedrun/attention/backend.py; 0 = off); the CPU layer runner
        # reads the same attributes.
        self.window = config.window_of(layer_idx)
        self.softcap = 0.0
        self.sinks = None  # GPT-OSS: a float32 [num_heads] parameter of learned attention sinks
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # (key_cache, value_cache), and with a quantized cache its (k_scale, v_scale) after them.
        key_cache, value_cache, *kv_scales = kv_cache
        if fused_rope_and_cache(backend, rotary, positions, q, k, v, key_cache, value_cache, meta, kv_scales):
            out = backend.forward(q, k, v, key_cache, value_cache, meta, self.scale, window=self.window,
                                  softcap=self.softcap, sinks=self.sinks, cache_written=True)
        else:
            q, k = rotary(positions, q, k)
            out = backend.forward(q, k, v, key_cache, value_cache, meta, self.scale, *kv_scales,
                                  window=self.window, softcap=self.softcap, sinks=self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = GateUpLinear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # silu(gate) * up: GateUpLinear


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int = 0, mlp: nn.Module | None = None,
                 self_attn: nn.Module | None = None) -> None:
        """`mlp`, `self_attn`: a family's own blocks in place of LlamaMLP / LlamaAttention (the MoE
        families: models/moe_models.py), built by the caller."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(config, dtype, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, dtype)

    def forward(self, positions, h, residual, rotary, kv_cache, meta, backend):
        """(h, residual) -> (h', residual'): the block's input is h + residual (just h in the first
        layer), its output is the MLP's plus residual', added by the next layer's (or the final) norm."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, x, rotary, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, make_layer=None) -> None:
        """make_layer(i): decoder layer i (default: LlamaDecoderLayer's)."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        make_layer = make_layer or (lambda i: LlamaDecoderLayer(config, dtype, i))
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


# HF checkpoint names that land in a slice of one of our fused weights: (hf part, ours, shard index).
_STACKED = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", make_layer=None
    ) -> None:
        """make_layer(i): a family's decoder layer i (LlamaModel's hook; default: Llama's)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        # Weights are allocated uninitialised (Linear and VocabEmbedding skip torch's random init:
        # load_weights() overwrites them all). Not on the meta device and then to_empty(): that
        # route imports sympy through torch's decompositions, which slows start-up
        # (docs/log/2026-11-25-amx-gemm-prefetch.md,
        # docs/log/2026-11-27-figures-from-code-comments.md).
        with torch.device(device):
            self.model = LlamaModel(config, dtype, make_layer)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            )
        self.rotary_emb = RotaryEmbedding(config).to(device)
        self.layer_runner: LayerRunner | None = None  # set once the weights are packed

    # no_grad, not inference_mode: inference tensors cannot be modified in place later (the
    # sampler may scale logits in place), and the KV caches are allocated outside this call.
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """[T] token ids at [T] positions -> [T, hidden] final-normed hidden states. `meta`: one
        AttentionMetadata for all layers, or one per layer (the hybrid KV manager's groups)."""
        h, residual = self.embed(input_ids), None
        metas = per_layer(meta, len(self.model.layers))
        # The same layers in one C call where every op would run its CPU kernel (layer_runner.py).
        done = self.layer_runner and self.layer_runner.run(h, positions, kv_caches, metas, backend)
        if done:
            h, residual = done
        else:
            for rotary in self.rotaries():
                rotary.step_rows.clear()  # rows of the tables for this call's positions only
            for i, (layer, kv_cache, layer_meta) in enumerate(zip(self.model.layers, kv_caches, metas, strict=True)):
                h, residual = layer(positions, h, residual, self.rotary_of(i), kv_cache, layer_meta, backend)
        return self.model.norm(h, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rotaries(self) -> tuple[RotaryEmbedding, ...]:
        return (self.rotary_emb,)

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        """The RoPE of a layer (one for all here; Gemma 3's sliding layers have their own)."""
        return self.rotary_emb

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as HF's head gives them. The sampler widens them to float32
        where it computes with them; greedy rows need no copy (a float32 copy of a step's logits was
        a visible cost: docs/log/2026-11-26-python-between-kernels.md)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        table = self.model.embed_tokens.weight  # tied: the embedding table is the head
        if table.dim() >= 3:
            return packed_gemm.linear_packed(hidden, table, None, self.config.vocab_size)
        return F.linear(hidden, table)

    def process_weights_after_loading(self) -> None:
        """Repack the Linear weights (and a tied embedding table, the LM head) for the CPU GEMM
        kernel, a no-op where it does not apply, as vLLM's quantisation methods repack theirs: once,
        in place, after load_weights()."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        if self.lm_head is None:
            embed = self.model.embed_tokens
            packed = packed_gemm.pack_weight(embed.weight.data)
            if packed is not None:
                embed.weight.data = packed
        self.layer_runner = LayerRunner.for_model(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be covered once."""
        params = self.named_weights()
        # What must arrive: for fused params one entry per shard, else one per parameter.
        expected: dict[tuple[str, int | None], str] = {}
        for name in params:
            fused = next((s for s in _STACKED if f".{s[1]}." in name), None)
            if fused is None:
                expected[(name, None)] = name
                continue
            for part, ours, shard in _STACKED:
                if ours == fused[1]:
                    expected[(name, shard)] = name.replace(f".{ours}.", f".{part}.")
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # old checkpoints store the RoPE table; we recompute it
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still ship the (identical) copy
            name, shard = hf_name, None
            for part, ours, idx in _STACKED:
                if f".{part}." in hf_name:
                    name, shard = hf_name.replace(f".{part}.", f".{ours}."), idx
                    break
            if name not in params:
                raise PagedrunError(f"{hf_name}: unexpected tensor (not part of {self.config.architecture})")
            if (name, shard) in loaded:
                raise PagedrunError(f"{hf_name}: appears twice in the checkpoint")
            target = self._shard(params[name], name, shard)
            if tuple(tensor.shape) != tuple(target.shape):
                raise PagedrunError(
                    f"{hf_name}: shape mismatch: model expects {list(target.shape)}, "
                    f"checkpoint has {list(tensor.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add((name, shard))
        missing = [hf for key, hf in expected.items() if key not in loaded]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise PagedrunError(f"missing tensors: {', '.join(missing[:3])}{more}")

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The parameters load_weights fills by name (a family loading some itself leaves them out)."""
        return dict(self.named_parameters())

    def _shard(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """The slice of a fused parameter (along the output dim) that one HF tensor fills."""
        if shard is None:
            return param.data
        if ".qkv_proj." in name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])
