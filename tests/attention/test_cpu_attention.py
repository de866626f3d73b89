"""The C++ CPU paged-attention kernel (kernels/cpu/paged_attention_cpu.cpp) against a float64 reference.

Every case draws each sequence's whole K/V (random, never zero), writes the already-cached part into
shuffled blocks of a cache whose every other slot is NaN, hands the backend only this step's tokens,
and compares with causal attention computed in float64 over the original per-sequence tensors. A
read of any slot the sequence does not own, or of a padding token's K/V, poisons the output.
"""
from __future__ import annotations

import random
import subprocess

import pytest
import torch
from attention_reference import assert_matches_reference
from cpu_libraries import load_or_skip

from pagedrun.attention import cpu_kernels
from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.attention.torch_backend import TorchAttentionBackend
from pagedrun.build.cpu import machine_flags


@pytest.fixture(scope="module")
def kern():
    return load_or_skip(cpu_kernels.load, cpu_kernels.load_error, "CPU attention kernel")


class Case:
    """(context_len, query_len) per sequence, laid out in a NaN-filled paged cache."""

    def __init__(self, seqs, block_size, heads, kv_heads, head_dim, seed=0, dtype=torch.float32,
                 num_pad_tokens=0, fused_qkv=False, window=0, softcap=0.0, sinks=None):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.dtype, self.block_size, self.window, self.softcap = dtype, block_size, window, softcap
        self.sinks = sinks  # float32 [heads] or None
        num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
        self.value_cache = torch.full_like(self.key_cache, float("nan"))
        flat_k = self.key_cache.view(-1, kv_heads, head_dim)
        flat_v = self.value_cache.view(-1, kv_heads, head_dim)

        def randn(*shape):
            return (torch.randn(*shape, generator=gen) + 0.1).to(dtype)

        self.queries, self.keys, self.values, tables = [], [], [], []
        slots, q_all, k_all, v_all = [], [], [], []
        for ctx, n in seqs:
            seq_len = ctx + n
            table = [ids.pop() for _ in range(-(-seq_len // block_size))]
            tables.append(table)
            k, v, q = randn(seq_len, kv_heads, head_dim), randn(seq_len, kv_heads, head_dim), randn(n, heads, head_dim)
            self.keys.append(k), self.values.append(v), self.queries.append(q)
            for pos in range(seq_len):
                slot = table[pos // block_size] * block_size + pos % block_size
                if pos < ctx:
                    flat_k[slot], flat_v[slot] = k[pos], v[pos]
                else:
                    slots.append(slot)
            q_all.append(q), k_all.append(k[ctx:]), v_all.append(v[ctx:])
        for _ in range(num_pad_tokens):  # garbage tokens: neither written nor read, zero output rows
            slots.append(-1)
            q_all.append(randn(1, heads, head_dim) * float("nan"))
            k_all.append(randn(1, kv_heads, head_dim) * float("nan"))
            v_all.append(randn(1, kv_heads, head_dim) * float("nan"))
        query, key, value = torch.cat(q_all), torch.cat(k_all), torch.cat(v_all)
        if fused_qkv:  # strided views of one [T, (heads + 2 kv_heads) * hd] tensor, as the model makes them
            t = query.shape[0]
            qkv = torch.cat([query.reshape(t, -1), key.reshape(t, -1), value.reshape(t, -1)], dim=1)
            q_size, kv_size = heads * head_dim, kv_heads * head_dim
            query, key, value = (x.view(t, -1, head_dim) for x in qkv.split([q_size, kv_size, kv_size], dim=-1))
            assert not key.is_contiguous()
        self.query, self.key, self.value = query, key, value
        # A spare column: tables are padded past their end.
        self.meta = AttentionMetadata.build([n for _, n in seqs], [c for c, _ in seqs], tables, block_size,
                                            num_pad_tokens=num_pad_tokens,
                                            table_width=max(len(t) for t in tables) + 1)
        assert self.meta.slot_mapping.tolist() == slots
        self.context_lens = [c for c, _ in seqs]
        self.num_real = sum(n for _, n in seqs)
        self.scale = head_dim**-0.5
        self.spare = ids  # blocks no sequence uses: NaN throughout

    def placeholders(self) -> int:
        """Points every table entry wholly below the window of its sequence's first query at a NaN
        block, as the hybrid KV manager leaves them; returns how many it replaced."""
        count = 0
        for i, ctx in enumerate(self.context_lens if self.window > 0 else []):
            first = max(0, ctx - self.window + 1) // self.block_size
            self.meta.block_tables[i, :first] = self.spare[0]
            count += first
        return count

    def run(self, use_cpu_kernel=True):
        backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
        out = backend.forward(self.query, self.key, self.value, self.key_cache, self.value_cache, self.meta,
                              self.scale, window=self.window, softcap=self.softcap, sinks=self.sinks)
        expected = "torch" if use_cpu_kernel is False else "cpu_kernel"
        assert backend.last_path == expected, backend.cpu_kernel_error
        return out

    def check(self, atol=2e-5, use_cpu_kernel=True):
        out = self.run(use_cpu_kernel)
        assert out.shape == self.query.shape and out.dtype == self.dtype
        assert_matches_reference(out, self.queries, self.keys, self.values, self.context_lens, self.scale, atol,
                                 self.window, self.softcap, self.sinks)
        assert torch.equal(out[self.num_real :], torch.zeros_like(out[self.num_real :])), "padding rows not zero"
        return out


GQA = [(4, 4), (4, 2), (8, 1)]  # ratios 1, 2, 8


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_mixed_batch(kern, head_dim, block_size, heads, kv_heads):
    seqs = [
        (0, 9),  # fresh prefill
        (block_size, 5),  # prefix hit of exactly one block, then 5 new tokens
        (13, 1),  # decode
        (2 * block_size + 3, block_size),  # chunked prefill continuing mid-block
        (0, 1),  # one-token prompt
        (3 * block_size - 1, 1),  # decode filling a block exactly
        (4 * block_size, 1),  # decode opening a new block
    ]
    Case(seqs, block_size, heads, kv_heads, head_dim, seed=block_size * heads + head_dim, num_pad_tokens=2).check()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_only_ragged(kern, block_size, heads, kv_heads):
    lens = [1, block_size, 2 * block_size, block_size + 1, 3 * block_size - 1, 5, 77]
    Case([(n - 1, 1) for n in lens], block_size, heads, kv_heads, 64, seed=block_size + heads).check()


def test_decode_with_padding_goes_through_varlen(kern):
    Case([(9, 1), (30, 1)], 16, 4, 2, 64, seed=4, num_pad_tokens=3).check()


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_long_prefill_spans_several_tiles(kern, heads, kv_heads):
    # More query tokens than one work item holds (64 rows / group), with and without a cached prefix
    # that is not a multiple of the tile, and a block size of 1 and one larger than a key chunk.
    seqs = [(0, 150), (37, 90), (0, 2)]
    Case(seqs, 16, heads, kv_heads, 64, seed=heads).check()
    Case(seqs[:2], 1, heads, kv_heads, 32, seed=7).check()
    Case(seqs[:2], 64, heads, kv_heads, 16, seed=8).check()


def test_large_growing_logits(kern):
    """Scores spanning hundreds, growing along the sequence: every new key chunk raises the running
    max, so a missed rescale overflows exp (inf/NaN) instead of cancelling out."""
    case = Case([(0, 70), (90, 1), (33, 20)], 8, 4, 2, 64, seed=12)
    scale = 1.0
    for i, ctx in enumerate(case.context_lens):
        seq_len = case.keys[i].shape[0]
        ramp = torch.linspace(1.0, 8.0, seq_len)[:, None, None]
        case.keys[i] = case.keys[i].abs() * ramp
        case.queries[i] = case.queries[i].abs() * 0.5
    case.scale = scale
    # Rebuild the cache and this step's inputs from the edited tensors (same slots as before).
    flat_k = case.key_cache.view(-1, 2, 64)
    new_k, new_q = [], []
    table_rows = case.meta.block_tables.tolist()
    for i, ctx in enumerate(case.context_lens):
        for pos in range(ctx):
            flat_k[table_rows[i][pos // 8] * 8 + pos % 8] = case.keys[i][pos]
        new_k.append(case.keys[i][ctx:]), new_q.append(case.queries[i])
    case.key, case.query = torch.cat(new_k), torch.cat(new_q)
    out = case.check(atol=1e-4)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("head_dim", [8, 24, 56, 256])
# Groups the kernel takes in passes of up to 4 rows: 1; 3; 5 = 4 + 1; 7 = 4 + 3.
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (6, 2), (10, 2), (14, 2)])
def test_head_sizes_and_odd_groups(kern, head_dim, heads, kv_heads):
    Case([(0, 20), (11, 1), (5, 7)], 16, heads, kv_heads, head_dim, seed=head_dim).check()


def test_fused_qkv_views_and_writes(kern):
    """Strided q/k/v (slices of one fused projection) are read in place and written to exactly
    their slots; padding tokens are never written."""
    case = Case([(5, 3), (0, 4), (10, 1)], 8, 4, 2, 64, seed=5, num_pad_tokens=2, fused_qkv=True)
    before = case.key_cache.clone()
    case.check()
    written = ~torch.isnan(case.key_cache) & torch.isnan(before)
    assert int(written.any(-1).any(-1).sum()) == 3 + 4 + 1
    flat_k, flat_v = case.key_cache.view(-1, 2, 64), case.value_cache.view(-1, 2, 64)
    for t, slot in enumerate(case.meta.slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], case.key[t]) and torch.equal(flat_v[slot], case.value[t])


def test_matches_torch_path(kern):
    seqs = [(0, 33), (40, 1), (17, 6), (64, 1), (0, 1)]
    fast = Case(seqs, 16, 8, 2, 64, seed=2).run(use_cpu_kernel=True)
    slow = Case(seqs, 16, 8, 2, 64, seed=2).run(use_cpu_kernel=False)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision(kern, dtype, atol):
    if dtype not in kern.dtypes:
        pytest.skip(f"{dtype} not supported by this build")
    seqs = [(0, 6), (17, 1), (8, 3), (31, 1), (0, 70)]
    out = Case(seqs, 16, 8, 2, 64, seed=9, dtype=dtype, num_pad_tokens=1).check(atol=atol)
    slow = Case(seqs, 16, 8, 2, 64, seed=9, dtype=dtype, num_pad_tokens=1).run(use_cpu_kernel=False)
    torch.testing.assert_close(out[:-1].float(), slow[:-1].float(), atol=atol, rtol=0)


def test_threads_give_identical_results(kern):
    case = Case([(0, 40), (50, 1), (20, 9), (7, 1)], 16, 8, 2, 64, seed=13)
    case.run()  # writes this step's K/V
    outs = []
    for threads in (1, 2):
        out = torch.empty_like(case.query)
        rc = kern.varlen(out, case.query, case.key_cache, case.value_cache, case.meta.block_tables,
                         case.meta.query_start_loc, case.meta.seq_lens, case.meta.context_lens, case.scale, threads)
        assert rc == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_kernel_refuses_bad_metadata(kern):
    case = Case([(9, 1), (3, 4)], 8, 4, 2, 64, seed=3)
    case.run()
    m = case.meta
    out = torch.full_like(case.query, 7.0)
    bad_tables = m.block_tables.clone()
    bad_tables[1, 0] = case.key_cache.shape[0]  # a block past the cache's end
    args = (case.key_cache, case.value_cache)
    assert kern.varlen(out, case.query, *args, bad_tables, m.query_start_loc, m.seq_lens, m.context_lens, 1.0, 1) < 0
    bad_ctx = m.context_lens + 1  # seq_lens no longer = context + query length
    assert kern.varlen(out, case.query, *args, m.block_tables, m.query_start_loc, m.seq_lens, bad_ctx, 1.0, 1) < 0
    assert torch.equal(out, torch.full_like(out, 7.0)), "a refused call must write nothing"
    bad_slots = torch.tensor([0, case.key_cache.shape[0] * 8, 1, 2, 3])
    assert kern.reshape_and_cache(case.key, case.value, *args, bad_slots) < 0


def test_backend_falls_back_when_kernel_refuses(kern):
    case = Case([(9, 1), (0, 3)], 8, 4, 2, 64, seed=6)
    case.meta.block_tables[0, -1] = 10**6  # past the table's used part: harmless for both paths
    case.check()
    case.meta.block_tables[0, 0] = 10**6  # really read: the kernel refuses, torch raises
    backend = TorchAttentionBackend()
    with pytest.raises(IndexError):
        backend.forward(case.query, case.key, case.value, case.key_cache, case.value_cache, case.meta, case.scale)
    assert "status" in backend.cpu_kernel_error


def test_fallback_when_kernel_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_load_error", "RuntimeError: no compiler here")
    case = Case([(0, 5), (12, 1)], 16, 4, 2, 64, seed=1, num_pad_tokens=1)
    backend = TorchAttentionBackend()
    out = backend.forward(case.query, case.key, case.value, case.key_cache, case.value_cache, case.meta, case.scale)
    assert backend.last_path == "torch" and backend.cpu_kernel_error == "RuntimeError: no compiler here"
    assert torch.isfinite(out[: case.num_real]).all()
    with pytest.raises(RuntimeError, match="unavailable"):
        TorchAttentionBackend(use_cpu_kernel=True).forward(case.query, case.key, case.value, case.key_cache,
                                                           case.value_cache, case.meta, case.scale)


def test_torch_path_for_unsupported_inputs(kern):
    case = Case([(0, 5), (12, 1)], 16, 4, 2, 64, seed=1)
    backend = TorchAttentionBackend()
    backend.forward(case.query.double(), case.key, case.value, case.key_cache, case.value_cache, case.meta,
                    case.scale)
    assert backend.last_path == "torch" and "dtype" in backend.cpu_kernel_error
    forced = TorchAttentionBackend(use_cpu_kernel=False)
    case.check(use_cpu_kernel=False)
    assert forced.load_cpu_kernel() is None


def test_load_reports_build_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDRUN_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGEDRUN_CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert "no-such-compiler" in cpu_kernels.load_error()
        monkeypatch.setenv("PAGEDRUN_CXX", "g++")
        monkeypatch.setenv("PAGEDRUN_CPU_ATTENTION", "0")
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is None and "PAGEDRUN_CPU_ATTENTION" in cpu_kernels.load_error()
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.slow


def test_build_cache_is_keyed_and_reused(monkeypatch, tmp_path):
    try:
        subprocess.run(["g++", "--version"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no g++")
    monkeypatch.setenv("PAGEDRUN_CACHE", str(tmp_path))
    so = cpu_kernels.build()
    assert so.is_file() and so.parent.parent == tmp_path / "cpu_kernels"
    mtime = so.stat().st_mtime_ns
    assert cpu_kernels.build() == so and so.stat().st_mtime_ns == mtime  # no rebuild
    assert [p.name for p in (tmp_path / "cpu_kernels").iterdir()] == [so.parent.name]  # no temp dirs left
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="compiling broken.cpp failed"):
        cpu_kernels.build(broken)
    assert [p.name for p in (tmp_path / "cpu_kernels").iterdir()] == [so.parent.name]


def test_machine_flags(monkeypatch):
    monkeypatch.delenv("PAGEDRUN_KERNEL_ISA", raising=False)  # what the parser reads, uncapped
    assert machine_flags("flags : fpu sse2 avx avx2 fma f16c") == ["-mavx2", "-mfma", "-mf16c"]
    assert machine_flags("flags : fpu sse2 avx f16c") == ["-mf16c"]
    assert machine_flags("flags : fpu sse2") == []


def test_engine_runs_the_kernel_and_matches_the_torch_path(kern, tmp_path):
    """Whole engine, tiny llama (GQA), chunked prefill + prefix caching + decode in mixed steps:
    the kernel path is the one taken and its greedy tokens equal the pure-torch path's."""
    from tiny_models import make_tiny_model

    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    d = make_tiny_model("llama", tmp_path / "m", seed=3)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 640) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 640) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    prompts += [[rng.randrange(3, 640) for _ in range(n)] for n in (1, 17, 50)]
    results = {}
    for use_kernel in (True, False):
        recipe = load_recipe(None, [f"model.path={d}", "sampling.max_tokens=6", "sampling.ignore_eos=true",
                                    "cache.block_size=8", "cache.num_blocks=256",
                                    "scheduler.max_num_batched_tokens=24"])
        llm = LLM(recipe)
        llm.engine.worker.backend.use_cpu_kernel = use_kernel
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], None)
        assert llm.engine.worker.backend.last_path == ("cpu_kernel" if use_kernel else "torch")
        assert sum(s.prefix_hit_tokens for s in llm.engine.steps) > 0
        results[use_kernel] = [o.outputs[0].token_ids for o in outs]
    assert results[True] == results[False]


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (80, 4, 4), (48, 6, 3)])
@pytest.mark.slow
def test_vector_widths_agree(kern, head_dim, heads, kv_heads):
    """Head sizes that are whole 16-float vectors run the wide dot products and weighted sums when the
    build has AVX-512; the 8-wide build (PR_GEMM_VEC8, every machine) must give the same attention
    within rounding (the weighted sums are the same per-lane sums; the dots differ only in
    association), mixed prefill and decode alike. On an AVX2-only machine both builds are 8-wide."""
    from pagedrun.attention.cpu_kernels import SOURCE, CpuAttentionKernels
    from pagedrun.build import cpu as cpu_build

    narrow = CpuAttentionKernels(cpu_build.build(SOURCE, ("-DPR_GEMM_VEC8",)))
    case = Case([(0, 40), (50, 1), (20, 9), (7, 1), (90, 1)], 16, heads, kv_heads, head_dim, seed=head_dim)
    case.run()  # writes this step's K/V
    outs = []
    for lib in (kern, narrow):
        out = torch.empty_like(case.query)
        assert lib.varlen(out, case.query, case.key_cache, case.value_cache, case.meta.block_tables,
                          case.meta.query_start_loc, case.meta.seq_lens, case.meta.context_lens, case.scale, 2) == 0
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=0)


# bf16 prefill on AMX tiles (kernels/cpu/attention_amx.h) where the CPU has them: Q.K^T and P.V
# (P rounded to bf16) in the tile unit, chunks of 32 keys across blocks. Held to the float64
# reference with the FMA path's bound, switched off for the same case, and compared with it.
AMX_CASES = [
    # (seqs, block_size, heads, kv_heads, head_dim)
    ([(0, 6), (17, 1), (8, 3), (31, 1), (0, 70)], 16, 8, 2, 64),
    ([(0, 150), (37, 90), (0, 2), (5, 33)], 16, 9, 3, 64),  # the default model's GQA 9/3
    ([(0, 45), (64, 20), (3, 17)], 32, 4, 1, 128),
    ([(0, 19), (40, 9)], 8, 4, 4, 96),
    ([(0, 70), (10, 2)], 16, 2, 1, 80),  # head 80: not a multiple of 32, the FMA path
]


@pytest.mark.parametrize("case_args", AMX_CASES)
def test_bf16_prefill_on_tiles_and_off_match_float64(kern, case_args):
    seqs, block_size, heads, kv_heads, head_dim = case_args
    had = kern.amx()
    outs = []
    try:
        for on in (1, 0):
            kern.amx(on)
            case = Case(seqs, block_size, heads, kv_heads, head_dim, seed=block_size + head_dim, dtype=torch.bfloat16,
                        num_pad_tokens=1)
            outs.append(case.check(atol=3e-2))
    finally:
        kern.amx(int(had))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=3e-2, rtol=0)


def test_amx_is_used_where_the_cpu_has_it(kern):
    if "-mamx-tile" not in machine_flags():
        pytest.skip("no AMX on this CPU (or PAGEDRUN_KERNEL_ISA rules it out)")
    assert kern.amx()
