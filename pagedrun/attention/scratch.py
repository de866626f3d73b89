"""What attention allocates beyond the memory profile's pass, as formulas (derived, not measured):
worker/memory.py budgets it, the torch backend chunks its decode to stay within it.

The profile pass prefills fresh prompts of at most max_num_batched_tokens / max_num_seqs tokens.
A real run also prefills behind a cached prefix as long as max_model_len, decodes max_num_seqs
sequences of that length, and on the torch path gathers their K/V into copies: none of that is in
the profile, so each backend's worst case per layer call is added to the plan's peak.
"""
from __future__ import annotations

from pagedrun.attention.cuda.kernels import num_partitions

# The most K/V rows one decode SDPA call of the torch path gathers (sequences padded to the longest
# of their chunk): a step with more decodes runs in chunks (torch_backend.decode_chunks), so the
# gather is a bound the memory plan can hold and a capped CUDA allocator can rely on, not a share of
# whatever the cache holds.
DECODE_GATHER_TOKENS = 65_536


def _padded(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size) * block_size


def attention_scratch_bytes(*, num_heads: int, num_kv_heads: int, head_size: int, elem_bytes: int,
                            block_size: int, max_model_len: int, max_num_seqs: int,
                            max_num_batched_tokens: int, paged_decode: bool) -> int:
    """The worst case, per layer call, of what attention allocates at max_model_len that the profile
    pass never allocates:

    - prefill with a cached prefix (SDPA, every CUDA backend): the prefix's K/V gathered into one
      [max_model_len, kv_heads, head_size] pair, and the shifted causal mask (bool, queries x keys);
    - paged_decode (the CuPy kernels): v2's per-partition partials for max_num_seqs decode rows,
      fp32 [rows, heads, parts, head_size + 2], and the rows' block tables and lengths.
    The two are never live at once (one layer's decode launch ends before its prefills start)."""
    padded = _padded(max_model_len, block_size)
    gather = 2 * padded * num_kv_heads * head_size * elem_bytes + min(max_num_batched_tokens, max_model_len) * padded
    v2 = tables = 0
    if paged_decode:
        parts = num_partitions(max_model_len)
        # v2 runs for every decode row once a sequence spans two partitions (kernels.use_v1)
        v2 = max_num_seqs * num_heads * parts * (head_size + 2) * 4 if parts > 1 else 0
        tables = max_num_seqs * (padded // block_size + 3) * 4 + 8 * max_num_seqs
    return max(gather, v2) + tables


def decode_gather_tokens(max_num_seqs: int, padded_len: int) -> int:
    """The most K/V rows one decode call gathers: a chunk stops at DECODE_GATHER_TOKENS rows, but
    always holds at least one sequence of padded_len (max_model_len rounded up to a block)."""
    return min(max_num_seqs * padded_len, max(DECODE_GATHER_TOKENS, padded_len))


def decode_gather_bytes(*, num_heads: int, num_kv_heads: int, head_size: int, elem_bytes: int,
                        block_size: int, max_model_len: int, max_num_seqs: int, quantized: bool = False) -> int:
    """Upper bound on what one decode call of the torch path allocates: per gathered row, K and V in
    the cache's dtype, room for SDPA to widen them to one row per query head (its math path repeats
    K/V for GQA), fp32 scores and probabilities per head, and the length masks. A quantized cache
    (elem_bytes 4) is first widened, block by block of the step, to an fp32 copy."""
    per_row = 2 * head_size * elem_bytes * (num_kv_heads + num_heads) + 8 * num_heads + 2
    widened = dequantized_copy_bytes(num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                                     max_model_len=max_model_len, max_num_seqs=max_num_seqs) if quantized else 0
    return decode_gather_tokens(max_num_seqs, _padded(max_model_len, block_size)) * per_row + widened


def dequantized_copy_bytes(*, num_kv_heads: int, head_size: int, block_size: int, max_model_len: int,
                           max_num_seqs: int) -> int:
    """The fp32 K and V copy of a quantized cache's blocks that one step reads (the torch path's
    _dequantized_blocks): at most max_num_seqs sequences of max_model_len."""
    return max_num_seqs * _padded(max_model_len, block_size) * 2 * num_kv_heads * head_size * 4


def plan_scratch(*, model_cfg, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, elem_bytes: int, cache_elem_bytes: int, cuda: bool,
                 paged_decode: bool, gathers: bool, quantized: bool) -> tuple[int, int]:
    """(attention scratch on CUDA, the torch path's decode gather) for a model and recipe.
    gathers: the backend's decode copies K/V (the torch path); quantized: a 1-byte cache, which that
    path attends to as an fp32 copy of the step's blocks, live through the layer's whole attention
    call (so its prefill gathers fp32 rows, and the copy counts beside both gathers)."""
    shape = dict(num_kv_heads=model_cfg.num_key_value_heads, head_size=model_cfg.head_dim, block_size=block_size,
                 max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    widened = gathers and quantized
    scratch = 0
    if cuda:
        scratch = attention_scratch_bytes(num_heads=model_cfg.num_attention_heads, **shape,
                                          elem_bytes=4 if widened else elem_bytes,
                                          max_num_batched_tokens=max_num_batched_tokens, paged_decode=paged_decode)
        if widened:
            scratch += dequantized_copy_bytes(**shape)
    gather = decode_gather_bytes(num_heads=model_cfg.num_attention_heads, **shape,
                                 elem_bytes=4 if widened else cache_elem_bytes, quantized=widened) if gathers else 0
    return scratch, gather
