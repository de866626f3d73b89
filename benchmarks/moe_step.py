"""The MoE block's decode step against the same experts computed densely, on Qwen3-MoE-30B-A3B's
widths (hidden 2048, 128 experts, top-8, moe_intermediate 768), random weights.

For each dtype (float32, bfloat16) and batch (1, 8, 64 decode tokens): the time of FusedMoE's
forward (router, top-k, the C++ grouped kernel, the weighted sum) on fresh random rows each step,
alternating between `--layers` blocks so that no expert's weights stay in cache from the step
before (a decode step visits every layer once); and the dense step: one packed GEMM pair over all
experts' weights for the same rows (gate/up of all 128 experts with SiLU fused, then down over all
of them), which reads every expert once. The target:

    MoE step <= (active experts / all experts) x dense step x 1.25

where active = the distinct experts the step's tokens route to. Medians over --steps steps.

    PYTHONPATH=. python3 benchmarks/moe_step.py [--layers 2] [--steps 12] [--threads 2]

Memory: each block is 128 x 3 x 2048 x 768 weights (1.2 GB in bf16, 2.4 GB in fp32), plus one dense
copy; --layers 2 in fp32 needs some 7.5 GB.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedrun.models import packed_gemm
from pagedrun.models.config import ModelConfig
from pagedrun.models.moe import FusedMoE

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
             "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "intermediate_size": 6144, "max_position_embeddings": 40960, "num_experts": 128,
             "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True}


def make_block(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> FusedMoE:
    block = FusedMoE(cfg, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (block.w13, block.w2, block.gate.weight):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(dtype))
    block.gate.process_weights_after_loading()
    block.process_weights_after_loading()
    assert block.packed, "the CPU kernels did not pack the experts"
    return block


def dense_weights(block: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts as one dense layer: [gate of every expert; up of every expert] packed for
    gate_up_silu, and every expert's down projection side by side ([H, E * I]) packed."""
    gates, ups, downs = [], [], []
    for e in range(block.num_experts):
        w13, _, w2, _ = block.expert_weights(e)
        gates.append(w13[:block.intermediate_size])
        ups.append(w13[block.intermediate_size:])
        downs.append(w2)
    w13 = packed_gemm.pack_gate_up(torch.cat(gates + ups), None)[0]
    w2 = packed_gemm.pack_weight(torch.cat(downs, dim=1))
    return w13, w2


def median_ms(fn, steps: int) -> float:
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        fn(i)
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,8,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_hf_dict(QWEN3_MOE, "qwen3-moe-30b-a3b widths")
    m = cfg.moe
    print(f"Qwen3-MoE widths: hidden {cfg.hidden_size}, {m.num_experts} experts, top-{m.top_k}, "
          f"moe_intermediate {m.intermediate_size}; {args.layers} layers, {args.threads} threads")
    print(f"{'dtype':9} {'batch':>5} {'active':>6} {'moe ms':>8} {'dense ms':>9} {'bound ms':>9} {'ratio':>6}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        blocks = [make_block(cfg, dtype, seed) for seed in range(args.layers)]
        w13, w2 = dense_weights(blocks[0])
        i_all = m.num_experts * m.intermediate_size
        for batch in map(int, args.batches.split(",")):
            g = torch.Generator().manual_seed(batch)
            xs = [torch.randn(batch, cfg.hidden_size, generator=g).to(dtype) for _ in range(args.steps + 1)]
            active = []

            def moe_step(i):
                block = blocks[i % len(blocks)]
                active.append(len(set(block.gate(xs[i]).float().topk(m.top_k, dim=-1).indices.flatten().tolist())))
                t0 = time.perf_counter()
                block(xs[i])
                return time.perf_counter() - t0

            times = []
            for i in range(args.steps + 1):
                dt = moe_step(i)
                if i:
                    times.append(dt)
            moe_ms = statistics.median(times) * 1e3
            dense_ms = median_ms(lambda i: packed_gemm.linear_packed(
                packed_gemm.gate_up_silu(xs[i], w13, None, i_all), w2, None, cfg.hidden_size), args.steps)
            act = statistics.mean(active[1:])
            bound = act / m.num_experts * dense_ms * 1.25
            print(f"{name:9} {batch:>5} {act:>6.1f} {moe_ms:>8.2f} {dense_ms:>9.2f} {bound:>9.2f} "
                  f"{moe_ms / (bound / 1.25):>6.2f}")
        del blocks, w13, w2


if __name__ == "__main__":
    main()
