"""The varlen prefill kernel through CuPy on a real GPU (skipped without one): the CuPy backend with
prefill="varlen" against the float64 reference and against prefill="sdpa" and "kernel" on the same step,
the emulator's cases (tests/attention/cuda/test_prefill_kernel.py) plus steps only a GPU runs in
reasonable time: long cached prefixes, long prompts, head sizes whose shared memory needs the opt-in
past 48 KiB (head 128: 53 KiB, head 256: 84 KiB)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cuda_required import GPU_ONLY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attention" / "cuda"))  # the emulator tests' cases
import test_kernels as T  # noqa: E402
import test_prefill_kernel as P  # noqa: E402

from pagedrun.attention.cuda import kernels as K  # noqa: E402
from pagedrun.attention.cuda import prefill_kernels  # noqa: E402

pytestmark = GPU_ONLY


def run_modes(shape, spec, seed, modes=("varlen", "sdpa", "kernel"), window=0, softcap=0.0, sinks=None):
    """The step through CupyAttentionBackend in each prefill mode (fresh caches each time), and the
    float64 reference."""
    import torch

    from pagedrun.attention.cuda.cupy_backend import CupyAttentionBackend

    dtype_name, D, bs, H, KVH = shape
    outs = {}
    for mode in modes:
        query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, getattr(torch, dtype_name), D, bs, H, KVH, seed)
        if window:
            T.placeholders_below_window(meta, kc, vc, window)
        cuda = lambda t: t.cuda()  # noqa: E731
        meta.slot_mapping, meta.block_tables = cuda(meta.slot_mapping), cuda(meta.block_tables)
        out = CupyAttentionBackend(prefill=mode).forward(
            cuda(query), cuda(key), cuda(value), cuda(kc), cuda(vc), meta, D**-0.5, window=window, softcap=softcap,
            sinks=None if sinks is None else sinks.cuda())
        torch.cuda.synchronize()
        outs[mode] = out.double().cpu().numpy()
    ref = T.causal_reference(query, meta, fk, fv, D**-0.5, H, KVH, window, softcap, sinks).numpy()
    return outs, ref


@pytest.mark.parametrize("shape", P.SHAPES, ids=[f"{s[0]}-h{s[1]}-bs{s[2]}-{s[3]}q{s[4]}kv" for s in P.SHAPES])
def test_gpu_varlen_matches_reference_sdpa_and_kernel(shape):
    v = P.variant_of(*shape)
    spec = P.tile_specs(v.prefill_tile_q(v.launch_group(shape[3], shape[4])), shape[2])
    outs, ref = run_modes(shape, spec, seed=shape[1] + shape[2])
    for mode, out in outs.items():
        T.assert_close(out, ref, shape[0], f"gpu {mode}")
    T.assert_close(outs["varlen"], outs["sdpa"], shape[0], "gpu varlen vs sdpa")


@pytest.mark.parametrize("case", P.WINDOW_CASES, ids=[f"s{c[0]}-w{c[2]}-cap{c[3]:g}-sinks{int(c[4])}" for c in P.WINDOW_CASES])
def test_gpu_varlen_window_softcap_sinks(case):
    import torch

    i, spec, window, softcap, with_sinks = case
    sinks = torch.linspace(-1.0, 2.5, P.SHAPES[i][3]) if with_sinks else None
    outs, ref = run_modes(P.SHAPES[i], spec, window + 7, ("varlen", "sdpa"), window, softcap, sinks)
    for mode, out in outs.items():
        T.assert_close(out, ref, P.SHAPES[i][0], f"gpu {mode} window {window} cap {softcap}")


LONG_SHAPES = [("bfloat16", 128, 16, 32, 8), ("float16", 256, 16, 8, 4), ("bfloat16", 64, 32, 9, 3)]


@pytest.mark.parametrize("shape", LONG_SHAPES, ids=[f"{s[0]}-h{s[1]}-bs{s[2]}" for s in LONG_SHAPES])
def test_gpu_varlen_long_prefix_and_prompt(shape):
    """A 1,500-token cached prefix ending inside a block behind 300 new queries, a 700-token prompt and a
    decode: shared memory past 48 KiB (opted in), many chunks per tile; varlen vs SDPA and float64."""
    spec = T.StepSpec([1501, 0, 90], [300, 700, 1])
    outs, ref = run_modes(shape, spec, seed=3, modes=("varlen", "sdpa"))
    T.assert_close(outs["varlen"], ref, shape[0], "gpu varlen long")
    T.assert_close(outs["varlen"], outs["sdpa"], shape[0], "gpu varlen vs sdpa long")
    group = K.group_for(shape[3], shape[4])
    if shape[1] >= 128:  # this shape needed the opt-in past 48 KiB of dynamic shared memory
        smem = prefill_kernels.prefill_shared_mem(shape[1], K.prefill_tile_q(shape[1], group) * group)
        assert smem > K.DEFAULT_SMEM_LIMIT
