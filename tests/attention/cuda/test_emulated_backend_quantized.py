"""The emulated backend (the CuPy backend's host code and kernels, run on the CPU) with a quantized KV
cache (issue 18): a mixed step of prefills over cached prefixes and decodes, against float64
attention over the dequantized K/V; the new tokens' cache rows bit-equal to the float32 reference
quantizer; prefill forced through the kernels; copy-on-write moving int8 scales."""
from __future__ import annotations

import numpy as np
import pytest
import test_kernels as T  # noqa: E402
import test_kernels_quantized as Q  # noqa: E402
import torch

from pagedrun.attention.cuda import kernels as K  # noqa: E402
from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend  # noqa: E402

# (model dtype, head, block, heads, kv heads, step): prefill, prefix + prefill, decodes (v1 rows)
CASES = [
    ("float32", 64, 16, 4, 2, T.StepSpec([0, 40, 7, 0], [5, 3, 1, 1])),
    ("float16", 64, 16, 9, 3, T.StepSpec([16, 0, 33], [4, 6, 1])),
]


def quantize_tensor(x: torch.Tensor, kv: str, fp8_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = Q.quantize(x.double().numpy(), kv, fp8_scale)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def dequantize_tensor(x: torch.Tensor, kv: str, fp8_scale: float) -> torch.Tensor:
    codes, scales = Q.quantize(x.double().numpy(), kv, fp8_scale)
    return torch.from_numpy(Q.dequantize(codes, kv, scales))


@pytest.fixture(scope="module")
def kernels():
    T.emulator_or_skip()
    # the variants the backend asks for: K.group_for's group (the grouped 1-byte kernels), and one
    # head per block where it has seen no query
    variants = {K.KernelVariant(d, D, bs, kv, g) for kv in K.QUANTIZED_KV_DTYPES for d, D, bs, h, kvh, _ in CASES
                for g in (1, K.group_for(h, kvh, kv))}
    built = K.build_kernels(K.emulator_module_factory(), sorted(variants, key=str), np)
    return lambda v: built[v]


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
@pytest.mark.parametrize("kv", K.QUANTIZED_KV_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-h{c[1]}" for c in CASES])
@pytest.mark.slow
def test_mixed_step_equals_dequantized_reference(kernels, case, kv, prefill):
    dtype_name, D, bs, H, KVH, spec = case
    dtype = getattr(torch, dtype_name)
    query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, dtype, D, bs, H, KVH, seed=D + len(kv))
    kq, ks = quantize_tensor(kc, kv, Q.FP8_SCALE[0])  # the cached prefixes (NaN slots: NaN codes / scales)
    vq, vs = quantize_tensor(vc, kv, Q.FP8_SCALE[1])
    backend = EmulatedAttentionBackend(kernels=kernels, kv_cache_dtype="fp8" if kv == "fp8_e4m3" else kv,
                                       prefill=prefill)  # a quantized cache always prefills through the kernels
    scale = D**-0.5
    k_scale = float(ks[0]) if kv != "int8" else ks  # fp8 scales as a Python float, int8 as the tensor
    out = backend.forward(query, key, value, kq, vq, meta, scale, k_scale=k_scale, v_scale=vs)
    n = sum(spec.query_lens)
    ref = T.causal_reference(query, meta, [dequantize_tensor(k, kv, Q.FP8_SCALE[0]) for k in fk],
                             [dequantize_tensor(v, kv, Q.FP8_SCALE[1]) for v in fv], scale, H, KVH)
    T.assert_close(out[:n].double().numpy(), ref[:n].numpy(), dtype_name, f"{kv} {prefill}")
    assert (out[n:] == 0).all() and backend.last_version == "v1"
    want_k, want_ks = quantize_tensor(key[:n], kv, Q.FP8_SCALE[0])
    slots = meta.slot_mapping[:n]
    assert torch.equal(kq.view(-1, KVH, D)[slots], want_k), "reshape_and_cache bits differ from the reference"
    if kv == "int8":
        assert torch.equal(ks.view(-1, KVH)[slots], want_ks)


def test_scale_errors(kernels):
    spec = T.StepSpec([0], [3])
    query, key, value, kc, vc, meta, _, _ = T.build_step(spec, torch.float32, 64, 16, 4, 2, seed=1)
    kq, _ = quantize_tensor(kc, "int8", 1.0)
    backend = EmulatedAttentionBackend(kernels=kernels, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="needs k_scale"):
        backend.forward(query, key, value, kq, kq.clone(), meta, 0.125)
    with pytest.raises(ValueError, match="stored as int8"):
        backend.forward(query, key, value, kc, vc, meta, 0.125, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        EmulatedAttentionBackend(kv_cache_dtype="int4")


