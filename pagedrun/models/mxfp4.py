"""MXFP4 expert weights (GPT-OSS checkpoints) dequantized once, at load.

OpenAI ships GPT-OSS's expert projections in the OCP microscaling format MXFP4: every 32
consecutive weights along the input dimension share one 8-bit power-of-two scale (E8M0, bias 127),
and each weight is a 4-bit E2M1 float, two to a byte, low nibble first. On disk, per projection:

    mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]
    mlp.experts.down_proj_blocks     uint8 [E, H,  I/32, 16]   mlp.experts.down_proj_scales     uint8 [E, H,  I/32]

A weight is E2M1(nibble) * 2^(scale - 127). Dequantized rows are [E, out, in]; the bf16
checkpoints' layout (and transformers' after its own dequantization) is the transpose, [E, in, out],
which is what `dequantize` returns, so a model's loader takes either checkpoint alike.

This is the simple way to run these checkpoints: the experts then take 4x the memory of the packed
bytes (GPT-OSS-20b: about 13 GB of MXFP4 experts become about 25 GB in bf16). Keeping them packed and
dequantizing inside the expert GEMM is the next step; it is not done yet.
"""
from __future__ import annotations

import torch

from pagedrun.errors import PagedrunError

# E2M1: sign, 2 exponent bits, 1 mantissa bit; the 16 values a nibble encodes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # weights per scale
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """[E, out, G, 16] packed nibbles and [E, out, G] scales -> [E, G * 32, out] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise PagedrunError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise PagedrunError(f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not "
                            f"match ([E, out, G, {BLOCK // 2}] and [E, out, G])")
    experts, rows, groups, _ = blocks.shape
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(experts, rows, groups, BLOCK, dtype=dtype)
    for e in range(experts):  # one expert at a time: the float32 intermediate stays small
        b = blocks[e].to(torch.int64)
        values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(rows, groups, BLOCK)
        # Exact: a power of two times an E2M1 value is representable in float32 (and in bf16 unless
        # the scale leaves bf16's exponent range, where ldexp saturates as the hardware format would).
        exponent = scales[e].to(torch.int32) - 127
        out[e] = torch.ldexp(values, exponent[..., None].to(torch.float32)).to(dtype)
    return out.reshape(experts, rows, groups * BLOCK).transpose(1, 2).contiguous()


def is_mxfp4_name(name: str) -> bool:
    return name.endswith(SUFFIXES)


def pair_and_dequantize(weights, dtype: torch.dtype):
    """(name, tensor) pairs with each `X_blocks` / `X_scales` pair replaced by (X, dequantized);
    everything else passes through. A pair's halves may come in either order, from any shard."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if not is_mxfp4_name(name):
            yield name, tensor
            continue
        suffix = "_blocks" if name.endswith("_blocks") else "_scales"
        base = name[: -len(suffix)]
        halves = pending.setdefault(base, {})
        if suffix in halves:
            raise PagedrunError(f"{name}: appears twice in the checkpoint")
        halves[suffix] = tensor
        if len(halves) == 2:
            del pending[base]
            yield base, dequantize(halves["_blocks"], halves["_scales"], dtype, base)
    if pending:
        base, halves = next(iter(pending.items()))
        missing = "_scales" if "_blocks" in halves else "_blocks"
        raise PagedrunError(f"{base}{missing}: missing (MXFP4 weights come as _blocks and _scales pairs)")
