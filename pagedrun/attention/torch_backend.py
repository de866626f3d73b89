"""Paged attention in plain torch: the CPU backend and the reference the CuPy kernels are checked against.

Two steps per layer, as in vLLM: reshape_and_cache (scatter this step's K/V into their slots) and
then attention over each sequence's blocks, found through its block table.

- Decode tokens (query length 1, the bulk of the work in a batch job) are done together: one gather
  of every sequence's blocks (padded to the longest), a length mask, one batched SDPA call with
  GQA (K/V are never repeated per query head). No Python loop over sequences, except that a step
  gathering more than DECODE_GATHER_TOKENS rows runs in chunks (a bound the memory plan holds).
- Prefill tokens (query length > 1) go one sequence at a time through torch SDPA
  (pagedrun/attention/sdpa_prefill.py, shared with the CuPy backend); with a cached prefix
  (context_lens > 0) the causal mask is shifted by the context length.
- A sliding window (window > 0) gathers each sequence's blocks from the one holding the first key
  its first query sees, so the placeholders the hybrid KV manager leaves below it are never read;
  a softcap or attention sinks compute the scores explicitly (sdpa_prefill.attention).

On the CPU the fast path is the C++ kernel (kernels/cpu/paged_attention_cpu.cpp through
pagedrun.attention.cpu_kernels, issue 8): one call per layer for every token of the step, reading K/V
in place through the block tables with an online softmax, so no gather copies, masks or Python loop
over prefills. The pure-torch path above stays as the fallback (no compiler, CUDA tensors, an
unsupported dtype or layout) and as the reference the kernel is tested against;
TorchAttentionBackend(use_cpu_kernel=False) forces it.

A quantized cache (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2 / int8, pagedrun/attention/kv_cache_spec.py): this
step's K/V are quantized in torch and scattered as bytes (int8 scales beside them); the C++ kernel
widens each chunk of cache rows to float32 as it reads them (a 256-entry table for fp8, the row's
scale for int8); the torch path dequantizes the blocks the step reads into a compact float32 copy.
"""
from __future__ import annotations

import dataclasses

import torch

from pagedrun.attention import cpu_kernels, sdpa_prefill
from pagedrun.attention import kv_cache_spec as kv_quant
from pagedrun.attention.cpu_kernels import int_arg
from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.attention.scratch import DECODE_GATHER_TOKENS
from pagedrun.attention.sdpa_prefill import attend_prefills, prefill_seqs


def decode_chunks(seq_lens: list[int], block_size: int, limit: int) -> list[range]:
    """Consecutive runs of sequences whose gather (count x the longest, padded to a block) stays
    within `limit` rows; a sequence longer than the limit is a chunk of its own."""
    chunks, start, longest = [], 0, 0
    for i, n in enumerate(seq_lens):
        padded = -(-n // block_size) * block_size
        if i > start and (i - start + 1) * max(longest, padded) > limit:
            chunks.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, padded)
    chunks.append(range(start, len(seq_lens)))
    return chunks


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, use_cpu_kernel: bool | None = None, kv_cache_dtype: str = "auto") -> None:
        """use_cpu_kernel: None (auto) = the C++ kernel for CPU tensors it supports, once it builds,
        else torch; True = the same, but raise if the kernel cannot be built; False = torch only.
        kv_cache_dtype: auto (the cache holds the model's dtype, or another float) | fp8_e4m3 |
        fp8_e5m2 | int8 (the cache holds codes; forward then needs k_scale / v_scale)."""
        self.use_cpu_kernel = use_cpu_kernel
        self.kv_cache_dtype = kv_quant.kv_cache_spec(kv_cache_dtype, torch.float32).name if kv_cache_dtype != "auto" \
            else "auto"
        self.quantized = self.kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2", "int8")
        # Why the C++ kernel is not (or was not, on the last call) used; None while it is.
        self.cpu_kernel_error: str | None = "disabled (use_cpu_kernel=False)" if use_cpu_kernel is False else None
        self.last_path: str | None = None  # "cpu_kernel" or "torch": what the last forward ran
        self._kernels: cpu_kernels.CpuAttentionKernels | None = None
        self._loaded = False

    def load_cpu_kernel(self) -> cpu_kernels.CpuAttentionKernels | None:
        """The loaded C++ kernel (built on first use), or None when it is off or unavailable."""
        if self.use_cpu_kernel is False:
            return None
        if not self._loaded:
            self._loaded = True
            self._kernels = cpu_kernels.load()
            if self._kernels is None:
                self.cpu_kernel_error = cpu_kernels.load_error() or "unavailable"
                if self.use_cpu_kernel:
                    raise RuntimeError(f"the CPU attention kernel is unavailable: {self.cpu_kernel_error}")
        return self._kernels

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kern = self._usable_kernel(query, key_cache, value_cache)
        if self.quantized:
            key, value = self._write_quantized(key, value, key_cache, value_cache, k_scale, v_scale, meta, kern)
        else:
            reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, kernels=kern)
        if kern is not None:
            out = self._attend_kernel(kern, query, key_cache, value_cache, meta, scale, k_scale, v_scale,
                                      window=window, softcap=softcap, sinks=sinks)
            if out is not None:
                self.last_path = "cpu_kernel"
                return out
        self.last_path = "torch"
        if self.quantized:
            key_cache, value_cache, meta = self._dequantized_blocks(key_cache, value_cache, k_scale, v_scale, meta,
                                                                    window)
        return self._attend_torch(query, key, value, key_cache, value_cache, meta, scale, window, softcap, sinks)

    def _write_quantized(self, key, value, key_cache, value_cache, k_scale, v_scale, meta, kern):
        """Quantize this step's K/V and scatter the codes (and int8 scales); returns K/V as the cache
        now holds them, dequantized (what the torch path attends to for the step's own tokens)."""
        if k_scale is None or v_scale is None:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs k_scale and v_scale")
        fmt = self.kv_cache_dtype
        if fmt == "int8":
            (qk, sk), (qv, sv) = kv_quant.quantize_int8(key), kv_quant.quantize_int8(value)
            reshape_and_cache(qk, qv, key_cache, value_cache, meta.slot_mapping, kernels=kern)
            reshape_and_cache(sk.unsqueeze(-1), sv.unsqueeze(-1), k_scale.unsqueeze(-1), v_scale.unsqueeze(-1),
                              meta.slot_mapping)
            return kv_quant.dequantize_int8(qk, sk), kv_quant.dequantize_int8(qv, sv)
        kv_quant.calibrate_fp8_(k_scale, key, fmt)
        kv_quant.calibrate_fp8_(v_scale, value, fmt)
        qk, qv = kv_quant.quantize_fp8(key, k_scale, fmt), kv_quant.quantize_fp8(value, v_scale, fmt)
        reshape_and_cache(qk, qv, key_cache, value_cache, meta.slot_mapping, kernels=kern)
        return kv_quant.dequantize_fp8(qk, k_scale, fmt), kv_quant.dequantize_fp8(qv, v_scale, fmt)

    def _dequantized_blocks(self, key_cache, value_cache, k_scale, v_scale, meta, window: int = 0):
        """The blocks this step reads, dequantized to float32 in a compact cache, and the metadata
        with its block tables renumbered into it (the full cache is never widened)."""
        ids, renumbered = torch.unique(_tables_read(meta, window), return_inverse=True)
        if self.kv_cache_dtype == "int8":
            kc = kv_quant.dequantize_int8(key_cache[ids], k_scale[ids])
            vc = kv_quant.dequantize_int8(value_cache[ids], v_scale[ids])
        else:
            kc = kv_quant.dequantize_fp8(key_cache[ids], k_scale, self.kv_cache_dtype)
            vc = kv_quant.dequantize_fp8(value_cache[ids], v_scale, self.kv_cache_dtype)
        meta = dataclasses.replace(meta, block_tables=renumbered.to(torch.int32), backend_state={})
        return kc, vc, meta

    def plain_cpu_kernels(self, dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor
                          ) -> cpu_kernels.CpuAttentionKernels | None:
        """The C++ kernels where forward() would run them on a `dtype` query over an unquantized
        cache (the CPU layer runner calls them itself, pagedrun/models/layer_runner.py), else None."""
        if self.quantized:
            return None
        return self._kernel_for(dtype, key_cache.device, True, key_cache, value_cache)

    def _usable_kernel(self, query, key_cache, value_cache) -> cpu_kernels.CpuAttentionKernels | None:
        shape_ok = query.dim() == 3 and query.shape[2] == key_cache.shape[3]
        return self._kernel_for(query.dtype, query.device, shape_ok, key_cache, value_cache)

    def _kernel_for(self, dtype, device, shape_ok: bool, key_cache, value_cache
                    ) -> cpu_kernels.CpuAttentionKernels | None:
        """The kernels for a query of `dtype` on `device` (shape_ok: its shape fits the cache), or
        None, with the reason in cpu_kernel_error where the kernel exists but cannot take it."""
        if self.use_cpu_kernel is False or device.type != "cpu":
            return None
        kern = self.load_cpu_kernel()
        if kern is None:
            return None
        plain = not self.quantized and dtype == key_cache.dtype == value_cache.dtype
        if not (plain or self.quantized) or dtype not in kern.dtypes:
            self.cpu_kernel_error = f"dtype {dtype} / cache {key_cache.dtype} not supported by the kernel"
            return None
        if not shape_ok:
            self.cpu_kernel_error = "query shape does not match the cache"
            return None
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.shape[3] % 8:
            self.cpu_kernel_error = "cache not contiguous or head size not a multiple of 8"
            return None
        return kern

    def _attend_kernel(self, kern, query, key_cache, value_cache, meta, scale, k_scale=None, v_scale=None, *,
                       window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """Every token of the step in one kernel call; None if the kernel refused the arguments."""
        head_size = query.shape[2]
        if query.stride(2) != 1 or query.stride(1) != head_size:
            query = query.contiguous()  # the kernel takes any token stride, not a head stride
        out = torch.empty(query.shape, dtype=query.dtype)
        tables, seq_lens = int_arg(meta.block_tables, torch.int32), int_arg(meta.seq_lens, torch.int32)
        threads = torch.get_num_threads()
        kv = cpu_kernels.kv_reader(self.kv_cache_dtype, k_scale, v_scale)
        if meta.is_decode_only and meta.num_seqs == query.shape[0]:
            rc = kern.decode(out, query, key_cache, value_cache, tables, seq_lens, scale, threads, kv,
                             window=window, softcap=softcap, sinks=sinks)
        else:
            starts, context_lens = int_arg(meta.query_start_loc, torch.int32), int_arg(meta.context_lens, torch.int32)
            rc = kern.varlen(out, query, key_cache, value_cache, tables, starts, seq_lens, context_lens, scale, threads,
                             kv, window=window, softcap=softcap, sinks=sinks)
        if rc != 0:
            # Inconsistent metadata or a block id outside the cache: let the torch path have it
            # (it raises on what the kernel could only have crashed on).
            self.cpu_kernel_error = f"the kernel refused this step's arguments (status {rc})"
            return None
        self.cpu_kernel_error = None
        return out

    def _attend_torch(self, query, key, value, key_cache, value_cache, meta, scale, window: int = 0,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The reference path: batched gather + SDPA for decodes, one SDPA per prefill."""
        num_tokens = query.shape[0]
        qlens = meta.query_lens_list
        if meta.is_decode_only and sum(qlens) == num_tokens:
            return self._decode(query, key_cache, value_cache, meta, range(meta.num_seqs), scale, window, softcap,
                                sinks)

        out = query.new_zeros(query.shape)  # rows of padding tokens stay zero
        starts = meta.query_start_loc.tolist()
        decode_seqs = [i for i, n in enumerate(qlens) if n == 1]
        if decode_seqs:
            tok = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
            out[tok] = self._decode(query[tok], key_cache, value_cache, meta, decode_seqs, scale, window, softcap,
                                    sinks)
        attend_prefills(out, query, key, value, key_cache, value_cache, meta.block_tables,
                        prefill_seqs(qlens, meta.seq_lens_list), meta.block_size, scale, window=window,
                        softcap=softcap, sinks=sinks)
        return out

    def _decode(self, query, key_cache, value_cache, meta, seqs, scale, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [S, heads, hd], one token per sequence in `seqs` -> [S, heads, hd], in chunks of
        at most DECODE_GATHER_TOKENS gathered rows (one chunk in most steps)."""
        all_seqs = isinstance(seqs, range) and len(seqs) == meta.num_seqs
        lens = meta.seq_lens_list if all_seqs else [meta.seq_lens_list[i] for i in seqs]
        seq_lens = meta.seq_lens if all_seqs else meta.seq_lens[list(seqs)]
        tables = meta.block_tables if all_seqs else meta.block_tables[list(seqs)]
        # The same for every layer of the step: worked out by the first.
        # (A window bounds what is gathered: at most window + block_size - 1 rows a sequence.)
        block_size = key_cache.shape[1]
        key = ("decode_chunks", all_seqs, DECODE_GATHER_TOKENS, window)
        chunks = meta.backend_state.get(key)
        if chunks is None:
            gathered = [min(n, window + block_size - 1) for n in lens] if window > 0 else lens
            chunks = meta.backend_state[key] = decode_chunks(gathered, block_size, DECODE_GATHER_TOKENS)
        variant = {"window": window, "softcap": softcap, "sinks": sinks}
        if len(chunks) == 1:
            return _gather_decode(query, key_cache, value_cache, tables, seq_lens, max(lens), scale, **variant)
        out = torch.empty_like(query)
        for c in chunks:
            sl = slice(c.start, c.stop)
            out[sl] = _gather_decode(query[sl], key_cache, value_cache, tables[sl], seq_lens[sl],
                                     max(lens[sl]), scale, **variant)
        return out



def _gather_decode(query, key_cache, value_cache, tables, seq_lens, max_len, scale, *, window: int = 0,
                   softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One gather of the sequences' blocks (padded to the longest) and one batched SDPA. With a window,
    each sequence's blocks from the one holding its first visible key (seq_len - window) only: the
    table entries below it (placeholders) are not read."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    ids, pos, num_blocks = _decode_blocks(tables, seq_lens, max_len, block_size, window)
    length = num_blocks * block_size
    # One gather for all sequences: [S, L, kv_heads, hd], viewed as [S, kv_heads, L, hd].
    k = key_cache.index_select(0, ids).view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache.index_select(0, ids).view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    lens = seq_lens.to(query.device)[:, None]
    valid = pos < lens
    if window > 0:
        valid &= pos >= lens - window
    # Slots past the end may hold anything (another sequence's stale data, or memory never
    # written, possibly NaN): zero them, since a masked NaN score or 0 * NaN value still
    # poisons the output. k and v are copies. (Cheaper than gathering token by token.)
    invalid = ~valid[:, None, :, None]
    k.masked_fill_(invalid, 0.0)
    v.masked_fill_(invalid, 0.0)
    # SDPA with GQA on the un-repeated K/V: faster on CPU than matmul+softmax, and no repeated K/V
    # (docs/log/2026-11-27-figures-from-code-comments.md).
    q = query.unsqueeze(2).to(k.dtype)  # [S, heads, 1, hd]
    out = sdpa_prefill.attention(q, k, v, valid[:, None, None, :], scale, softcap, sinks=sinks)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def _decode_blocks(tables, seq_lens, max_len: int, block_size: int, window: int):
    """The block ids to gather ([S * num_blocks], the sequences' runs one after another), the cache
    position of each gathered row ([S, num_blocks * block_size]) and num_blocks."""
    device = tables.device
    if window <= 0:
        num_blocks = -(-max_len // block_size)
        pos = torch.arange(num_blocks * block_size, device=device)[None, :]
        return tables[:, :num_blocks].reshape(-1), pos, num_blocks
    # window keys span at most this many blocks (the first key at a block's last slot)
    num_blocks = min(-(-max_len // block_size), (window + block_size - 2) // block_size + 1)
    first = (seq_lens.to(device).long() - window).clamp(min=0) // block_size  # [S]
    cols = first[:, None] + torch.arange(num_blocks, device=device)[None, :]
    # Columns past a table's end are padding: clamped here, and their rows masked like any past seq_len.
    ids = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
    pos = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).view(len(first), -1)
    return ids.reshape(-1), pos, num_blocks


def _tables_read(meta: AttentionMetadata, window: int) -> torch.Tensor:
    """meta.block_tables (int64) with every entry below the first block the sequence's first query
    of the step sees (window > 0) pointed at that block: a placeholder's block is never dequantized."""
    tables = meta.block_tables.long()
    if window <= 0 or tables.numel() == 0:
        return tables
    first = (meta.context_lens.to(tables.device).long() - window + 1).clamp(min=0) // meta.block_size
    first = first.clamp(max=tables.shape[1] - 1)[:, None]
    below = torch.arange(tables.shape[1], device=tables.device)[None, :] < first
    return torch.where(below, tables.gather(1, first), tables)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kernels: cpu_kernels.CpuAttentionKernels | None = None,
) -> None:
    """Scatter [T, kv_heads, hd] K/V into slot_mapping's slots; negative slots are skipped.

    With `kernels` (CPU tensors) the C++ scatter does it in one call, straight from strided K/V
    views; it checks every slot first and torch takes over if it refuses."""
    if kernels is not None and _scatter_ok(key, value, key_cache, value_cache, slot_mapping):
        if kernels.reshape_and_cache(key, value, key_cache, value_cache, int_arg(slot_mapping, torch.int64)) == 0:
            return
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    flat_k.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(value_cache.dtype))


def _scatter_ok(key, value, key_cache, value_cache, slot_mapping) -> bool:
    hd = key_cache.shape[3]
    return (
        key.dim() == value.dim() == 3
        and key.shape[0] == value.shape[0] == slot_mapping.shape[0]
        and key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        and key.device.type == "cpu"
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and key.shape[1:] == value.shape[1:] == key_cache.shape[2:]
        and key.stride(2) == value.stride(2) == 1
        and key.stride(1) == value.stride(1) == hd
    )

