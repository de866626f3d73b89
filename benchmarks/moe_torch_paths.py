"""FusedMoE's two torch paths on the CPU: grouped_experts (two torch._grouped_mm calls) against
loop_experts (one matmul pair per active expert), same block, same rows, interleaved.

Widths: Qwen3-MoE-30B-A3B (hidden 2048, 128 experts, top-8, moe_intermediate 768, SiLU) and
GPT-OSS-20B (hidden 2880, 32 experts, top-4, intermediate 2880, biased swigluoai), random weights
and random distinct experts per token; batch 1, 8, 64; then the tiny widths (hidden 64,
intermediate 32) where the GEMMs cost nothing and what is left is each path's overhead. Medians
and minimums over `--reps` calls per path, the two paths alternated twice.

    PYTHONPATH=. python3 benchmarks/moe_torch_paths.py [--threads 1] [--dtypes bfloat16,float32]

Memory: the Qwen3 block is 1.2 GB in bf16 (2.4 GB fp32), the GPT-OSS one 1.6 GB (3.2 GB).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_blocks import random_block  # noqa: E402

from pagedrun.models.moe import grouped_mm_takes  # noqa: E402

WIDTHS = {"qwen3-30b-a3b": ("qwen3_moe", dict(e=128, h=2048, i=768, k=8)),
          "gpt-oss-20b": ("gpt_oss", dict(e=32, h=2880, i=2880, k=4)),
          "tiny-e8-k2": ("qwen3_moe", dict(e=8, h=64, i=32, k=2)),
          "tiny-e128-k8": ("qwen3_moe", dict(e=128, h=64, i=32, k=8))}


def run(name: str, dtype: torch.dtype, reps: int) -> None:
    flavour, s = WIDTHS[name]
    block, _ = random_block(dtype, flavour, **s)
    g = torch.Generator().manual_seed(0)
    for t in (1, 8, 64):
        x = torch.randn(t, s["h"], generator=g).to(dtype)
        ids = torch.stack([torch.randperm(s["e"], generator=g)[:s["k"]].sort().values for _ in range(t)])
        w = torch.rand(t, s["k"], generator=g).to(dtype)
        assert grouped_mm_takes(x, block.w13, block.w2)
        n = reps if name.startswith("tiny") else max(3, reps * 8 // (8 + t))
        res: dict[str, list[float]] = {}
        with torch.no_grad():
            for label, f in (("loop", block.loop_experts), ("grouped", block.torch_experts)) * 2:
                f(x, w, ids)
                for _ in range(n):
                    t0 = time.perf_counter()
                    f(x, w, ids)
                    res.setdefault(label, []).append(time.perf_counter() - t0)
        cells = "  ".join(f"{k} {statistics.median(v) * 1e3:8.3f} / {min(v) * 1e3:8.3f}" for k, v in res.items())
        print(f"{name:14} {str(dtype)[6:]:8} T={t:<3} active={len(ids.unique()):<4} {cells}  (ms median / min)",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--widths", default=",".join(WIDTHS))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for name in a.widths.split(","):
        for d in a.dtypes.split(","):
            run(name, getattr(torch, d), a.reps)


if __name__ == "__main__":
    main()
