"""Loading the C++ CPU kernels in tests: skip only when there is no compiler."""
from __future__ import annotations

import shutil

import pytest

from pagedrun.build import cpu as cpu_build


def load_or_skip(load, load_error, what: str):
    """load() of pagedrun.attention.cpu_kernels or pagedrun.models.ops, or skip/fail the test."""
    lib = load()
    if lib is None:
        # No compiler is the one acceptable reason; a compiler that fails to build the kernels is a bug.
        if shutil.which(cpu_build.compiler()) is None:
            pytest.skip(f"{what} unavailable: {load_error()}")
        pytest.fail(f"the {what} did not build: {load_error()}")
    return lib
