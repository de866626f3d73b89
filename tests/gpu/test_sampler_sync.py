"""The sampler on a GPU reads the device once per step (issue 36 item 4): greedy rows, random rows
with penalties, logit bias, top-k/p and seeded counter draws all stay on the device until the ids
are read. torch's sync debug mode counts every synchronising call."""
from __future__ import annotations

import warnings

import pytest
import torch

from pagedrun.sample.sampler import Sampler, SamplingRow, make_generator
from pagedrun.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB = 4096


def _rows(kind: str, n: int) -> list[SamplingRow]:
    rows = []
    for i in range(n):
        if kind == "greedy":
            p = SamplingParams(max_tokens=8)
        else:
            p = SamplingParams(max_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=i,
                               repetition_penalty=1.1, frequency_penalty=0.2, logit_bias={5: 3.0})
        rows.append(SamplingRow(p, make_generator(i) if p.seed is not None else None, ([1, 2, 3, i], 2)))
    return rows


def _syncs(fn) -> int:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("kind", ["greedy", "random"])
def test_one_read_per_step(kind):
    sampler = Sampler(seed=0)
    logits = torch.randn(16, VOCAB, device="cuda")
    rows = _rows(kind, 16)
    sampler(logits, rows)  # warm-up: pinned host blocks, counter columns
    torch.cuda.synchronize()
    assert _syncs(lambda: sampler(logits, rows)) <= 1
