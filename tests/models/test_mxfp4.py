"""MXFP4 dequantization (GPT-OSS expert weights) against transformers' own, bit for bit."""
import pytest
import torch

from pagedrun.errors import PagedrunError
from pagedrun.models import mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert ours.shape == (3, 4 * 32, 10) and ours.dtype == dtype
    assert torch.equal(ours, theirs)


def test_values_and_layout_by_hand():
    # Expert 0, output row 1, first group: byte 0x21 = low nibble 1 (0.5), high nibble 2 (1.0);
    # scale 128 = 2^1. In [E, in, out]: inputs 0 and 1 of output 1.
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, 1, 0, 0] = 0x21
    blocks[0, 0, 0, 15] = 0xF9  # inputs 30, 31 of output 0: -0.5 (9), -6.0 (15)
    scales = torch.full((1, 2, 1), 127, dtype=torch.uint8)
    scales[0, 1, 0] = 128
    w = mxfp4.dequantize(blocks, scales, torch.float32)
    assert w[0, 0, 1].item() == 1.0 and w[0, 1, 1].item() == 2.0
    assert w[0, 30, 0].item() == -0.5 and w[0, 31, 0].item() == -6.0
    assert w.abs().sum().item() == 1.0 + 2.0 + 0.5 + 6.0


def test_pairs_in_any_order_and_missing_halves():
    b = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    s = torch.full((1, 2, 1), 127, dtype=torch.uint8)
    got = list(mxfp4.pair_and_dequantize([("x_scales", s), ("other", torch.ones(1)), ("x_blocks", b)],
                                         torch.float32))
    assert [n for n, _ in got] == ["other", "x"] and got[1][1].shape == (1, 32, 2)
    with pytest.raises(PagedrunError, match=r"^y_scales: missing"):
        list(mxfp4.pair_and_dequantize([("y_blocks", b)], torch.float32))
    with pytest.raises(PagedrunError, match="do not match"):
        mxfp4.dequantize(b, s[:, :1], torch.float32, "z")
