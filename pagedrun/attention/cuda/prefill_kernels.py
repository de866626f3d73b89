"""The varlen prefill launch (kernels/cuda/prefill_attention.cu): every prefilling query of a step
in one launch per layer, over tiles of consecutive queries of one sequence (paged_step.prefill_tiles),
reading the paged cache in place. A part of PagedKernels (kernels.py), which holds the compiled
module, the variant and the shared-memory opt-in this launch uses.
"""
from __future__ import annotations

import numpy as np

from pagedrun.attention.cuda.launch_checks import c_contiguous_ignoring_size1, check, check_launch, variant_args
from pagedrun.attention.cuda.variants import NUM_THREADS, PREFILL_CHUNK


def prefill_shared_mem(head_size: int, rows: int) -> int:
    """Bytes of the varlen prefill kernel's fp32 buffers (PrefillSmem in prefill_attention.cu): the
    tile's q [rows][D], one chunk's K [32][D + 1] (padded) and V [32][D], its weights [rows][32], and
    three floats per row (running max, sum, rescale)."""
    c = PREFILL_CHUNK
    return 4 * (rows * head_size + c * (head_size + 1) + c * head_size + rows * c + 3 * rows)


class PrefillLaunch:
    """PagedKernels' prefill launcher: uses its variant, xp, function() and max_grid_y."""

    def prefill_attention(
        self, out, query, key_cache, value_cache, block_tables, tiles, max_seq_len: int, scale: float,
        group: int | None = None, *, window: int = 0, softcap: float = 0.0, sinks=None,
    ) -> int:
        """The varlen prefill kernel over every tile of `tiles` (int32 [num_tiles, 4]: block-table row,
        first token, queries, the first query's position; paged_step.prefill_tiles with this launch's
        tile size, `self.variant.prefill_tile_q(group)`): out[token, h] = causal attention of query
        [token, h] over its sequence's cache positions up to its own, read through block_tables in place.
        out [num_tokens, num_heads, head_size] contiguous: rows of no tile are left as they are.
        max_seq_len >= every tile's last position + 1 (decides whether the window binds). window /
        softcap / sinks as paged_attention's. group: query heads per block (default: the variant's
        where it divides the heads per KV head, else 1). Returns the number of tiles launched."""
        num_tiles = int(tiles.shape[0])
        if num_tiles == 0:
            return 0
        v = self.variant
        check(not v.quantized, "the prefill kernel reads a cache in the model dtype (quantized: prefill 'kernel')")
        num_tokens, num_heads, head_size = (int(s) for s in query.shape)
        _, block_size, num_kv_heads, _ = key_cache.shape
        check_launch(v, out, query, key_cache, value_cache, block_tables, None, None)
        check(tiles.dtype == np.int32 and tiles.ndim == 2 and int(tiles.shape[1]) == 4
              and c_contiguous_ignoring_size1(tiles), "tiles must be contiguous int32 [num_tiles, 4]")
        window, softcap = variant_args(window, softcap, sinks, num_heads)
        if group is None:
            group = v.launch_group(num_heads, num_kv_heads)
        check(group in (1, v.launch_group(num_heads, num_kv_heads)),
              lambda: f"group {group}: this variant launches 1 or {v.launch_group(num_heads, num_kv_heads)}")
        tile_q = v.prefill_tile_q(group)
        if self.xp is np:  # cheap on the host; on a GPU it would cost a sync
            check(bool((tiles[:, 2] >= 1).all() and (tiles[:, 2] <= tile_q).all()),
                  lambda: f"tiles must hold 1..{tile_q} queries each (this launch's tile size)")
            check(bool((tiles[:, 1] + tiles[:, 2] <= num_tokens).all()), "tiles past the last token")
            check(bool((tiles[:, 3] + tiles[:, 2] <= max_seq_len).all()),
                  lambda: f"a tile reaches past max_seq_len {max_seq_len}")
            check(bool((tiles[:, 0] >= 0).all() and (tiles[:, 0] < block_tables.shape[0]).all()),
                  "tile block-table rows out of range")
        check(int(block_tables.shape[1]) * block_size >= max_seq_len,
              lambda: f"block_tables has {block_tables.shape[1]} columns, too few for max_seq_len {max_seq_len}")
        if window >= max_seq_len:  # no query has more keys than the window: full attention (and an int32)
            window = 0
        q_stride = np.int32(query.strides[0] // query.itemsize if num_tokens > 1 else num_heads * head_size)
        name = v.prefill_name(group)
        smem = prefill_shared_mem(head_size, tile_q * group)
        fn = self.function(name, smem)
        for lo in range(0, num_tiles, self.max_grid_y):  # tiles sit on gridDim.y
            hi = min(num_tiles, lo + self.max_grid_y)
            fn((num_heads // group, hi - lo, 1), (NUM_THREADS, 1, 1),
               (out, query, key_cache, value_cache, np.int32(num_kv_heads), np.float32(scale), block_tables,
                tiles[lo:hi], np.int32(block_tables.shape[1]), q_stride, np.int32(window), np.float32(softcap),
                sinks),
               shared_mem=smem)
        return num_tiles
