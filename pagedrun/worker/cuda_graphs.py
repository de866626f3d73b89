"""CUDA graphs for decode-only steps: one graph per batch-size bucket, replayed on static buffers.

A decode step of a small model on a GPU is bound by the host issuing ~1,000 kernels one by one
(docs/design/cuda-graphs.md). Captured once per bucket (worker/decode_buffers.py: 1, 2, 4, 8, 16, ...,
max_num_seqs), a step is: fill the pinned buffers, copy them (non-blocking), replay. The region is
ModelRunner.forward_static: embedding, every layer (torch ops and the CuPy RawKernels, launched on
torch's current stream, which is the capture stream while capturing), final norm, LM head, the
logits copied into one static [max_num_seqs, vocab] buffer.

What must hold inside the region (GPU-ROOFLINE.md 5.3): one stream; no host synchronisation and no
host data (every per-step input is in the static buffers); no allocation outside torch's graph pool
(a CuPy allocation while capturing raises, `no_cupy_allocations`); fixed launch arguments (the bucket
fixes the rows, max_model_len the attention version and grid); everything loaded before capture
(warm-up forwards per bucket: NVRTC modules, cuBLAS handles, CuPy's first DLPack-checked wraps).
Buckets are captured largest first into one pool (torch.cuda.graph_pool_handle()), as vLLM and
nano-vllm do: a smaller graph's intermediates fit in the blocks the larger one freed.

`graphs_off_reason` decides (model.cuda_graphs: auto | true | false) and says why not;
`DecodeGraphs.capture` measures what capture took (time, torch's pool, the device's memory).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from pagedrun.errors import PagedrunError
from pagedrun.worker.decode_buffers import DecodeShape

WARMUP_FORWARDS = 2  # per bucket before its capture (vLLM V0's _NUM_WARMUP_ITERS)
# The estimate's fixed part: the allocator's segments (2 MiB for small blocks, 20 MiB for large
# ones) that a pool holds whole, and the graph objects. Derived, not measured.
POOL_FLOOR = 32 << 20
SETTINGS = ("auto", "true", "false")


def graphs_off_reason(setting: str, device: torch.device, backend_name: str, model_cfg, kv_cache_dtype: str,
                      dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when decode steps are to be captured, else why not (the start-up line's words).
    setting `true` makes a reason an error, `auto` a fallback to eager steps."""
    if setting not in SETTINGS:
        raise PagedrunError(f"model.cuda_graphs: {setting!r}: one of {', '.join(SETTINGS)}")
    if setting == "false":
        return "model.cuda_graphs is false"
    reason = None
    if device.type != "cuda":
        reason = f"the model runs on {device.type}, graphs need CUDA"
    elif backend_name != "cupy":
        reason = f"the {backend_name} attention backend (graphs capture the cupy backend's kernels)"
    elif getattr(model_cfg, "moe", None) is not None and not _moe_host_free(model_cfg, device, dtype):
        # Only the grouped experts path (torch._grouped_mm, native on sm90/sm100 in bf16) keeps the
        # routing on the device; the per-expert loop reads counts back to the host, which capture forbids.
        reason = ("an MoE model whose experts run the per-expert loop (it reads counts back to the host; "
                  "graphs need bf16 on an sm90/sm100 GPU: models/moe.py)")
    elif kv_cache_dtype.startswith("fp8"):
        reason = "an fp8 KV cache (its per-layer scales are host tensors, copied in every layer)"
    if reason is not None and setting == "true":
        raise PagedrunError(f"model.cuda_graphs: true, but {reason}; use auto or false")
    return reason


def _moe_host_free(model_cfg, device: torch.device, dtype: torch.dtype) -> bool:
    from pagedrun.models.moe import host_free_on

    return host_free_on(device, dtype, model_cfg.hidden_size, model_cfg.moe.intermediate_size)


def estimate_pool_bytes(shape: DecodeShape, model_cfg, elem_bytes: int) -> int:
    """What capture is expected to take, reserved before the KV cache is sized (derived, not
    measured): the static logits [Bmax, vocab] and the pool, which holds one forward's live
    tensors at the largest bucket: the LM head's output, a layer's activations (qkv, attention,
    residual, MLP at twice the intermediate size) and v2's fp32 partials at max_model_len.
    Counted twice over for the allocator's rounding and the blocks a graph keeps per layer, plus
    POOL_FLOOR."""
    from pagedrun.attention.cuda.kernels import num_partitions

    b = shape.max_rows
    h, inter, vocab = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.vocab_size
    heads, kv_heads, hd = model_cfg.num_attention_heads, model_cfg.num_key_value_heads, model_cfg.head_dim
    parts = num_partitions(shape.max_model_len)
    layer = b * elem_bytes * (4 * h + (heads + 2 * kv_heads) * hd + heads * hd + 3 * inter)
    v2 = b * heads * parts * (hd + 2) * 4 if parts > 1 else 0
    logits = b * vocab * elem_bytes
    return 2 * logits + 2 * (layer + v2) + POOL_FLOOR


@contextlib.contextmanager
def no_cupy_allocations():
    """Any CuPy allocation inside raises: during capture it would bypass torch's graph pool (a
    cudaMalloc refused under global capture, or a pool block the graph later shares)."""
    import cupy

    def refuse(size: int):
        raise RuntimeError(f"cuda graphs: a CuPy allocation of {size} bytes while capturing (every allocation "
                           f"in a captured step must come from torch's graph pool: cupy_backend.torch_alloc)")

    with cupy.cuda.using_allocator(refuse):
        yield


@dataclass
class CaptureStats:
    buckets: list[int]
    capture_s: float
    pool_bytes: int  # torch's reserved memory grown by capture (the private pool and the logits)
    device_bytes: int  # the device's free memory shrunk by capture (pool + graph objects)

    def line(self, estimate: int = 0) -> str:
        mib = 1 << 20
        est = f", est. {estimate / mib:.0f} MiB" if estimate else ""
        return (f"cuda graphs: {len(self.buckets)} buckets up to {max(self.buckets)}, {self.capture_s:.1f} s capture, "
                f"pool {self.pool_bytes / mib:.0f} MiB (device {self.device_bytes / mib:.0f} MiB{est})")


class DecodeGraphs:
    """The captured graphs of a ModelRunner with static buffers, and their logits."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None

    def has(self, bucket: int) -> bool:
        return bucket in self.graphs

    def replay(self, bucket: int) -> torch.Tensor:
        """The bucket's graph on what the buffers hold (filled and copied on this stream before)."""
        self.graphs[bucket].replay()
        return self.logits[:bucket]

    def capture(self, buckets: list[int] | None = None) -> CaptureStats:
        r = self.runner
        device = r.kv_caches[0][0].device
        buckets = sorted(buckets or r.buckets, reverse=True)  # largest first: one pool for all
        torch.cuda.synchronize(device)
        reserved0, free0 = torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        r.buffers.padding()  # every row writes nothing and reads nothing: the KV cache is untouched
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in buckets:
                for _ in range(WARMUP_FORWARDS):
                    out = r.forward_static(b)
                if self.logits is None:
                    self.logits = torch.empty((buckets[0], out.shape[1]), dtype=out.dtype, device=out.device)
                del out
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with no_cupy_allocations(), torch.cuda.graph(graph, pool=pool):
                    self.logits[:b].copy_(r.forward_static(b))
                self.graphs[b] = graph
        torch.cuda.synchronize(device)
        r.graphs = self
        return CaptureStats(sorted(buckets), time.perf_counter() - t0,
                            max(0, torch.cuda.memory_reserved(device) - reserved0),
                            max(0, free0 - torch.cuda.mem_get_info(device)[0]))
