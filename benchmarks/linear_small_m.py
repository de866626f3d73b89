"""The model's GEMM: pagedrun.models.packed_gemm.linear_packed's C++ kernel on packed weights against torch's
F.linear on the same weights unpacked, per row count.

Runs every linear layer of the bench's 29M tiny-llama shapes (qkv 512->1024, o 512->512, gate/up
512->3072, down 1536->512, x 8 layers) on random weights for M rows, best and median of a few
repetitions, both paths alternating in the same process, and prints GFLOP/s.

    python benchmarks/linear_small_m.py [--threads 2] [--rows 1,8,16,32,64,128,256]
    python benchmarks/linear_small_m.py --model default   # SmolLM2-135M's shapes (hidden 576, 30 layers)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "tiny-llama": ([(1024, 512), (512, 512), (3072, 512), (512, 1536)], 8),
    "default": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
}


def bench(fn, reps: int = 10) -> tuple[float, float]:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,16,32,64,128,256")
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny-llama")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedrun.models import ops, packed_gemm

    if ops.load() is None:
        raise SystemExit(f"the CPU model ops are unavailable: {ops.load_error()}")
    shapes, layers = SHAPES[args.model]
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * k**-0.5 for n, k in shapes] for _ in range(layers)]
    packed = [[packed_gemm.pack_weight(w) for w in layer] for layer in weights]
    print(f"{args.model} shapes x {layers} layers, {args.threads} threads; GFLOP/s best (median)")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for _, k in shapes}
        flops = 2 * m * sum(n * k for n, k in shapes) * layers

        def run_kernel():
            for layer in packed:
                for p, (n, k) in zip(layer, shapes):
                    packed_gemm.linear_packed(xs[k], p, None, n)

        def run_torch():
            for layer in weights:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        kernel, torch_ = bench(run_kernel), bench(run_torch)
        print(f"M={m:5d}  packed kernel {flops / kernel[0] / 1e9:6.1f} ({flops / kernel[1] / 1e9:6.1f})   "
              f"torch {flops / torch_[0] / 1e9:6.1f} ({flops / torch_[1] / 1e9:6.1f})   "
              f"kernel/torch {torch_[0] / kernel[0]:4.2f}x")


if __name__ == "__main__":
    main()
