"""Counter-based random numbers for sampling on the device: a draw is a hash of (seed, position,
token id), so a request's tokens depend only on its seed and its own history, whichever batch it
is in, and no per-row generator runs on the host.

The host path (sample/sampler.py) keeps a torch.Generator per seeded sequence and draws a
vocabulary of exponentials from it on the CPU each step; on a GPU that is a host loop per row and
a vocabulary-sized copy per row per step. Here every random row's exponentials come from one
vectorised expression on the logits' device, keyed like Philox streams (vLLM and FlashInfer key
theirs by seed and offset): the row's key is a hash of its seed and the position of the token it
samples, each vocabulary entry adds its index.

The hash is MurmurHash3's 32-bit finaliser, a bijection with full avalanche, on int64 tensors that
hold 32-bit values: multiplications are split in 16-bit halves so that no product overflows.
"""
from __future__ import annotations

import torch

from pagedrun.sample.transfer import to_device

_M32 = 0xFFFF_FFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32): the high half's product is kept to 16 bits before the shift."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    """fmix32 on a Python int (the per-row keys are computed on the host, a few per step)."""
    h ^= h >> 16
    h = (h * 0x85EB_CA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2_AE35) & _M32
    return h ^ (h >> 16)


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of the draw of one sequence's token at `position`."""
    seed &= 0xFFFF_FFFF_FFFF_FFFF
    key = _fmix32_int(_fmix32_int((seed & _M32) ^ 0x9E37_79B9) ^ (seed >> 32))
    return _fmix32_int(key ^ _fmix32_int((position & _M32) ^ 0x7F4A_7C15))


_COLUMNS: dict[tuple[int, str], torch.Tensor] = {}


def _columns(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _COLUMNS:
        _COLUMNS[key] = fmix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ 0x94D0_49BB)
    return _COLUMNS[key]


def exponentials(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 draws of Exp(1), row r from its key (row_key)."""
    k = to_device(keys, torch.int64, device).unsqueeze(1)
    bits = fmix32(k ^ _columns(vocab, device).unsqueeze(0)) >> 8  # 24 bits: exact in float32
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(uniform)
