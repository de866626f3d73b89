"""The MoE experts' grouped torch path (pagedrun/models/moe.py grouped_experts) on a CUDA GPU in
bfloat16: equal to the per-expert loop within bf16 rounding, both near a float32 reference on the
CPU; no host sync (torch.cuda.set_sync_debug_mode("error"), which the loop trips); and captured in
a CUDA graph, replayed on other routings, equal to the eager result.

Skipped without CUDA; the grouped path needs torch's native bf16 _grouped_mm (compute capability
9.x or 10.x: H100, B200), elsewhere the loop runs and the grouped checks are skipped.
"""
from __future__ import annotations

import pytest
import torch
from moe_blocks import FLAVOURS, random_block

from pagedrun.models.moe import grouped_mm_takes, route

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def _native() -> bool:
    return torch.cuda.get_device_capability()[0] in (9, 10)


def _cuda_block(flavour, h=256, i=128, e=16, k=4):
    """A bf16 block on the GPU with real-model-like row strides (multiples of 16 bytes) and its
    float32 twin on the CPU (the same bf16 values, widened): the reference."""
    block, cfg = random_block(torch.bfloat16, flavour, e=e, h=h, i=i, k=k)
    ref, _ = random_block(torch.float32, flavour, e=e, h=h, i=i, k=k)
    ref.load_state_dict({n: v.float() for n, v in block.state_dict().items()})
    return block.cuda(), ref, cfg


def _close(got, want):
    """bf16 rounding of the two GEMMs and the activation: 2 % of the largest value."""
    got, want = got.float().cpu(), want.float().cpu()
    assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, (got - want).abs().max()


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("t", [1, 7, 300])
def test_grouped_equals_loop_cuda_bf16(flavour, t):
    if not _native():
        pytest.skip("torch's _grouped_mm has no native bf16 kernel on this GPU: the loop runs")
    block, ref, cfg = _cuda_block(flavour)
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(t)).bfloat16()
    with torch.no_grad():
        w, ids = route(block.gate(x.cuda()), cfg.moe)
        xc = x.cuda()
        assert grouped_mm_takes(xc, block.w13, block.w2)
        got, loop = block.torch_experts(xc, w, ids), block.loop_experts(xc, w, ids)
        want = ref.loop_experts(x.float(), w.float().cpu(), ids.cpu())
    _close(got, loop)
    _close(got, want)
    with torch.no_grad():  # every slot of every token to one expert; experts 0 and 15 idle
        one = torch.full_like(ids, 5)
        _close(block.torch_experts(xc, w, one), block.loop_experts(xc, w, one))


@pytest.mark.parametrize("flavour", ["qwen3_moe", "gpt_oss"])
def test_no_sync_cuda(flavour):
    """Under sync debug mode "error" the grouped experts and the whole block run; the loop raises
    (its bincount().tolist()), which shows the mode catches a sync."""
    if not _native():
        pytest.skip("torch's _grouped_mm has no native bf16 kernel on this GPU: the loop runs (it syncs)")
    block, _, cfg = _cuda_block(flavour)
    x = torch.randn(33, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        w, ids = route(block.gate(x), cfg.moe)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            block.torch_experts(x, w, ids)
            block(x)
            with pytest.raises(RuntimeError):
                block.loop_experts(x, w, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_other_routings():
    """The experts captured once in a CUDA graph, replayed on three routings (new ids and weights
    copied into the captured inputs): each replay equals the eager grouped result."""
    if not _native():
        pytest.skip("torch's _grouped_mm has no native bf16 kernel on this GPU")
    block, _, cfg = _cuda_block("gpt_oss")
    t, k = 16, cfg.moe.top_k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, cfg.hidden_size, generator=g).bfloat16().cuda()
    routings = []
    for r in range(3):
        logits = torch.randn(t, cfg.moe.num_experts, generator=g).bfloat16().cuda()
        if r == 2:
            logits[:, 3] += 100  # every token's first choice expert 3
        routings.append(route(logits, cfg.moe))
    w_in, ids_in = routings[0][0].clone(), routings[0][1].clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture, as torch's docs ask
            block.torch_experts(x, w_in, ids_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block.torch_experts(x, w_in, ids_in)
        for w, ids in routings:
            assert ids.shape == (t, k)
            w_in.copy_(w)
            ids_in.copy_(ids)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, block.torch_experts(x, w, ids))
