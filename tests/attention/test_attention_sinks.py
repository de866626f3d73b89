"""GPT-OSS's learned attention sinks (pagedrun/attention/backend.py's `sinks`) on every CPU path: the
torch reference (gather + explicit scores for decodes, explicit prefill scores in row chunks), the C++
kernels (decode, varlen: read alone and tiled; the AMX path where the CPU has it) and the quantized
caches, against the float64 oracle of tests/attention_reference.py (HF's eager_attention_forward:
the sink concatenated to the scores, softmaxed, dropped).

Each head gets its own sink; the sets below mix ordinary values (about the scores' size, where a
sink left out or added twice moves the output by O(0.1)) with one that dominates every score (the
output all but vanishes; 100 also overflows a float32 exp(sink - max score) taken naively) and one
far below them (no effect). The CUDA kernels' cases are in tests/attention/cuda/test_kernels_sinks.py.
"""
from __future__ import annotations

import pytest
import torch
from attention_reference import assert_matches_reference, reference_attention
from test_cpu_attention import Case, kern  # noqa: F401  (the fixture)

PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="kernel")]
GQA = [(4, 4), (4, 2), (8, 1)]


def make_sinks(heads: int, seed: int, dominant: float = 100.0) -> torch.Tensor:
    """float32 [heads]: random sinks about the scores' size, one `dominant`, one at -40."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(heads, generator=gen) * 1.5 + 0.5
    sinks[seed % heads] = dominant
    if heads > 1:
        sinks[(seed + 1) % heads] = -40.0
    return sinks


def _use(request, use_cpu_kernel):
    if use_cpu_kernel:
        request.getfixturevalue("kern")


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_sinks(request, use_cpu_kernel, block_size, heads, kv_heads):
    """Decodes at and around block boundaries (1 key, a block, a block + 1, many blocks)."""
    _use(request, use_cpu_kernel)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 97]
    case = Case([(n - 1, 1) for n in lens], block_size, heads, kv_heads, 64, seed=block_size + heads,
                sinks=make_sinks(heads, block_size))
    case.check(use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("window", [0, 13])
def test_varlen_sinks_mixed_batch(request, use_cpu_kernel, block_size, heads, kv_heads, window):
    """Fresh prefills (tiled rows), cached prefixes, chunks straddling the window's edge, decodes and
    padding tokens in one step; with a window, the blocks below it are NaN placeholders."""
    _use(request, use_cpu_kernel)
    seqs = [(0, 70), (0, 2), (37, 1), (2 * block_size + 3, 21), (11, 4), (5 * block_size, 40), (0, 1)]
    case = Case(seqs, block_size, heads, kv_heads, 64, seed=heads + window, window=window, num_pad_tokens=2,
                sinks=make_sinks(heads, block_size + window))
    if window:
        assert case.placeholders() > 0
    case.check(use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("window", [0, 1, 7, 64])
@pytest.mark.parametrize("softcap", [0.0, 2.5, 30.0])
def test_sinks_with_softcap_and_window(request, use_cpu_kernel, window, softcap):
    """The sink joins the capped scores (it is not capped itself), window 1 included (one key and the sink)."""
    _use(request, use_cpu_kernel)
    seqs = [(0, 70), (33, 1), (20, 9), (0, 1), (90, 30)]
    case = Case(seqs, 16, 8, 2, 64, seed=window + int(softcap), window=window, softcap=softcap,
                sinks=make_sinks(8, window + 3, dominant=4.0))
    case.placeholders()
    case.check(use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("decode", [True, False])
def test_sinks_bite(request, use_cpu_kernel, decode):
    """The output with sinks is the oracle's with them and far from the oracle's without them (and the
    reverse): a path that drops the sink, or adds it twice, fails one of the two checks."""
    _use(request, use_cpu_kernel)
    seqs = [(40, 1), (5, 1)] if decode else [(0, 30), (19, 6)]
    sinks = torch.tensor([1.0, 2.5, -0.5, 0.0])  # the scores' size: every head moves
    case = Case(seqs, 8, 4, 2, 64, seed=7, sinks=sinks)
    with_sinks = case.check(use_cpu_kernel=use_cpu_kernel)
    ref_without = reference_attention(case.queries, case.keys, case.values, case.context_lens, case.scale)
    twice = torch.log(2 * sinks.double().exp())  # the sink's term counted twice
    ref_twice = reference_attention(case.queries, case.keys, case.values, case.context_lens, case.scale,
                                    sinks=twice)
    n0 = ref_without[0].shape[0]
    for refs in (ref_without, ref_twice):
        assert (with_sinks[:n0].double() - refs[0]).abs().max() > 1e-2
    case.sinks = None
    without = case.check(use_cpu_kernel=use_cpu_kernel)
    assert (with_sinks - without).abs().max() > 1e-2


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_dominant_sink_gives_near_zero_rows(request, use_cpu_kernel):
    """A sink far above every score takes nearly all of the weight, with no overflow into inf or NaN."""
    _use(request, use_cpu_kernel)
    sinks = torch.tensor([200.0, 80.0, 1e30, 100.0])
    case = Case([(0, 20), (50, 1), (9, 4)], 8, 4, 2, 64, seed=2, sinks=sinks)
    out = case.check(use_cpu_kernel=use_cpu_kernel)
    assert out.abs().max() < 1e-20


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_minus_inf_sink_is_no_sink(request, use_cpu_kernel):
    _use(request, use_cpu_kernel)
    seqs = [(0, 20), (50, 1), (9, 4)]
    plain = Case(seqs, 8, 4, 2, 64, seed=3).check(use_cpu_kernel=use_cpu_kernel)
    off = Case(seqs, 8, 4, 2, 64, seed=3, sinks=torch.full((4,), float("-inf"))).check(use_cpu_kernel=use_cpu_kernel)
    torch.testing.assert_close(off, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_sinks(request, use_cpu_kernel, dtype, atol):
    """bf16 / fp16 models keep float32 sinks; bf16 prefill takes the AMX tiles where the CPU has them."""
    _use(request, use_cpu_kernel)
    if use_cpu_kernel and dtype not in request.getfixturevalue("kern").dtypes:
        pytest.skip(f"{dtype} not supported by this build")
    seqs = [(0, 40), (17, 1), (25, 9), (60, 1), (0, 3)]
    case = Case(seqs, 16, 8, 2, 64, seed=9, dtype=dtype, window=12, softcap=20.0, num_pad_tokens=1,
                sinks=make_sinks(8, 5))
    case.placeholders()
    case.check(atol=atol, use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("amx", [0, 1])
def test_bf16_prefill_tiles_and_fma_with_sinks(kern, amx):
    """The bf16 prefill on AMX tiles (where the CPU has them; else both runs are the FMA path) and on FMAs."""
    before = kern.amx()
    kern.amx(amx)
    try:
        seqs = [(0, 64), (20, 33), (0, 17)]
        case = Case(seqs, 16, 8, 2, 64, seed=amx, dtype=torch.bfloat16, sinks=make_sinks(8, 11, dominant=6.0))
        case.check(atol=3e-2)
    finally:
        kern.amx(int(before))


def test_kernel_threads_give_identical_results_with_sinks(kern):
    case = Case([(0, 60), (50, 1), (20, 19), (7, 1)], 16, 8, 2, 64, seed=13, window=11, sinks=make_sinks(8, 1))
    case.placeholders()
    case.run()  # writes this step's K/V
    outs = []
    for threads in (1, 2):
        out = torch.empty_like(case.query)
        m = case.meta
        assert kern.varlen(out, case.query, case.key_cache, case.value_cache, m.block_tables, m.query_start_loc,
                           m.seq_lens, m.context_lens, case.scale, threads, window=11, sinks=case.sinks) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_kernel_refuses_bad_sinks(kern):
    case = Case([(9, 1), (3, 4)], 8, 4, 2, 64, seed=3)
    case.run()
    m, out = case.meta, torch.full_like(case.query, 7.0)
    args = (out, case.query, case.key_cache, case.value_cache, m.block_tables, m.query_start_loc, m.seq_lens,
            m.context_lens, case.scale, 1)
    for bad in (float("nan"), float("inf")):
        sinks = torch.zeros(4)
        sinks[2] = bad
        assert kern.varlen(*args, sinks=sinks) < 0, bad
        assert kern.decode(out[:1], case.query[:1], case.key_cache, case.value_cache, m.block_tables[:1],
                           m.seq_lens[:1], case.scale, 1, sinks=sinks) < 0, bad
    assert torch.equal(out, torch.full_like(out, 7.0)), "a refused call must write nothing"
    with pytest.raises(ValueError, match="sinks has 3 entries"):
        kern.varlen(*args, sinks=torch.zeros(3))


def test_sinks_of_another_dtype_are_read_as_float32(kern):
    """A bf16 or strided sinks tensor is converted (the kernels read contiguous float32)."""
    sinks = make_sinks(8, 4, dominant=3.0)
    case = Case([(0, 20), (31, 1)], 8, 8, 2, 64, seed=4, sinks=sinks.to(torch.bfloat16))
    out = case.run()
    assert_matches_reference(out, case.queries, case.keys, case.values, case.context_lens, case.scale, 2e-5,
                             sinks=sinks.to(torch.bfloat16).float())
    case.sinks = torch.stack([sinks, sinks], dim=1)[:, 0]  # a strided view
    assert not case.sinks.is_contiguous()
    case.check()


@pytest.mark.parametrize("window", [0, 9])
def test_torch_sinks_prefill_in_row_chunks(monkeypatch, window):
    """Explicit scores (sinks alone force them) go in chunks of query rows: down to one row a chunk,
    the result is the oracle's."""
    from pagedrun.attention import sdpa_prefill

    monkeypatch.setattr(sdpa_prefill, "SCORE_ELEMS", 1)
    case = Case([(0, 30), (21, 17), (3, 12), (40, 1)], 8, 4, 2, 64, seed=window, window=window,
                sinks=make_sinks(4, window))
    case.placeholders()
    case.check(use_cpu_kernel=False)


@pytest.mark.parametrize("limit", [48, 1 << 20])
def test_torch_decode_in_chunks_with_sinks(monkeypatch, limit):
    from pagedrun.attention import torch_backend as TB

    monkeypatch.setattr(TB, "DECODE_GATHER_TOKENS", limit)
    lens = [5, 40, 17, 1, 33, 64, 9, 120]
    case = Case([(n - 1, 1) for n in lens], 8, 8, 2, 64, seed=limit, window=10, sinks=make_sinks(8, 2))
    case.placeholders()
    case.check(use_cpu_kernel=False)


# ---------------------------------------------------------------- quantized caches


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("window", [0, 11])
def test_quantized_cache_with_sinks(request, fmt, use_cpu_kernel, window):
    """The quantized-KV paths (the kernel widening rows, torch dequantizing the blocks read) take the
    sinks like the plain ones: against the oracle over the dequantized sequences."""
    from test_kv_quant import _quantized_case

    from pagedrun.attention.torch_backend import TorchAttentionBackend

    _use(request, use_cpu_kernel)
    seqs = [(0, 40), (35, 1), (50, 9), (3, 1), (2 * 11, 12)]
    sinks = make_sinks(4, len(fmt) + window)
    case = Case(seqs, 8, 4, 2, 64, seed=len(fmt) + window, window=window, sinks=sinks)
    case.placeholders()
    kq, vq, ks, vs, keys, values = _quantized_case(case, fmt)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel, kv_cache_dtype=fmt)
    out = backend.forward(case.query, case.key, case.value, kq, vq, case.meta, case.scale, ks, vs, window=window,
                          sinks=sinks)
    assert backend.last_path == ("cpu_kernel" if use_cpu_kernel else "torch"), backend.cpu_kernel_error
    assert_matches_reference(out, case.queries, keys, values, case.context_lens, case.scale, 2e-5, window,
                             sinks=sinks)
