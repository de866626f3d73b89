"""The varlen prefill kernel (kernels/cuda/prefill_attention.cu) on the CPU through the CUDA emulator.

Checked against the float64 causal reference (test_kernels.causal_reference) and against the other
prefill modes ("kernel": the decode kernels on pseudo-sequences; "sdpa"): sequences of different
lengths in one step, cached prefixes that end inside a cache block, query counts around the tile size
(tile boundaries) and contexts across 32-key chunks and cache blocks, every block size, fp32 / fp16 /
bf16, MHA, GQA groups (SmolLM2's 9 / 3 heads, Qwen2-like 8 / 1) and MQA, head sizes up to 256 (the
16-row tiles), sliding windows over NaN placeholder blocks, soft-capping and attention sinks. Every
cache slot no query may read is NaN (build_step), so a read past a sequence's end or below its window
shows. The planted bugs of MUTATIONS (an off-by-one causal limit, a dropped rescale, ...) must fail.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import test_kernels as T
import torch

from pagedrun.attention.cuda import kernels as K
from pagedrun.attention.cuda import paged_step, prefill_kernels
from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend, as_numpy
from pagedrun.attention.sdpa_prefill import prefill_seqs

# (dtype, head_size, block_size, heads, kv_heads): the variant's group is group_for(heads, kv_heads)
SHAPES = [
    ("float32", 64, 16, 4, 2),  # group 2: tiles of 16 queries
    ("float16", 64, 16, 9, 3),  # SmolLM2-135M's heads, group 3: tiles of 10
    ("bfloat16", 96, 8, 2, 2),  # MHA, block 8 (4 blocks per 32-key chunk): tiles of 32
    ("float16", 32, 32, 4, 1),  # MQA, one block per chunk: group 4, tiles of 8
    ("bfloat16", 128, 16, 8, 1),  # group 8: tiles of 4
    ("float32", 256, 8, 4, 2),  # head 256: 16-row tiles, group 2: tiles of 8
]


def variant_of(dtype: str, D: int, bs: int, H: int, KVH: int) -> K.KernelVariant:
    return K.KernelVariant(dtype, D, bs, "auto", K.group_for(H, KVH))


VARIANTS = list(dict.fromkeys(variant_of(*s) for s in SHAPES))


@functools.lru_cache(maxsize=None)
def emu_module(schedule: str = "round_robin"):
    from pagedrun.build.cudaemu import EmuModule

    names = list(dict.fromkeys(n for v in VARIANTS for n in v.name_expressions()))
    return EmuModule(K.full_source(), name_expressions=names, schedule=schedule,
                     filename="kernels/cuda/prefill_attention.cu")


def kernels(schedule: str = "round_robin") -> dict[K.KernelVariant, K.PagedKernels]:
    from pagedrun.build.cudaemu.module import MAX_OPT_IN_SHARED

    out = {}
    for v in VARIANTS:
        out[v] = K.PagedKernels(v, emu_module(schedule), np)
        out[v].smem_optin = MAX_OPT_IN_SHARED
    return out


@pytest.fixture(scope="module")
def emu():
    T.emulator_or_skip()
    return kernels()


def tile_specs(tile_q: int, bs: int) -> T.StepSpec:
    """One step: a fresh prompt of 2 tiles + 1 query, a prefix hit ending inside a block with exactly one
    tile, one of tile_q - 1 queries behind a context past a 32-key chunk, a decode, and a prompt of
    one query more than two chunks (its tiles cross chunk and block boundaries)."""
    return T.StepSpec([0, bs + 3, 37, 20, 0], [2 * tile_q + 1, tile_q, max(tile_q - 1, 2), 1, 70])


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}-h{s[1]}-bs{s[2]}-{s[3]}q{s[4]}kv" for s in SHAPES])
def test_varlen_backend_matches_reference_and_kernel_mode(emu, shape):
    dtype_name, D, bs, H, KVH = shape
    v = variant_of(*shape)
    tile_q = v.prefill_tile_q(v.launch_group(H, KVH))
    spec = tile_specs(tile_q, bs)
    outs = {}
    for prefill in ("varlen", "kernel"):
        query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, getattr(torch, dtype_name), D, bs, H, KVH,
                                                               seed=D + bs + H)
        seen = T.launches(emu[v])
        try:
            backend = EmulatedAttentionBackend(kernels=lambda vv: emu[vv], prefill=prefill)
            outs[prefill] = backend.forward(query, key, value, kc, vc, meta, D**-0.5).double().numpy()
        finally:
            del emu[v].function
        prefill_launches = [s for s in seen if s[0].startswith("paged_prefill_kernel")]
        if prefill == "varlen":  # one launch for all the prefills: (heads / group) x tiles
            want_tiles = sum(-(-q // tile_q) for q in spec.query_lens if q > 1)
            assert [s[1] for s in prefill_launches] == [(H // v.launch_group(H, KVH), want_tiles, 1)]
            assert prefill_launches[0][0] == v.prefill_name(v.launch_group(H, KVH))
        else:
            assert not prefill_launches
    ref = T.causal_reference(query, meta, fk, fv, D**-0.5, H, KVH).numpy()
    n = sum(spec.query_lens)
    T.assert_close(outs["varlen"], ref, dtype_name, f"varlen {v}")
    T.assert_close(outs["varlen"], outs["kernel"], dtype_name, f"varlen vs kernel {v}")
    assert (outs["varlen"][n:] == 0).all(), "padding rows stay zero"


WINDOW_CASES = [
    # (shape index, spec, window, softcap, sinks)
    (0, T.StepSpec([0, 40, 70, 3], [50, 17, 1, 33]), 37, 0.0, False),  # prefill past the window, placeholders
    (1, T.StepSpec([16, 0, 33, 90], [24, 11, 1, 12]), 20, 5.0, False),  # SmolLM2's heads, window and cap
    (2, T.StepSpec([5, 0], [40, 3]), 0, 0.0, True),  # sinks, MHA
    (1, T.StepSpec([35, 0, 7], [21, 12, 1]), 16, 3.0, True),  # everything at once, window = one block
    (3, T.StepSpec([64, 0], [9, 40]), 1, 0.0, False),  # window of one key: each query sees only itself
]


@pytest.mark.parametrize("prefill", ["varlen", "sdpa"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=[f"s{c[0]}-w{c[2]}-cap{c[3]:g}-sinks{int(c[4])}" for c in WINDOW_CASES])
def test_varlen_window_softcap_sinks(emu, case, prefill):
    """Sliding window over NaN placeholder blocks (the hybrid KV manager's), soft-cap and sinks: the
    varlen kernel equals the float64 reference, as the SDPA prefill does on the same step."""
    i, spec, window, softcap, with_sinks = case
    dtype_name, D, bs, H, KVH = SHAPES[i]
    query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, getattr(torch, dtype_name), D, bs, H, KVH,
                                                           seed=window + 7)
    if window:
        T.placeholders_below_window(meta, kc, vc, window)
    sinks = torch.linspace(-1.0, 2.5, H) if with_sinks else None
    backend = EmulatedAttentionBackend(kernels=lambda vv: emu[vv], prefill=prefill)
    out = backend.forward(query, key, value, kc, vc, meta, D**-0.5, window=window, softcap=softcap, sinks=sinks)
    ref = T.causal_reference(query, meta, fk, fv, D**-0.5, H, KVH, window, softcap, sinks)
    T.assert_close(out.double().numpy(), ref.numpy(), dtype_name, f"{prefill} window {window} cap {softcap}")
    if softcap or with_sinks:  # what was asked for reached the output
        plain = T.causal_reference(query, meta, fk, fv, D**-0.5, H, KVH, window)
        assert T.rel_err(out.double().numpy(), plain.numpy()) > 1e-3


# ------------------------------------------------------------------ the kernel alone


def prefill_case(v: K.KernelVariant, spec: T.StepSpec, H: int, KVH: int, seed: int, window: int = 0):
    """A step's caches with its new K/V already written (what reshape_and_cache leaves), its tiles
    and the float64 reference of its prefill rows."""
    dtype = getattr(torch, v.dtype)
    query, key, value, kc, vc, meta, fk, fv = T.build_step(spec, dtype, v.head_size, v.block_size, H, KVH, seed)
    if window:
        T.placeholders_below_window(meta, kc, vc, window)
    n = sum(spec.query_lens)
    flat_k, flat_v = kc.view(-1, KVH, v.head_size), vc.view(-1, KVH, v.head_size)
    flat_k[meta.slot_mapping[:n]], flat_v[meta.slot_mapping[:n]] = key[:n], value[:n]
    seqs = np.array([(p.index, p.start, p.num_tokens, p.context_len)
                     for p in prefill_seqs(spec.query_lens, [c + q for c, q in zip(spec.context_lens, spec.query_lens)])])
    ref = T.causal_reference(query, meta, fk, fv, v.head_size**-0.5, H, KVH, window).numpy()
    rows = np.concatenate([np.arange(s, s + q) for _, s, q, _ in seqs])
    return query, kc, vc, meta, seqs, ref, rows


def run_prefill(ker: K.PagedKernels, query, kc, vc, meta, seqs, H: int, KVH: int, window: int = 0) -> np.ndarray:
    v = ker.variant
    group = v.launch_group(H, KVH)
    tiles = paged_step.prefill_tiles(seqs, v.prefill_tile_q(group))
    out = torch.full_like(query, 7.0)  # rows of no tile must stay as they were
    max_len = int((seqs[:, 2] + seqs[:, 3]).max())
    ker.prefill_attention(as_numpy(out), as_numpy(query), as_numpy(kc), as_numpy(vc),
                          as_numpy(meta.block_tables.to(torch.int32).contiguous()), tiles, max_len,
                          v.head_size**-0.5, window=window)
    return out.double().numpy()


def test_kernel_leaves_other_rows_and_is_schedule_independent(emu):
    """Decode and padding rows are not written; the greedy schedule (warp 0 runs ahead) gives the same
    bits as round-robin (no shared-memory race)."""
    shape = SHAPES[1]
    v = variant_of(*shape)
    H, KVH = shape[3], shape[4]
    spec = T.StepSpec([13, 0, 5, 40], [30, 11, 1, 21])
    query, kc, vc, meta, seqs, ref, rows = prefill_case(v, spec, H, KVH, seed=4)
    out = run_prefill(emu[v], query, kc, vc, meta, seqs, H, KVH)
    T.assert_close(out[rows], ref[rows], v.dtype, "kernel alone")
    others = np.setdiff1d(np.arange(query.shape[0]), rows)
    assert len(others) == 2 and (out[others] == 7.0).all()
    greedy = run_prefill(kernels("greedy")[v], query, kc, vc, meta, seqs, H, KVH)
    assert np.array_equal(greedy, out)


def test_one_head_per_block_equals_grouped(emu):
    """group 1 (tiles of 32 queries, one query head per block) gives the grouped launch's result."""
    shape = SHAPES[0]
    v = variant_of(*shape)
    H, KVH = shape[3], shape[4]
    query, kc, vc, meta, seqs, ref, rows = prefill_case(v, T.StepSpec([9, 0], [40, 33]), H, KVH, seed=5)
    outs = []
    for group in (1, v.group):
        out = torch.zeros_like(query)
        tiles = paged_step.prefill_tiles(seqs, v.prefill_tile_q(group))
        emu[v].prefill_attention(as_numpy(out), as_numpy(query), as_numpy(kc), as_numpy(vc),
                                 as_numpy(meta.block_tables.to(torch.int32).contiguous()), tiles, 49,
                                 v.head_size**-0.5, group)
        outs.append(out.double().numpy())
    T.assert_close(outs[0][rows], ref[rows], v.dtype, "group 1")
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6)


def test_prefill_tiles():
    seqs = np.array([[0, 0, 21, 5], [2, 21, 3, 0], [3, 24, 10, 17]])
    tiles = paged_step.prefill_tiles(seqs, 10)
    assert tiles.dtype == np.int32 and tiles.flags.c_contiguous
    # every query exactly once, at its position, in tiles of <= 10 consecutive queries of one sequence
    seen = {}
    for row, start, n, pos0 in tiles.tolist():
        assert 1 <= n <= 10
        seq = next(s for s in seqs.tolist() if s[0] == row)
        for j in range(n):
            assert start + j not in seen
            seen[start + j] = pos0 + j
            assert start + j - seq[1] == pos0 + j - seq[3]  # the query's position is its context + offset
    assert sorted(seen) == list(range(34))
    last = tiles[:, 3] + tiles[:, 2]
    assert (np.diff(last) <= 0).all()  # the tiles with the most keys first
    assert paged_step.prefill_tiles(np.zeros((0, 4)), 10).shape == (0, 4)


def test_shared_memory_and_tile_sizes():
    assert K.prefill_tile_q(64, 3) == 10 and K.prefill_tile_q(64, 1) == 32 and K.prefill_tile_q(256, 8) == 2
    assert prefill_kernels.prefill_shared_mem(64, 32) == 4 * (32 * 64 + 32 * 65 + 32 * 64 + 32 * 32 + 96)
    # head 256 with 16-row tiles: under the 99 KiB a block can have on sm_86 / sm_89, far under sm_90's 227
    assert max(prefill_kernels.prefill_shared_mem(h, K.prefill_tile_q(h, 1)) for h in K.HEAD_SIZES) < 99 * 1024
    v = K.KernelVariant("float16", 64, 16, "auto", 3)
    assert v.prefill_name(3) == "paged_prefill_kernel<__half, 64, 16, 128, 10, 3>"
    assert v.prefill_name(3) in v.name_expressions() and v.prefill_name(1) in v.name_expressions()
    assert not [n for n in K.KernelVariant("float16", 64, 16, "int8").name_expressions() if "prefill" in n]


def test_argument_checks(emu):
    shape = SHAPES[0]
    v = variant_of(*shape)
    query, kc, vc, meta, seqs, _, _ = prefill_case(v, T.StepSpec([0], [20]), 4, 2, seed=1)
    args = (as_numpy(torch.zeros_like(query)), as_numpy(query), as_numpy(kc), as_numpy(vc),
            as_numpy(meta.block_tables.to(torch.int32).contiguous()))
    too_long = paged_step.prefill_tiles(seqs, 32)  # one tile of 20 queries: more than this launch's 16
    with pytest.raises(ValueError, match="1..16 queries"):
        emu[v].prefill_attention(*args, too_long, 20, 0.125)
    with pytest.raises(ValueError, match="past max_seq_len"):
        emu[v].prefill_attention(*args, paged_step.prefill_tiles(seqs, 16), 19, 0.125)
    with pytest.raises(ValueError, match="window -1"):
        emu[v].prefill_attention(*args, paged_step.prefill_tiles(seqs, 16), 20, 0.125, window=-1)


def test_quantized_cache_keeps_the_kernel_mode():
    assert paged_step.prefill_mode("varlen", K.KernelVariant("float16", 64, 16, "fp8_e4m3")) == "kernel"
    assert paged_step.prefill_mode("varlen", K.KernelVariant("float16", 64, 16)) == "varlen"
    assert paged_step.PREFILL_MODES == ("varlen", "sdpa", "kernel")


def test_step_builds_tiles_once_for_every_layer(emu):
    """The tile array is built by the first layer and reused (same object) by the next ones."""
    shape = SHAPES[1]
    v = variant_of(*shape)
    _, D, bs, H, KVH = shape
    spec = T.StepSpec([0, 3], [12, 1])
    query, key, value, kc, vc, meta, _, _ = T.build_step(spec, torch.float16, D, bs, H, KVH, seed=2)
    backend = EmulatedAttentionBackend(kernels=lambda vv: emu[vv], prefill="varlen")
    a = backend.forward(query, key, value, kc, vc, meta, D**-0.5)
    step = meta.backend_state[("paged_step", "emulated", "cpu", "varlen")]
    tiles = step.tiles[v.prefill_tile_q(v.group)]
    b = backend.forward(query, key, value, kc, vc, meta, D**-0.5)  # the next layer (same caches here)
    assert step.tiles[v.prefill_tile_q(v.group)] is tiles and torch.equal(a, b)
    assert step.prefills == [] and step.num_rows == 1  # the decode goes through the decode kernels


# ------------------------------------------------------------------ planted bugs


MUTATIONS = [
    # (id, what, old, new, count)
    ("causal_off_by_one", "a query also sees the key after its own",
     "(unsigned)(key - row_first) <= (unsigned)(pos - row_first)",
     "(unsigned)(key - row_first) <= (unsigned)(pos + 1 - row_first)", 1),
    ("no_rescale", "the accumulators are not rescaled when a chunk raises the running max",
     "acc[k] *= alpha_smem[e / HEAD_SIZE];", "acc[k] *= 1.f;", 1),
    ("window_off_by_one", "each query's window starts one key early",
     "const int row_first = window_first_key(pos + 1, window);",
     "const int row_first = window_first_key(pos + 1, window + 1);", 1),
    ("missing_barrier_kv", "no barrier between writing a chunk's K/V and reading them",
     "        v_smem[t * HEAD_SIZE + c * VEC + e] = vf[e];\n      }\n    }\n    __syncthreads();\n",
     "        v_smem[t * HEAD_SIZE + c * VEC + e] = vf[e];\n      }\n    }\n", 1),
    ("rows_past_the_end_loaded", "K/V rows up to the chunk's end are loaded (unwritten slots: NaN)",
     "if ((unsigned)(key - first_key) <= (unsigned)(last_pos - first_key)) {",
     "if ((unsigned)(key - first_key) <= (unsigned)(last_pos - first_key) + (unsigned)(CHUNK - 1 - last_pos % CHUNK)) {",
     1),
]
MUTANT_SHAPE = SHAPES[1]  # fp16, head 64, block 16, 9 / 3 heads: group 3, tiles of 10
MUTANT_WINDOW = 20


def mutated_source(old: str, new: str, count: int) -> str:
    src = K.load_source(K.PREFILL_SOURCE)
    assert src.count(old) == count, f"{old!r} occurs {src.count(old)} times, expected {count}"
    return src.replace(old, new)


@functools.lru_cache(maxsize=None)
def mutant_module():
    from pagedrun.build.cudaemu import EmuModule

    v = variant_of(*MUTANT_SHAPE)
    parts, names = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"], []
    for mid, _, old, new, count in [("control", "", "", "", 0)] + MUTATIONS:
        body = re.sub(r"^#include <[^>]+>\n", "", mutated_source(old, new, count) if old else
                      K.load_source(K.PREFILL_SOURCE), flags=re.M)
        parts.append(f"namespace {mid} {{\n{body}\n}}  // namespace {mid}\n")
        names.append(f"{mid}::{v.prefill_name(v.group)}")
    return EmuModule("".join(parts), name_expressions=names, filename="kernels/cuda/prefill_attention.cu (mutants)")


class _Prefixed:
    def __init__(self, module, prefix: str):
        self.module, self.prefix = module, prefix

    def get_function(self, name: str):
        return self.module.get_function(f"{self.prefix}::{name}")


def mutant_outcome(mid: str) -> str:
    """'ok' | 'wrong' | 'error' for the mutant (or the control) on a plain and a windowed step."""
    from pagedrun.build.cudaemu import EmuError

    v = variant_of(*MUTANT_SHAPE)
    H, KVH = MUTANT_SHAPE[3], MUTANT_SHAPE[4]
    ker = K.PagedKernels(v, _Prefixed(mutant_module(), mid), np)
    for spec, window in ((T.StepSpec([13, 0, 40], [30, 45, 21]), 0), (T.StepSpec([40, 0], [25, 31]), MUTANT_WINDOW)):
        query, kc, vc, meta, seqs, ref, rows = prefill_case(v, spec, H, KVH, seed=6, window=window)
        try:
            out = run_prefill(ker, query, kc, vc, meta, seqs, H, KVH, window)
        except EmuError:
            return "error"
        if not np.isfinite(out[rows]).all() or T.rel_err(out[rows], ref[rows]) > T.TOL[v.dtype]:
            return "wrong"
    return "ok"


def test_mutation_control_passes():
    T.emulator_or_skip()
    assert mutant_outcome("control") == "ok"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutant_is_caught(mutation):
    T.emulator_or_skip()
    assert mutant_outcome(mutation[0]) != "ok", f"{mutation[0]} ({mutation[1]}) escaped"


# ------------------------------------------------------------------ the GPU session's benchmark


def _prefill_modes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import prefill_modes

    return prefill_modes


def test_prefill_modes_configs():
    B = _prefill_modes()
    assert B.parse_configs("16x128, 8x256+1024") == [(16, 128, 0), (8, 256, 1024)]
    with pytest.raises(SystemExit, match="SEQSxNEW"):
        B.parse_configs("16y128")


@pytest.mark.slow
def test_prefill_modes_benchmark_runs_on_the_cpu(tmp_path, capsys):
    """benchmarks/prefill_modes.py through the emulated backend: every mode runs and agrees."""
    import json

    T.emulator_or_skip()
    out = tmp_path / "modes.json"
    assert _prefill_modes().main(["--device", "cpu", "--dtype", "float32", "--head-size", "32", "--block-size", "8",
                                  "--configs", "2x20,1x9+13", "--iters", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["2x20", "1x9+13"]
    assert all(set(r["ms"]) == {"varlen", "sdpa", "kernel"} and r["max_abs_diff"] < 1e-5 for r in rows)
