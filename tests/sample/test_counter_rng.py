"""The counter-based sampler draws (sample/counter_rng.py), the GPU's path, run here on the CPU:
the tensor hash equals the integer one bit for bit, the draws are Exp(1), sampling with them
follows the probabilities, and a row's token depends on its seed and position only."""
from __future__ import annotations

import math
import random

import torch

from pagedrun.sample import counter_rng
from pagedrun.sample.sampler import Sampler, SamplingRow, make_generator
from pagedrun.sampling_params import SamplingParams


def test_the_tensor_hash_is_the_integer_hash():
    rng = random.Random(0)
    values = [0, 1, 0xFFFF, 0x10000, 0xFFFF_FFFF, 0x8000_0000] + [rng.randrange(1 << 32) for _ in range(2000)]
    got = counter_rng.fmix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [counter_rng._fmix32_int(v) for v in values]
    assert len(set(got)) == len(set(values))  # a bijection


def test_draws_are_exponential():
    keys = [counter_rng.row_key(seed, 7) for seed in range(64)]
    e = counter_rng.exponentials(keys, 4096, torch.device("cpu")).double()
    assert torch.isfinite(e).all() and (e > 0).all()
    n = e.numel()
    # Mean and variance of Exp(1) are 1; over 262k draws both stay within 6 standard errors.
    assert abs(e.mean().item() - 1) < 6 / math.sqrt(n)
    assert abs(e.var().item() - 1) < 6 * math.sqrt(8 / n)
    # P(E > 1) = 1/e
    assert abs((e > 1).double().mean().item() - math.exp(-1)) < 6 * math.sqrt(0.25 / n)


def test_sampling_follows_the_probabilities():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    n = 20_000
    keys = [counter_rng.row_key(seed, 3) for seed in range(n)]
    exp = counter_rng.exponentials(keys, 5, torch.device("cpu"))
    tokens = (probs / exp).argmax(dim=-1)
    freq = torch.bincount(tokens, minlength=5).double() / n
    sd = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() < 6 * sd).all(), freq


def _row(seed, history_len, temperature=1.0):
    return SamplingRow(SamplingParams(temperature=temperature, seed=seed), make_generator(seed),
                       (list(range(history_len)), 1))


def test_a_rows_token_depends_on_its_seed_and_position_only():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    rows = [_row(s, 10 + s) for s in range(6)]
    batch = Sampler(rng="counter")(logits, rows).token_ids
    for i in range(6):  # alone, and in the reverse order
        assert Sampler(rng="counter")(logits[i : i + 1], [rows[i]]).token_ids == [batch[i]]
    reverse = Sampler(rng="counter")(logits.flip(0), rows[::-1]).token_ids
    assert reverse[::-1] == batch
    # Another position draws again: not one token forever.
    later = [Sampler(rng="counter")(logits[:1], [_row(0, 10 + k)]).token_ids[0] for k in range(40)]
    assert len(set(later)) > 1
