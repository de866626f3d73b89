"""The marks of a test module that runs on a real GPU through the CuPy backend: skipped, with one
reason, where torch sees no CUDA device or CuPy none (benchmarks/gpu_check.sh runs tests/gpu/)."""
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
