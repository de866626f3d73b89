"""The CPU decode attention kernel against itself at another commit, alternated in one process.

    python3 benchmarks/decode_attention_ab.py REF [--block-size 16] [--seqs 48] [--dtype float32]

Builds kernels/cpu/paged_attention_cpu.cpp twice, as REF has it (a commit exported with git
archive, or a folder holding pagedrun/ and kernels/, as ab_bench.py takes it) and as this tree has it,
with the flags the engine uses (pagedrun.build.cpu), loads both and times paged_attention_decode
over 30 layers of their own caches, the default model's heads (9 query, 3 KV, head size 64), one
query per sequence, contexts of 120-380 tokens, blocks in random order: 30 x 18 MiB (fp32, 48
sequences) is more than the L3 holds, so every layer's K/V comes from memory, as in a decode step.
Prints the median time of each, the K/V read rate (bytes the contexts hold / time) and whether the
two produce the same bits. Timings alternate, so a drift of the machine weighs on both.

A REF from before the window and softcap arguments (issue 37) is called without them, one from before
the sinks argument (GPT-OSS) without it; --window W (default 0) times sliding-window decode in both (REF
must then take the arguments); --sinks gives the tree's calls a sink per head (REF's, where it takes
them; timing what sinks cost, the bits then differ). --cpu-time
(with --threads 1, where the kernel runs on the calling thread) times the thread's CPU time instead
of wall time, which other processes' load on a shared machine inflates much less.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedrun.build import cpu as cpu_build

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_bench import ROOT, ref_tree  # noqa: E402  (REF's pagedrun/ and kernels/, as ab_bench takes it)

HEADS, KV_HEADS, HEAD_SIZE, LAYERS = 9, 3, 64, 30
DTYPES = {"float32": (torch.float32, 0), "bfloat16": (torch.bfloat16, 1)}


def decode_fn(kernel_dir: Path, window: int, sinks: torch.Tensor | None = None):
    """The decode entry point, called with or without (window, softcap) after the scale and the sinks
    pointer last, as its source declares them."""
    source = kernel_dir / "paged_attention_cpu.cpp"
    lib = ctypes.CDLL(str(cpu_build.build(source)))
    fn = lib.paged_attention_decode
    fn.restype = ctypes.c_int
    has_window = "int32_t window, float softcap" in source.read_text()
    if window and not has_window:
        raise SystemExit(f"decode_attention_ab: {kernel_dir} has no window argument")
    variant = [ctypes.c_int32, ctypes.c_float] if has_window else []
    has_sinks = "const float* v_aux, const float* sinks" in source.read_text()
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9 + [ctypes.c_float] + variant + \
        [ctypes.c_int] * 3 + [ctypes.c_void_p] * (3 if has_sinks else 2)

    def call(*args):
        head, tail = args[:16], args[16:]
        last = (None if sinks is None else sinks.data_ptr(),) if has_sinks else ()
        return fn(*head, *((window, 0.0) if has_window else ()), *tail, *last)
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=48)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--sinks", action="store_true")
    args = ap.parse_args()
    dtype, code = DTYPES[args.dtype]
    bs, nseq = args.block_size, args.seqs

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(120, 380, (nseq,), generator=g).to(torch.int32)
    per_seq = [(int(n) + bs - 1) // bs for n in lens]
    num_blocks, stride = sum(per_seq), max(per_seq)
    layers = []
    for _ in range(LAYERS):
        k = torch.randn(num_blocks, bs, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
        v = torch.randn(num_blocks, bs, KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
        perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
        table = torch.zeros(nseq, stride, dtype=torch.int32)
        for i, start in enumerate([0, *torch.tensor(per_seq).cumsum(0).tolist()[:-1]]):
            table[i, :per_seq[i]] = perm[start:start + per_seq[i]]
        layers.append((torch.randn(nseq, HEADS, HEAD_SIZE, generator=g).to(dtype), k, v, table))
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_SIZE * 2 * layers[0][1].element_size() * LAYERS

    with tempfile.TemporaryDirectory() as tmp:
        sinks = torch.randn(HEADS, generator=g) if args.sinks else None
        fns = {"ref": decode_fn(ref_tree(args.ref, Path(tmp)) / "kernels" / "cpu", args.window, sinks),
               "tree": decode_fn(ROOT / "kernels" / "cpu", args.window, sinks)}
    outs = {name: [torch.empty(nseq, HEADS, HEAD_SIZE, dtype=dtype) for _ in range(LAYERS)] for name in fns}
    times: dict[str, list[float]] = {name: [] for name in fns}

    if args.cpu_time and args.threads != 1:
        raise SystemExit("decode_attention_ab: --cpu-time needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter

    def run(name: str) -> None:
        fn, t = fns[name], clock()
        for (q, k, v, table), out in zip(layers, outs[name]):
            rc = fn(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                    nseq, HEADS, KV_HEADS, HEAD_SIZE, bs, num_blocks, stride, HEADS * HEAD_SIZE,
                    HEADS * HEAD_SIZE, HEAD_SIZE ** -0.5, code, args.threads, 0, None, None)
            if rc:
                raise SystemExit(f"decode_attention_ab: paged_attention_decode returned {rc} ({name})")
        times[name].append(clock() - t)

    for r in range(args.rounds):
        for name in (("ref", "tree") if r % 2 == 0 else ("tree", "ref")):
            run(name)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    same = all(torch.equal(a, b) for a, b in zip(outs["ref"], outs["tree"]))
    print(f"block {bs}, {nseq} sequences, {args.dtype}, {args.threads} threads, {LAYERS} layers, "
          f"{kv_bytes / 2**20:.0f} MiB of K/V; medians of {args.rounds}:")
    for name in ("ref", "tree"):
        print(f"  {name:4s} {med[name] * 1e3:8.2f} ms  {kv_bytes / med[name] / 1e9:5.1f} GB/s")
    print(f"  tree / ref time {med['tree'] / med['ref']:.3f}; same bits: {same}")


if __name__ == "__main__":
    main()
