"""Sliding-window attention and logit soft-capping (pagedrun/attention/backend.py's window and softcap)
on every CPU path: the torch reference (gather + SDPA, explicit scores under a softcap) and the C++
kernels (decode, varlen, tiled prefill), against the float64 oracle of tests/attention_reference.py.

Every case lays its sequences out in a NaN-filled paged cache (test_cpu_attention.Case); most also
point the table entries wholly below the window of each sequence's first query at a NaN block, as the
hybrid KV manager leaves them: a read of one of them, or of any slot outside the window mixed in with
a zero weight, poisons the output.
"""
from __future__ import annotations

import pytest
import torch
from attention_reference import reference_attention
from test_cpu_attention import Case, kern  # noqa: F401  (the fixture)

PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="kernel")]
GQA = [(4, 4), (4, 2), (8, 1)]


def _use(request, use_cpu_kernel):
    """The kernel fixture where the case runs the C++ kernel (it skips without a compiler)."""
    if use_cpu_kernel:
        request.getfixturevalue("kern")


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_window_boundaries(request, use_cpu_kernel, block_size, heads, kv_heads):
    """Decodes whose sequences hold W - 1, W, W + 1 keys and many more, with W a block multiple and not."""
    _use(request, use_cpu_kernel)
    for window in (block_size, 2 * block_size + 3, 5):
        lens = [window - 1, window, window + 1, 3 * window + 7, 1, 2 * block_size + window]
        case = Case([(n - 1, 1) for n in lens if n > 0], block_size, heads, kv_heads, 64, seed=window + heads,
                    window=window)
        assert case.placeholders() > 0
        case.check(use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_varlen_window_mixed_batch(request, use_cpu_kernel, block_size, heads, kv_heads):
    """Prefill, chunked prefill whose chunk straddles the window's edge, prefix hits and decodes, in one step."""
    _use(request, use_cpu_kernel)
    w = block_size + 5
    seqs = [
        (0, 3 * w + 2),  # fresh prefill much longer than the window
        (0, w - 1), (0, w), (0, w + 1),  # the boundary: the last query sees W - 1, W, W + 1 keys
        (2 * w + 3, w + 9),  # chunk straddling: its first queries' windows start in the prefix
        (w - 2, 4),  # the prefix shorter than the window, the chunk crossing it
        (4 * block_size, 1),  # decode
        (5 * w, 40),  # long prefix, placeholders below
    ]
    case = Case(seqs, block_size, heads, kv_heads, 64, seed=block_size * heads, window=w, num_pad_tokens=2)
    assert case.placeholders() > 0
    case.check(use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("window", [0, 1, 7, 64])
@pytest.mark.parametrize("softcap", [0.0, 2.5, 50.0])
def test_softcap_with_and_without_window(request, use_cpu_kernel, window, softcap):
    _use(request, use_cpu_kernel)
    seqs = [(0, 70), (33, 1), (20, 9), (0, 1), (90, 30)]
    case = Case(seqs, 16, 8, 2, 64, seed=window + int(softcap), window=window, softcap=softcap)
    case.placeholders()
    case.check(use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_softcap_bites(request, use_cpu_kernel):
    """Large logits, capped low: the capped result is far from the uncapped one, and the reference's."""
    _use(request, use_cpu_kernel)
    case = Case([(0, 20), (30, 1), (12, 6)], 8, 4, 2, 64, seed=4, softcap=1.0)
    case.queries = [q * 4 for q in case.queries]
    case.query = case.query * 4
    capped = case.check(use_cpu_kernel=use_cpu_kernel)
    case.softcap = 0.0
    plain = case.check(use_cpu_kernel=use_cpu_kernel)
    assert (capped - plain).abs().max() > 0.1


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_window(request, use_cpu_kernel, dtype, atol):
    _use(request, use_cpu_kernel)
    if use_cpu_kernel and dtype not in request.getfixturevalue("kern").dtypes:
        pytest.skip(f"{dtype} not supported by this build")
    seqs = [(0, 40), (17, 1), (25, 9), (60, 1), (0, 3)]
    case = Case(seqs, 16, 8, 2, 64, seed=9, dtype=dtype, window=12, softcap=20.0, num_pad_tokens=1)
    case.placeholders()
    case.check(atol=atol, use_cpu_kernel=use_cpu_kernel)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("decode", [True, False])
def test_off_by_one_is_caught(request, use_cpu_kernel, decode):
    """The key at position p - W is in window W + 1 and not in window W: the results differ, and the
    oracle tells which window ran. A kernel using <= for < (or the reverse) fails one of the checks."""
    _use(request, use_cpu_kernel)
    w = 9
    seqs = [(w + 2, 1)] if decode else [(w + 2, 3)]
    outs = {}
    for window in (w, w + 1):
        case = Case(seqs, 8, 4, 2, 64, seed=1, window=window)
        outs[window] = case.check(use_cpu_kernel=use_cpu_kernel)
        other = w + (window == w)  # the neighbouring window's oracle must reject this output
        ref = reference_attention(case.queries, case.keys, case.values, case.context_lens, case.scale, other)[0]
        assert (outs[window].double() - ref).abs().max() > 1e-3
    assert (outs[w] - outs[w + 1]).abs().max() > 1e-3


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_window_larger_than_every_sequence_is_full_attention(request, use_cpu_kernel):
    _use(request, use_cpu_kernel)
    seqs = [(0, 30), (20, 1), (7, 5)]
    full = Case(seqs, 8, 4, 2, 64, seed=3).check(use_cpu_kernel=use_cpu_kernel)
    wide = Case(seqs, 8, 4, 2, 64, seed=3, window=31).check(use_cpu_kernel=use_cpu_kernel)
    assert torch.equal(full, wide)


@pytest.mark.parametrize("limit", [48, 1 << 20])
def test_torch_decode_in_chunks_with_window(monkeypatch, limit):
    """The torch path's batched decode, in chunks or not, gathers each sequence's window only (from the
    block holding seq_len - window): the placeholders below it are never in the gather."""
    from pagedrun.attention import torch_backend as TB

    lens = [5, 40, 17, 1, 33, 64, 9, 120]
    case = Case([(n - 1, 1) for n in lens], 8, 8, 2, 64, seed=limit, window=10, softcap=3.0)
    assert case.placeholders() > 0
    gathered, gather = [], TB._gather_decode

    def spy(query, key_cache, value_cache, tables, seq_lens, max_len, scale, **variant):
        out = gather(query, key_cache, value_cache, tables, seq_lens, max_len, scale, **variant)
        ids, _, _ = TB._decode_blocks(tables, seq_lens, max_len, 8, variant["window"])
        gathered.append(ids)
        return out

    monkeypatch.setattr(TB, "DECODE_GATHER_TOKENS", limit)
    monkeypatch.setattr(TB, "_gather_decode", spy)
    case.check(use_cpu_kernel=False)
    assert (len(gathered) > 1) == (limit < 1000)
    assert case.spare[0] not in torch.cat(gathered).tolist()


def test_kernel_threads_give_identical_results_with_window(kern):
    case = Case([(0, 60), (50, 1), (20, 19), (7, 1)], 16, 8, 2, 64, seed=13, window=11, softcap=7.0)
    case.placeholders()
    case.run()  # writes this step's K/V
    outs = []
    for threads in (1, 2):
        out = torch.empty_like(case.query)
        m = case.meta
        assert kern.varlen(out, case.query, case.key_cache, case.value_cache, m.block_tables, m.query_start_loc,
                           m.seq_lens, m.context_lens, case.scale, threads, window=11, softcap=7.0) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_kernel_refuses_a_bad_variant(kern):
    case = Case([(9, 1), (3, 4)], 8, 4, 2, 64, seed=3)
    case.run()
    m, out = case.meta, torch.full_like(case.query, 7.0)
    args = (out, case.query, case.key_cache, case.value_cache, m.block_tables, m.query_start_loc, m.seq_lens,
            m.context_lens, case.scale, 1)
    for variant in ({"window": -1}, {"softcap": -1.0}, {"softcap": float("nan")}, {"softcap": float("inf")}):
        assert kern.varlen(*args, **variant) < 0, variant
        assert kern.decode(out[:1], case.query[:1], case.key_cache, case.value_cache, m.block_tables[:1],
                           m.seq_lens[:1], case.scale, 1, **variant) < 0, variant
    assert torch.equal(out, torch.full_like(out, 7.0)), "a refused call must write nothing"


@pytest.mark.parametrize("window", [0, 9])
def test_torch_softcap_prefill_in_row_chunks(monkeypatch, window):
    """Explicit (soft-capped) scores go in chunks of query rows, each against the keys its rows see:
    down to one row a chunk, the result is the oracle's."""
    from pagedrun.attention import sdpa_prefill

    monkeypatch.setattr(sdpa_prefill, "SCORE_ELEMS", 1)
    case = Case([(0, 30), (21, 17), (3, 12), (40, 1)], 8, 4, 2, 64, seed=window, window=window, softcap=4.0)
    case.placeholders()
    case.check(use_cpu_kernel=False)
