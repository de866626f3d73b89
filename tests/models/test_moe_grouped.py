"""The MoE experts through torch._grouped_mm (pagedrun/models/moe.py grouped_experts) against the
per-expert loop (FusedMoE.loop_experts, the fallback and reference), on the CPU.

- equal to the loop for every activation / bias / weight combination the families use (Qwen3-MoE,
  Qwen2-MoE's shared expert, Mixtral's float32 weights, GPT-OSS's biased swigluoai): bit for bit in
  float32, because torch's CPU _grouped_mm runs one mm per group, the GEMM the loop runs on the same
  rows; bfloat16 and float16 are equal here too but held to 2 ulps only, so that no CPU's choice of
  low-precision GEMM fails them; edge routings: experts with no rows, one token, every token to one
  expert, T * k prime-ish, no tokens; a planted bug (a bias row from the wrong expert) caught;
- which path runs: grouped on plain weights with 16-byte row strides, the loop on packed weights and
  on strides _grouped_mm refuses;
- no host sync and no routing-dependent shape: the aten ops it dispatches hold none of .item's,
  bincount's, nonzero's kind, and it runs on meta tensors (no data at all); the loop fails both;
- greedy tokens through the engine equal HF's with the torch path forced (ops.torch_only()):
  Qwen3-MoE and GPT-OSS, the grouped path seen running.
The CUDA bf16 case (the native kernel, torch.cuda.set_sync_debug_mode) is tests/gpu/test_moe_grouped_cuda.py.
"""
from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_greedy_cached, random_prompts
from moe_blocks import FLAVOURS, random_block
from torch.utils._python_dispatch import TorchDispatchMode

from pagedrun.llm import LLM
from pagedrun.models import moe, ops, packed_gemm
from pagedrun.models.loader import load_model
from pagedrun.models.moe import FusedMoE, grouped_experts, grouped_mm_takes, route
from pagedrun.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (family, tiny model seed): the seeds tests/models/test_moe.py and test_gpt_oss.py build them with
FAMILIES = {"qwen3_moe": 20, "qwen2_moe": 22, "gpt_oss": 3}
# Syncs a GPU (reads a value back) or sizes an output by the data: none may run per step.
SYNCING = {"_local_scalar_dense", "item", "nonzero", "bincount", "masked_select", "_unique", "_unique2",
           "unique_dim", "unique_consecutive", "repeat_interleave", "_to_copy", "equal", "is_nonzero"}


def _both(block, x, w, ids):
    with torch.no_grad():
        return block.torch_experts(x, w, ids), block.loop_experts(x, w, ids)


def _assert_same(got, want, dtype):
    if dtype is torch.float32:
        assert torch.equal(got, want), (got - want).abs().max()
    else:  # equal here too; held to 2 ulps of the dtype so that no CPU's GEMM choice fails it
        eps, top = torch.finfo(dtype).eps, float(want.abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * top)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_grouped_equals_loop(flavour, dtype):
    """The block's experts on the router's choice for 37 tokens (T * k = 111 rows), then the whole
    block (shared expert included) with the loop forced, grouped on."""
    block, cfg = random_block(dtype, flavour)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        w, ids = route(block.gate(x), cfg.moe)
    assert w.dtype is (torch.float32 if flavour == "mixtral" else dtype)
    assert grouped_mm_takes(x, block.w13, block.w2)
    got, want = _both(block, x, w, ids)
    _assert_same(got, want, dtype)
    with torch.no_grad():
        whole = block(x)
        block.torch_experts = block.loop_experts  # the instance's: the block's forward takes it
        _assert_same(whole, block(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["idle_experts", "one_token", "one_expert", "no_tokens", "many"])
def test_grouped_edges(case, dtype):
    """Routings the router rarely gives: experts 0, 5, 7 idle (and the first and last groups
    empty), one token, every slot of every token to expert 3 (k copies: HF's top-k never repeats an
    expert, worst_case_routing can when E < k), no tokens, 101 tokens on 5 of 8 experts."""
    block, cfg = random_block(dtype, "gpt_oss", k=3)
    g = torch.Generator().manual_seed(2)
    t = {"one_token": 1, "no_tokens": 0, "many": 101}.get(case, 13)
    x = torch.randn(t, cfg.hidden_size, generator=g).to(dtype)
    if case == "one_expert":
        ids = torch.full((t, 3), 3)
    else:
        pool = torch.tensor([1, 2, 3, 4, 6]) if case != "one_token" else torch.arange(8)
        rows = [pool[torch.randperm(len(pool), generator=g)[:3]].sort().values for _ in range(t)]
        ids = torch.stack(rows) if rows else torch.empty(0, 3, dtype=torch.long)
    w = torch.rand(t, 3, generator=g).to(dtype)
    got, want = _both(block, x, w, ids)
    assert got.shape == (t, cfg.hidden_size) and got.dtype is dtype
    _assert_same(got, want, dtype)
    if t:
        assert float(got.float().abs().max()) > 0


def test_grouped_catches_a_wrong_bias_row():
    """Mutation: each row's w2 bias taken from the next expert's row is caught by the comparison."""
    block, cfg = random_block(torch.float32, "gpt_oss")
    x = torch.randn(9, cfg.hidden_size)
    w, ids = route(block.gate(x), cfg.moe)
    with torch.no_grad():
        want = block.loop_experts(x, w, ids)
        b2 = block.w2_bias.roll(1, dims=0)
        got = grouped_experts(x, w, ids, block.w13, block.w13_bias, block.w2, b2, block._act)
    assert not torch.equal(got, want)


def test_which_path_runs(monkeypatch):
    """Grouped on plain weights with 16-byte row strides; the loop on packed weights (the CPU
    kernels' layout, under ops.torch_only()) and where a row stride is not a multiple of 16 bytes."""
    seen = []
    monkeypatch.setattr(moe, "grouped_experts", lambda *a: seen.append("grouped") or real(*a))
    real = grouped_experts
    block, cfg = random_block(torch.float32)
    x = torch.randn(4, cfg.hidden_size)
    w, ids = route(block.gate(x), cfg.moe)
    with torch.no_grad():
        block.torch_experts(x, w, ids)
    assert seen == ["grouped"]
    for dtype, h, i in ((torch.bfloat16, 64, 36), (torch.float32, 66, 32)):  # 72 / 264 bytes: rows not 16-aligned
        odd, odd_cfg = random_block(dtype, h=h, i=i)
        x = torch.randn(4, h).to(dtype)
        assert not grouped_mm_takes(x, odd.w13, odd.w2)
        w, ids = route(odd.gate(x), odd_cfg.moe)
        with torch.no_grad():
            torch.testing.assert_close(odd.torch_experts(x, w, ids), odd.loop_experts(x, w, ids))
    assert seen == ["grouped"]
    if packed_gemm.packing_panel(torch.float32, torch.device("cpu")) is None:
        pytest.skip(f"no CPU kernels, nothing is packed: {ops.load_error()}")
    packed = FusedMoE(cfg, torch.float32)  # kernels on: packed as the CPU kernels want
    assert packed.packed
    with torch.no_grad():
        for e in range(8):
            for part, rows in (("gate", slice(0, 32)), ("up", slice(32, 64))):
                packed.load_expert(e, part, block.w13[e, rows])
            packed.load_expert(e, "down", block.w2[e])
        x = torch.randn(4, cfg.hidden_size)
        w, ids = route(block.gate(x), cfg.moe)
        with ops.torch_only():  # the C++ kernel declines: torch_experts, on packed weights
            got, want = packed.torch_experts(x, w, ids), block.loop_experts(x, w, ids)
        assert seen == ["grouped"]
        assert torch.equal(got, want)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flavour", ["qwen3_moe", "gpt_oss"])
def test_no_host_sync(flavour):
    """The grouped path dispatches no op that reads a value back or sizes by the data, two
    _grouped_mm calls, and runs on meta tensors (no data: no .item / .tolist can run, every shape
    follows from the input shapes: what a CUDA graph needs; _grouped_mm's meta kernel is bf16
    only). The loop fails both checks (bincount, then .tolist of it)."""
    block, cfg = random_block(torch.bfloat16, flavour)
    x = torch.randn(21, cfg.hidden_size).bfloat16()
    with torch.no_grad():
        w, ids = route(block.gate(x), cfg.moe)
        with _Recorder() as rec:
            block.torch_experts(x, w, ids)
        assert rec.ops.count("_grouped_mm") == 2 and not SYNCING & set(rec.ops), rec.ops
        with _Recorder() as rec:
            block.loop_experts(x, w, ids)
        assert SYNCING & set(rec.ops)

        def meta(t):
            return None if t is None else t.to("meta")

        out = grouped_experts(meta(x), meta(w), meta(ids), meta(block.w13), meta(block.w13_bias), meta(block.w2),
                              meta(block.w2_bias), block._act)
        assert out.device.type == "meta" and out.shape == x.shape and out.dtype is x.dtype
        block.to("meta")
        with pytest.raises((NotImplementedError, RuntimeError)):
            block.loop_experts(meta(x), meta(w), meta(ids))


def _generate(model_dir, prompts):
    llm = LLM(None, [f"model.path={model_dir}", "model.dtype=float32", "cache.block_size=16",
                     "cache.num_blocks=64"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_engine_greedy_matches_hf_on_the_grouped_path(tiny_model, family, monkeypatch):
    """The engine's float32 greedy tokens equal HF's with every model op in torch (ops.torch_only():
    the experts stay plain, so torch_experts runs them grouped), prefill and decode steps."""
    model_dir = tiny_model(family, seed=FAMILIES[family])
    calls = []
    real = grouped_experts
    monkeypatch.setattr(moe, "grouped_experts", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    prompts = random_prompts(640, [17, 4, 1, 30], seed=7)
    with ops.torch_only():
        got = _generate(model_dir, prompts)
    assert got == hf_greedy_cached(model_dir, prompts, 8)[0]
    assert calls and min(calls) <= 4 < max(calls)  # decode steps (few rows) and prefill ones


def test_loaded_model_blocks_take_the_grouped_path(tiny_model):
    """A model loaded under ops.torch_only() keeps every expert plain, in the [E, 2I, H] layout the
    grouped path takes."""
    with ops.torch_only():
        model, _ = load_model(tiny_model("qwen2_moe", seed=FAMILIES["qwen2_moe"]), torch.float32)
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(not b.packed and grouped_mm_takes(torch.empty(1, b.hidden_size), b.w13, b.w2)
                          for b in blocks)
