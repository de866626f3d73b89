"""ModelConfig: the few numbers of an HF config.json that a supported model's forward pass needs.

Everything the model files, the KV cache sizing and the memory report read comes from here, so the
supported subset is checked once, with errors that name config.json and the offending field.
transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x writes one `rope_parameters` dict (Gemma 3:
one per layer type); both are read, and each RoPE type's parameters are resolved here as transformers
resolves them (defaults, original length, attention factor; models/rope.py computes the tables).
LongRoPE's factors and dynamic NTK's base are chosen once, from the run's max_model_len.
Sliding-window attention (Mistral, Qwen2/3 with use_sliding_window, Phi-3, Gemma 2's and Gemma 3's
sliding layers) becomes `layer_windows`, one window per layer, as transformers assigns them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedrun.errors import PagedrunError, echo
from pagedrun.models.moe_config import MOE_ARCHITECTURES, MoEConfig, parse_moe
from pagedrun.models.rope_config import (  # noqa: F401 (LAYER_TYPES, SUPPORTED_ROPE_TYPES: re-exported)
    LAYER_TYPES,
    MAX_SIZE,
    SUPPORTED_ROPE_TYPES,
    RopeContext,
    as_number,
    parse_gemma3_rope,
    parse_rope,
    rotary_dim_of,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # its text model only: the vision tower's weights are skipped
    "Phi3ForCausalLM",  # Phi-3, Phi-3.5, Phi-4, Phi-4-mini: Llama with fused q/k/v and gate/up on disk
    "GraniteForCausalLM",  # Llama plus four scalar multipliers
    *MOE_ARCHITECTURES,
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' Gemma2Config and Gemma3TextConfig defaults, for the fields pagedrun reads: Google's
# configs leave some out (gemma-3-4b-it's text_config has six fields), and transformers fills them
# in. A key present in config.json, null included, wins, as it does in transformers.
_GEMMA_DEFAULTS = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}
_GEMMA3_DEFAULTS = {**_GEMMA_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None}
# transformers' GptOssConfig defaults, for the fields pagedrun reads that a config may leave out.
_GPT_OSS_DEFAULTS = {"sliding_window": 128, "attention_bias": True, "rope_theta": 150000.0, "head_dim": 64,
                     "rms_norm_eps": 1e-5}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_DEFAULT_MAX_MODEL_LEN = 8192  # resolve_max_model_len's cap on the model's context


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
    # None for plain RoPE, else {"rope_type": "linear" | "dynamic" | "llama3" | "yarn" | "longrope",
    # ...HF parameters, resolved (_rope_of: defaults filled in, LongRoPE's factors chosen)}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None  # as config.json says (None: off); layer_windows is what applies
    bos_token_id: int | None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    source: str = "config.json"
    # The attention window of each layer (0: full attention), num_hidden_layers entries; empty
    # means every layer is full. The model applies it in compute; the KV cache groups layers by it
    # (worker/kv_groups.py) so that a sliding layer's blocks are freed once they leave the window.
    layer_windows: tuple[int, ...] = ()
    # Gemma 2 / 3 (defaults: the Llama family's). Activation of the gated MLP.
    hidden_act: str = "silu"
    # HF's layer_types ("sliding_attention" / "full_attention" per layer): Gemma 3 picks each layer's
    # RoPE by it, whether or not its window is shorter than the run (layer_windows).
    layer_types: tuple[str, ...] = ()
    # The RoPE of the "sliding_attention" layers where it differs from the global one (Gemma 3's
    # local base frequency, never scaled); None: every layer uses rope_theta / rope_scaling.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim ** -0.5)
    attn_logit_softcapping: float = 0.0  # 0: off
    final_logit_softcapping: float = 0.0  # 0: off
    # Partial rotary (partial_rotary_factor < 1, Phi-4-mini): the first rotary_dim dims of each head
    # rotate, the rest pass through. 0: head_dim (set in __post_init__).
    rotary_dim: int = 0
    # Granite's scalars (defaults: none of them changes anything). embedding_multiplier scales the
    # embeddings, residual_multiplier the attention's and the MLP's outputs before each residual add,
    # the logits are divided by logits_scaling; attention_multiplier (None: head_dim ** -0.5) is the
    # softmax scale.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # Mixture of experts (models/moe_config.py); None: every layer's MLP is dense.
    moe: MoEConfig | None = None
    qk_norm_whole: bool = False  # OLMoE: q_norm / k_norm over the whole projected q and k, not per head
    clip_qkv: float = 0.0  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (0: off)
    # GPT-OSS: a learned logit per head joins each softmax's denominator (self_attn.sinks)
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim

    def window_of(self, layer: int) -> int:
        """The window of one layer (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    def text_tensor_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in the text model's own layout (model.*, lm_head.*), or None for
        a tensor that is not part of it. Gemma3ForConditionalGeneration checkpoints keep the text
        model under language_model.model.* (as transformers still saves them) or
        model.language_model.* (its module names), beside a vision tower pagedrun does not run."""
        if self.architecture != "Gemma3ForConditionalGeneration":
            return name
        for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                return new + name[len(old):]
        if name.startswith("lm_head."):
            return name
        return None

    @classmethod
    def from_hf_dict(
        cls, d: dict[str, Any], source: str, max_model_len: int | None = None
    ) -> "ModelConfig":
        """Parse an HF config.json dict. `source` names the file in errors.

        A sliding window applies where it is shorter than the longest sequence we may run
        (max_model_len, default max_position_embeddings); a longer one is full attention (0).
        """
        prefix = ""  # "text_config." where the text model's fields are nested (Gemma3ForConditionalGeneration)

        def err(key: str, msg: str) -> PagedrunError:
            return PagedrunError(f"{source}: {prefix}{key}: {msg}")

        def req(key: str, typ: type = int) -> Any:
            if key not in d or d[key] is None:
                raise err(key, "missing")
            value = d[key]
            if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise err(key, f"expected an integer, got {echo(value)}")
            if typ is int and not 0 < value <= MAX_SIZE:
                raise err(key, f"expected an integer in 1..{MAX_SIZE}, got {echo(value)}")
            if typ is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise err(key, f"expected a number, got {echo(value)}")
                value = float(value)
            return value

        def positive(key: str, default: float | None) -> float | None:
            """An optional positive number (null: the default)."""
            value = d.get(key)
            if value is None:
                return default
            value = as_number(value, key, err)
            if not 0 < value < float("inf"):
                raise err(key, f"expected a positive number or null, got {echo(d[key])}")
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
        top = d
        if arch == "Gemma3ForConditionalGeneration":
            # The text model's fields; the top level keeps what is shared (tied embeddings, dtype).
            if not isinstance(d.get("text_config"), dict):
                raise err("text_config", f"expected an object, got {echo(d.get('text_config'))}")
            d, prefix = d["text_config"], "text_config."
        gemma = arch in GEMMA_ARCHITECTURES
        if arch == "GptOssForCausalLM":
            d = {**_GPT_OSS_DEFAULTS, **d}
            if d.get("rope_parameters") is None and d.get("rope_scaling") is None:
                d["rope_parameters"] = dict(_GPT_OSS_ROPE)  # transformers' GptOssConfig fills it so
        if gemma:
            d = {**(_GEMMA_DEFAULTS if arch == "Gemma2ForCausalLM" else _GEMMA3_DEFAULTS), **d}
            if arch == "Gemma3ForConditionalGeneration" and "eos_token_id" in top:  # its own ids first
                d["eos_token_id"] = top["eos_token_id"]

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
        if gemma:  # Gemma configs name it hidden_activation (older ones also carry hidden_act)
            act_key = "hidden_activation" if d.get("hidden_activation") is not None else "hidden_act"
            act, allowed = d.get(act_key, "gelu_pytorch_tanh"), "gelu_pytorch_tanh"
        else:
            act_key, act, allowed = "hidden_act", d.get("hidden_act", "silu"), "silu"
        if act != allowed:
            raise err(act_key, f"{echo(act)} is not supported (only {allowed!r})")
        max_pos = req("max_position_embeddings")
        num_layers = req("num_hidden_layers")
        local_theta, local_scaling = None, None
        # The run's length, as resolve_max_model_len will make it: LongRoPE's factors and dynamic
        # NTK's base are chosen from it once (models/rope.py).
        run_len = max_model_len or min(max_pos, _DEFAULT_MAX_MODEL_LEN)
        rotary_dim = rotary_dim_of(d, head_dim, err)
        rope = RopeContext(max_pos, run_len, rotary_dim, arch, err)
        if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            (rope_theta, rope_scaling), (local_theta, local_scaling) = parse_gemma3_rope(d, rope)
        else:
            rope_theta, rope_scaling = parse_rope(d, rope, default_theta=10000.0)

        is_qwen2 = arch == "Qwen2ForCausalLM"
        # Phi-3's projections never have biases (transformers' Phi3 reads no attention_bias).
        attention_bias = True if is_qwen2 else bool(d.get("attention_bias", False)) and arch != "Phi3ForCausalLM"
        o_proj_bias = False if is_qwen2 else attention_bias
        if arch == "Qwen2MoeForCausalLM":  # q/k/v bias under its own name, none on o_proj
            attention_bias, o_proj_bias = bool(d.get("qkv_bias", True)), False
        moe = parse_moe(d, arch, num_layers, req("intermediate_size"), err) if arch in MOE_ARCHITECTURES else None
        clip_qkv = positive("clip_qkv", None) if arch == "OlmoeForCausalLM" else None
        if arch in ("LlamaForCausalLM", "GraniteForCausalLM"):  # (GraniteMoE: no dense MLP)
            mlp_bias = bool(d.get("mlp_bias", False))
        else:
            mlp_bias = False
        granite: dict[str, Any] = {}
        if arch in ("GraniteForCausalLM", "GraniteMoeForCausalLM"):
            for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier"):
                # transformers' GraniteConfig defaults: 1.0 each (attention_multiplier too, not 1/sqrt(d))
                value = as_number(d.get(name, 1.0), name, err)
                if not math.isfinite(value) or (name == "logits_scaling" and value == 0):
                    raise err(name, f"expected a finite number{' other than 0' if name == 'logits_scaling' else ''}, "
                                    f"got {echo(d.get(name))}")
                granite[name] = value

        sliding_window = d.get("sliding_window")
        if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
            if d.get("use_sliding_window", False):
                raise err("use_sliding_window", "sliding-window attention is not supported for this architecture")
            sliding_window = None  # Qwen2-MoE writes 0 for "off"
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window <= 0):
            raise err("sliding_window", f"expected a positive integer or null, got {echo(sliding_window)}")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
            sliding_window = None  # present in every Qwen config but switched off
        if arch in ("LlamaForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM"):
            sliding_window = None
        layer_types = _layer_types(d, arch, num_layers, sliding_window, err)
        if sliding_window is None and gemma and "sliding_attention" in layer_types:
            raise err("sliding_window", "null, but the model has sliding_attention layers")
        limit = max_model_len or max_pos
        # A window at least as long as any sequence we run never drops a key: full attention, which
        # also keeps such layers in the full-attention KV cache group.
        window = sliding_window if sliding_window is not None and sliding_window < limit else 0
        layer_windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        if not any(layer_windows):
            layer_windows = ()

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

        query_pre_attn_scalar = attn_softcap = final_softcap = None
        if gemma:
            if d.get("use_bidirectional_attention"):
                raise err("use_bidirectional_attention", "bidirectional attention (an embedding model) is not "
                                                         "supported: pagedrun generates with causal attention")
            query_pre_attn_scalar = positive("query_pre_attn_scalar", 256.0)
            final_softcap = positive("final_logit_softcapping", None)
            attn_softcap = positive("attn_logit_softcapping", None)
            if arch != "Gemma2ForCausalLM":
                # transformers' Gemma 3 attention never applies attn_logit_softcapping (its configs
                # leave it null), and Gemma3ForConditionalGeneration's head never applies
                # final_logit_softcapping: what HF computes is the reference.
                attn_softcap = None
                if arch == "Gemma3ForConditionalGeneration":
                    final_softcap = None
        tie = top.get("tie_word_embeddings", d.get("tie_word_embeddings", gemma))

        return cls(
            architecture=arch,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=req("intermediate_size"),
            rms_norm_eps=as_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", err),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(tie),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                             "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            sliding_window=sliding_window,
            bos_token_id=bos,
            eos_token_id=eos_list,
            torch_dtype=top.get("torch_dtype") or top.get("dtype") or d.get("torch_dtype") or d.get("dtype"),
            source=source,
            layer_windows=layer_windows,
            hidden_act=act,
            layer_types=tuple(layer_types) if gemma else (),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            query_pre_attn_scalar=query_pre_attn_scalar,
            attn_logit_softcapping=attn_softcap or 0.0,
            final_logit_softcapping=final_softcap or 0.0,
            rotary_dim=rotary_dim,
            **granite,
            moe=moe,
            qk_norm_whole=arch == "OlmoeForCausalLM",
            clip_qkv=clip_qkv or 0.0,
            attention_sinks=arch == "GptOssForCausalLM",
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Parameter count from the shapes (tied embeddings counted once; every expert: all stay
        resident)."""
        return self._parameters(active=False)

    def active_parameters(self) -> int:
        """Parameters one token computes with: num_parameters() with each MoE block's experts cut to
        the top_k it routes to (plus the router and any shared expert). num_parameters() for a dense
        model."""
        return self._parameters(active=True)

    def _parameters(self, active: bool) -> int:
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
            per_layer += q + kv if self.qk_norm_whole else 2 * hd
        if self.is_gemma:
            per_layer += 2 * h  # pre_feedforward_layernorm, post_feedforward_layernorm
        if self.attention_sinks:
            per_layer += self.num_attention_heads
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        layers = self.num_hidden_layers * per_layer
        if self.moe is not None:  # an MoE block in place of the dense MLP where the layer has one
            sparse = self.moe.num_sparse_layers
            layers += sparse * (self.moe.layer_parameters(h, active) - 3 * h * i - (2 * i + h) * self.mlp_bias)
        return embed + layers + h + lm_head


def _layer_types(d: dict[str, Any], arch: str, num_layers: int, sliding_window: int | None, err) -> list[str]:
    """Each layer's attention type as transformers assigns it: config.json's layer_types where the
    family reads them, else the family's rule (Gemma 2: even layers slide; Gemma 3: all but every
    sliding_window_pattern-th; Qwen2/3: layers from max_window_layers on; Mistral: all)."""
    if sliding_window is None and arch not in GEMMA_ARCHITECTURES:
        return ["full_attention"] * num_layers
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        # transformers ignores a Mistral config's layer_types, and Phi-3's has none: one window for all
        return ["sliding_attention"] * num_layers
    given = d.get("layer_types")
    if given is not None:
        if (not isinstance(given, list) or len(given) != num_layers
                or any(not isinstance(t, str) or t not in LAYER_TYPES for t in given)):
            raise err("layer_types", f"expected a list of {num_layers} (num_hidden_layers) of "
                                     f"{' / '.join(map(repr, LAYER_TYPES))}, got {echo(given)}")
        return list(given)
    if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if arch in GEMMA_ARCHITECTURES:
        pattern = d.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise err("sliding_window_pattern", f"expected a positive integer, got {echo(pattern)}")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    first = d.get("max_window_layers", 28)  # Qwen2/3; transformers' default
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise err("max_window_layers", f"expected a non-negative integer, got {echo(first)}")
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


def resolve_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    """The run's max_model_len: the recipe's, else the model's context capped at 8192 (a longer
    default would size every sequence's worst case, and the KV budget, for contexts batch jobs
    rarely use). One rule for a local run, a Ray driver and its replicas."""
    max_model_len = requested or min(cfg.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
    if max_model_len > cfg.max_position_embeddings:
        raise PagedrunError(
            f"model.max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    return max_model_len
