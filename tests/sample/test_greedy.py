"""Greedy argmax (kernels/cpu/argmax_cpu.cpp through pagedrun.sample.argmax) against torch.argmax, whose
answer it must give exactly: the first maximum, ties included (bf16 logits tie often), the first
NaN of a row that holds one, rows of -inf, rows shorter than a vector, strided rows; float32 and
bfloat16 logits."""
from __future__ import annotations

import pytest
import torch
from cpu_libraries import load_or_skip

from pagedrun.sample import argmax as greedy


@pytest.fixture(scope="module")
def kern():
    return load_or_skip(greedy.load, greedy.load_error, "argmax kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 1000, 49152])
def test_argmax_rows_is_torch_argmax_with_ties(kern, n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(37, n, generator=g) * 0.05).bfloat16().float()  # few distinct values: many ties
    x[3] = 0.5  # a whole row tied
    x[5, n // 2] = x[5, n - 1] = 9.0  # the maximum twice, late in the row
    x[6, -1] = 9.0  # the maximum in the tail past the last whole vector
    x[7] = -float("inf")
    x = x.to(dtype)  # the values are bf16's already: the same logits either way
    got = greedy.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(got, x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_nan_and_strided_rows(kern, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 200, generator=g).to(dtype)
    x[1, 150] = float("nan")
    x[2, 3] = x[2, 190] = float("nan")
    x[3, 199] = float("nan")  # in the tail only
    x[4, 0] = float("inf")
    assert torch.equal(greedy.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(5, 300, generator=g).to(dtype)
    view = wide[:, 17:250]  # row stride 300, rows of 233
    assert torch.equal(greedy.argmax_rows(view), view.argmax(dim=-1))


def test_other_dtypes_take_torch(kern):
    x = torch.randn(4, 50).half()
    assert torch.equal(greedy.argmax_rows(x), x.argmax(dim=-1))
