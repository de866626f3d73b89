"""The emulator's <cuda_fp8.h> (kernels/emulator/cudaemu_fp8.h) against torch's float8 types and,
where nvcc is installed, against the CUDA header's own conversions on the same inputs.

CUDA semantics checked: round to nearest even; __NV_SATFINITE clamps overflow and +-inf to the
largest finite value (torch: clamp first, then convert); __NV_NOSAT gives inf for e5m2 (torch
does the same) and NaN for e4m3 (torch saturates instead, so that case is checked by value);
float NaN -> code 0x7f; fp8 -> half is exact with every NaN code -> 0x7fff.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

KDIR = Path(__file__).parent / "emu_kernels"
FORMATS = {0: (torch.float8_e4m3fn, 448.0), 1: (torch.float8_e5m2, 57344.0)}
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")


@pytest.fixture(scope="module")
def mod():
    from pagedrun.build.cudaemu import EmuModule

    return EmuModule((KDIR / "fp8.cu").read_text(), filename="emu_kernels/fp8.cu")


def all_codes() -> np.ndarray:
    return np.arange(256, dtype=np.uint8)


def code_values(e5m2: int) -> np.ndarray:
    """Every code's value per torch (NaN codes NaN), float64."""
    dt, _ = FORMATS[e5m2]
    return torch.from_numpy(all_codes()).view(dt).double().numpy()


def probe_floats(seed: int = 0) -> np.ndarray:
    """Random normals at several scales, every representable value, the exact midpoints between
    neighbours (ties) and just beside them, subnormals, overflow, +-inf, NaN, signed zeros."""
    rng = np.random.default_rng(seed)
    parts = [rng.standard_normal(4000) * s for s in (1e-3, 0.05, 1, 30, 300, 3e4)]
    for e5m2 in (0, 1):
        v = code_values(e5m2)
        v = np.unique(v[np.isfinite(v)])
        mids = (v[:-1] + v[1:]) / 2
        parts += [v, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)]
        top, tie = FORMATS[e5m2][1], (464.0, 61440.0)[e5m2]  # tie: largest finite + half its ulp
        parts.append(np.array([tie, np.nextafter(np.float32(tie), 0), top * 1.0625, top * 1.125, top * 1.2, top * 4, 1e30, 2.0 ** -30]))
    parts.append(np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45]))
    x = np.concatenate(parts).astype(np.float32)
    return np.concatenate([x, -x, np.array([np.nan], np.float32)])


def emu_to_fp8(mod, x: np.ndarray, e5m2: int, satfinite: int, double: bool = False) -> np.ndarray:
    out = np.empty(x.shape, np.uint8)
    kern = mod.get_function("fp8_from_double" if double else "fp8_from_float")
    kern(((x.size + 127) // 128,), (128,), (x, out, np.int32(x.size), np.int32(e5m2), np.int32(satfinite)))
    return out


def torch_satfinite(x: np.ndarray, e5m2: int) -> np.ndarray:
    dt, top = FORMATS[e5m2]
    t = torch.from_numpy(x.astype(np.float32)).clamp(-top, top)  # NaN stays NaN
    return t.to(dt).view(torch.uint8).numpy()


def assert_codes_equal(got: np.ndarray, want: np.ndarray, x: np.ndarray, e5m2: int, what: str) -> None:
    vals = code_values(e5m2)
    nan_want = np.isnan(vals[want])
    assert (np.isnan(vals[got]) == nan_want).all(), f"{what}: NaN-ness differs"
    bad = np.flatnonzero((got != want) & ~nan_want)
    assert bad.size == 0, f"{what}: {bad.size} differ, e.g. x={x[bad[:5]]} got {got[bad[:5]]} want {want[bad[:5]]}"


@pytest.mark.parametrize("e5m2", [0, 1], ids=["e4m3", "e5m2"])
def test_float_to_fp8_satfinite_matches_torch(mod, e5m2):
    x = probe_floats()
    got = emu_to_fp8(mod, x, e5m2, 1)
    assert_codes_equal(got, torch_satfinite(x, e5m2), x, e5m2, "satfinite")
    assert got[np.isnan(x)].tolist() == [0x7F], "float NaN -> canonical 0x7f"
    top_code = 0x7E if not e5m2 else 0x7B
    assert set(got[x == np.inf].tolist()) == {top_code} and set(got[x == -np.inf].tolist()) == {top_code | 0x80}
    # ties really are in the probe, and they went to the even code
    v = code_values(e5m2)
    fin = np.unique(v[np.isfinite(v) & (v >= 0)])
    mids = ((fin[:-1] + fin[1:]) / 2).astype(np.float32)
    codes = emu_to_fp8(mod, mids, e5m2, 1)
    assert (codes % 2 == 0).all(), "a tie rounded to an odd code"


@pytest.mark.parametrize("e5m2", [0, 1], ids=["e4m3", "e5m2"])
def test_float_to_fp8_nosat(mod, e5m2):
    x = probe_floats(1)
    got = emu_to_fp8(mod, x, e5m2, 0)
    dt, top = FORMATS[e5m2]
    # Overflow = beyond the largest finite value plus half its ulp (ties there round to even: e4m3's
    # 448 is even, so 464 stays; e5m2's 57344 is odd, so 61440 overflows).
    half_ulp = 16.0 if not e5m2 else 4096.0
    over = np.abs(x.astype(np.float64)) > top + half_ulp - (0 if not e5m2 else 1e-9)
    if e5m2:  # torch's e5m2 overflows to inf exactly like __NV_NOSAT
        want = torch.from_numpy(x).to(dt).view(torch.uint8).numpy()
        assert_codes_equal(got, want, x, e5m2, "nosat")
        assert set(got[over & (x > 0)].tolist()) == {0x7C}
    else:  # torch saturates e4m3fn; CUDA without saturation gives NaN
        assert_codes_equal(got[~over], torch_satfinite(x[~over], 0), x[~over], 0, "nosat in range")
        assert set(got[over].tolist()) <= {0x7F, 0xFF} and over.sum() > 10
        assert set(got[x == np.float32(464.0)].tolist()) == {0x7E} and set(got[x == np.float32(-464.0)].tolist()) == {0xFE}


@pytest.mark.parametrize("e5m2", [0, 1], ids=["e4m3", "e5m2"])
def test_double_to_fp8_matches_float_path(mod, e5m2):
    x = probe_floats(2)
    x = x[~np.isnan(x)]
    for sat in (0, 1):
        a = emu_to_fp8(mod, x, e5m2, sat)
        b = emu_to_fp8(mod, x.astype(np.float64), e5m2, sat, double=True)
        assert np.array_equal(a, b)


@pytest.mark.parametrize("e5m2", [0, 1], ids=["e4m3", "e5m2"])
def test_fp8_to_half_all_256_codes(mod, e5m2):
    codes = all_codes()
    out = np.empty(2 * 256, np.uint16)
    mod.get_function("fp8_to_half")((2,), (128,), (codes, out, np.int32(256), np.int32(e5m2)))
    single, pair = out[0::2], out[1::2]
    assert np.array_equal(single, pair), "x2 conversion differs from the scalar one"
    got = single.view(np.float16).astype(np.float64)
    want = code_values(e5m2)
    nan = np.isnan(want)
    assert (single[nan] == 0x7FFF).all(), "NaN codes -> canonical half NaN 0x7fff"
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))  # -0 stays -0
    assert nan.sum() == (2 if not e5m2 else 6)


@pytest.mark.parametrize("e5m2", [0, 1], ids=["e4m3", "e5m2"])
def test_fp8_classes_round_like_satfinite(mod, e5m2):
    x = probe_floats(3)
    codes = np.empty(x.shape, np.uint8)
    back = np.empty(x.shape, np.float32)
    mod.get_function("fp8_classes")(((x.size + 127) // 128,), (128,), (x, codes, back, np.int32(x.size), np.int32(e5m2)))
    assert np.array_equal(codes, emu_to_fp8(mod, x, e5m2, 1))
    v = code_values(e5m2)[codes]
    ok = ~np.isnan(v)
    assert np.array_equal(back[ok].astype(np.float64), v[ok]) and np.isnan(back[~ok]).all()


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the comparison with CUDA's own header needs it")
def test_emulator_equals_cuda_header_conversions(mod, tmp_path):
    """The same inputs through cuda_fp8.hpp's host conversions (the software path sm_80 runs; on
    sm_89+ the same conversions are one cvt.rn.satfinite instruction): identical codes and halves."""
    exe = tmp_path / "fp8_ref"
    build = subprocess.run([NVCC, "-DFP8_HOST_MAIN", "-arch=sm_80", "-o", str(exe), str(KDIR / "fp8.cu")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    x = probe_floats(4)
    run = subprocess.run([str(exe)], input=struct.pack("i", x.size) + x.tobytes(), capture_output=True, check=True)
    n = x.size
    ref = np.frombuffer(run.stdout[: 4 * n], np.uint8).reshape(2, 2, n)
    for e5m2 in (0, 1):
        for sat in (0, 1):
            assert np.array_equal(emu_to_fp8(mod, x, e5m2, sat), ref[e5m2, sat]), (e5m2, sat)
    halves = np.frombuffer(run.stdout[4 * n :], np.uint16).reshape(2, 256)
    for e5m2 in (0, 1):
        out = np.empty(512, np.uint16)
        mod.get_function("fp8_to_half")((2,), (128,), (all_codes(), out, np.int32(256), np.int32(e5m2)))
        assert np.array_equal(out[0::2], halves[e5m2])
