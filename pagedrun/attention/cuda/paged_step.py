"""One step's inputs for the paged kernels, built once per step and reused by every layer.

Every layer of a step attends with the same slot mapping, block tables and lengths; only the
caches and the activations change. So the host work (which tokens go to the kernels, their block
table rows and lengths, the host-to-device copies and the wraps as device arrays) is done by the
first layer and cached on the step's AttentionMetadata; the other layers reuse it. It is all done
with torch on the cache's device, so on a GPU it is in torch's allocator (and its accounting).

Three ways to do prefill:
- "varlen": decode tokens (query length 1) go through the paged decode kernels; every prefilling
  sequence goes through one launch of the varlen prefill kernel per layer
  (kernels/cuda/prefill_attention.cu), over tiles of consecutive queries of one sequence
  (prefill_tiles below: a small int32 array built on the host once per step) that read the cache in
  place, cached prefix included. The CuPy backend's default.
- "sdpa": decodes as above; each prefilling sequence goes through torch's
  scaled_dot_product_attention (tensor cores on a GPU; pagedrun/attention/sdpa_prefill.py), one call,
  mask and prefix gather per sequence per layer.
- "kernel": every token is a paged-kernel row, prefill token j of sequence i a "pseudo-sequence"
  of length context_i + j + 1 on i's block table (pseudo_sequences below). The emulated
  backend's default, so CI runs the decode kernels on prefill too.
A quantized KV cache (issue 18) always takes the "kernel" path: SDPA would read the raw codes, and
the varlen kernel reads only caches in the model dtype.

Quantized caches also carry their float32 scales (k_scale / v_scale, vLLM's names): fp8 one per layer
(a float or a 1-element tensor), int8 one per (slot, kv head) in a [num_blocks, block_size,
num_kv_heads] tensor beside the blocks. kv_variant / scale_tensors check them once for both backends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pagedrun.attention.cuda import kernels as K
from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.attention.sdpa_prefill import PrefillSeq, attend_prefills, prefill_seqs

PREFILL_MODES = ("varlen", "sdpa", "kernel")
Wrap = Callable[[torch.Tensor], Any]  # torch tensor -> device array sharing its memory


@dataclass
class PagedStep:
    slot_mapping: Any  # device array int64 [num_tokens]
    num_rows: int  # queries that go through the paged kernels
    row_tokens: torch.Tensor | None  # their token indices; None: tokens 0..num_rows-1 in order
    block_tables: Any  # device array int32 [num_rows, max_blocks]
    seq_lens: Any  # device array int32 [num_rows]
    max_seq_len: int
    prefills: list[PrefillSeq]  # sequences for SDPA ("sdpa" mode)
    block_tables_t: torch.Tensor  # the step's block tables on the device (SDPA's prefix gathers)
    # torch tensors behind the device arrays: they must outlive every layer's launches
    keep: list[torch.Tensor] = field(default_factory=list)
    # the slot mapping as a torch tensor on the device: what a fused RoPE + cache write takes
    # (written_slots below)
    slots: torch.Tensor | None = None
    # "varlen": the prefilling sequences' (index, first token, queries, context), their longest
    # seq_len, the step's block tables as a device array, and the tile arrays by tile size
    # (device array, made by the first layer that launches: the size is the kernel variant's)
    varlen: np.ndarray | None = None
    varlen_max_seq_len: int = 0
    tables: Any = None
    tiles: dict[int, Any] = field(default_factory=dict)

    def tiles_for(self, tile_q: int, wrap: Wrap) -> Any:
        """The step's prefill tiles of tile_q queries as a device array (built once per step and size)."""
        arr = self.tiles.get(tile_q)
        if arr is None:
            t = torch.from_numpy(prefill_tiles(self.varlen, tile_q)).to(self.block_tables_t.device)
            self.keep.append(t)
            arr = self.tiles[tile_q] = wrap(t)
        return arr


def build(meta: AttentionMetadata, device: torch.device, wrap: Wrap, prefill: str) -> PagedStep:
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill mode {prefill!r}: one of {', '.join(PREFILL_MODES)}")
    slot = meta.slot_mapping.to(device=device, dtype=torch.int64).contiguous()
    tables = meta.block_tables.to(device=device, dtype=torch.int32).contiguous()
    qlens, slens = meta.query_lens_list, meta.seq_lens_list
    num_real = sum(qlens)
    prefills: list[PrefillSeq] = []
    row_tokens = None
    if meta.is_decode_only and num_real == meta.num_seqs:
        bt, lens = tables, torch.tensor(slens, dtype=torch.int32).to(device)
        max_seq_len = max(slens)
    elif prefill in ("sdpa", "varlen"):
        prefills = prefill_seqs(qlens, slens)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        decodes = [i for i, n in enumerate(qlens) if n == 1]
        row_tokens = torch.tensor([starts[i] for i in decodes], dtype=torch.long).to(device)
        seqs = torch.tensor(decodes, dtype=torch.long).to(device)
        bt = tables.index_select(0, seqs).contiguous()
        lens = torch.tensor([slens[i] for i in decodes], dtype=torch.int32).to(device)
        max_seq_len = max((slens[i] for i in decodes), default=0)
    else:
        token_to_seq, seq_lens = pseudo_sequences(qlens, slens)
        bt = tables.index_select(0, torch.from_numpy(token_to_seq).to(device)).contiguous()
        lens = torch.from_numpy(seq_lens).to(device)
        max_seq_len = int(seq_lens.max()) if len(seq_lens) else 0
    num_rows = int(lens.shape[0])
    step = PagedStep(wrap(slot), num_rows, row_tokens, wrap(bt), wrap(lens), max_seq_len, prefills, tables,
                     keep=[slot, tables, bt, lens], slots=slot)
    if prefill == "varlen" and prefills:  # the prefills go to the varlen kernel instead of SDPA
        step.varlen = np.array([(p.index, p.start, p.num_tokens, p.context_len) for p in prefills], dtype=np.int64)
        step.varlen_max_seq_len = max(p.seq_len for p in prefills)
        step.tables = wrap(tables)
        step.prefills = []
    return step


def _key(owner: str, device: torch.device, prefill: str) -> tuple:
    return ("paged_step", owner, str(device), prefill)


def cached(meta: AttentionMetadata, device: torch.device, wrap: Wrap, prefill: str, owner: str) -> PagedStep:
    """The step's PagedStep, built by the first layer that asks (per backend, device and mode)."""
    key = _key(owner, device, prefill)
    step = meta.backend_state.get(key)
    if step is None:
        step = meta.backend_state[key] = build(meta, device, wrap, prefill)
    return step


def seed_static(meta: AttentionMetadata, device: torch.device, wrap: Wrap, owner: str) -> PagedStep:
    """The PagedStep of a decode-only step on static buffers (worker/decode_buffers.py), stored where
    `cached` finds it in either prefill mode: every row a kernel row (padding rows included, so the
    output is never zero-filled or scattered), max_seq_len the metadata's bound (max_model_len),
    nothing read from the host. Built once per bucket; CUDA graphs replay its launches."""
    slot, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
    step = PagedStep(wrap(slot), int(lens.shape[0]), None, wrap(tables), wrap(lens), meta.max_seq_len, [], tables,
                     keep=[slot, tables, lens], slots=slot)
    for mode in PREFILL_MODES:
        meta.backend_state[_key(owner, device, mode)] = step
    return step


def written_slots(ker: K.PagedKernels, meta: AttentionMetadata, device: torch.device, wrap: Wrap, prefill: str,
                  owner: str) -> torch.Tensor | None:
    """The step's slot mapping (int64 torch tensor on the device) for a caller that writes this
    layer's K/V itself (the fused RoPE + cache write: models/ops.rope_and_cache) and then calls
    forward with cache_written=True; None where the backend must write them (a quantized cache:
    codes and scales are reshape_and_cache's)."""
    if ker.variant.quantized:
        return None
    return cached(meta, device, wrap, prefill_mode(prefill, ker.variant), owner).slots


def kv_variant(model_dtype: torch.dtype, key_cache: torch.Tensor, kv_cache_dtype: str,
               num_heads: int | None = None) -> K.KernelVariant:
    """The kernel variant for a layer: the model (query) dtype, the cache's layout and storage, and
    the query heads a block serves (num_heads: the query's; None: one per block)."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    kv = K.kv_dtype_name(kv_cache_dtype)
    want = K.KV_DTYPES[kv][2]
    if want is not None and key_cache.dtype != getattr(torch, np.dtype(want).name):
        raise ValueError(f"kv_cache_dtype {kv}: the cache must be stored as {np.dtype(want).name}, not {key_cache.dtype}")
    group = K.group_for(int(num_heads), int(num_kv_heads), kv) if num_heads else 1
    return K.KernelVariant(K.dtype_name(model_dtype), int(head_size), int(block_size), kv, group)


def prefill_mode(requested: str, variant: K.KernelVariant) -> str:
    return "kernel" if variant.quantized else requested


def scale_tensors(variant: K.KernelVariant, key_cache: torch.Tensor, k_scale, v_scale
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """k_scale / v_scale as contiguous float32 tensors on the cache's device (None when unquantized)."""
    if not variant.quantized:
        return None, None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"kv_cache_dtype {variant.kv_dtype} needs {name}")
        t = torch.as_tensor(s, dtype=torch.float32, device=key_cache.device)
        out.append(t.reshape(1) if t.dim() == 0 else t.contiguous())
    return out[0], out[1]


def forward(ker: K.PagedKernels, step: PagedStep, wrap: Wrap, query, key, value, key_cache, value_cache,
            meta: AttentionMetadata, scale: float, alloc: K.Alloc | None = None,
            k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
            cache_views: tuple[Any, Any] | None = None, *, window: int = 0,
            softcap: float = 0.0, sinks: torch.Tensor | None = None,
            cache_written: bool = False) -> tuple[torch.Tensor, str]:
    """reshape_and_cache for every token (unless cache_written: the model's fused RoPE + cache write
    did it, through written_slots), then paged attention for the kernel rows, and the varlen
    prefill kernel ("varlen": one launch for every prefilling sequence) or SDPA ("sdpa") for the
    prefills. Returns (out, the kernel version launched or "none"). k/v_scales: from scale_tensors.
    cache_views: the caches already wrapped (a backend may keep them: they live as long as it).
    window / softcap / sinks: the layer's sliding window, logit cap and attention sinks (0 / None:
    off), the backend contract's.
    Every kernel row is one query at position seq_len - 1 (a decode, or a prefill token's
    pseudo-sequence), so the kernels' per-row window is the contract's per-query one."""
    kc, vc = cache_views or (wrap(key_cache), wrap(value_cache))
    ks = None if k_scales is None else wrap(k_scales)
    vs = None if v_scales is None else wrap(v_scales)
    if not cache_written:
        ker.reshape_and_cache(wrap(heads_packed(key)), wrap(heads_packed(value)), kc, vc, step.slot_mapping, ks, vs)
    # Rows no kernel writes (padding) stay 0; when the kernel rows are every token, none is left.
    every_row = step.row_tokens is None and step.num_rows == query.shape[0] and not step.prefills
    out = (torch.empty_like if every_row else torch.zeros_like)(query, memory_format=torch.contiguous_format)
    version = "none"
    if step.num_rows:
        if step.row_tokens is None:
            q, o = heads_packed(query[: step.num_rows]), out[: step.num_rows]
        else:
            q = query.index_select(0, step.row_tokens)
            o = torch.empty_like(q)
        version = ker.paged_attention(wrap(o), wrap(q), kc, vc, step.block_tables, step.seq_lens,
                                      step.max_seq_len, float(scale), alloc=alloc, k_scales=ks, v_scales=vs,
                                      window=window, softcap=softcap,
                                      sinks=None if sinks is None else wrap(sink_tensor(sinks, query)))
        if step.row_tokens is not None:
            out.index_copy_(0, step.row_tokens, o)
    if step.varlen is not None:
        assert not ker.variant.quantized, "quantized caches take the kernel prefill path (prefill_mode)"
        v = ker.variant
        group = v.launch_group(int(query.shape[1]), int(key_cache.shape[2]))
        ker.prefill_attention(wrap(out), wrap(heads_packed(query)), kc, vc, step.tables,
                              step.tiles_for(v.prefill_tile_q(group), wrap), step.varlen_max_seq_len, float(scale),
                              group, window=window, softcap=softcap,
                              sinks=None if sinks is None else wrap(sink_tensor(sinks, query)))
    if step.prefills:
        assert not ker.variant.quantized, "quantized caches take the kernel prefill path (prefill_mode)"
        attend_prefills(out, query, key, value, key_cache, value_cache, step.block_tables_t, step.prefills,
                        meta.block_size, scale, window=window, softcap=softcap, sinks=sinks)
    return out, version


def sink_tensor(sinks: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """sinks as the kernels read them: float32 [num_heads], contiguous, on the query's device."""
    if sinks.numel() != query.shape[1]:
        raise ValueError(f"sinks has {sinks.numel()} entries for {query.shape[1]} query heads")
    return sinks.detach().to(query.device, torch.float32).contiguous()


def heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_size] as the kernels take it: each row's heads packed, rows any stride
    apart. The projections' k and v are such views into the qkv output already; copied only if not."""
    if x.dim() == 3 and (x.shape[2] <= 1 or x.stride(2) == 1) and (x.shape[1] <= 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def launch_each_version(ker: K.PagedKernels, wrap: Wrap, key_cache, value_cache, dtype: torch.dtype,
                        alloc: K.Alloc | None = None) -> list[str]:
    """v1, then v2 and its reduce, once each per group (one head per block, and the variant's
    group): the group's queries per KV head over the first cached token of block 0 (the output is
    thrown away). CUDA loads a kernel's code on its first launch, and which version and group a step
    takes depends on lengths; launched here, all are loaded, and counted, before the memory profile
    reads what is in use. Not for quantized caches (their scales come per layer)."""
    if ker.variant.quantized:
        return []
    device = key_cache.device
    q = torch.zeros(1, key_cache.shape[2] * ker.variant.group, key_cache.shape[3], dtype=dtype, device=device)
    o = torch.empty_like(q)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    groups = dict.fromkeys((1, ker.variant.group))  # the grid of one query picks one head per block
    return [ker.paged_attention(wrap(o), wrap(q), wrap(key_cache), wrap(value_cache), wrap(table), wrap(lens), 1,
                                1.0, version=v, alloc=alloc, group=g) for v in ("v1", "v2") for g in groups]


def prefill_tiles(seqs: np.ndarray, tile_q: int) -> np.ndarray:
    """The varlen prefill kernel's tiles: seqs [n, 4] int rows (block-table row, first token, queries,
    context length) -> int32 [num_tiles, 4] rows (block-table row, first token, queries <= tile_q,
    the first query's position), tile_q consecutive queries of one sequence each (the last one of a
    sequence the rest). Ordered by their last position, highest first: a tile costs its keys, so the
    long ones start first and the short ones fill in behind them."""
    seqs = np.asarray(seqs, dtype=np.int64).reshape(-1, 4)
    per_seq = -(-seqs[:, 2] // tile_q)
    which = np.repeat(np.arange(len(seqs)), per_seq)
    j0 = (np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * tile_q
    rows, start, n, ctx = (seqs[which, k] for k in range(4))
    tiles = np.stack([rows, start + j0, np.minimum(n - j0, tile_q), ctx + j0], axis=1)
    order = np.argsort(-(tiles[:, 3] + tiles[:, 2]), kind="stable")
    return np.ascontiguousarray(tiles[order], dtype=np.int32)


def pseudo_sequences(query_lens: list[int], seq_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One pseudo-sequence per query token: (token -> sequence index, its seq_len).

    Query j of sequence i sits at position context_i + j and may see cache positions
    0..context_i + j, i.e. it is a decode query of a sequence of length context_i + j + 1 that
    uses sequence i's block table. Causality comes from the lengths alone; decode tokens are the
    case j = 0 with query length 1.
    """
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    token_to_seq = np.repeat(np.arange(len(q), dtype=np.int64), q)
    starts = np.cumsum(q) - q
    j = np.arange(int(q.sum()), dtype=np.int64) - np.repeat(starts, q)
    lens = (s - q)[token_to_seq] + j + 1
    return token_to_seq, lens.astype(np.int32)
