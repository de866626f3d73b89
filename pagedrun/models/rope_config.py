"""The RoPE fields of an HF config.json, checked once: `rope_scaling` / `rope_parameters` (one dict, or
one per layer type as Gemma 3 writes them), `rope_theta`, `partial_rotary_factor`, resolved as
transformers resolves them (defaults, the original length, the attention factor) so that
models/rope.py only computes. Errors name config.json's field (ModelConfig.from_hf_dict's `err`).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from pagedrun.errors import PagedrunError, echo

LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# No size of a real model comes near this; a larger one is a broken config (ModelConfig's sizes too).
MAX_SIZE = 1 << 31


def as_number(value: Any, key: str, err) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise err(key, f"expected a number, got {echo(value)}")
    try:
        return float(value)
    except OverflowError:
        raise err(key, f"expected a number, got {echo(value)}") from None


def parse_rope(d: dict[str, Any], rope: RopeContext, default_theta: float
                ) -> tuple[float, dict[str, Any] | None]:
    err = rope.err
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
    key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
    return _rope_of(params, d.get("rope_theta", default_theta), d, rope, key, "rope_scaling")


def parse_gemma3_rope(d: dict[str, Any], rope: RopeContext):
    """Gemma 3's two RoPEs: ((theta, scaling) of the full-attention layers, (theta, scaling) of the
    sliding ones). transformers 5 writes rope_parameters keyed by layer type; older configs have
    rope_theta + rope_scaling (the full layers') and rope_local_base_freq (the sliding layers',
    never scaled). Missing thetas take transformers' defaults, 1e6 and 1e4."""
    err = rope.err
    params = d.get("rope_parameters")
    local_default = as_number(d.get("rope_local_base_freq", 10000.0), "rope_local_base_freq", err)
    if isinstance(params, dict) and any(k in LAYER_TYPES for k in params):
        out = []
        for layer_type, default in (("full_attention", d.get("rope_theta", 1e6)), ("sliding_attention", local_default)):
            key = f"rope_parameters.{layer_type}"
            sub = params.get(layer_type) or {}
            if not isinstance(sub, dict):
                raise err(key, f"expected an object, got {echo(sub)}")
            out.append(_rope_of(sub, default, d, rope, key, key))
        return out[0], out[1]
    return parse_rope(d, rope, default_theta=1e6), (local_default, None)


class RopeContext(NamedTuple):
    """What parsing a RoPE parameter dict needs besides the dict (from_hf_dict's fields)."""
    max_pos: int
    run_len: int  # the run's max_model_len
    rotary_dim: int
    arch: str
    err: Any


def rotary_dim_of(d: dict[str, Any], head_dim: int, err) -> int:
    """int(head_dim * partial_rotary_factor), the factor read as transformers reads it: the RoPE
    parameters' own, else config.json's top-level one, else 1."""
    params = d.get("rope_parameters") or d.get("rope_scaling")
    key = "partial_rotary_factor"
    if isinstance(params, dict) and params.get(key) is not None:
        value, where = params[key], f"{'rope_parameters' if d.get('rope_parameters') else 'rope_scaling'}: {key}"
    else:
        value, where = d.get(key, 1.0), key
    if value is None:
        value = 1.0
    factor = as_number(value, where, err)
    dim = int(head_dim * factor) if 0 < factor <= 1 else 0
    if dim <= 0 or dim % 2:
        raise err(where, f"expected a number in (0, 1] that leaves an even number of rotated dims of "
                         f"head_dim {head_dim}, got {echo(value)}")
    return dim


def _rope_of(params: dict[str, Any], default_theta: Any, d: dict[str, Any], rope: RopeContext, key: str,
             scaling_key: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one RoPE parameter dict; `key` and `scaling_key` name it in errors.
    The scaling dict comes resolved as transformers resolves it (defaults, original length, attention
    factor), so that models/rope.py only computes."""
    err = rope.err
    theta = as_number(params.get("rope_theta", default_theta), "rope_theta", err)
    if not 0 < theta < float("inf"):
        raise err("rope_theta", f"expected a positive number, got {echo(params.get('rope_theta', default_theta))}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope.arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers' Phi3Config renames both (old Phi-3 configs say "su")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise err(
            key,
            f"rope type {echo(rope_type)} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    if rope_type == "default":
        return float(theta), None

    def bad(name: str, msg: str) -> PagedrunError:
        return err(scaling_key, f"{rope_type}: {name}: {msg}")

    def number(name: str, default: Any = "required", positive: bool = True) -> float | None:
        value = params.get(name)
        if value is None:
            if default == "required":
                raise bad(name, "missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(name, f"expected a number, got {echo(value)}")
        value = float(value)
        if not abs(value) < float("inf") or (positive and value <= 0):
            raise bad(name, f"expected a {'positive' if positive else 'finite'} number, got {echo(params[name])}")
        return value

    out: dict[str, Any] = {"rope_type": rope_type}
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3
        # writes it there) wins over the RoPE parameters' own; the default is max_position_embeddings.
        where = "original_max_position_embeddings"
        orig = d.get(where)
        if orig is None:
            orig, where = params.get(where, rope.max_pos), f"{scaling_key}: {rope_type}: {where}"
        if isinstance(orig, bool) or not isinstance(orig, int) or not 0 < orig <= MAX_SIZE:
            raise err(where, f"expected a positive integer, got {echo(orig)}")
        out["original_max_position_embeddings"] = orig
    if rope_type in ("linear", "dynamic", "llama3"):
        out["factor"] = number("factor")
    if rope_type == "llama3":
        out["low_freq_factor"], out["high_freq_factor"] = number("low_freq_factor"), number("high_freq_factor")
        if out["low_freq_factor"] == out["high_freq_factor"]:
            raise bad("high_freq_factor", "must differ from low_freq_factor")
    elif rope_type == "dynamic":
        if rope.rotary_dim <= 2:
            raise bad("factor", f"needs a rotary dimension above 2, got {rope.rotary_dim}")
        out["max_model_len"] = rope.run_len
    elif rope_type == "yarn":
        orig = out["original_max_position_embeddings"]
        factor = number("factor", None) or rope.max_pos / orig  # HF: no factor, the ratio of the lengths
        attention_factor = number("attention_factor", None)
        mscale, mscale_all_dim = number("mscale", None, False), number("mscale_all_dim", None, False)

        def get_mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise bad("truncate", f"expected true or false, got {echo(truncate)}")
        out.update(factor=factor, attention_factor=attention_factor, truncate=truncate,
                   beta_fast=number("beta_fast", None) or 32.0, beta_slow=number("beta_slow", None) or 1.0)
    elif rope_type == "longrope":
        orig = out["original_max_position_embeddings"]
        use_long = rope.run_len > orig  # chosen once for the run, as vLLM does (models/rope.py)
        factors = {}
        for name in ("short_factor", "long_factor"):
            value = params.get(name)
            if (not isinstance(value, list) or len(value) != rope.rotary_dim // 2
                    or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")
                           for v in value)):
                raise bad(name, f"expected a list of {rope.rotary_dim // 2} (rotary dims / 2) positive numbers, "
                                f"got {echo(value)}")
            factors[name] = [float(v) for v in value]
        factor = number("factor", None) or rope.max_pos / orig
        attention_factor = number("attention_factor", None)
        # vLLM's short_mscale / long_mscale where the config has them (transformers ignores both).
        mscale = number("long_mscale" if use_long else "short_mscale", None)
        if attention_factor is None:
            attention_factor = mscale
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        out.update(long=use_long, ext_factors=factors["long_factor" if use_long else "short_factor"],
                   attention_factor=attention_factor)
    return float(theta), out
