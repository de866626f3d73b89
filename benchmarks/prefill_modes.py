"""Prefill attention per layer in each prefill mode of the CuPy backend: varlen (one kernel launch for
every prefilling sequence), sdpa (torch SDPA per sequence) and kernel (pseudo-sequences).

    python3 benchmarks/prefill_modes.py [--dtype bfloat16] [--head-size 64] [--heads 9 --kv-heads 3]
                                        [--block-size 16] [--configs 16x128,4x512,1x2048,8x256+1024]
                                        [--modes varlen,sdpa,kernel] [--iters 20] [--json PATH]

A config SEQSxNEW[+PREFIX] is one step of SEQS sequences, each with NEW new tokens behind a cached
prefix of PREFIX tokens (0 when left out). For each mode the step's metadata is built once (the
first layer's call, not timed), then `iters` more layer calls are queued back to back on the same
step and timed with one synchronisation at the end: ms per layer, host work included, as the model
runs it (reshape_and_cache and attention). The modes' outputs are compared with the first mode's.
Without a GPU it prints one line and exits 2; `--device cpu` runs the same through the emulated
backend (tiny configs only: a check that the script runs, not a timing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "attention" / "cuda")]

import test_kernels as T  # noqa: E402

DEFAULT_CONFIGS = "16x128,4x512,1x2048,8x256+1024"


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        seqs, _, rest = item.strip().partition("x")
        new, _, prefix = rest.partition("+")
        try:
            out.append((int(seqs), int(new), int(prefix or 0)))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not SEQSxNEW[+PREFIX]") from None
    return out


def gpu_available() -> bool:
    try:
        import cupy
        import torch

        return bool(cupy.is_available()) and torch.cuda.is_available()
    except Exception:
        return False


def time_mode(mode: str, config: tuple[int, int, int], a, device: str):
    """(ms per layer, output) of `iters` layer calls on one step in prefill mode `mode`."""
    import torch

    seqs, new, prefix = config
    spec = T.StepSpec([prefix] * seqs, [new] * seqs)
    dtype = getattr(torch, a.dtype)
    q, k, v, kc, vc, meta, _, _ = T.build_step(spec, dtype, a.head_size, a.block_size, a.heads, a.kv_heads,
                                               seed=1, poison=False)
    if device == "cuda":
        from pagedrun.attention.cuda.cupy_backend import CupyAttentionBackend

        for name in ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc"):
            setattr(meta, name, getattr(meta, name).cuda())
        q, k, v, kc, vc = (t.cuda() for t in (q, k, v, kc, vc))
        backend = CupyAttentionBackend(prefill=mode)
        sync = torch.cuda.synchronize
    else:
        from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

        backend = EmulatedAttentionBackend(prefill=mode)
        sync = lambda: None  # noqa: E731
    scale = a.head_size**-0.5
    out = backend.forward(q, k, v, kc, vc, meta, scale)  # builds the step (and compiles, the first time)
    sync()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        out = backend.forward(q, k, v, kc, vc, meta, scale)
    sync()
    return (time.perf_counter() - t0) / a.iters * 1e3, out.float().cpu()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--modes", default="varlen,sdpa,kernel")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    configs, modes = parse_configs(a.configs), [m.strip() for m in a.modes.split(",")]
    if a.device == "cuda" and not gpu_available():
        print("prefill_modes: no GPU (cupy / torch CUDA unavailable)")
        return 2
    if a.device == "cuda":
        import torch

        print(f"device: {torch.cuda.get_device_name()}")
    print(f"{a.dtype}, head {a.head_size}, {a.heads}/{a.kv_heads} heads, block {a.block_size}; ms per layer call")
    print(f"{'config':>14} " + " ".join(f"{m:>9}" for m in modes) + "  max |diff| vs " + modes[0])
    rows = []
    for config in configs:
        results = {m: time_mode(m, config, a, a.device) for m in modes}
        first = results[modes[0]][1]
        diff = max(float((r[1] - first).abs().max()) for r in results.values())
        name = f"{config[0]}x{config[1]}" + (f"+{config[2]}" if config[2] else "")
        print(f"{name:>14} " + " ".join(f"{results[m][0]:9.3f}" for m in modes) + f"  {diff:.2e}")
        rows.append({"config": name, "ms": {m: results[m][0] for m in modes}, "max_abs_diff": diff})
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
