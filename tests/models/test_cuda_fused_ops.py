"""The fused CUDA ops (kernels/cuda/fused_ops.cu through pagedrun.models.cuda_ops) run by the CUDA
emulator on CPU tensors, against ops.py's torch path (what a GPU ran before) and a float64 reference.

Random data, every dtype, and the edges: a hidden size that is not a multiple of the block, over
1,024 (threads loop), one row, strided rows (views into a wider buffer, as the model hands them over),
partial rotary, positions 0 and max_pos - 1, slot -1. RoPE and the residual add are elementwise in
both paths, so they must match torch's bits; the norm's variance is a reduction in another order, and
the activations call libm's exp / tanh where torch CPU calls its own, so those allow one rounding.
The planted bugs (MUTATIONS) show the checks catch a wrong kernel; NVRTC compiles every variant.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re

import numpy as np
import pytest
import torch
from cuda_required import nvrtc_includes_or_skip

from pagedrun.models import cuda_ops as C
from pagedrun.models import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding of the dtype, relative (plus a little for float32's reduction order).
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _emulator_or_skip():
    try:
        import pagedrun.build.cudaemu  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"CUDA emulator unavailable: {e}")


@pytest.fixture(scope="module")
def fused():
    _emulator_or_skip()
    return C.emulated()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """|got - want| <= rel * (|want| + mean |want|): relative, with a floor for entries near zero."""
    g, w = got.double(), want.double()
    bound = rel * (w.abs() + w.abs().mean())
    bad = ((g - w).abs() > bound) | ~torch.isfinite(g)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off, max err {float((g - w).abs().max()):.3g}"


def _mostly_equal(got: torch.Tensor, want: torch.Tensor, share: float, what: str) -> None:
    same = float((got == want).double().mean())
    assert same >= share, f"{what}: only {same:.1%} of the elements are torch's bits"


# ---------------------------------------------------------------- RMSNorm


def _rms_ref64(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 100), (3, 1100), (2, 1)])
def test_rms_norm_with_residual(fused, dtype, rows, hidden):
    """h = x + residual in residual's memory (torch's add, bit for bit), out = norm(h); x is a
    strided view (its rows are wider than hidden), as the attention output never is but a split is."""
    eps = 1e-6
    x = _randn(rows, hidden + 7, dtype=dtype, seed=1)[:, :hidden]
    residual = _randn(rows, hidden, dtype=dtype, seed=2, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=3)
    with ops.torch_only():
        want, want_h = ops.rms_norm(x, w, eps, residual.clone())
    r = residual.clone()
    out, h = fused.rms_norm(x, w, eps, r)
    assert h is r and out.shape == (rows, hidden) and out.dtype == dtype
    assert torch.equal(h, want_h), "the residual add is torch's elementwise add: same bits"
    _close(out, want, 2 * ULP[dtype], "vs torch path")
    _close(out, _rms_ref64(want_h, w, eps), 4 * ULP[dtype], "vs float64")
    if dtype is not torch.float32 and rows * hidden >= 64:
        _mostly_equal(out, want, 0.95, "rms_norm")


@pytest.mark.parametrize("hidden", [100, 1100])
def test_rms_norm_same_bits_under_the_greedy_schedule(fused, hidden):
    """The block reduction's shared partials: warp 0 run ahead of the others (greedy) must give the
    lockstep schedule's bits (a missing barrier would read a poisoned, NaN, partial)."""
    greedy = C.emulated("greedy")
    x, r, w = _randn(3, hidden, seed=9), _randn(3, hidden, seed=10), _randn(hidden, seed=11)
    a, ra = fused.rms_norm(x, w, 1e-6, r.clone())
    b, rb = greedy.rms_norm(x, w, 1e-6, r.clone())
    assert torch.equal(a, b) and torch.equal(ra, rb) and torch.isfinite(a).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_plain_and_gemma_weight(fused, dtype):
    eps = 1e-5
    x = _randn(4, 300, dtype=dtype, seed=4, scale=2.0)
    weights = [_randn(300, dtype=dtype, seed=5)]
    if dtype is not torch.float32:
        weights.append(_randn(300, seed=6) + 1.0)  # Gemma: 1 + w in float32, the product rounded once
    for w in weights:
        with ops.torch_only():
            want = ops.rms_norm(x, w, eps)
        out = fused.rms_norm(x, w, eps)
        _close(out, want, 2 * ULP[dtype], f"weight {w.dtype}")
        _close(out, _rms_ref64(x, w, eps), 3 * ULP[dtype], f"weight {w.dtype} vs float64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head(fused, dtype):
    """Qwen3's q / k norms: [T, heads, hd] views into the qkv projection, each head normalised."""
    t, heads, hd = 3, 4, 64
    qkv = _randn(t, heads * hd + 2 * hd, dtype=dtype, seed=7)
    q = qkv[:, : heads * hd].view(t, heads, hd)
    w = _randn(hd, dtype=dtype, seed=8)
    with ops.torch_only():
        want = ops.rms_norm(q, w, 1e-6)
    out = fused.rms_norm(q, w, 1e-6)
    assert out.shape == (t, heads, hd)
    _close(out, want, 2 * ULP[dtype], "per head")
    _close(out, _rms_ref64(q, w, 1e-6), 3 * ULP[dtype], "per head vs float64")


def test_rms_norm_refuses_what_it_cannot_take(fused):
    x = torch.randn(3, 8)
    assert fused.rms_norm(x.t().contiguous().t(), torch.ones(3), 1e-6) is None  # columns, not rows
    assert fused.rms_norm(x, torch.ones(7), 1e-6) is None
    assert fused.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-6) is None
    r = torch.randn(3, 8, dtype=torch.bfloat16)
    assert fused.rms_norm(x, torch.ones(8), 1e-6, r) is None  # residual of another dtype: untouched
    assert fused.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)


# ---------------------------------------------------------------- RoPE


def _tables(max_pos: int, rot_half: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(rot_half, dtype=torch.float32) / rot_half)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return freqs.cos(), freqs.sin()


def _rope_ref64(x: torch.Tensor, positions, cos, sin) -> torch.Tensor:
    """HF's rotate-half on the first 2 * rot_half dims, in float64."""
    rot_half = cos.shape[1]
    x = x.double().clone()
    c, s = cos[positions].double()[:, None, :], sin[positions].double()[:, None, :]
    lo, hi = x[..., :rot_half].clone(), x[..., rot_half:2 * rot_half].clone()
    x[..., :rot_half] = lo * c - hi * s
    x[..., rot_half:2 * rot_half] = hi * c + lo * s
    return x


def _qkv(t, heads, kv_heads, hd, dtype, seed):
    qkv = _randn(t, (heads + 2 * kv_heads) * hd, dtype=dtype, seed=seed)
    q = qkv[:, : heads * hd].view(t, heads, hd)
    k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(t, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd:].view(t, kv_heads, hd)
    return qkv, q, k, v


ROPE_SHAPES = [  # (tokens, heads, kv_heads, hd, rot_half)
    (5, 4, 2, 64, 32),  # full rotary, GQA
    (3, 3, 1, 80, 16),  # partial rotary (rotary_dim 32 of 80), MQA
    (1, 2, 2, 128, 64),  # one token
    (4, 9, 3, 64, 32),  # SmolLM2-135M's heads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_matches_the_torch_path_bit_for_bit(fused, dtype, shape):
    t, heads, kv_heads, hd, rot_half = shape
    max_pos = 64
    cos, sin = _tables(max_pos, rot_half)
    positions = torch.tensor([0, max_pos - 1, 7, 33, 1][:t], dtype=torch.long)
    _, q, k, v = _qkv(t, heads, kv_heads, hd, dtype, seed=11)
    v_before, q_before = v.clone(), q.clone()
    with ops.torch_only():
        want_q, want_k = ops.rope(positions, q.clone(), k.clone(), cos, sin)
    assert fused.rope(positions, q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k), "RoPE is elementwise: torch's bits"
    assert torch.equal(v, v_before), "v (the rest of the qkv buffer) untouched"
    _close(q, _rope_ref64(q_before, positions, cos, sin), 3 * ULP[dtype], "q vs float64")


def test_rope_out_of_range_position_leaves_the_token(fused):
    """Documented: a position outside the table leaves its token unrotated (torch would raise)."""
    cos, sin = _tables(8, 16)
    _, q, k, _ = _qkv(2, 2, 1, 32, torch.float32, seed=12)
    q0, k0 = q.clone(), k.clone()
    assert fused.rope(torch.tensor([8, 3]), q, k, cos, sin)
    assert torch.equal(q[0], q0[0]) and torch.equal(k[0], k0[0])
    assert not torch.equal(q[1], q0[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_rope_and_cache(fused, dtype, shape):
    """rope, plus k (rotated) and v at their slots in reshape_and_cache's layout [blocks, block_size,
    kv_heads, hd] (row s at element s * kv_heads * hd); slot -1 writes nothing; other slots keep
    their (NaN) contents."""
    t, heads, kv_heads, hd, rot_half = shape
    cos, sin = _tables(64, rot_half)
    positions = torch.tensor([0, 63, 5, 9, 2][:t], dtype=torch.long)
    slots = torch.tensor([5, -1, 17, 2, 30][:t], dtype=torch.long)
    _, q, k, v = _qkv(t, heads, kv_heads, hd, dtype, seed=13)
    key_cache = torch.full((4, 8, kv_heads, hd), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    with ops.torch_only():
        want_q, want_k = ops.rope(positions, q.clone(), k.clone(), cos, sin)
    want_kc, want_vc = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    want_kc.view(-1, kv_heads, hd)[slots[keep]] = want_k[keep]
    want_vc.view(-1, kv_heads, hd)[slots[keep]] = v[keep]
    assert fused.rope_and_cache(positions, q, k, v, cos, sin, key_cache, value_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert _nan_equal(key_cache, want_kc), "key cache"
    assert _nan_equal(value_cache, want_vc), "value cache"


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_rope_and_cache_refuses_a_quantized_cache(fused):
    cos, sin = _tables(8, 16)
    _, q, k, v = _qkv(1, 2, 1, 32, torch.bfloat16, seed=14)
    cache = torch.zeros(2, 4, 1, 32, dtype=torch.uint8)
    assert not fused.rope_and_cache(torch.tensor([1]), q, k, v, cos, sin, cache, cache.clone(), torch.tensor([0]))


# ---------------------------------------------------------------- gated activations


def _act64(name: str, g: torch.Tensor) -> torch.Tensor:
    g = g.double()
    if name == "silu":
        return g / (1 + torch.exp(-g))
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 5), (4, 700), (3, 1500)])
def test_act_and_mul(fused, act, dtype, rows, inter):
    gate_up = _randn(rows, 2 * inter + 6, dtype=dtype, seed=15, scale=3.0)[:, : 2 * inter]  # strided rows
    with ops.torch_only():
        want = ops.silu_and_mul(gate_up) if act == "silu" else ops.gelu_tanh_and_mul(gate_up)
    out = fused.act_and_mul(gate_up, act)
    assert out.shape == (rows, inter) and out.dtype == dtype
    _close(out, want, 2 * ULP[dtype], "vs torch path")
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    _close(out, _act64(act, gate) * up.double(), 3 * ULP[dtype], "vs float64")
    if dtype is not torch.float32 and rows * inter >= 700:
        _mostly_equal(out, want, 0.97, act)


def test_act_and_mul_refuses_an_odd_width(fused):
    assert fused.act_and_mul(torch.randn(2, 7)) is None


def test_launch_count(fused):
    """One launch per op (what issue 36 counts): a layer's norm x2, rope, activation."""
    before = fused.launches
    x, r, w = torch.randn(2, 64), torch.randn(2, 64), torch.randn(64)
    fused.rms_norm(x, w, 1e-6, r)
    cos, sin = _tables(8, 16)
    _, q, k, _ = _qkv(2, 2, 1, 32, torch.float32, seed=16)
    fused.rope(torch.tensor([1, 2]), q, k, cos, sin)
    fused.act_and_mul(torch.randn(2, 64))
    assert fused.launches - before == 3


# ---------------------------------------------------------------- mutations


@functools.lru_cache(maxsize=None)
def _mutations() -> dict[str, tuple[str, str, int]]:
    """id -> (old, new, count in the source): one planted bug per kernel."""
    return {
        "residual_not_stored": ("      r_row[i] = h;  // read back below", "      // read back below", 1),
        "reduction_reads_unwritten_partial": ("lane < num_warps ? red[lane]", "lane <= num_warps ? red[lane]", 1),
        "rope_sign": ("-round_to<scalar_t>(__fmul_rn(hi, s))", "round_to<scalar_t>(__fmul_rn(hi, s))", 1),
        "cache_misses_first_passthrough_dim": ("if (i % head_size >= rot)", "if (i % head_size > rot)", 1),
        "silu_sign": ("expf(-g)", "expf(g)", 1),
    }


CONTROL = "control"  # the unmutated source through the same harness: must pass every check


def _mutated(old: str, new: str, count: int) -> str:
    src = C.source()
    if not old:
        return src
    assert src.count(old) == count, f"mutation site {old!r} found {src.count(old)} times"
    return src.replace(old, new)


class _Prefixed:
    def __init__(self, module, prefix: str):
        self.module, self.prefix = module, prefix

    def get_function(self, name: str):
        return self.module.get_function(f"{self.prefix}::{name}")


@functools.lru_cache(maxsize=1)
def _mutant_module():
    """Every mutant in its own namespace of one emulator module (one g++ run)."""
    from pagedrun.build.cudaemu import EmuModule

    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"]
    names = []
    for mid, (old, new, count) in {CONTROL: ("", "", 0), **_mutations()}.items():
        body = re.sub(r"^#include <[^>]+>\n", "", _mutated(old, new, count), flags=re.M)
        parts.append(f"namespace {mid} {{\n{body}\n}}  // namespace {mid}\n")
        names += [f"{mid}::{n}" for n in C.kernel_names() if n.split("<")[1].startswith("float,")]  # float32 only
    return EmuModule("".join(parts), name_expressions=names, filename="kernels/cuda/fused_ops.cu (mutants)")


def _caught(fused: C.FusedOps, mid: str) -> bool:
    """Runs the float32 checks of the kernel the mutant touches (the control: all of them); True
    when one of them fails."""
    if mid == CONTROL:
        return any(_caught(fused, m) for m in _mutations())
    try:
        if mid in ("residual_not_stored", "reduction_reads_unwritten_partial"):
            test_rms_norm_with_residual(fused, torch.float32, 5, 100)
        elif mid == "rope_sign":
            test_rope_matches_the_torch_path_bit_for_bit(fused, torch.float32, ROPE_SHAPES[0])
        elif mid == "cache_misses_first_passthrough_dim":
            test_rope_and_cache(fused, torch.float32, ROPE_SHAPES[1])
        else:
            test_act_and_mul(fused, "silu", torch.float32, 4, 700)
    except AssertionError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("mid", list(_mutations()))
def test_mutant_is_caught(fused, mid):
    ops_ = C.FusedOps(_Prefixed(_mutant_module(), mid), pointer=lambda t: t)
    assert _caught(ops_, mid), f"planted bug {mid} passed the checks"


@pytest.mark.slow
def test_control_passes(fused):
    assert not _caught(C.FusedOps(_Prefixed(_mutant_module(), CONTROL), pointer=lambda t: t), CONTROL)


def test_mutation_sites_exist():
    for old, new, count in _mutations().values():
        _mutated(old, new, count)


# ---------------------------------------------------------------- NVRTC


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_every_variant(arch):
    """What cupy.RawModule compiles on a GPU: no error, no warning, every name lowered to its own symbol."""
    from pagedrun.build import nvrtc

    includes = nvrtc_includes_or_skip()
    names = C.kernel_names()
    out = nvrtc.compile_program(C.source(), names, arch, includes, filename="fused_ops.cu")
    assert set(out.lowered) == set(names)
    assert len(set(out.lowered.values())) == len(names)
    assert out.cubin[:4] == b"\x7fELF"
    assert "warning" not in out.log.lower(), out.log


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_gate(arch, tmp_path, capsys):
    """nvcc -Werror all-warnings with ptxas' resource report: every variant compiles, none spills,
    the shared memory is the norm's 33 partials."""
    import shutil
    import subprocess

    from pagedrun.attention.cuda import kernels as K

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    src = tmp_path / "fused_instances.cu"
    src.write_text(f'#include "{K.KERNEL_DIR / C.SOURCE}"\nvoid* pagedrun_instances[] = {{\n'
                   + "".join(f"    (void*)&{n},\n" for n in C.kernel_names()) + "};\n")
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v",
           "-o", str(tmp_path / "fused.cubin"), str(src)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    log = run.stdout + run.stderr
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    smem = [int(n) for n in re.findall(r"Used \d+ registers.*?(\d+) bytes smem", log)]
    with capsys.disabled():
        print(f"\nnvcc {arch}: {len(regs)} kernels, registers {min(regs)}-{max(regs)}, smem {sorted(set(smem))}")
    assert len(regs) == len(C.kernel_names()) and len(spills) == len(regs)
    assert not any(spills) and max(regs) <= 64
    assert set(smem) <= {0, 4 * 33}


def test_kernel_names_cover_every_dtype():
    names = C.kernel_names()
    assert len(names) == 17 and len(set(names)) == 17
    assert np.all([any(t in n for n in names) for t in ("float", "__half", "__nv_bfloat16")])


# ---------------------------------------------------------------- launches per decoder layer

# aten ops that launch no kernel on a GPU: views and allocations
_NO_LAUNCH = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "t", "transpose", "unsqueeze",
              "expand", "as_strided", "alias", "detach", "empty", "empty_like", "empty_strided", "lift_fresh"}


class _Counter:
    """The aten ops of a forward that would each be a kernel launch on a GPU."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.ops: list[str] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._overloadpacket.__name__
                if name not in _NO_LAUNCH:
                    counter.ops.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


class _StubBackend:
    """The CuPy backend's launches for a decode step without running attention: reshape_and_cache
    and paged attention v1 (v2 adds its reduce)."""

    launches = 2

    def __init__(self, out: torch.Tensor):
        self.out = out  # made before the count: what the kernels would write

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, *rest, **kw):
        assert q.shape == self.out.shape
        return self.out


def _decoder_layer(dtype: torch.dtype):
    from pagedrun.models.config import ModelConfig
    from pagedrun.models.llama import LlamaDecoderLayer
    from pagedrun.models.rope import RotaryEmbedding

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 160, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "rope_theta": 10000.0,
    }, "c")
    layer = LlamaDecoderLayer(cfg, dtype)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):
            p.copy_(_randn(*p.shape, dtype=dtype, seed=100 + i, scale=0.1))
    return layer, RotaryEmbedding(cfg)


def _count_layer(layer, rotary, fused: C.FusedOps | None = None) -> tuple[list[str], int, torch.Tensor]:
    """(the aten ops that launch, the fused launches, the layer's output) of one decode-step forward."""
    t = 3
    positions = torch.tensor([4, 9, 17])
    dtype = layer.input_layernorm.weight.dtype
    h, residual = _randn(t, 96, dtype=dtype, seed=20), _randn(t, 96, dtype=dtype, seed=21)
    backend = _StubBackend(_randn(t, 6, 16, dtype=dtype, seed=23))
    rotary(positions, *_qkv(t, 6, 2, 16, dtype, seed=22)[1:3])  # the step's rows gathered (first layer)
    counter = _Counter()
    before = fused.launches if fused else 0
    with counter.mode, torch.no_grad():
        out, _ = layer(positions, h, residual, rotary, (None, None), None, backend)
    return counter.ops, (fused.launches - before if fused else 0), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoder_layer_launches_ten_kernels(fused, dtype):
    """Issue 36's count on the CPU: the torch path's aten ops of one Llama decoder layer in a decode
    step (what a GPU launches today, attention counted as the CuPy backend's 2) against the layer
    with ops.py's four elementwise ops each one fused launch (what ops.py dispatches CUDA tensors to)."""
    layer, rotary = _decoder_layer(dtype)
    with ops.torch_only():  # the torch path: what ops.py runs on a GPU without the fused kernels
        torch_ops, _, want = _count_layer(layer, rotary)
    with ops.fused_ops_on_cpu(fused):
        fused_ops, launches, got = _count_layer(layer, rotary, fused)
    torch_total = len(torch_ops) + _StubBackend.launches
    fused_total = len(fused_ops) + launches + _StubBackend.launches
    print(f"\n{dtype} launches per layer: torch path {torch_total} ({torch_ops}), fused {fused_total} ({fused_ops})")
    assert launches == 4  # two norms, rope, silu x up
    assert sorted(fused_ops) == ["mm"] * 4, fused_ops  # qkv, o_proj, gate_up, down
    assert fused_total == 10 and torch_total == (30 if dtype is torch.float32 else 34)
    _close(got, want, 1e-5 if dtype is torch.float32 else 4 * ULP[dtype], "the layer's output, fused vs torch")


# ---------------------------------------------------------------- whole models, the GPU's dispatch


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "granite", "qwen3_moe"])
def test_greedy_tokens_equal_the_torch_path(fused, tiny_model, family, dtype, monkeypatch):
    """A tiny model's greedy tokens over mixed prefill / chunked prefill / decode steps with ops.py
    dispatching to the fused kernels (emulated) as it does CUDA tensors, against the torch path:
    Llama; Qwen3's per-head q / k norms; Gemma 2's float32-weight norms, sandwich norms and GeGLU;
    Phi-3's partial rotary (0.75); Granite's multipliers; Qwen3-MoE's experts."""
    from test_models import paged_greedy

    from pagedrun.models.loader import load_model

    with ops.torch_only():  # loaded without the CPU kernels: plain weights, no C layer runner
        model, config = load_model(tiny_model(family, seed=3), dtype, "cpu")
    assert all(getattr(m, "layer_runner", None) is None for m in model.modules())
    prompts = [[(7 * i + 3 * j) % (config.vocab_size - 2) + 2 for j in range(n)] for i, n in enumerate((9, 4, 1))]
    with ops.torch_only():
        want, want_logits = paged_greedy(model, config, prompts, 6, 8, False)
    launched: set[str] = set()
    launch = fused._launch
    monkeypatch.setattr(fused, "_launch", lambda name, *a: launched.add(name) or launch(name, *a))
    with ops.fused_ops_on_cpu(fused):
        got, got_logits = paged_greedy(model, config, prompts, 6, 8, False)
    t = C.CUDA_TYPES[dtype]
    gemma = family.startswith("gemma")
    expect = {C.rope_name(dtype, False), C.act_name(dtype, "gelu_tanh" if gemma else "silu"),
              C.rms_norm_name(dtype, torch.float32 if gemma else dtype)}
    assert expect <= launched, f"{t}: launched {sorted(launched)}"
    assert got == want
    for g_seq, w_seq in zip(got_logits, want_logits):
        for g, w in zip(g_seq, w_seq):
            _close(g, w, 1e-4 if dtype is torch.float32 else 8 * ULP[dtype], "logits")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefill", ["varlen", "kernel"])
def test_rope_and_cache_through_the_paged_kernels(fused, tmp_path_factory, dtype, prefill, monkeypatch):
    """The model writes each layer's K/V with its RoPE in one launch (LlamaAttention through
    backend.written_slots and ops.rope_and_cache) and the paged kernels only attend: greedy tokens
    equal those of the separate rope + reshape_and_cache launches, on the emulated CUDA kernels,
    over prefill, chunked prefill, static-buffer decode steps with padding, and preemption."""
    from tiny_models import make_tiny_model

    from pagedrun.attention.cuda import kernels as K
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    d = make_tiny_model("llama", tmp_path_factory.mktemp("rc") / "m", seed=5, hidden_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2)  # head 32: a compiled head size
    prompts = [[(7 * i + 3 * j) % 600 + 2 for j in range(n)] for i, n in enumerate((9, 4, 1, 20, 13))]

    def run(fuse: bool):
        llm = LLM(load_recipe(None, [f"model.path={d}", f"model.dtype={dtype}", "model.attention_backend=emulated",
                                     "cache.block_size=8", "cache.num_blocks=5", "scheduler.max_num_seqs=3",
                                     "scheduler.max_num_batched_tokens=16", "sampling.max_tokens=7",
                                     "sampling.ignore_eos=true"]))
        llm.engine.worker.backend.prefill = prefill
        cache_writes = []
        real = K.PagedKernels.reshape_and_cache
        monkeypatch.setattr(K.PagedKernels, "reshape_and_cache",
                            lambda self, *a, **k: cache_writes.append(1) or real(self, *a, **k))
        with ops.fused_ops_on_cpu(fused) if fuse else contextlib.nullcontext():
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
        monkeypatch.setattr(K.PagedKernels, "reshape_and_cache", real)
        return out, len(cache_writes), sum(s.preempted_recompute for s in llm.engine.steps)

    launched: list[str] = []
    launch = fused._launch
    monkeypatch.setattr(fused, "_launch", lambda name, *a: launched.append(name) or launch(name, *a))
    want, writes, _ = run(False)
    assert writes > 0 and not launched
    got, writes, preempted = run(True)
    assert got == want
    assert writes == 0, "the backend wrote the cache although the model did"
    assert launched.count(C.rope_name(getattr(torch, dtype), True)) > 0
    assert C.rope_name(getattr(torch, dtype), False) not in launched  # every layer's rope went with its write
    assert preempted > 0
