"""The CUDA-on-CPU emulator (pagedrun.build.cudaemu): semantics, bug detection, argument checks, caching.

Kernels live in tests/emu_kernels/cuda/*.cu and are plain CUDA. Each .cu file is compiled once per
cache (~/.cache/pagedrun/cudaemu or $PAGEDRUN_CACHE), so a warm run does not invoke g++.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pagedrun.build.cudaemu import EmuDeadlockError, EmuError, EmuLaunchError, EmuModule
from pagedrun.build.cudaemu import build as emu_build

KDIR = Path(__file__).parent / "emu_kernels"
TEMPLATES = ("rotate_scale<float, 64>", "rotate_scale<__half, 32>", "template_shared<64>")


def load(name: str, **kw) -> EmuModule:
    return EmuModule((KDIR / name).read_text(), filename=f"emu_kernels/{name}", **kw)


def site(name: str, marker: str) -> str:
    """file:line of the line holding `marker` in a kernel file, as the emulator reports it."""
    lines = (KDIR / name).read_text().splitlines()
    return f"emu_kernels/{name}:{next(i + 1 for i, line in enumerate(lines) if marker in line)}"


@pytest.fixture(scope="module")
def rr() -> EmuModule:
    return load("basics.cu", name_expressions=TEMPLATES)


@pytest.fixture(scope="module")
def greedy() -> EmuModule:
    return load("basics.cu", name_expressions=TEMPLATES, schedule="greedy")


@pytest.fixture(scope="module")
def faults() -> EmuModule:
    return load("faults.cu")


# ---------------------------------------------------------------- basic semantics


def test_vector_add(rr: EmuModule) -> None:
    rng = np.random.default_rng(0)
    n = 1000
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    c = np.full(n, -1.0, np.float32)
    rr.get_function("vector_add")(((n + 127) // 128,), (128,), (a, b, c, np.int32(n)))
    np.testing.assert_array_equal(c, a + b)


@pytest.mark.parametrize("schedule", ["rr", "greedy"])
def test_block_sum_with_barriers_is_correct(schedule: str, rr: EmuModule, greedy: EmuModule) -> None:
    mod = rr if schedule == "rr" else greedy
    rng = np.random.default_rng(1)
    x = rng.random(1000, dtype=np.float32)
    out = np.zeros(4, np.float32)
    mod.get_function("block_sum")((4,), (256,), (x, out, np.int32(1000), np.int32(1)))
    ref = np.pad(x, (0, 24)).reshape(4, 256).sum(axis=1)
    np.testing.assert_allclose(out, ref, rtol=1e-5)


def test_block_sum_missing_barrier_is_wrong(rr: EmuModule, greedy: EmuModule) -> None:
    rng = np.random.default_rng(2)
    x = rng.random(256, dtype=np.float32)
    results = []
    for mod in (rr, greedy):
        out = np.zeros(1, np.float32)
        mod.get_function("block_sum")((1,), (256,), (x, out, np.int32(256), np.int32(0)))
        results.append(out[0])
    assert any(not np.isclose(r, x.sum(), rtol=1e-4) for r in results), results


def test_warp_shuffle_reductions_match_numpy(rr: EmuModule) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(8 * 32).astype(np.float32)
    out = np.zeros(16, np.float32)
    rr.get_function("warp_reduce")((2,), (128,), (x, out))
    rows = x.reshape(8, 32)
    np.testing.assert_array_equal(out[0::2], rows.max(axis=1))
    np.testing.assert_allclose(out[1::2], rows.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_shuffles_of_64_and_16_bit_types_and_votes(rr: EmuModule) -> None:
    lanes = np.arange(32)
    d = (lanes * 1.25 + 1e10).astype(np.float64)
    h = (lanes * 0.5).astype(np.float16)
    b = (lanes.astype(np.uint32) * 3 + 0x3F80).astype(np.uint16)  # bf16 bit patterns
    dout, hout, bout = np.zeros(32), np.zeros(32, np.float16), np.zeros(32, np.uint16)
    votes = np.zeros(4, np.uint32)
    rr.get_function("warp_types")((1,), (32,), (d, h, b, dout, hout, bout, votes))
    np.testing.assert_array_equal(dout, d[lanes ^ 1])
    np.testing.assert_array_equal(hout, h[np.where(lanes + 3 < 32, lanes + 3, lanes)])
    np.testing.assert_array_equal(bout, b[np.where(lanes >= 5, lanes - 5, lanes)])
    assert votes[0] == sum(1 << i for i in range(0, 32, 3))
    assert list(votes[1:]) == [1, 1, 0]


def _ref_shfl(kind: str, lane: int, param: int, width: int) -> int:
    seg = lane // width * width
    if kind == "idx":
        src = seg + param % width
    elif kind == "up":
        src = lane - param if lane - param >= seg else lane
    elif kind == "down":
        src = lane + param if lane + param < seg + width else lane
    else:  # xor: earlier segments are reachable, later ones give the own value
        src = lane ^ param if (lane ^ param) < seg + width else lane
    return 100 + src


@pytest.mark.parametrize("width", [32, 16, 8, 1])
@pytest.mark.parametrize("delta", [1, 3, 8, 16])
def test_shfl_rules_out_of_range_and_width(rr: EmuModule, width: int, delta: int) -> None:
    rng = np.random.default_rng(width * 100 + delta)
    src = rng.integers(-40, 72, 32).astype(np.int32)
    out = np.zeros(4 * 32, np.int32)
    rr.get_function("shfl_rules")((1,), (32,), (src, out, np.int32(delta), np.int32(width)))
    for r, kind in enumerate(("idx", "up", "down", "xor")):
        p = [int(s) for s in src] if kind == "idx" else [delta] * 32
        expect = [_ref_shfl(kind, lane, p[lane], width) for lane in range(32)]
        assert list(out[r * 32 : (r + 1) * 32]) == expect, kind


def test_shfl_source_outside_mask_returns_own_value(rr: EmuModule) -> None:
    src = np.array([20, 3, 15, 16, 0, 31] + [1] * 26, np.int32)
    out = np.zeros(32, np.int32)
    rr.get_function("shfl_partial_mask")((1,), (32,), (src, out))
    expect = [(100 + s if s < 16 else 100 + lane) if lane < 16 else -1 for lane, s in enumerate(src)]
    assert list(out) == expect


def test_syncthreads_count_and_or(rr: EmuModule) -> None:
    out = np.zeros(3, np.int32)
    rr.get_function("sync_votes")((1,), (64,), (out,))
    assert list(out) == [16, 1, 1]


@pytest.mark.parametrize("grid,block", [((3,), (40,)), ((2, 3), (8, 4)), ((3, 2, 2), (4, 2, 3))])
def test_multidimensional_grids_and_blocks(rr: EmuModule, grid: tuple, block: tuple) -> None:
    g, b = (grid + (1, 1))[:3], (block + (1, 1))[:3]
    nb, nt = int(np.prod(g)), int(np.prod(b))
    out = np.full(nb * nt * 6, -1, np.int32)
    rr.get_function("indices")(grid, block, (out,))
    got = out.reshape(nb, nt, 6)
    bz, by, bx = np.meshgrid(range(g[2]), range(g[1]), range(g[0]), indexing="ij")
    tz, ty, tx = np.meshgrid(range(b[2]), range(b[1]), range(b[0]), indexing="ij")
    np.testing.assert_array_equal(got[:, :, 3:], np.broadcast_to(np.stack([bx, by, bz], -1).reshape(nb, 1, 3), (nb, nt, 3)))
    np.testing.assert_array_equal(got[:, :, :3], np.broadcast_to(np.stack([tx, ty, tz], -1).reshape(1, nt, 3), (nb, nt, 3)))


# ---------------------------------------------------------------- races and shared memory


def test_cross_warp_reuse_race_missed_by_round_robin_caught_by_greedy(rr: EmuModule, greedy: EmuModule) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(128).astype(np.float32) * 3
    ref = np.exp(x - x.max()) / np.exp(x - x.max()).sum()

    def run(mod: EmuModule, with_barrier: int) -> np.ndarray:
        out = np.zeros(128, np.float32)
        mod.get_function("reuse_race")((1,), (128,), (x, out, np.int32(with_barrier)))
        return out

    np.testing.assert_allclose(run(rr, 1), ref, rtol=1e-5)
    np.testing.assert_allclose(run(greedy, 1), ref, rtol=1e-5)
    np.testing.assert_allclose(run(rr, 0), ref, rtol=1e-5)  # lockstep warps: the race stays hidden
    assert not np.allclose(run(greedy, 0), ref, rtol=1e-3)  # warp 0 runs ahead and clobbers red[]


def test_unwritten_shared_memory_reads_nan(rr: EmuModule) -> None:
    out = np.zeros(128, np.float32)
    rr.get_function("read_unwritten")((1,), (64,), (out, np.int32(64)), shared_mem=64 * 4)
    assert np.isnan(out).all()


def test_static_shared_memory_in_templates_is_poisoned_per_block(rr: EmuModule) -> None:
    out = np.zeros(64, np.float32)
    kern = rr.get_function("template_shared<64>")
    for _ in range(2):
        kern((2,), (64,), (out,))
        assert np.isnan(out).all()
    assert kern.shared_size_bytes >= 64 * 4


def test_dynamic_shared_memory_limit(rr: EmuModule) -> None:
    kern = rr.get_function("read_unwritten")
    out = np.zeros(128, np.float32)
    assert kern.max_dynamic_shared_size_bytes == 48 * 1024
    with pytest.raises(EmuLaunchError, match="max_dynamic_shared_size_bytes"):
        kern((1,), (64,), (out, np.int32(64)), shared_mem=64 * 1024)
    kern.max_dynamic_shared_size_bytes = 64 * 1024
    try:
        kern((1,), (64,), (out, np.int32(64)), shared_mem=64 * 1024)
        with pytest.raises(EmuLaunchError):
            kern.max_dynamic_shared_size_bytes = 300 * 1024
    finally:
        kern.max_dynamic_shared_size_bytes = 48 * 1024


# ---------------------------------------------------------------- types


def _bf16_rne_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), r)


def _half_directed(x: np.ndarray, mode: str) -> np.ndarray:
    h = x.astype(np.float16)
    back = h.astype(np.float32)
    with np.errstate(invalid="ignore"):
        if mode == "rz":
            step = np.abs(back) > np.abs(x)
            target = np.float16(0)
        elif mode == "rd":
            step, target = back > x, np.float16(-np.inf)
        else:
            step, target = back < x, np.float16(np.inf)
    return np.where(step, np.nextafter(h, target), h).view(np.uint16)


def test_fp16_bf16_conversions_round_like_cuda(rr: EmuModule) -> None:
    rng = np.random.default_rng(5)
    halves = rng.integers(0, 0x7C00, 2000).astype(np.uint16).view(np.float16).astype(np.float32)
    ties = halves + (np.nextafter(halves.astype(np.float16), np.float16(np.inf)).astype(np.float32) - halves) / 2
    bf_ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 256 + 1], np.float32)
    x = np.concatenate([
        rng.standard_normal(3000).astype(np.float32) * np.float32(10.0) ** rng.integers(-8, 6, 3000),
        ties, -ties, bf_ties, np.array([0.0, -0.0, 65504, 65520, 1e6, -1e6, 6e-8, 1e-9, np.inf, -np.inf, np.nan], np.float32),
    ]).astype(np.float32)
    n = x.size
    outs = [np.zeros(n, np.uint16) for _ in range(5)] + [np.zeros(n, np.float32) for _ in range(2)]
    rr.get_function("convert")(((n + 255) // 256,), (256,), (x, *outs, np.int32(n)))
    h_rn, h_rz, h_rd, h_ru, b_rn, h_back, b_back = outs
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h_rn, x.astype(np.float16).view(np.uint16))
    finite = ~np.isnan(x)
    for got, mode in ((h_rz, "rz"), (h_rd, "rd"), (h_ru, "ru")):
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(got[finite], _half_directed(x, mode)[finite], err_msg=mode)
    np.testing.assert_array_equal(b_rn, _bf16_rne_bits(x))
    assert list(b_rn[-15:-11]) == [0x3F80, 0x3F82, 0xBF80, 0x4380]  # ties go to even
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h_back[finite], x.astype(np.float16).astype(np.float32)[finite])
    np.testing.assert_array_equal(b_back.view(np.uint32), b_rn.astype(np.uint32) << 16)


def test_templated_kernels_via_name_expressions(rr: EmuModule) -> None:
    x = np.arange(64, dtype=np.float32)
    rr.get_function("rotate_scale<float, 64>")((1,), (64,), (x, np.float32(2.0)), shared_mem=64 * 4)
    np.testing.assert_array_equal(x, np.roll(np.arange(64, dtype=np.float32), -1) * 2)
    h = np.arange(32).astype(np.float16)
    rr.get_function("rotate_scale<__half, 32>")((1,), (32,), (h, np.float32(0.5)), shared_mem=32 * 2)
    np.testing.assert_array_equal(h, np.roll(np.arange(32), -1).astype(np.float16) * np.float16(0.5))
    with pytest.raises(EmuError, match="name_expressions"):
        rr.get_function("rotate_scale<double, 8>")


# ---------------------------------------------------------------- arguments


def test_numpy_scalars_are_packed_with_their_exact_size(rr: EmuModule) -> None:
    out = np.zeros(6)
    args = (out, np.int32(-7), np.float32(1.5), np.int64(2**40 + 3), np.float64(0.1), np.uint16(65535), np.float16(0.25))
    rr.get_function("pack_args")((1,), (1,), args)
    assert list(out) == [-7, 1.5, 2**40 + 3, 0.1, 65535, 0.25]


@pytest.mark.parametrize(
    "bad,match",
    [
        (1.5, "Python float"),
        (7, "Python int"),
        (np.float64(1.5), "float32"),
        (np.int32(1), "float32"),
        (np.zeros(2, np.float32), "array"),
    ],
)
def test_argument_type_errors(rr: EmuModule, bad: object, match: str) -> None:
    out = np.zeros(6)
    args = [out, np.int32(-7), np.float32(1.5), np.int64(3), np.float64(0.1), np.uint16(1), np.float16(0.25)]
    args[2] = bad
    with pytest.raises(EmuLaunchError, match=match):
        rr.get_function("pack_args")((1,), (1,), tuple(args))


def test_argument_count_and_launch_config_errors(rr: EmuModule) -> None:
    kern = rr.get_function("indices")
    out = np.zeros(6 * 2048, np.int32)
    with pytest.raises(EmuLaunchError, match="takes 1 arguments"):
        kern((1,), (1,), (out, out))
    with pytest.raises(EmuLaunchError, match="scalar|pointer"):
        kern((1,), (1,), (np.int32(1),))
    with pytest.raises(EmuLaunchError, match="1024 threads"):
        kern((1,), (2048,), (out,))
    with pytest.raises(EmuLaunchError, match="configuration"):
        kern((0,), (32,), (out,))
    with pytest.raises(EmuError, match="no kernel named"):
        rr.get_function("nope")


# ---------------------------------------------------------------- bugs become exceptions


def test_divergent_shuffle_is_a_deadlock_naming_both_sites(faults: EmuModule) -> None:
    x = np.ones(32, np.float32)
    with pytest.raises(EmuDeadlockError) as e:
        faults.get_function("divergent_shuffle")((1,), (32,), (x,))
    msg = str(e.value)
    assert site("faults.cu", "SITE_A") in msg and site("faults.cu", "SITE_B") in msg, msg
    assert "__shfl_xor_sync" in msg and "divergent warp collective" in msg


def test_syncthreads_in_divergent_code_is_a_deadlock(faults: EmuModule) -> None:
    x = np.zeros(64, np.float32)
    with pytest.raises(EmuDeadlockError) as e:
        faults.get_function("divergent_syncthreads")((1,), (64,), (x,))
    msg = str(e.value)
    assert site("faults.cu", "SITE_SYNC") in msg and "threads 0-39" in msg and "40-63 have exited" in msg, msg
    assert "reached by only some threads" in msg


def test_lane_exiting_before_a_collective_is_a_deadlock(faults: EmuModule) -> None:
    x = np.ones(32, np.float32)
    with pytest.raises(EmuDeadlockError, match="exited before reaching it") as e:
        faults.get_function("early_exit_shuffle")((1,), (32,), (x,))
    assert site("faults.cu", "SITE_EXIT") in str(e.value)


def test_lane_not_in_its_own_mask_is_an_error(faults: EmuModule) -> None:
    with pytest.raises(EmuLaunchError, match="not in the mask"):
        faults.get_function("lane_not_in_mask")((1,), (32,), (np.ones(32, np.float32),))


def test_faults_become_launch_errors_and_the_process_survives(faults: EmuModule, rr: EmuModule) -> None:
    x = np.ones(64, np.float32)
    with pytest.raises(EmuLaunchError, match="invalid memory access"):
        faults.get_function("bad_pointer")((1,), (4,), (x, np.int64(1 << 40)))
    with pytest.raises(EmuLaunchError, match="misaligned"):
        faults.get_function("misaligned_vector")((1,), (4,), (x, np.zeros(64, np.float32), np.int32(1)))
    with pytest.raises(EmuLaunchError, match="assertion"):
        faults.get_function("failing_assert")((1,), (8,), (np.array([1, 2, -3, 4, 5, 6, 7, 8], np.int32),))
    with pytest.raises(EmuLaunchError, match="stack overflow"):
        faults.get_function("huge_local_array")((1,), (2,), (x, np.int32(1 << 20)))
    test_vector_add(rr)  # the emulator still works afterwards


def test_spin_wait_on_another_thread_times_out(faults: EmuModule) -> None:
    kern = faults.get_function("spin_wait")
    kern.timeout_s = 0.3
    with pytest.raises(EmuLaunchError, match="timeout"):
        kern((1,), (2,), (np.zeros(1, np.int32),))


def test_compile_error_reports_gcc_lines() -> None:
    with pytest.raises(EmuError, match="undefined_thing"):
        EmuModule('extern "C" __global__ void k(float* x) { x[0] = undefined_thing; }', filename="broken.cu")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux")
def test_address_sanitizer_catches_dynamic_shared_overflow() -> None:
    try:
        from pagedrun.build.cudaemu.asan import libasan_path

        libasan_path()
    except EmuError as e:
        pytest.skip(str(e))
    plain, asan = load("faults.cu"), load("faults.cu", sanitize="address")
    x, y = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    plain.get_function("dyn_overflow")((1,), (64,), (x, y, np.int32(63)), shared_mem=63 * 4)  # silent
    asan.get_function("dyn_overflow")((1,), (64,), (x, y, np.int32(64)), shared_mem=64 * 4)
    np.testing.assert_array_equal(y, np.roll(x, -1))  # results come back from the child process
    with pytest.raises(EmuLaunchError, match="heap-buffer-overflow") as e:
        asan.get_function("dyn_overflow")((1,), (64,), (x, y, np.int32(63)), shared_mem=63 * 4)
    assert "dynamic shared memory" in str(e.value)


# ---------------------------------------------------------------- cache


def test_warm_cache_does_not_recompile(monkeypatch: pytest.MonkeyPatch, rr: EmuModule) -> None:
    def no_compiler(*a, **k):
        raise AssertionError("g++ was invoked for a cached module")

    monkeypatch.setattr(emu_build.subprocess, "run", no_compiler)
    again = load("basics.cu", name_expressions=TEMPLATES, schedule="greedy")
    assert again.built.so_path == rr.built.so_path
    assert str(again.built.so_path).startswith(str(emu_build.cache_root()))


@pytest.mark.benchmark
def test_benchmark_block_throughput(rr: EmuModule) -> None:
    import time

    blocks = 2000
    x = np.ones(blocks * 128, np.float32)
    out = np.zeros(blocks, np.float32)
    kern = rr.get_function("bench_block")
    t = time.perf_counter()
    kern((blocks,), (128,), (x, out))
    dt = time.perf_counter() - t
    assert (out == 128).all()
    print(f"\n128-thread blocks: {blocks / dt:,.0f} blocks/s, {blocks * 128 / dt:,.0f} thread-blocks/s")
