"""ModelConfig: the few numbers of an HF config.json that the Llama family's forward pass needs.

Everything the model file, the KV cache sizing and the memory report read comes from here, so the
supported subset is checked once, with errors that name config.json and the offending field.
transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x writes one `rope_parameters` dict; both
are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedrun.errors import PagedrunError, echo

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# No size of a real model comes near this; a larger one is a broken config, refused before any
# arithmetic or allocation (models/shapes.py then checks every size against the weights).
_MAX_SIZE = 1 << 31


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", ...HF parameters}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None  # only kept to report it; never applied (we refuse when it would matter)
    bos_token_id: int | None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    source: str = "config.json"
    # The attention window of each layer (0: full attention), num_hidden_layers entries; empty
    # means every layer is full. The model applies it in compute; the KV cache groups layers by it
    # (worker/kv_groups.py) so that a sliding layer's blocks are freed once they leave the window.
    layer_windows: tuple[int, ...] = ()

    def window_of(self, layer: int) -> int:
        """The window of one layer (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_hf_dict(
        cls, d: dict[str, Any], source: str, max_model_len: int | None = None
    ) -> "ModelConfig":
        """Parse an HF config.json dict. `source` names the file in errors.

        Mistral/Qwen sliding-window attention is not implemented: a window shorter than the longest
        sequence we may run (max_model_len, default max_position_embeddings) is refused.
        """
        def err(key: str, msg: str) -> PagedrunError:
            return PagedrunError(f"{source}: {key}: {msg}")

        def req(key: str, typ: type = int) -> Any:
            if key not in d or d[key] is None:
                raise err(key, "missing")
            value = d[key]
            if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise err(key, f"expected an integer, got {echo(value)}")
            if typ is int and not 0 < value <= _MAX_SIZE:
                raise err(key, f"expected an integer in 1..{_MAX_SIZE}, got {echo(value)}")
            if typ is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise err(key, f"expected a number, got {echo(value)}")
                value = float(value)
            return value

        if not isinstance(d, dict):
            raise PagedrunError(f"{source}: expected a JSON object")
        archs = d.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise err("architectures", f"missing; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise err(
                "architectures",
                f"{echo(arch)} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )

        hidden = req("hidden_size")
        heads = req("num_attention_heads")
        kv_heads = d.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0 or heads % kv_heads:
            raise err(
                "num_key_value_heads",
                f"{echo(kv_heads)} must divide num_attention_heads ({heads})",
            )
        head_dim = req("head_dim") if d.get("head_dim") is not None else hidden // heads
        if d.get("head_dim") is None and hidden % heads:
            raise err("head_dim", f"missing and hidden_size {hidden} is not a multiple of {heads} heads")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise err("hidden_act", f"{echo(act)} is not supported (only 'silu')")
        max_pos = req("max_position_embeddings")
        rope_theta, rope_scaling = _parse_rope(d, max_pos, err)

        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(d.get("attention_bias", False))
        o_proj_bias = False if is_qwen2 else attention_bias
        if arch == "MistralForCausalLM":
            mlp_bias = False
        else:
            mlp_bias = bool(d.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False

        sliding_window = d.get("sliding_window")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
            raise err("sliding_window", f"expected an integer or null, got {echo(sliding_window)}")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
            sliding_window = None  # present in every Qwen config but switched off
        if arch == "LlamaForCausalLM":
            sliding_window = None
        limit = max_model_len or max_pos
        if sliding_window is not None and sliding_window < limit:
            raise err(
                "sliding_window",
                f"sliding-window attention ({sliding_window} tokens) is not supported; "
                f"set max_model_len <= {sliding_window} (now {limit})",
            )

        eos = d.get("eos_token_id")
        if eos is None:
            eos_list: list[int] = []
        elif isinstance(eos, int):
            eos_list = [eos]
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_list = list(eos)
        else:
            raise err("eos_token_id", f"expected an integer or a list of integers, got {echo(eos)}")
        bos = d.get("bos_token_id")
        if bos is not None and not isinstance(bos, int):
            raise err("bos_token_id", f"expected an integer, got {echo(bos)}")

        return cls(
            architecture=arch,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=req("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=req("intermediate_size"),
            rms_norm_eps=_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", err),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            bos_token_id=bos,
            eos_token_id=eos_list,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            source=source,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Parameter count from the shapes (tied embeddings counted once)."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.o_proj_bias:
            per_layer += h
        if self.mlp_bias:
            per_layer += 2 * i + h
        if self.qk_norm:
            per_layer += 2 * hd
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * per_layer + h + lm_head


def _number(value: Any, key: str, err) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise err(key, f"expected a number, got {echo(value)}")
    try:
        return float(value)
    except OverflowError:
        raise err(key, f"expected a number, got {echo(value)}") from None


def _parse_rope(d: dict[str, Any], max_pos: int, err) -> tuple[float, dict[str, Any] | None]:
    params = d.get("rope_parameters")
    key = "rope_parameters" if params is not None else "rope_scaling"
    if params is None:
        params = d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise err(key, f"expected an object, got {echo(params)}")
    params = dict(params)
    if key == "rope_parameters" and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type RoPE (nested by layer type): fine only when all layers agree.
        variants = [v for v in params.values() if v]
        if any(v != variants[0] for v in variants):
            raise err("rope_parameters", "different RoPE per layer type is not supported")
        params = dict(variants[0]) if variants else {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    theta = _number(theta, "rope_theta", err)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
        raise err(
            key,
            f"rope type {echo(rope_type)} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    if rope_type == "default":
        return float(theta), None
    out: dict[str, Any] = {"rope_type": rope_type}
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor"]
        # Same fallback as transformers' standardize_rope_params.
        out["original_max_position_embeddings"] = params.get(
            "original_max_position_embeddings", d.get("original_max_position_embeddings", max_pos)
        )
    for key in needed:
        out[key] = _number(params.get(key), f"{rope_type}: {key}", lambda k, m: err("rope_scaling", f"{k}: {m}"))
    return float(theta), out


def resolve_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    """The run's max_model_len: the recipe's, else the model's context capped at 8192 (a longer
    default would size every sequence's worst case, and the KV budget, for contexts batch jobs
    rarely use). One rule for a local run, a Ray driver and its replicas."""
    max_model_len = requested or min(cfg.max_position_embeddings, 8192)
    if max_model_len > cfg.max_position_embeddings:
        raise PagedrunError(
            f"model.max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    return max_model_len
