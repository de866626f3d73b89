"""Prefill attention on the CPU: the C++ kernel's varlen call with its products on AMX tiles and on
fp32 FMAs (bf16: kernels/cpu/attention_amx.h where the CPU has AMX), against torch's SDPA per
sequence over contiguous K/V (flash attention on CPU), in one process, best of --reps, interleaved.

Sequences of --min-len..--max-len prompt tokens (no cached prefix) in a shuffled paged cache;
GFLOP/s count Q.K^T and P.V over the causal triangle. Also prints each path's worst error against
float64.

    python benchmarks/cpu_prefill_attention.py [--heads 9 --kv-heads 3 --head-size 64 --block-size 16]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from pagedrun.attention import cpu_kernels

    kern = cpu_kernels.load()
    if kern is None:
        sys.exit(f"cpu_prefill_attention: the CPU attention kernel did not load: {cpu_kernels.load_error()}")
    dtype = getattr(torch, a.dtype)
    H, KVH, D, BS = a.heads, a.kv_heads, a.head_size, a.block_size
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    lens = [rng.randint(a.min_len, a.max_len) for _ in range(a.seqs)]
    nblk = [-(-n // BS) for n in lens]
    num_blocks = sum(nblk) + 4
    kc = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).int()
    tables = torch.zeros(a.seqs, max(nblk), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = ids[used:used + n]
        used += n
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ctx = torch.zeros(a.seqs, dtype=torch.int32)
    q = torch.randn(sum(lens), H, D, generator=g).to(dtype)
    scale = D**-0.5
    # Per sequence, contiguous: [heads, len, D] for SDPA and the float64 reference.
    per_seq = []
    for i, n in enumerate(lens):
        blocks = tables[i, :nblk[i]].long()
        k = kc[blocks].reshape(-1, KVH, D)[:n].transpose(0, 1).contiguous()
        v = vc[blocks].reshape(-1, KVH, D)[:n].transpose(0, 1).contiguous()
        per_seq.append((q[qsl[i]:qsl[i + 1]].transpose(0, 1).contiguous(), k, v))

    outs = {}

    def kernel(amx: int):
        def run():
            kern.amx(amx)
            out = outs.setdefault(amx, torch.empty_like(q))
            assert kern.varlen(out, q, kc, vc, tables, qsl, seq_lens, ctx, scale, a.threads) == 0
        return run

    def sdpa():
        for qq, k, v in per_seq:
            F.scaled_dot_product_attention(qq[None], k[None], v[None], is_causal=True, enable_gqa=True)

    had = kern.amx()
    paths = [("kernel, fp32 FMAs", kernel(0)), ("torch SDPA per sequence", sdpa)]
    if had and dtype == torch.bfloat16:
        paths.insert(0, ("kernel, AMX tiles", kernel(1)))
    best = {name: float("inf") for name, _ in paths}
    for _ in range(a.reps):
        for name, fn in paths:
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    kern.amx(int(had))

    ref = []
    for qq, k, v in per_seq:
        rep = H // KVH
        s = (qq.double() @ k.double().repeat_interleave(rep, 0).transpose(1, 2)) * scale
        n = qq.shape[1]
        s.masked_fill_(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        ref.append((s.softmax(-1) @ v.double().repeat_interleave(rep, 0)).transpose(0, 1))
    ref = torch.cat(ref)
    flops = sum(n * (n + 1) / 2 for n in lens) * H * D * 4
    print(f"{a.seqs} sequences, {sum(lens)} tokens ({a.min_len}-{a.max_len}), heads {H}/{KVH}, head {D}, "
          f"block {BS}, {a.dtype}, {a.threads} threads; best of {a.reps}")
    for name, _ in paths:
        err = ""
        if name.startswith("kernel"):
            amx = 1 if "AMX" in name else 0
            err = f"  worst |err| vs float64 {(outs[amx].double() - ref).abs().max().item():.4f}"
        print(f"  {name:26s} {best[name] * 1e3:7.2f} ms  {flops / best[name] / 1e9:6.0f} GFLOP/s{err}")


if __name__ == "__main__":
    main()
