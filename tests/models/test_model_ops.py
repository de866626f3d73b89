"""The model's CPU ops (kernels/cpu/model_ops_cpu.cpp through pagedrun.models.ops) against float64
references and against their torch fallback, on random data (never zeros).

Greedy equality with HF through the whole model is tests/models/test_models.py and tests/engine/test_engine.py;
these tests pin each op down on its own: odd shapes (N not a multiple of the 16/32-column panel, K not a
multiple of 8 or over one panel slice, 1-7 rows and more than one L2 chunk of rows), strided rows,
bias, the in-place residual contract, the fallbacks.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cpu_libraries import load_or_skip

from pagedrun.models import ops, packed_gemm


@pytest.fixture(scope="module")
def kern():
    return load_or_skip(ops.load, ops.load_error, "CPU model ops")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bf16_vector_paths() -> list[int]:
    """The bf16 GEMM's vector paths this build has: widened FMAs (0) and, with avx512_bf16,
    vdpbf16ps (1). The library picks one by timing them; tests run each (_bf16_path)."""
    from pagedrun.build import cpu as cpu_build

    return [0, 1] if "-mavx512bf16" in cpu_build.machine_flags() else [0]


@contextlib.contextmanager
def _bf16_path(kern, dot: int):
    """bf16 GEMMs off the AMX tiles, on the vector path `dot` (see _bf16_vector_paths)."""
    amx, before = kern.lib.packed_gemm_amx(-1), kern.lib.packed_gemm_bf16_dot(-1)
    try:
        kern.lib.packed_gemm_amx(0)
        assert kern.lib.packed_gemm_bf16_dot(dot) == dot
        yield
    finally:
        kern.lib.packed_gemm_bf16_dot(before)
        kern.lib.packed_gemm_amx(amx)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 300])
@pytest.mark.parametrize("n,k", [(1024, 512), (13, 77), (40, 1100), (960, 576), (4000, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_packed_matches_float64(kern, m, n, k, with_bias):
    """Packed weights: N not a multiple of the panel (padding), K over one 512-row slice (partial sums
    continued through the output), M over one L2 chunk of rows (300 x 1100 floats), 1-6 row tiles."""
    g = _gen(m * 7 + n * 3 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if with_bias else None
    packed = packed_gemm.pack_weight(w)
    assert packed.shape == (-(-n // kern.panel), k, kern.panel)
    assert torch.equal(packed_gemm.unpack_weight(packed, n), w)
    got = packed_gemm.linear_packed(x, packed, b, n)
    assert got.shape == (m, n) and got.dtype == torch.float32
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert (got.double() - want).abs().max().item() < 4e-6 * k**0.5


def test_linear_packed_strided_rows_threads_and_fallback(kern):
    g = _gen(3)
    big = torch.randn(70, 700, generator=g)
    x = big[:, 100:612]  # rows 700 floats apart, read in place
    w, b = torch.randn(301, 512, generator=g), torch.randn(301, generator=g)
    packed = packed_gemm.pack_weight(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(packed_gemm.linear_packed(x, packed, b, 301))
    finally:
        torch.set_num_threads(before)
    # One sum over k in order per output, whoever computes it: bit-identical across thread counts.
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert (outs[0].double() - (x.double() @ w.double().T + b.double())).abs().max().item() < 1e-4
    # Kernels switched off after packing: torch on the unpacked weight, exactly F.linear.
    with ops.torch_only():
        assert torch.equal(packed_gemm.linear_packed(x, packed, b, 301), F.linear(x, w, b))
        assert packed_gemm.pack_weight(w) is None
    assert packed_gemm.linear_packed(x[:0], packed, b, 301).shape == (0, 301)


@pytest.mark.slow


def test_linear_packed_is_bit_identical_at_every_vector_width(kern):
    """The GEMM is width-generic (16 floats with AVX-512, 8 otherwise): each lane sums one output
    column over k in order, so the 8-wide build (forced with PR_GEMM_VEC8) gives the same bits as the
    build this machine loads, whatever that is. On an AVX2-only machine both are the 8-wide kernel."""
    from pagedrun.build import cpu as cpu_build

    narrow = ops.CpuModelOps(cpu_build.build(ops.SOURCE, ("-ffp-contract=off", "-DPR_GEMM_VEC8")))
    assert narrow.panel == 16 and kern.panel in (16, 32)
    g = _gen(11)
    for m, n, k in [(1, 1000, 577), (13, 96, 1100), (64, 333, 64)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
        outs = []
        for lib in (kern, narrow):
            panels = -(-n // lib.panel)
            packed = F.pad(w, (0, 0, 0, panels * lib.panel - n)).view(panels, lib.panel, k).transpose(1, 2).contiguous()
            out = torch.empty(m, n)
            assert lib.lib.linear_packed_f32(x.data_ptr(), packed.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k,
                                             k, n, 2) == 0
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert (outs[0].double() - (x.double() @ w.double().T + b.double())).abs().max().item() < 4e-6 * k**0.5


@pytest.mark.parametrize("m,n,k", [(1, 1000, 576), (13, 96, 1100), (64, 333, 64), (300, 40, 512)])
def test_linear_packed_bf16_matches_float64_and_every_width(kern, m, n, k):
    """bf16 weights packed in k pairs: fp32 sums of exact bf16 products, rounded once to bf16. The
    vdpbf16ps path (avx512_bf16) and the widened-FMA path (every CPU; the 8-wide build here too)
    add each pair's products in the same order, so they give the same bits, and each output is
    within one bf16 rounding (plus fp32 summation error) of the float64 product."""
    from pagedrun.build import cpu as cpu_build

    g = _gen(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = packed_gemm.pack_weight(w)
    assert packed.shape == (-(-n // kern.panel), k // 2, kern.panel, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(packed_gemm.unpack_weight(packed, n), w)
    outs = []
    for dot in _bf16_vector_paths():  # off the AMX tiles, which sum in their own order (below)
        with _bf16_path(kern, dot):
            outs.append(packed_gemm.linear_packed(x, packed, b, n))
    got = outs[0]
    assert all(torch.equal(o, got) for o in outs)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = x.double() @ w.double().T + b.double()
    # half an ulp of bf16 (2^-8 relative) for the final rounding, plus fp32 summation error
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5 * k**0.5).all()
    narrow = ops.CpuModelOps(cpu_build.build(ops.SOURCE, ("-ffp-contract=off", "-DPR_GEMM_VEC8")))
    assert not narrow.bf16_dot
    panels = -(-n // narrow.panel)
    packed8 = F.pad(w, (0, 0, 0, panels * narrow.panel - n)).view(panels, narrow.panel, k // 2, 2).transpose(1, 2)
    out8 = torch.empty(m, n, dtype=torch.bfloat16)
    assert narrow.lib.linear_packed_bf16(x.data_ptr(), packed8.contiguous().data_ptr(), b.data_ptr(), out8.data_ptr(),
                                         m, n, k, k, n, 2) == 0
    assert torch.equal(out8, got)


def test_bf16_vector_path_choice(kern):
    """The library times its two bf16 vector paths once and keeps one for the process (a row's
    result so never depends on the batch around it); asking it to use vdpbf16ps where the build
    lacks the instruction leaves the widened FMAs."""
    paths = _bf16_vector_paths()
    before = kern.lib.packed_gemm_bf16_dot(-1)
    assert before in paths and kern.bf16_dot == bool(before)
    try:
        assert kern.lib.packed_gemm_bf16_dot(1) == (1 if 1 in paths else 0)
        assert kern.lib.packed_gemm_bf16_dot(0) == 0
    finally:
        kern.lib.packed_gemm_bf16_dot(before)
    assert kern.lib.packed_gemm_bf16_dot(-1) == before


@pytest.mark.parametrize("m,n,k", [(3, 1000, 576), (16, 64, 32), (17, 96, 1536), (64, 333, 64), (300, 40, 512),
                                   (40, 49152 // 64, 576), (700, 40, 1536)])  # the last: 3 chunks of rows
def test_linear_packed_bf16_on_amx_tiles_matches_float64(kern, m, n, k):
    """Where the CPU has AMX (amx_tile + amx_bf16), bf16 GEMMs run on tiles: row counts
    that are not a multiple of 16 (a zero-padded copy), a partial last panel, a bias. Same bound as the
    vector path; the tiles' sums are fp32 in their own order, so no bit equality is asked."""
    if not kern.amx:
        pytest.skip("this CPU (or kernel) has no AMX tiles: the vector path above is the bf16 GEMM")
    g = _gen(7 * m + n + k)
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]  # a row stride of 2k, not k
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    got = packed_gemm.linear_packed(x, packed_gemm.pack_weight(w), b, n)
    want = x.double() @ w.double().T + b.double()
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5 * k**0.5).all()
    # K not a multiple of 32 leaves the tiles for the vector path, which still answers
    x2 = x[:, :k - 2].contiguous()
    w2 = w[:, :k - 2].contiguous()
    got2 = packed_gemm.linear_packed(x2, packed_gemm.pack_weight(w2), None, n)
    want2 = x2.double() @ w2.double().T
    assert ((got2.double() - want2).abs() <= want2.abs() * 2**-8 + 1e-5 * k**0.5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kern, dtype):
    """Batch invariance of the GEMMs: row r's output is the same bits whether the call has 1, 2, 3
    or 40 rows (a request decoded alone gets the tokens it gets in a batch, as far as the linear
    layers go). Every path sums a row over k in one fixed order; on AMX machines the tiles take every
    row count (before, 1-2 rows ran vdpbf16ps, whose sums can differ from the tiles' in the last bit)."""
    g = _gen(11)
    n, k = 96 * kern.panel + 5, 576
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    packed = packed_gemm.pack_weight(w)
    x = torch.randn(40, k, generator=g).to(dtype)
    full = packed_gemm.linear_packed(x, packed, None, n)
    for m in (1, 2, 3, 17):
        part = packed_gemm.linear_packed(x[:m].contiguous(), packed, None, n)
        assert torch.equal(part, full[:m]), f"{m} rows: {(part != full[:m]).sum().item()} elements differ"


def test_bf16_odd_k_and_mixed_dtypes_take_the_torch_path(kern):
    g = _gen(5)
    assert packed_gemm.pack_weight(torch.randn(8, 7, generator=g).bfloat16()) is None  # K odd: no pairs
    w = torch.randn(40, 64, generator=g).bfloat16()
    packed = packed_gemm.pack_weight(w)
    x32 = torch.randn(3, 64, generator=g)
    # float32 activations against bf16 weights: the kernel refuses, torch's F.linear decides
    with pytest.raises(RuntimeError):
        packed_gemm.linear_packed(x32, packed, None, 40)
    x = x32.bfloat16()
    with ops.torch_only():
        assert torch.equal(packed_gemm.linear_packed(x, packed, None, 40), F.linear(x, w))


def test_model_linears_are_packed_after_loading(kern):
    from pagedrun.models.llama import Linear

    g = _gen(4)
    lin = Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(9, 96, generator=g)
    want = F.linear(x, lin.weight, lin.bias)
    lin.process_weights_after_loading()
    assert lin.weight.shape == (-(-40 // kern.panel), 96, kern.panel)
    torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("h", [576, 64, 13])
def test_rms_norm_matches_float64_and_updates_residual_in_place(kern, h):
    g = _gen(h)
    x = torch.randn(37, h, generator=g) * 3
    residual = torch.randn(37, h, generator=g)
    weight = torch.randn(h, generator=g)
    eps = 1e-5
    hsum = x.double() + residual.double()
    want = weight.double() * hsum / torch.sqrt(hsum.pow(2).mean(-1, keepdim=True) + eps)
    before = residual.clone()
    out, res = ops.rms_norm(x, weight, eps, residual)
    assert res is residual  # the kernel writes x + residual into the caller's residual stream
    assert torch.equal(res, x + before)  # one float32 add per element, as torch does it
    assert (out.double() - want).abs().max().item() < 2e-5
    with ops.torch_only():
        out_t, res_t = ops.rms_norm(x, weight, eps, before.clone())
    assert torch.equal(res_t, res)
    torch.testing.assert_close(out, out_t, atol=1e-5, rtol=1e-6)
    alone = ops.rms_norm(x, weight, eps)
    want_alone = weight.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    assert (alone.double() - want_alone).abs().max().item() < 2e-5


def test_rope_is_bit_identical_to_torch(kern):
    g = _gen(3)
    t, heads, kv_heads, hd, max_pos = 29, 8, 4, 64, 300
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, generator=g)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    freqs = torch.arange(max_pos).float()[:, None] * torch.rand(hd // 2, generator=g)[None, :]
    cos, sin = freqs.cos(), freqs.sin()

    def split(buf):
        q, k, _ = buf.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        return q.view(t, heads, hd), k.view(t, kv_heads, hd)

    with ops.torch_only():
        q_ref, k_ref = ops.rope(positions, *split(qkv.clone()), cos, sin)
    buf = qkv.clone()
    q, k = ops.rope(positions, *split(buf), cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    # In place: the rotated q/k live in the projection's output buffer, v untouched.
    assert q.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:, (heads + kv_heads) * hd:], qkv[:, (heads + kv_heads) * hd:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_torch_path_is_hf_bit_for_bit_and_gathers_once_a_step(dtype):
    """The torch path (CUDA, and CPUs without the kernel) against transformers' own
    apply_rotary_pos_emb on random data: the same bits, with rotate_half's sign carried by sin.
    With a memo the step's rows are gathered once: a second layer reuses them, a new positions
    tensor (or an emptied memo: the model empties it at each forward) gathers again."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = _gen(31)
    t, heads, kv_heads, hd, max_pos = 19, 6, 2, 32, 200
    q = torch.randn(t, heads, hd, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, hd, generator=g).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    freqs = torch.arange(max_pos).float()[:, None] * torch.rand(hd // 2, generator=g)[None, :] * 3
    emb = torch.cat((freqs, freqs), dim=-1)[positions]  # HF's cos/sin: [T, hd], in the model dtype
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          emb.cos().to(dtype)[None], emb.sin().to(dtype)[None])
    memo: dict = {}
    with ops.torch_only():
        got_q, got_k = ops.rope(positions, q, k, freqs.cos(), freqs.sin(), memo)
        assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
        rows = memo[dtype]
        ops.rope(positions, q, k, freqs.cos(), freqs.sin(), memo)
        assert memo[dtype] is rows  # the next layer of the step
        memo.clear()
        ops.rope(positions, q, k, freqs.cos(), freqs.sin(), memo)
        assert memo[dtype] is not rows
        rows = memo[dtype]
        ops.rope(positions.clone(), q, k, freqs.cos(), freqs.sin(), memo)
        assert memo[dtype] is not rows


def test_rope_position_outside_the_table_raises_and_writes_nothing(kern):
    q = torch.randn(2, 2, 8)
    k = torch.randn(2, 1, 8)
    cos, sin = torch.rand(4, 4), torch.rand(4, 4)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(IndexError):
        ops.rope(torch.tensor([1, 4]), q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_silu_and_mul_matches_float64_including_extremes(kern):
    g = _gen(4)
    gate_up = torch.randn(45, 2 * 1536, generator=g) * 6
    gate_up[0, :8] = torch.tensor([-100.0, 100.0, 0.0, -88.0, 89.0, -87.5, 88.5, 1e-30])
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate / (1 + torch.exp(-gate)) * up
    got = ops.silu_and_mul(gate_up)
    assert got.shape == (45, 1536)
    rel = ((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel < 1e-6
    with ops.torch_only():
        torch.testing.assert_close(got, ops.silu_and_mul(gate_up), atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 17, 64, 300, 700])  # 700: several row chunks
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_silu_is_the_gemm_then_silu_and_mul(kern, dtype, m, with_bias):
    """The MLP's fused gate/up GEMM + SiLU * up (weights interleaved a panel at a time) gives the bits
    of the two ops it replaces, run on the plain layout: GEMM (same path: AMX tiles at >= 3 bf16
    rows where the CPU has them, the vector kernel otherwise), then silu_and_mul. Checked against
    float64 too, and through the torch fallback with the kernels off."""
    g = _gen(m + 3 * with_bias + (dtype == torch.bfloat16))
    i, k = 2 * kern.panel * 3, 192  # 6 panel pairs of intermediate columns
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * i, k, generator=g) * 2 / k**0.5).to(dtype)
    b = torch.randn(2 * i, generator=g).to(dtype) if with_bias else None
    packed, b_packed = packed_gemm.pack_gate_up(w, b)
    assert packed.shape == packed_gemm.pack_weight(w).shape  # same bytes, rows reordered
    got = packed_gemm.gate_up_silu(x, packed, b_packed, i)
    want = ops.silu_and_mul(packed_gemm.linear_packed(x, packed_gemm.pack_weight(w), b, 2 * i))
    assert got.dtype == dtype and got.shape == (m, i)
    assert torch.equal(got, want)
    h = x.double() @ w.double().T + (0 if b is None else b.double())
    gate, up = h.chunk(2, dim=-1)
    ref = gate / (1 + torch.exp(-gate)) * up
    tol = 2**-6 if dtype == torch.bfloat16 else 1e-5  # bf16: three roundings of 2^-9 each, and the GEMM's
    assert ((got.double() - ref).abs() <= ref.abs() * tol + tol * 2).all()
    with ops.torch_only():
        torch.testing.assert_close(packed_gemm.gate_up_silu(x, packed, b_packed, i), got,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("m", [3, 17, 64, 300])  # 300 rows of k = 576: three row chunks
def test_bf16_gate_up_silu_on_the_vector_paths(kern, m):
    """Off the AMX tiles each thread takes pairs of gate/up panels through its own scratch: the bits
    of the [M, 2I] GEMM then silu_and_mul, on each vector path of this build (FMAs on widened bf16,
    and vdpbf16ps where it has avx512_bf16) and on the 8-wide widening build (PR_GEMM_VEC8), which
    must all agree."""
    from pagedrun.build import cpu as cpu_build

    g = _gen(31 + m)
    i, k = 2 * kern.panel * 3, 576
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * i, k, generator=g) * 2 / k**0.5).bfloat16()
    b = torch.randn(2 * i, generator=g).bfloat16()
    packed, b_packed = packed_gemm.pack_gate_up(w, b)
    outs = []
    for dot in _bf16_vector_paths():
        with _bf16_path(kern, dot):
            got = packed_gemm.gate_up_silu(x, packed, b_packed, i)
            want = ops.silu_and_mul(packed_gemm.linear_packed(x, packed_gemm.pack_weight(w), b, 2 * i))
            assert torch.equal(got, want)
            outs.append(got)
    assert all(torch.equal(o, got) for o in outs)
    narrow = ops.CpuModelOps(cpu_build.build(ops.SOURCE, ("-ffp-contract=off", "-DPR_GEMM_VEC8")))
    p = narrow.panel
    w8, b8 = ops._interleave(w, p), ops._interleave(b, p)  # gate/up panels of 16 columns, interleaved
    packed8 = w8.view(2 * i // p, p, k // 2, 2).transpose(1, 2).contiguous()
    out8 = torch.empty(m, i, dtype=torch.bfloat16)
    assert narrow.op("linear_packed_silu", torch.bfloat16)(
        x.data_ptr(), packed8.data_ptr(), b8.data_ptr(), out8.data_ptr(), m, i, k, k, i, 2) == 0
    assert torch.equal(out8, got)


def test_gate_up_not_a_multiple_of_the_panel_stays_plain(kern):
    w = torch.randn(2 * (kern.panel + 1), 64)
    assert packed_gemm.pack_gate_up(w, None) is None


def test_other_dtypes_and_layouts_take_the_torch_path(kern):
    g = _gen(5)
    w = torch.randn(8, 64, generator=g)
    assert packed_gemm.pack_weight(w.half()) is None and packed_gemm.pack_weight(w[:, None]) is None
    x32 = torch.randn(4, 8, 64, generator=g).transpose(0, 1)  # 3-D, heads not contiguous per token
    wn = torch.randn(64, generator=g)
    with ops.torch_only():
        want = ops.rms_norm(x32, wn, 1e-6)
    assert torch.equal(ops.rms_norm(x32, wn, 1e-6), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_rms_norm_of_q_and_k_in_the_qkv_buffer(kern, dtype):
    """Qwen3's q_norm / k_norm: [T, heads, hd] views into the qkv projection's output (token rows
    qkv-wide apart), every head normalised over hd; float64's result within float32 rounding, and in
    bf16 torch's bits (the kernel rounds where torch's bf16 ops do)."""
    g = _gen(6)
    t, heads, kv_heads, hd = 37, 9, 3, 64  # 37 x 9 x 64 > 8K elements: the threaded split runs too
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * hd, generator=g) * 3).to(dtype)
    w = torch.randn(hd, generator=g).to(dtype)
    for x in (qkv[:, : heads * hd].view(t, heads, hd), qkv[:, heads * hd: (heads + kv_heads) * hd].view(t, kv_heads, hd)):
        got = ops.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape and got.is_contiguous()
        with ops.torch_only():
            want = ops.rms_norm(x, w, 1e-6)
        x64 = x.double()
        exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        if dtype == torch.float32:
            assert (got.double() - exact).abs().max().item() < 2e-5
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("h", [576, 64, 13])
def test_bf16_elementwise_ops_are_bit_identical_to_torchs_bf16_ops(kern, h):
    """In bf16 each kernel rounds to bf16 exactly where the torch op it replaces ends (transformers'
    op order), so norm (with the residual), RoPE and SiLU * up give torch's bits; exp may differ
    from torch's by an ulp in fp32, which a bf16 rounding almost never shows (none here)."""
    g = _gen(h)
    x = (torch.randn(37, h, generator=g) * 3).bfloat16()
    r = torch.randn(37, h, generator=g).bfloat16()
    w = torch.randn(h, generator=g).bfloat16()
    with ops.torch_only():
        want, want_h = ops.rms_norm(x, w, 1e-5, r.clone())
        want_plain = ops.rms_norm(x, w, 1e-5)
    got, got_h = ops.rms_norm(x, w, 1e-5, r.clone())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got_h, want_h) and torch.equal(got, want) and torch.equal(ops.rms_norm(x, w, 1e-5), want_plain)
    hd = 64
    q = torch.randn(29, 9, hd, generator=g).bfloat16()
    k = torch.randn(29, 3, hd, generator=g).bfloat16()
    pos = torch.randint(0, 100, (29,), generator=g)
    freqs = torch.outer(torch.arange(128).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
    with ops.torch_only():
        wq, wk = ops.rope(pos, q.clone(), k.clone(), freqs.cos(), freqs.sin())
    gq, gk = ops.rope(pos, q.clone(), k.clone(), freqs.cos(), freqs.sin())
    assert torch.equal(gq, wq) and torch.equal(gk, wk)
    gate_up = (torch.randn(31, 2 * h, generator=g) * 4).bfloat16()
    with ops.torch_only():
        want_act = ops.silu_and_mul(gate_up)
    assert torch.equal(ops.silu_and_mul(gate_up), want_act)


def test_disabled_by_env_and_build_failure_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDRUN_CACHE", str(tmp_path))
    ops.load.cache_clear()
    try:
        monkeypatch.setenv("PAGEDRUN_CPU_MODEL_OPS", "0")
        assert ops.load() is None and "PAGEDRUN_CPU_MODEL_OPS" in ops.load_error()
        assert packed_gemm.pack_weight(torch.randn(5, 16)) is None  # weights stay as loaded: torch's F.linear
        monkeypatch.setenv("PAGEDRUN_CPU_MODEL_OPS", "1")
        monkeypatch.setenv("PAGEDRUN_CXX", str(tmp_path / "no-such-compiler"))
        ops.load.cache_clear()
        assert ops.load() is None and "no-such-compiler" in ops.load_error()
    finally:
        ops.load.cache_clear()


def test_packed_embedding_table_looks_up_the_same_rows(kern):
    from pagedrun.models.llama import VocabEmbedding

    g = _gen(6)
    emb = VocabEmbedding(37, 24)  # 37 rows: the last panel is padded
    with torch.no_grad():
        emb.weight.copy_(torch.randn(37, 24, generator=g))
    ids = torch.tensor([0, 36, 15, 16, 5, 36, 31])
    want = emb(ids)
    table = emb.weight.data
    emb.weight.data = packed_gemm.pack_weight(table)
    assert emb.weight.shape == (-(-37 // kern.panel), 24, kern.panel)
    assert torch.equal(emb(ids), want)
    # As the tied LM head: the same product as the unpacked table.
    h = torch.randn(5, 24, generator=g)
    got = packed_gemm.linear_packed(h, emb.weight, None, 37)
    torch.testing.assert_close(got, F.linear(h, table), atol=1e-5, rtol=0)


def test_bf16_rounding_of_denormals_is_torchs(kern):
    """Where the CPU has avx512_bf16, bf16 rounding is one vcvtneps2bf16, which reads fp32 denormals
    as zero; vectors holding one take the integer route (simd.h bf16_v). Tiny activations (most of
    these results are denormal) must still give torch's bits: RoPE and SiLU * up."""
    g = _gen(99)
    hd = 64
    q = (torch.randn(29, 9, hd, generator=g) * 1e-38).bfloat16()
    k = (torch.randn(29, 3, hd, generator=g) * 3e-39).bfloat16()
    q[0, 0, :8] = torch.tensor([1e-40, -1e-40, 5e-39, 1.1e-38, 1.2e-38, 0.0, -0.0, 9e-41]).bfloat16()
    pos = torch.randint(0, 100, (29,), generator=g)
    freqs = torch.outer(torch.arange(128).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
    with ops.torch_only():
        wq, wk = ops.rope(pos, q.clone(), k.clone(), freqs.cos(), freqs.sin())
    gq, gk = ops.rope(pos, q.clone(), k.clone(), freqs.cos(), freqs.sin())
    assert (wq.float().abs() < 2**-126).float().mean() > 0.3  # the case is really about denormals
    assert torch.equal(gq.view(torch.int16), wq.view(torch.int16)) and torch.equal(gk.view(torch.int16),
                                                                                    wk.view(torch.int16))
    gate_up = (torch.randn(31, 2 * 576, generator=g) * 4).bfloat16()
    gate_up[:, :20] = (torch.randn(31, 20, generator=g) * 1e-38).bfloat16()
    gate_up[:, 576:600] = (torch.randn(31, 24, generator=g) * 1e-30).bfloat16()
    with ops.torch_only():
        want = ops.silu_and_mul(gate_up)
    assert (want.float().abs() < 2**-126).sum() > 100
    assert torch.equal(ops.silu_and_mul(gate_up).view(torch.int16), want.view(torch.int16))
