"""The fused CUDA ops (pagedrun.models.cuda_ops) on a real GPU, reached through ops.py's dispatch:
each against ops.py's torch path on the same GPU, against the CPU emulator's output for the same
inputs, on a side stream, and inside a captured CUDA graph (the decode-graphs work replays them).

Skipped without a CUDA build of torch and CuPy. The emulator versions of these checks, with the
edges and the planted bugs, are tests/models/test_cuda_fused_ops.py.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import pytest
import torch
from cuda_required import GPU_ONLY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import test_cuda_fused_ops as T  # noqa: E402  (the emulator tests' helpers)

from pagedrun.models import cuda_ops as C  # noqa: E402
from pagedrun.models import ops  # noqa: E402

pytestmark = GPU_ONLY
DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def fused():
    f = C.for_device(DEV)
    assert f is not None, f"fused ops did not build: {C._failed}"
    return f


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEV)


def _qkv(t, heads, kv_heads, hd, dtype, seed):
    """q, k, v as the model hands them over: views into one qkv projection output on the GPU."""
    qkv = _cuda(T._qkv(t, heads, kv_heads, hd, dtype, seed)[0])
    q = qkv[:, : heads * hd].view(t, heads, hd)
    k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(t, kv_heads, hd)
    return q, k, qkv[:, (heads + kv_heads) * hd:].view(t, kv_heads, hd)


@pytest.mark.parametrize("dtype", T.DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 100), (3, 4100)])
def test_rms_norm_through_ops(fused, dtype, rows, hidden):
    x = _cuda(T._randn(rows, hidden + 5, dtype=dtype, seed=1))[:, :hidden]
    r = _cuda(T._randn(rows, hidden, dtype=dtype, seed=2, scale=3.0))
    w = _cuda(T._randn(hidden, dtype=dtype, seed=3))
    r_before = r.clone()
    with ops.torch_only():
        want, want_h = ops.rms_norm(x, w, 1e-6, r.clone())
    before = fused.launches
    got, h = ops.rms_norm(x, w, 1e-6, r)
    assert fused.launches == before + 1, "ops.rms_norm did not take the fused kernel"
    assert h is r and torch.equal(h, want_h)
    T._close(got.cpu(), want.cpu(), 2 * T.ULP[dtype], "vs torch on the GPU")
    emu_out, emu_h = C.emulated().rms_norm(x.cpu(), w.cpu(), 1e-6, r_before.cpu())
    assert torch.equal(emu_h, h.cpu())
    T._close(got.cpu(), emu_out, 2 * T.ULP[dtype], "vs the emulator")


@pytest.mark.parametrize("dtype", T.DTYPES)
def test_gemma_and_per_head_norms_through_ops(fused, dtype):
    x = _cuda(T._randn(5, 256, dtype=dtype, seed=4))
    weights = [_cuda(T._randn(256, dtype=dtype, seed=5))]
    if dtype is not torch.float32:
        weights.append(_cuda(T._randn(256, seed=6) + 1))
    for w in weights:
        with ops.torch_only():
            want = ops.rms_norm(x, w, 1e-6)
        T._close(ops.rms_norm(x, w, 1e-6).cpu(), want.cpu(), 2 * T.ULP[dtype], f"weight {w.dtype}")
    q = x[:, :192].view(5, 3, 64)
    w = _cuda(T._randn(64, dtype=dtype, seed=7))
    with ops.torch_only():
        want = ops.rms_norm(q, w, 1e-6)
    T._close(ops.rms_norm(q, w, 1e-6).cpu(), want.cpu(), 2 * T.ULP[dtype], "per head")


@pytest.mark.parametrize("dtype", T.DTYPES)
@pytest.mark.parametrize("shape", T.ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_through_ops_is_torch_bit_for_bit(fused, dtype, shape):
    t, heads, kv_heads, hd, rot_half = shape
    cos, sin = (_cuda(c) for c in T._tables(64, rot_half))
    positions = _cuda(torch.tensor([0, 63, 7, 33, 1][:t]))
    q, k, _ = _qkv(t, heads, kv_heads, hd, dtype, seed=11)
    with ops.torch_only():
        want_q, want_k = ops.rope(positions, q.clone(), k.clone(), cos, sin)
    emu_q, emu_k = q.cpu(), k.cpu()
    assert C.emulated().rope(positions.cpu(), emu_q, emu_k, cos.cpu(), sin.cpu())
    before = fused.launches
    got_q, got_k = ops.rope(positions, q, k, cos, sin)
    assert fused.launches == before + 1
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_q.cpu(), emu_q) and torch.equal(got_k.cpu(), emu_k)


@pytest.mark.parametrize("dtype", T.DTYPES)
def test_rope_and_cache(fused, dtype):
    t, heads, kv_heads, hd, rot_half = 5, 4, 2, 80, 16
    cos, sin = (_cuda(c) for c in T._tables(64, rot_half))
    positions = _cuda(torch.tensor([0, 63, 5, 9, 2]))
    slots = _cuda(torch.tensor([5, -1, 17, 2, 30]))
    q, k, v = _qkv(t, heads, kv_heads, hd, dtype, seed=13)
    kc = torch.full((4, 8, kv_heads, hd), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    with ops.torch_only():
        want_q, want_k = ops.rope(positions, q.clone(), k.clone(), cos, sin)
    want_kc, want_vc = kc.clone(), vc.clone()
    keep = slots >= 0
    want_kc.view(-1, kv_heads, hd)[slots[keep]] = want_k[keep]
    want_vc.view(-1, kv_heads, hd)[slots[keep]] = v[keep]
    assert fused.rope_and_cache(positions, q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert T._nan_equal(kc, want_kc) and T._nan_equal(vc, want_vc)


@pytest.mark.parametrize("dtype", T.DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul_through_ops(fused, dtype, act):
    gate_up = _cuda(T._randn(9, 2 * 1536, dtype=dtype, seed=15, scale=3.0))
    with ops.torch_only():
        want = ops.silu_and_mul(gate_up) if act == "silu" else ops.gelu_tanh_and_mul(gate_up)
    before = fused.launches
    got = ops.silu_and_mul(gate_up) if act == "silu" else ops.gelu_tanh_and_mul(gate_up)
    assert fused.launches == before + 1
    T._close(got.cpu(), want.cpu(), 2 * T.ULP[dtype], "vs torch on the GPU")
    T._close(got.cpu(), C.emulated().act_and_mul(gate_up.cpu(), act), 2 * T.ULP[dtype], "vs the emulator")


def _layer_ops(x, r, w, positions, q, k, cos, sin, gate_up):
    out, h = ops.rms_norm(x, w, 1e-6, r)
    ops.rope(positions, q, k, cos, sin)
    return out, h, ops.silu_and_mul(gate_up)


def _inputs(dtype, seed):
    x = _cuda(T._randn(4, 576, dtype=dtype, seed=seed))
    r = _cuda(T._randn(4, 576, dtype=dtype, seed=seed + 1))
    w = _cuda(T._randn(576, dtype=dtype, seed=seed + 2))
    q, k, _ = _qkv(4, 9, 3, 64, dtype, seed=seed + 3)
    gate_up = _cuda(T._randn(4, 2 * 1536, dtype=dtype, seed=seed + 4))
    positions = _cuda(torch.tensor([3, 0, 17, 63]))
    return x, r, w, positions, q.clone(), k.clone(), gate_up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_side_stream_and_cuda_graph_replay(fused, dtype):
    """Launched on torch's current stream (a side stream here), and captured into a CUDA graph whose
    replay on new inputs equals the eager ops: no allocation outside torch, no host sync."""
    cos, sin = (_cuda(c) for c in T._tables(64, 32))
    static = _inputs(dtype, 30)
    fresh = _inputs(dtype, 40)
    eager_in = tuple(t.clone() for t in fresh)
    x, r, w, positions, q, k, gate_up = eager_in
    want = _layer_ops(x, r, w, positions, q, k, cos, sin, gate_up)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        x, r, w, positions, q, k, gate_up = (t.clone() for t in static)
        _layer_ops(x, r, w, positions, q, k, cos, sin, gate_up)  # warm-up on the side stream
    torch.cuda.current_stream(DEV).wait_stream(side)
    x, r, w, positions, q, k, gate_up = static
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer_ops(x, r, w, positions, q, k, cos, sin, gate_up)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize(DEV)
    for got, exp in zip(outs, want):
        assert torch.equal(got, exp)
    assert torch.equal(q, eager_in[4]) and torch.equal(k, eager_in[5])


def test_host_time_per_call(fused, capsys):
    """Prints (asserts nothing on time): host microseconds per op call, fused vs torch path, for a
    decode-sized input on this GPU; the log's table comes from here."""
    dtype = torch.bfloat16
    cos, sin = (_cuda(c) for c in T._tables(2048, 32))
    x, r, w, positions, q, k, gate_up = _inputs(dtype, 50)
    cases = {
        "rms_norm+residual": lambda: ops.rms_norm(x, w, 1e-6, r),
        "rope q,k": lambda: ops.rope(positions, q, k, cos, sin),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
    }
    rows = []
    for name, fn in cases.items():
        timings = []
        for torch_path in (False, True):
            ctx = ops.torch_only() if torch_path else contextlib.nullcontext()
            with ctx:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize(DEV)
                t0 = time.perf_counter()
                for _ in range(500):
                    fn()
                host = (time.perf_counter() - t0) / 500 * 1e6
                torch.cuda.synchronize(DEV)
            timings.append(host)
        rows.append(f"{name:18} fused {timings[0]:6.1f} us  torch {timings[1]:6.1f} us")
    with capsys.disabled():
        print("\n" + "\n".join(rows))


def test_decoder_layer_kernels_on_the_gpu(fused, capsys):
    """The CUDA kernels one bf16 Llama decoder layer launches (attention stubbed out, as in the
    emulator count): the 4 fused ops and the GEMMs, no torch elementwise or reduction kernel."""
    from torch.profiler import ProfilerActivity, profile

    layer, rotary = T._decoder_layer(torch.bfloat16)
    layer, rotary = layer.to(DEV), rotary.to(DEV)
    t = 3
    positions = _cuda(torch.tensor([4, 9, 17]))
    h = _cuda(T._randn(t, 96, dtype=torch.bfloat16, seed=20))
    residual = _cuda(T._randn(t, 96, dtype=torch.bfloat16, seed=21))
    backend = T._StubBackend(_cuda(T._randn(t, 6, 16, dtype=torch.bfloat16, seed=23)))
    with torch.no_grad():
        layer(positions, h.clone(), residual.clone(), rotary, (None, None), None, backend)  # warm-up
        torch.cuda.synchronize(DEV)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(positions, h, residual, rotary, (None, None), None, backend)
            torch.cuda.synchronize(DEV)
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    with capsys.disabled():
        print(f"\n{len(kernels)} kernels (+2 attention): " + ", ".join(k[:60] for k in kernels))
    ours = [k for k in kernels if any(n in k for n in ("rms_norm_kernel", "rope_kernel", "act_and_mul_kernel"))]
    assert len(ours) == 4, kernels
    torch_elementwise = [k for k in kernels if "elementwise" in k or "reduce_kernel" in k or "CatArray" in k]
    assert not torch_elementwise, kernels
