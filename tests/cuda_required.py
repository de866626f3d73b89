"""What a CUDA test needs, and the skip with one reason where it is missing: a GPU with CuPy
(GPU_ONLY: tests/gpu/, run by benchmarks/gpu_check.sh) or NVRTC and the CUDA headers (the compile
gates, which need no GPU)."""
from __future__ import annotations

import pytest
import torch


def cuda_and_cupy() -> bool:
    try:
        import cupy

        return torch.cuda.is_available() and bool(cupy.is_available())
    except Exception:
        return False


GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not cuda_and_cupy(), reason="needs a CUDA GPU and CuPy")]


def nvrtc_includes_or_skip() -> list[str]:
    """The include directories NVRTC compiles our kernels with; a skip where NVRTC or the headers are missing."""
    from pagedrun.attention.cuda import kernels as K
    from pagedrun.build import nvrtc

    try:
        nvrtc.version()
    except nvrtc.NvrtcError as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    includes = K.cuda_include_dirs()
    if not includes:
        pytest.skip("no CUDA headers (cuda_fp16.h) for NVRTC: pip install nvidia-cuda-runtime or set CUDA_PATH")
    return includes
