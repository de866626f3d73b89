"""The recipe's schema: one check per key, and the size syntax ('2GiB') they accept.

Each check returns the normalised value or raises InvalidValue("must be ..."); config/recipe.py adds where
the value came from. The sampling section reuses sampling_params' checks, so a bad value reads the
same in a recipe and in a prompts line.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from pagedrun.config import hf_cache
from pagedrun.sampling_params import (
    FIELD_NAMES as SAMPLING_FIELDS,
)
from pagedrun.sampling_params import (
    InvalidValue,
    bool_check,
    float_check,
    int_check,
    is_int,
    optional,
)
from pagedrun.sampling_params import (
    check_field as check_sampling_field,
)

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct
BLOCK_SIZES = (8, 16, 32)  # the block sizes the CUDA kernels are compiled for
DEFAULT_CPU_KV_FRACTION = 0.25  # used when cache.kv_cache_memory is null
MIN_KV_BYTES = 1 << 20
# Upper bounds far above any real run, below the values that crash or hang instead of failing:
# 100000 OpenMP threads segfault, a 10^12-block cache is tried before it is refused.
MAX_THREADS = 1024
MAX_MODEL_LEN = 1 << 22  # 4M tokens: 4x the longest context of a released open model
MAX_KV_BYTES = 1 << 50  # 1 PiB
MAX_NUM_BLOCKS = 1 << 26
MAX_SWAP_GIB = 1 << 16
MAX_NUM_SEQS = 1 << 16
MAX_BATCHED_TOKENS = 1 << 24
MAX_REPLICAS = 4096
# fp8 layer scales are float32 and multiply codes up to 57344 (e5m2's max) on read, and divide values on write:
# within [1e-20, 1e20] both stay finite for any activation below 1e18 (1e39 was infinite once stored, 1e38 read
# back as inf, 1e-45 a denormal that turned every value into the format's max).
MIN_KV_SCALE, MAX_KV_SCALE = 1e-20, 1e20


# ---------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)b?|b?)\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648. KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB of 1000.

    Raises ValueError for anything else.
    """
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a size like '2GiB' or '512MiB': {text!r}")
    number, unit, binary = m.group(1), m.group(2), m.group(3)
    if unit is None:
        base = 1
    else:
        decimal = text.strip().lower().endswith("b") and not binary
        base = (1000 if decimal else 1024) ** _POWERS[unit.lower()]
    return int(float(number) * base) if "." in number else int(number) * base


# ---------------------------------------------------------------- per-key checks
# Each returns the normalised value or raises InvalidValue("must be ..."). `base` is the directory
# relative model paths resolve against (the recipe's directory, or the CWD for --set).

def _choice(options: Iterable[Any], aliases: dict[str, str] | None = None) -> Callable[[Any], Any]:
    options = tuple(options)
    listed = ", ".join(str(o) for o in options)

    def check(v: Any) -> Any:
        if aliases and isinstance(v, str) and v.lower() in aliases:
            v = aliases[v.lower()]
        if all(is_int(o) for o in options) and not is_int(v):
            raise InvalidValue(f"must be an integer (one of {listed})")
        if v not in options or isinstance(v, bool):
            raise InvalidValue(f"must be one of {listed}")
        return v
    return check


def _kv_cache_memory(v: Any) -> int | float | None:
    msg = (f"must be a fraction 0 < x <= 1 of available memory, a size like '2GiB', "
           f"or a number of bytes >= {MIN_KV_BYTES}")
    if v is None:
        return None
    if isinstance(v, float):
        if not 0 < v <= 1:
            raise InvalidValue(msg)
        return v
    if isinstance(v, str):
        try:
            v = parse_size(v)
        except ValueError:
            raise InvalidValue(msg) from None
    # An int is bytes: `kv_cache_memory: 1` is far more likely a fraction written without ".0".
    if not is_int(v) or v < MIN_KV_BYTES:
        raise InvalidValue(msg)
    if v > MAX_KV_BYTES:
        raise InvalidValue(f"must be at most {MAX_KV_BYTES} bytes (1 PiB)")
    return v


def _non_empty_str(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise InvalidValue("must be a non-empty string")
    return v


# cache.kv_cache_dtype (pagedrun/attention/kv_cache_spec.py): here, not there, so checking a recipe imports no torch.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_KV_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}

_kv_scale = float_check(f"a number in [{MIN_KV_SCALE:g}, {MAX_KV_SCALE:g}] (null: calibrated at start-up)",
                        lambda x: MIN_KV_SCALE <= x <= MAX_KV_SCALE)


def _auto_or_bool(v: Any) -> str:
    """auto | true | false, stored as one of those words (YAML reads true / false as booleans)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str) and v.lower() in ("auto", "true", "false"):
        return v.lower()
    raise InvalidValue("must be auto, true or false")


CHECKS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "model": {
        "path": _non_empty_str,  # resolved in model_path
        "dtype": _choice(("auto", "float32", "bfloat16", "float16"), _DTYPE_ALIASES),
        "max_model_len": optional(int_check(lo=16, cap=MAX_MODEL_LEN)),
        "device": _choice(("auto", "cpu", "cuda")),
        "attention_backend": _choice(("auto", "torch", "cupy", "emulated")),
        "cuda_graphs": _auto_or_bool,
        "threads": optional(int_check(lo=1, cap=MAX_THREADS)),
        "generation_config": _non_empty_str,  # resolved in generation_config_path
        "chat_template": optional(_non_empty_str),  # a Jinja file; resolved in chat_template_path
    },
    "cache": {
        "block_size": _choice(BLOCK_SIZES),
        "kv_cache_memory": _kv_cache_memory,
        "gpu_memory_utilization": float_check("a number in (0, 1]", lambda x: 0 < x <= 1),
        "num_blocks": optional(int_check(lo=1, cap=MAX_NUM_BLOCKS)),
        "swap_space": float_check("a number of GiB >= 0", lambda x: x >= 0, cap=MAX_SWAP_GIB),
        "enable_prefix_caching": bool_check,
        "hybrid_kv": bool_check,
        "watermark": float_check("a number in [0, 1)", lambda x: 0 <= x < 1),
        "kv_cache_dtype": _choice(KV_CACHE_DTYPES, _KV_DTYPE_ALIASES),
        "k_scale": optional(_kv_scale),
        "v_scale": optional(_kv_scale),
    },
    "scheduler": {
        "max_num_seqs": int_check(lo=1, cap=MAX_NUM_SEQS),
        "max_num_batched_tokens": int_check(lo=1, cap=MAX_BATCHED_TOKENS),
        "preemption_mode": _choice(("recompute", "swap")),
        "admission_burst": int_check(lo=1, cap=MAX_NUM_SEQS),
        "async_scheduling": _auto_or_bool,
    },
    "sampling": {name: (lambda v, name=name: check_sampling_field(name, v)) for name in SAMPLING_FIELDS},
    "output": {
        "fsync_interval_s": float_check("a number of seconds >= 0", lambda x: x >= 0),
        "report": bool_check,
    },
    "structured_outputs": {
        "disable_additional_properties": bool_check,
    },
    "distributed": {
        "address": optional(_non_empty_str),
        "replicas": optional(int_check(lo=1, cap=MAX_REPLICAS)),
    },
    "": {"seed": int_check(lo=0, hi=2**64 - 1, desc="an integer in 0..2**64-1")},
}


def model_path(v: str, base: Path) -> str:
    if v == DEFAULT_MODEL:
        return v
    p = Path(v).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.exists() and hf_cache.looks_like_id(v):  # a Hugging Face id, from the local cache only
        snapshot = hf_cache.snapshot_of(v)
        if snapshot is None:
            raise InvalidValue(hf_cache.missing_message(v))
        return str(snapshot.resolve())
    if not p.exists():
        raise InvalidValue(f'must be "{DEFAULT_MODEL}", an existing model directory or a Hugging Face id in the '
                           f'local cache; {p} does not exist')
    return str(p.resolve())


GENERATION_CONFIG_MODES = ("auto", "vllm")


def generation_config_path(v: str, base: Path) -> str:
    """model.generation_config: auto | vllm (vLLM's words) | a folder holding a generation_config.json."""
    if v in GENERATION_CONFIG_MODES:
        return v
    p = Path(v).expanduser()
    p = p if p.is_absolute() else base / p
    if not (p / "generation_config.json").is_file():
        raise InvalidValue(f"must be auto, vllm or a folder holding a generation_config.json; "
                           f"{p / 'generation_config.json'} does not exist")
    return str(p.resolve())


MAX_TEMPLATE_BYTES = 1 << 20


def chat_template_path(v: str | None, base: Path) -> str | None:
    """model.chat_template: an existing file (relative to the recipe's folder), made absolute."""
    if v is None:
        return None
    p = Path(v).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise InvalidValue(f"must be a chat template file (Jinja); {p} is not a file")
    if p.stat().st_size > MAX_TEMPLATE_BYTES:
        raise InvalidValue(f"must be a file of at most {MAX_TEMPLATE_BYTES:,} bytes; {p} is larger")
    return str(p.resolve())


def did_you_mean(key: Any, known: Iterable[str]) -> str:
    if len(str(key)) > 64:  # no key is this long; comparing a huge one would only cost time
        return ""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
