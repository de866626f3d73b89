"""Rotary position embeddings: the inverse frequencies and cos/sin tables of every RoPE type
config.json can ask for, computed with transformers' formulas (modeling_rope_utils) in float32.

Types (ModelConfig.rope_scaling["rope_type"]; None: default): linear, dynamic (NTK), llama3, yarn,
longrope. An attention factor (yarn's mscale, LongRoPE's sqrt(1 + ln s / ln L)) multiplies the
tables, as HF multiplies cos and sin. With partial_rotary_factor < 1 the tables are
rotary_dim / 2 wide (rotary_dim = int(head_dim * factor)) and ops.rope rotates only the first
rotary_dim dims of each head.

Two types depend on the sequence length in HF, which re-picks its frequencies at every forward
from the longest position in the batch. pagedrun picks once, from the run's max_model_len, as vLLM
does (config.py resolves it into rope_scaling):

- longrope: the long factors iff max_model_len > original_max_position_embeddings, else the short
  ones. HF uses the short ones while a sequence is at most original_max_position_embeddings long
  and the long ones past it, so greedy parity with HF holds for runs whose max_model_len is within
  the original length, and for sequences already longer than it (from their prefill on) in a run
  above it.
- dynamic: HF's scaled base at seq_len = max(max_model_len, max_position_embeddings). pagedrun
  refuses max_model_len > max_position_embeddings (config.resolve_max_model_len), so that is the
  plain base: what HF uses for every sequence up to max_position_embeddings, so parity holds for
  every run. vLLM instead scales the base once for max_position_embeddings * factor; that differs
  from HF at every length pagedrun runs.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedrun.models import ops
from pagedrun.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] in float32, attention factor), as HF's ROPE_INIT_FUNCTIONS."""
    dim, base = config.rotary_dim, config.rope_theta
    scaling = config.rope_scaling
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "dynamic":
        # HF's _compute_dynamic_ntk_parameters at the run's length (module docstring).
        factor, max_pos = scaling["factor"], config.max_position_embeddings
        seq_len = max(scaling["max_model_len"], max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    if kind == "yarn":
        return _yarn(scaling, dim, base)
    if kind == "longrope":
        ext = torch.tensor(scaling["ext_factors"], dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * base**shape), scaling["attention_factor"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    # llama3: leave high frequencies alone, divide low ones by `factor`, interpolate in between.
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


def _yarn(scaling: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    """HF's _compute_yarn_parameters, op for op (config.py resolved factor and attention factor)."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, scaling["attention_factor"]


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position_embeddings, rotary_dim/2] in float32, the attention factor folded in."""
    inv_freq, attention_factor = rope_inv_freq(config)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # HF's inv_freq @ positions: one product each
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


class RotaryEmbedding(nn.Module):
    """RoPE in the "rotate half" layout HF checkpoints use; cos/sin tables precomputed in float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cos, sin = rope_tables(config)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.step_rows: dict = {}  # the torch path's rows of the tables for this step (ops.rope_rows)

    # Called by every layer: straight to forward, past nn.Module's hook checks (llama.DirectCall's reason).
    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.forward(positions, q, k)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope(positions, q, k, self.cos, self.sin, self.step_rows)

    def rope_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """q, k rotated in place and k, v written to the caches in one launch where the fused kernels
        run (ops.rope_and_cache); False: nothing done."""
        return ops.rope_and_cache(positions, q, k, v, self.cos, self.sin, key_cache, value_cache, slot_mapping)
