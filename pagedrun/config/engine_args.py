"""vLLM's engine arguments, by their names, as recipe overrides: what `LLM(model=..., max_num_seqs=...)`
and `pagedrun generate --model ... --max-num-seqs ...` set (docs/guide/python-api.md, recipes.md).

Each sets exactly one recipe key, applied after the recipe and its `--set` overrides.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedrun.errors import PagedrunError

# vLLM's name -> the recipe key it sets: LLM(**kwargs) and the CLI's flags (--max-num-seqs, ...).
ENGINE_ARGS = {
    "model": "model.path",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "device": "model.device",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "kv_cache_memory": "cache.kv_cache_memory",
    "block_size": "cache.block_size",
    "num_gpu_blocks_override": "cache.num_blocks",
    "swap_space": "cache.swap_space",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "async_scheduling": "scheduler.async_scheduling",
    "seed": "seed",
    "generation_config": "model.generation_config",
}
# vLLM's switches that turn a recipe key off: name -> the key they set to `not value`.
NEGATED_ARGS = {
    "disable_hybrid_kv_cache_manager": "cache.hybrid_kv",
}


def engine_args_overrides(kwargs: dict[str, Any]) -> list[str]:
    """vLLM-style keyword arguments as `--set` overrides; a clear error for what pagedrun lacks."""
    tp = kwargs.pop("tensor_parallel_size", 1)
    if tp != 1:
        raise PagedrunError(f"tensor_parallel_size={tp}: pagedrun runs one device per engine; for more "
                            "devices run data-parallel replicas (`pagedrun generate --ray --replicas N`)")
    unknown = sorted(k for k in kwargs if k not in ENGINE_ARGS and k not in NEGATED_ARGS)
    if unknown:
        raise PagedrunError(f"LLM(): unknown argument(s) {', '.join(unknown)}; known: "
                            f"{', '.join([*ENGINE_ARGS, *NEGATED_ARGS])}, tensor_parallel_size (1), recipe, overrides")
    return [f"{ENGINE_ARGS[k]}={json.dumps(str(v) if isinstance(v, Path) else v)}" if k in ENGINE_ARGS
            else f"{NEGATED_ARGS[k]}={json.dumps(not v)}"
            for k, v in kwargs.items() if v is not None]
