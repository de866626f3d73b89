"""profile-memory's what-if table: the same KV budget in every KV cache dtype, side by side.

The configured dtype's row is what the engine allocated; every other row is derived from the same
budget: floor(budget / block bytes), with the CPU cap the plan applied (2 x max_num_seqs full-length
sequences) applied to each. Bytes per token count the int8 scales (attention/kv_cache_spec.py), in
the layers one block holds (all of them, or a KV cache group's: kv/groups.py).
"""
from __future__ import annotations

import torch
from rich import box
from rich.table import Table

from pagedrun.attention.kv_cache_spec import kv_cache_spec
from pagedrun.worker.memory import MemoryPlan


def kv_dtype_rows(plan: MemoryPlan, model_cfg, model_dtype: torch.dtype, configured: str) -> list[dict]:
    names = [str(model_dtype).removeprefix("torch.")]
    if model_dtype == torch.float32:
        names.append("bfloat16")
    names += ["fp8_e4m3", "fp8_e5m2", "int8"]
    if configured not in names:
        names.insert(0, configured)
    # A block holds plan.kv_slots layers (fewer than the model's with KV cache groups, kv/groups.py).
    shape = (plan.kv_slots or model_cfg.num_hidden_layers, model_cfg.num_key_value_heads, model_cfg.head_dim)
    cap = 2 * plan.max_num_seqs * plan.blocks_per_seq if plan.capped_to_blocks is not None else None
    rows = []
    for name in names:
        bpt = kv_cache_spec(name, model_dtype).bytes_per_token(*shape)
        if name == configured:
            blocks, source = plan.num_gpu_blocks, "allocated"
        else:
            blocks = plan.kv_budget_bytes // (bpt * plan.block_size)
            source = "derived, capped" if cap and blocks > cap else "derived"
            blocks = min(blocks, cap) if cap else blocks
        rows.append({"kv_cache_dtype": name, "bytes_per_token": bpt, "num_blocks": blocks,
                     "token_capacity": blocks * plan.block_size,
                     "max_concurrency_at_max_model_len": round(plan.concurrency(blocks), 4),
                     "source": source})
    return rows


def kv_dtype_table(rows: list[dict], budget_bytes: int, max_model_len: int, fmt_bytes) -> Table:
    t = Table(title=f"the KV budget ({fmt_bytes(budget_bytes)}) in each KV cache dtype", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    t.add_column("kv_cache_dtype")
    for name in ("B/token", "blocks", "tokens", f"seqs @ {max_model_len}"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("source", style="dim", no_wrap=True)
    for r in rows:
        t.add_row(r["kv_cache_dtype"], f"{r['bytes_per_token']:,}", f"{r['num_blocks']:,}",
                  f"{r['token_capacity']:,}", f"{r['max_concurrency_at_max_model_len']:.2f}x", r["source"])
    return t
