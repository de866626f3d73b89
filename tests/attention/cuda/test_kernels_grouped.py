"""GQA-grouped decode attention: a thread block serves the query heads of one KV head (issue 15's
H200 run: one block per query head read each KV head once per query head, v2 at 32% of the copy).

Each grouped kernel is checked against the float64 reference and against the one-head-per-block
kernel of the same module, bit for bit: a head's sums are added in the same order either way, so
grouping changes which block computes a head, never its arithmetic. Cases cover groups 2..8, a
ratio of 16 served by two blocks of 8 per KV head, all three dtypes, v1 and v2 (several
partitions), ragged lengths with NaN in every unused slot, an empty sequence, and the greedy fiber
schedule (a shared-memory race between the group's rows would change bits).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from test_kernels import TOL, emulator_or_skip, make_case, poison_below_window, run_case

from pagedrun.attention.cuda import kernels as K

# (dtype, head_size, block_size, num_heads, num_kv_heads): group = K.group_for(num_heads, num_kv_heads)
CASES = [
    ("bfloat16", 128, 16, 8, 2),    # Llama 3 (4 per KV head)
    ("float16", 64, 16, 9, 3),      # SmolLM2-135M (3)
    ("float32", 80, 8, 14, 2),      # Qwen2 (7), head 80: a partial vector sweep
    ("bfloat16", 64, 32, 16, 1),    # ratio 16: two blocks of 8 per KV head
    ("float16", 256, 8, 10, 5),     # 2 per KV head, head 256
    ("float32", 32, 32, 6, 1),      # MQA, 6 per block
]
SEQ_LENS = [1, 17, 511, 513, 1100]


def variant(dtype, head, block, heads, kv) -> K.KernelVariant:
    return K.KernelVariant(dtype, head, block, "auto", K.group_for(heads, kv))


@functools.lru_cache(maxsize=None)
def module(schedule: str = "round_robin"):
    from pagedrun.build.cudaemu import EmuModule

    names = list(dict.fromkeys(n for c in CASES for n in variant(*c).name_expressions(("v1", "v2"))))
    return EmuModule(K.full_source(), name_expressions=names, schedule=schedule, filename="kernels/cuda/paged_attention.cu")


def kernels(v: K.KernelVariant, schedule: str = "round_robin") -> K.PagedKernels:
    return K.PagedKernels(v, module(schedule), np)


@pytest.fixture(scope="module")
def emu():
    emulator_or_skip()
    module()
    return kernels


def test_group_for_takes_the_largest_divisor_up_to_eight():
    assert [K.group_for(h, kv) for h, kv in [(9, 3), (32, 8), (64, 4), (14, 2), (12, 12), (36, 4), (24, 1)]] == \
        [3, 4, 8, 7, 1, 3, 8]
    # a 1-byte cache: up to MAX_QUANTIZED_GROUP (4)
    assert [K.group_for(h, kv, q) for h, kv in [(32, 8), (64, 4), (9, 3), (12, 12)] for q in ("fp8_e4m3", "int8")] \
        == [4, 4, 4, 4, 3, 3, 1, 1]
    with pytest.raises(ValueError, match="group"):
        K.KernelVariant("float16", 64, 16, "int8", K.MAX_QUANTIZED_GROUP + 1)
    with pytest.raises(ValueError, match="group"):
        K.KernelVariant("float16", 64, 16, "auto", 9)


def test_names_keep_the_one_head_kernels_and_add_the_grouped_ones():
    v = K.KernelVariant("bfloat16", 128, 16, "auto", 4)
    assert v.v2_name == "paged_attention_v2_kernel<__nv_bfloat16, 128, 16, 128, 512>"
    assert v.attention_name("v2", 4) == \
        "paged_attention_v2_kernel<__nv_bfloat16, 128, 16, 128, 512, pagedrun::KvCacheDtype::kAuto, 4>"
    assert v.name_expressions(("v1",)) == [v.v1_name, v.attention_name("v1", 4)]
    assert v.launch_group(32, 8) == 4 and v.launch_group(64, 8) == 4 and v.launch_group(16, 8) == 1
    assert K.KernelVariant("bfloat16", 128, 16).name_expressions(("v1",)) == [v.v1_name]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-h{c[1]}-b{c[2]}-{c[3]}q{c[4]}kv" for c in CASES])
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.slow
def test_grouped_equals_reference_and_the_one_head_kernel_bit_for_bit(emu, case, version):
    dtype, head, block, heads, kv = case
    v = variant(*case)
    assert v.group > 1
    lens = SEQ_LENS if version == "v2" else SEQ_LENS[:3]
    c = make_case(v, lens, heads, kv, seed=head + block + heads)
    out, used = run_case(emu(v), c, version)
    assert used == version
    ref = c.reference()
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err <= TOL[dtype], f"{v} {version}: {err:.2e}"
    one_head, _ = run_case(emu(K.KernelVariant(dtype, head, block)), c, version)
    np.testing.assert_array_equal(out, one_head)


def test_grouped_kernels_race_free_under_the_greedy_schedule(emu):
    case = CASES[1]
    v = variant(*case)
    c = make_case(v, [5, 700, 1030], case[3], case[4], seed=3)
    for version in ("v1", "v2"):
        a, _ = run_case(emu(v), c, version)
        b, _ = run_case(emu(v, "greedy"), c, version)
        np.testing.assert_array_equal(a, b)


def test_grouped_v1_gives_zeros_for_an_empty_sequence(emu):
    v = variant(*CASES[0])
    c = make_case(v, [0, 40, 0], 8, 2, seed=7)
    out, _ = run_case(emu(v), c, "v1")
    assert np.all(out[0] == 0) and np.all(out[2] == 0)
    ref = c.reference()
    assert np.max(np.abs(out[1] - ref[1])) / np.max(np.abs(ref[1])) <= TOL["bfloat16"]


def test_grouped_launch_divides_the_grid_and_scales_shared_memory(emu):
    v = variant(*CASES[0])  # group 4
    ker = emu(v)
    launched = []
    real = ker.function

    def spy(name, smem=0):
        fn = real(name, smem)
        return lambda grid, block, args, shared_mem=0: launched.append((name, grid, shared_mem)) or fn(
            grid, block, args, shared_mem=shared_mem)

    ker.function = spy
    c = make_case(v, [30, 600], 8, 2, seed=1)
    run_case(ker, c, "v2")
    name, grid, smem = launched[0]
    assert name == v.attention_name("v2", 4) and grid == (2, 2, 2) and smem == K.v2_shared_mem(128, 4)
    assert K.v2_shared_mem(128, 4) == 4 * K.v2_shared_mem(128)
    assert K.v1_shared_mem(300, 64, 16, 3) == 3 * K.v1_shared_mem(300, 64, 16)


def test_pick_group_drops_the_group_when_the_grid_would_leave_sms_idle():
    """H200, bf16 head 128, 32/8 heads, 132 SMs: 8 x 1024 tokens took 128 grouped v2 blocks (569 GB/s)
    against 512 one-head blocks (743); 1,024 grouped blocks or more beat one head per block 1.6-2.1x."""
    v = K.KernelVariant("bfloat16", 128, 16, "auto", 4)
    assert K.pick_group(v, 32, 8, blocks_per_head=8 * 2, num_sms=132) == 1  # 128 blocks < 264
    assert K.pick_group(v, 32, 8, blocks_per_head=64 * 8, num_sms=132) == 4  # 4,096 blocks
    assert K.pick_group(v, 32, 8, blocks_per_head=32, num_sms=132) == 1  # 256 blocks, just under two per SM
    assert K.pick_group(v, 32, 8, blocks_per_head=33, num_sms=132) == 4  # 264 blocks
    assert K.pick_group(v, 24, 8, blocks_per_head=10_000, num_sms=132) == 1  # 3 per KV head: not divisible by 4


def test_a_forced_group_the_variant_does_not_launch_is_refused(emu):
    v = variant(*CASES[0])
    c = make_case(v, [30], 8, 2, seed=1)
    with pytest.raises(ValueError, match="group 2"):
        emu(v).paged_attention(c.empty_out(), c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens_arr,
                               30, c.scale, group=2)


@pytest.mark.parametrize("defines", [{"PR_V_BATCH": 1, "PR_K_CHUNK_ELEMS": 64}, {"PR_V_BATCH": 2, "PR_K_CHUNK_ELEMS": 256}],
                         ids=["V1-K64", "V2-K256"])
@pytest.mark.slow
def test_loads_in_flight_settings_change_no_bits(emu, defines):
    """PR_V_BATCH / PR_K_CHUNK_ELEMS (kernels/cuda/attention_common.cuh) decide how many loads a lane has
    in flight, never the order of a sum: any setting gives the default's bits (the H200 A/B of
    2026-11-26 checked the same on the GPU). Grouped and one-head, v1 and v2, ragged lengths."""
    from pagedrun.build.cudaemu import EmuModule

    case = CASES[1]  # fp16 head 64, 9 / 3: the default model's shape
    v = variant(*case)
    names = v.name_expressions(("v1", "v2"))
    code = "".join(f"#define {k} {n}\n" for k, n in defines.items()) + K.full_source()
    other = K.PagedKernels(v, EmuModule(code, name_expressions=names, filename="kernels/cuda/paged_attention.cu"), np)
    c = make_case(v, [1, 15, 16, 17, 600], case[3], case[4], seed=11)
    for version in ("v1", "v2"):
        for group in (1, v.group):
            outs = []
            for ker in (emu(v), other):
                out = c.empty_out()
                ker.paged_attention(out, c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens_arr,
                                    c.max_seq_len, c.scale, version=version, group=group)
                outs.append(out)
            np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"{defines} {version} group {group}")


# (case index, window, softcap): SmolLM2's 9 / 3 heads and Llama 3's 8 / 2 under windows that start
# mid-block and on a partition boundary, capped and not.
WINDOW_CASES = [(1, 100, 0.0), (1, 600, 30.0), (0, 1024, 0.0), (5, 33, 5.0)]


@pytest.mark.parametrize("i,window,softcap", WINDOW_CASES, ids=[f"case{i}-w{w}-cap{c:g}" for i, w, c in WINDOW_CASES])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_grouped_window_and_softcap_equal_reference_and_the_one_head_kernel(emu, i, window, softcap, version):
    """A grouped block's window and cap are its query heads' (one sequence, one KV head): the windowed
    reference, bit for bit the one-head kernel, NaN placeholders below each window never read."""
    dtype, head, block, heads, kv = CASES[i]
    v = variant(*CASES[i])
    c = poison_below_window(make_case(v, [1, 17, window + 1, 1100, 2048 if window == 1024 else 700], heads, kv,
                                      seed=window), window)
    grouped, used = run_case(emu(v), c, version, window, softcap)
    assert used == version
    ref = c.reference(window, softcap)
    err = np.max(np.abs(grouped - ref)) / np.max(np.abs(ref))
    assert np.isfinite(grouped).all() and err <= TOL[dtype], f"{v} {version} window {window}: {err:.2e}"
    one_head, _ = run_case(emu(K.KernelVariant(dtype, head, block)), c, version, window, softcap)
    np.testing.assert_array_equal(grouped, one_head)
