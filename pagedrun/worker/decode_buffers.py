"""Static inputs of a decode-only step: device buffers sized once for max_num_seqs rows, filled from
host mirrors with numpy and copied without a host synchronisation.

A decode step (every sequence computes one token) needs per row its token, position, length after the
step, the slot its K/V goes to and its block table (one slot and one table per KV cache group,
kv/groups.py). Today's path builds them as Python lists and `torch.tensor(..., device=cuda)`, each a
blocking copy; here they live in buffers that never move, so that

- a step costs a few non-blocking copies from pinned host memory (pin_memory only on CUDA), the
  host filling numpy views of it: no per-token Python list, no `.item()`;
- the kernel inputs of a step of `bucket` rows are views of the same memory every step, so the
  attention metadata (and its PagedStep, attention/cuda/paged_step.py) is built once per bucket and
  a CUDA graph captured on them replays on whatever the host wrote last (worker/cuda_graphs.py).

A batch of n rows runs as the smallest bucket >= n; rows n..bucket-1 are padding that writes and
reads nothing: slot -1 (kernels/cuda/cache_ops.cu skips it), seq_len 0 (kernels/cuda/paged_attention.cu
writes a defined zero), token 0, position 0. Row i is the step's i-th input (the scheduler's order,
so logits come out in input order with no gather); a block-table row is rewritten only when its
table differs from the one the row held last step (a sequence gained a block, joined, left, or the
rows shifted), found by comparing the engine's lists. A stable row per sequence would need the
sequences' ids, which the worker does not see, and a permutation of the logits;
docs/log/2026-11-28-decode-graphs.md measured both ways of re-packing. Columns past a table's end
keep what an earlier step left: the kernels read no block at or past ceil(seq_len / block_size).

The pinned mirrors are written while no copy from them is in flight. Without async scheduling
every step ends with the sampler reading its token ids back (a synchronisation after this step's
copies) before the next step's fill. With it (engine/inflight.py) step n+1 is filled while step n,
whose copies may not have run yet, is queued: so on CUDA there are two sets of mirrors, used in
turn (`mirrors=2`), and a set is written again only after the step that last read it was read
back. (On a CPU the copies are done when `copy_` returns.)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedrun.attention.metadata import AttentionMetadata, StepMetadata

# vLLM V0's _BATCH_SIZES_TO_CAPTURE: 1, 2, 4, then steps of 8.
BUCKET_STEP = 8


def decode_buckets(max_rows: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, ..., max_rows]: the batch sizes a decode step is padded to."""
    out = [b for b in (1, 2, 4) if b < max_rows]
    out += list(range(BUCKET_STEP, max_rows, BUCKET_STEP))
    return out + [max_rows]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows (None: more rows than the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass
class DecodeShape:
    max_rows: int  # Bmax: scheduler.max_num_seqs
    max_model_len: int
    block_size: int
    num_groups: int = 1

    @property
    def width(self) -> int:
        """Block table columns: a sequence of max_model_len tokens."""
        return -(-self.max_model_len // self.block_size)

    def nbytes(self) -> int:
        """Device bytes of the buffers (the host mirrors are as large)."""
        b, g = self.max_rows, self.num_groups
        return b * 8 * (2 + g) + b * 4 * 2 + g * b * self.width * 4


class DecodeBuffers:
    """The static buffers and their host mirrors. Device views (all contiguous):
    input_ids, positions int64 [Bmax]; slot_mapping int64 [G, Bmax]; seq_lens, context_lens int32
    [Bmax]; block_tables int32 [G, Bmax, W]. The int64 vectors share one buffer, the int32 vectors
    another: a step copies those two and each group's table rows in use."""

    def __init__(self, shape: DecodeShape, device: torch.device, mirrors: int = 1):
        self.shape, self.device = shape, device
        b, g, w = shape.max_rows, shape.num_groups, shape.width
        pin = device.type == "cuda"

        def pair(shape_: tuple, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape_, dtype=dtype, pin_memory=pin)
            return host.numpy(), host, torch.zeros(shape_, dtype=dtype, device=device)

        self.h64, self._host64, self.d64 = pair((2 + g, b), torch.int64)  # ids, positions, slots of each group
        self.h32, self._host32, self.d32 = pair((2, b), torch.int32)  # seq_lens, context_lens
        self.htab, self._hosttab, self.dtab = pair((g, b, w), torch.int32)
        self.h64[2:] = -1  # every row starts as padding
        self._spare = None  # the other set of host mirrors (mirrors=2), swapped in by each fill
        if mirrors == 2:
            (h64, host64, _), (h32, host32, _), (htab, hosttab, _) = (
                pair((2 + g, b), torch.int64), pair((2, b), torch.int32), pair((g, b, w), torch.int32))
            h64[2:] = -1
            self._spare = (h64, host64, h32, host32, htab, hosttab, [[] for _ in range(g)])
        self.input_ids, self.positions, self.slot_mapping = self.d64[0], self.d64[1], self.d64[2:]
        self.seq_lens, self.context_lens, self.block_tables = self.d32[0], self.d32[1], self.dtab
        self._rows = np.arange(b, dtype=np.int64)
        self._prev: list[list[list[int]]] = [[] for _ in range(g)]  # each group's tables of the last fill
        self._cols = np.arange(w, dtype=np.int64)
        self._copy()

    def fill(self, token_ids: list[int], start_pos: list[int], tables: list[list[list[int]]]) -> None:
        """Row i: token_ids[i] at position start_pos[i], through tables[g][i] in group g; the rows
        past len(token_ids) become padding. Then the copies to the device (non-blocking)."""
        if self._spare is not None:
            mine = (self.h64, self._host64, self.h32, self._host32, self.htab, self._hosttab, self._prev)
            self.h64, self._host64, self.h32, self._host32, self.htab, self._hosttab, self._prev = self._spare
            self._spare = mine
        n, bs = len(token_ids), self.shape.block_size
        ids, pos, slots = self.h64[0], self.h64[1], self.h64[2:]
        ids[:n] = token_ids
        pos[:n] = start_pos
        ids[n:] = 0
        pos[n:] = 0
        slots[:, n:] = -1
        lens, ctx = self.h32[0], self.h32[1]
        ctx[:n] = pos[:n]
        lens[:n] = ctx[:n] + 1
        lens[n:] = 0
        ctx[n:] = 0
        blk, off = pos[:n] // bs, pos[:n] % bs
        for g, group in enumerate(tables):
            counts = np.fromiter(map(len, group), dtype=np.int64, count=n)
            if n and (bool((counts <= blk).any()) or int(counts.max()) > self.shape.width):
                raise ValueError(f"decode buffers: a block table of group {g} is shorter than its position or "
                                 f"longer than max_model_len allows ({self.shape.width} blocks)")
            self._write_tables(g, group, counts)
            slots[g, :n] = self.htab[g, self._rows[:n], blk].astype(np.int64) * bs + off
        self._copy(n)

    def _write_tables(self, g: int, group: list[list[int]], counts: np.ndarray) -> None:
        """Rewrite the rows of group g whose table differs from what the row held last step (a
        sequence gained a block, or another sequence now sits in the row): list comparisons in C,
        then one numpy write per changed row, or one vectorised write when many rows moved (a
        sequence left the batch and the rows after it shifted). A table passed again as the same
        list object counts as changed: it may have been modified in place since."""
        prev, n = self._prev[g], len(group)
        changed = [i for i, (a, b) in enumerate(zip(group, prev)) if a is b or a != b]
        changed += range(len(prev), n)
        if 4 * len(changed) > n:
            width = int(counts.max()) if n else 0
            flat = np.fromiter(itertools.chain.from_iterable(group), dtype=np.int32, count=int(counts.sum()))
            rows = self.htab[g, :n, :width]
            rows[self._cols[:width] < counts[:, None]] = flat  # row-major: each row's blocks in order
        else:
            for i in changed:
                t = group[i]
                self.htab[g, i, : len(t)] = t
        self._prev[g] = group

    def _copy(self, n: int | None = None) -> None:
        """Host mirrors -> device: the two vectors buffers whole, the tables' first n rows."""
        self.d64.copy_(self._host64, non_blocking=True)
        self.d32.copy_(self._host32, non_blocking=True)
        rows = self.shape.max_rows if n is None else n
        if rows:
            for g in range(self.shape.num_groups):
                self.dtab[g, :rows].copy_(self._hosttab[g, :rows], non_blocking=True)

    def padding(self) -> None:
        """Every row padding (what warm-up and capture run on: nothing written, nothing read)."""
        self.fill([], [], [[] for _ in range(self.shape.num_groups)])

    def metadata(self, bucket: int, layer_groups: list[int] | None, wrap, owner: str,
                 device: torch.device) -> StepMetadata:
        """The step metadata of a `bucket`-row step on these buffers, with each group's PagedStep
        prebuilt (paged_step.seed_static), so that no layer builds one: v2 or v1 and the group
        follow from bucket and max_model_len alone, the same in eager and graph mode."""
        from pagedrun.attention.cuda import paged_step

        s = self.shape
        starts = torch.arange(bucket + 1, dtype=torch.int32, device=self.device)
        metas = []
        for g in range(s.num_groups):
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[g, :bucket], query_start_loc=starts, seq_lens=self.seq_lens[:bucket],
                context_lens=self.context_lens[:bucket], block_tables=self.block_tables[g, :bucket],
                max_query_len=1, max_seq_len=s.max_model_len, block_size=s.block_size,
                # The lengths live on the device; the host lists hold the bound the step is sized for.
                query_lens_list=[1] * bucket, seq_lens_list=[s.max_model_len] * bucket)
            paged_step.seed_static(meta, device, wrap, owner)
            metas.append(meta)
        if layer_groups is None:
            return metas[0]
        return [metas[g] for g in layer_groups]
