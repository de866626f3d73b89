"""The GPU path's host logic, checked on the CPU (issue 15): everything here runs without a GPU.

What needs a GPU to check is listed in docs/gpu.md and run by benchmarks/gpu_check.sh.
"""
from __future__ import annotations

import pytest

from pagedrun.attention import cuda_install as CI


# ---------------------------------------------------------------- install: which CuPy fits


@pytest.mark.parametrize("torch_cuda, installed, expect", [
    ("13.0", [], "pip install 'pagedrun[gpu-cu13]' (torch is built for CUDA 13.0)"),
    ("12.8", [], "pip install 'pagedrun[gpu-cu12]' (torch is built for CUDA 12.8)"),
    ("13.0", ["cupy-cuda12x"], "cupy-cuda12x is installed but torch is built for CUDA 13.0: "
                               "pip uninstall cupy-cuda12x && pip install 'pagedrun[gpu-cu13]'"),
    ("13.0", ["cupy-cuda12x", "cupy-cuda13x"], "several CuPy distributions are installed"),
    (None, [], "torch here has no CUDA build"),
    ("11.8", [], "no CuPy extra"),
])
def test_install_hint_names_the_matching_extra(torch_cuda, installed, expect):
    hint = CI.install_hint(torch_cuda, installed)
    assert expect in hint
    assert "\n" not in hint


def test_cupy_backend_without_cupy_is_one_line_naming_an_extra(monkeypatch):
    from pagedrun.attention import registry
    from pagedrun.errors import PagedrunError

    monkeypatch.setattr(registry, "_cupy_status", lambda: "import cupy failed: ModuleNotFoundError")
    with pytest.raises(PagedrunError) as e:
        registry.make_backend("cupy", "cuda")
    assert "\n" not in str(e.value) and "gpu-cu1" in str(e.value)
    monkeypatch.setattr(registry, "_cupy_status", lambda: "CuPy sees no CUDA GPU")
    with pytest.raises(PagedrunError, match="needs a CUDA GPU"):
        registry.make_backend("cupy", "cuda")
