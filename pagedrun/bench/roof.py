"""The roof `pagedrun bench` measures engines against: on the CPU the machine's FMA peak for the
dtype and the ISA the kernels are built for (pagedrun/bench/fma_peak.py), on a GPU torch.matmul's best."""
from __future__ import annotations

import time


class Roof:
    """Measured before and after the engines; the higher counts."""

    def __init__(self, dtype: str, device: str, threads: int, quick: bool) -> None:
        self.dtype, self.device, self.threads, self.quick = dtype, device, threads, quick
        self.kind = "matmul" if device == "cuda" else "fma_peak"
        self.isa: str | None = None
        self.samples: list[float] = []
        self.measure_again()

    def measure_again(self) -> None:
        if self.kind == "fma_peak":
            try:
                from pagedrun.bench import fma_peak

                m = fma_peak.measure(self.dtype, self.threads, 0.3 if self.quick else 1.0)
                self.isa = m["isa"]
                self.samples.append(m["flops_per_s"])
                return
            except (OSError, RuntimeError) as e:  # no compiler: torch's matmul is the best roof left
                self.kind, self.isa = "matmul", f"torch.matmul (FMA microbenchmark unavailable: {e})"
        self.samples.append(matmul_flops_per_s(self.dtype, self.device, self.quick))
        self.isa = self.isa or "torch.matmul"

    @property
    def flops(self) -> float:
        return max(self.samples)

    def describe(self) -> str:
        what = "FMA peak" if self.kind == "fma_peak" else "matmul"
        return (f"{what} {self.samples[-1] / 1e9:,.1f} GFLOP/s ({self.dtype}, {self.isa}, "
                f"{self.threads} threads)")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "isa": self.isa, "dtype": self.dtype, "threads": self.threads,
                "flops_per_s": self.flops, "samples": self.samples,
                "note": "fma_peak: register-only FMA chains (kernels/cpu/fma_peak.cpp) at the widest vector "
                        "the CPU kernels are built for; bf16: AMX tiles where the CPU has them, else the "
                        "higher of vdpbf16ps (avx512_bf16) and the fp32 FMAs"}


def matmul_flops_per_s(dtype: str, device: str, quick: bool) -> float:
    """Best of a few timed torch.matmul calls on square matrices: the compute roof for this dtype."""
    import torch

    n = 1024 if quick else 2048
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        torch.matmul(a, b)
    sync()
    best = float("inf")
    deadline = time.perf_counter() + (0.5 if quick else 2.0)
    while True:
        t = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best
