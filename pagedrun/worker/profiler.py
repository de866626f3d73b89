"""Step 1 of the KV sizing (pagedrun/worker/memory.py): one profile pass of the worst step the
scheduler may build, and the machine's memory read around it.

    CUDA  torch.cuda max_memory_allocated for the pass (+ reserved-not-allocated at its peak),
          cudaMemGetInfo for everything outside torch
    CPU   peak RSS over the pass: the kernel's high-water mark reset via /proc/self/clear_refs and
          read from VmHWM (a 1 ms VmRSS sampler where clear_refs cannot be written)

The raw readings (CudaReadings, CpuReadings) and the MemoryProfile built from them are separate so
tests can inject numbers a GPU would report; nothing here decides how many blocks to allocate.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import dataclass

import torch

from pagedrun.errors import PagedrunError
from pagedrun.models.moe import worst_case_routing

# Decoder layers the pass runs. Every layer has the same shapes and frees its intermediates before
# the next one starts (only h and the residual cross a layer), so the peak of the first layers is
# the peak of all of them; two, not one, so the pass also sees a layer that starts from the
# allocator state another layer left. All 30 layers of the default model were most of its start-up
# (docs/log/2026-11-23-profile-pass-two-layers.md); the activation peaks of the two passes are
# compared in tests/worker/test_memory.py.
PROFILE_LAYERS = 2

# What the profile pass samples with: the sampler's most expensive path (sort for top-k/top-p,
# min-p renormalisation, log-softmax + top-20 logprobs), so its buffers are in the peak.
_PROFILE_SAMPLING = dict(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20)


@dataclass
class MemoryProfile:
    """What one profile pass measured. Bytes throughout."""
    device: str
    method: str  # how the peak was measured
    total_bytes: int  # cudaMemGetInfo total | MemTotal
    free_before_bytes: int  # cudaMemGetInfo free | MemAvailable, before the pass
    free_after_bytes: int  # the same after it (CUDA: after empty_cache)
    weights_bytes: int  # parameters + buffers of the model (from the tensors' sizes)
    activation_peak_bytes: int  # peak during the pass above what was in use just before it
    non_torch_bytes: int  # CUDA: driver's in-use - torch reserved (context, CuPy, others); CPU: RSS - weights
    torch_other_bytes: int  # CUDA: torch allocations that are neither weights nor the pass (0 on CPU)
    cupy_pool_bytes: int  # CuPy's default pool (part of non_torch_bytes), 0 when CuPy is not loaded
    profile_tokens: int
    profile_seqs: int
    profile_s: float
    # CUDA: torch's reserved-but-unallocated bytes at the pass's peak (caching-allocator
    # fragmentation: held from the driver, unusable by the KV cache); 0 on CPU.
    reserved_slack_bytes: int = 0

    @property
    def peak_in_use_bytes(self) -> int:
        """What the KV cache must leave room for: weights + other torch + activation peak + non-torch
        + torch's reserved-not-allocated slack at the peak."""
        return (self.weights_bytes + self.torch_other_bytes + self.activation_peak_bytes + self.non_torch_bytes
                + self.reserved_slack_bytes)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); empty off Linux."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


def mem_available_bytes() -> int:
    """MemAvailable: what the kernel says can be allocated without swapping."""
    m = meminfo()
    if "MemAvailable" in m:
        return m["MemAvailable"]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1]) * 1024
    except OSError:  # no /proc (macOS): only the lifetime peak exists, an upper bound for both
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        out = {"VmRSS": peak, "VmHWM": peak}
    return out


def rss_bytes() -> int:
    return _status()["VmRSS"]


def peak_rss_bytes() -> int:
    return _status()["VmHWM"]


def _malloc_trim() -> None:
    """Give freed heap pages back to the kernel, so RSS before the pass is not inflated by whatever
    glibc kept from earlier work (and two profiles in one process see the same baseline)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRSS:
    """Peak resident set size over a `with` block.

    Preferred: reset the kernel's high-water mark (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0)
    and read VmHWM afterwards: exact, every page counted, no sampling gaps. Where clear_refs cannot
    be written, a thread samples VmRSS every millisecond (torch kernels release the GIL, so it
    runs during them), which can miss a peak shorter than the interval.
    """

    def __enter__(self) -> PeakRSS:
        self._stop = threading.Event()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM reset via /proc/self/clear_refs"
            self._thread = None
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self._max = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._max = max(self._max, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            self.peak = peak_rss_bytes()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, rss_bytes())


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Lengths of the dummy sequences: the step budget spread evenly, as vLLM's profile_run does."""
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    q, r = divmod(max_num_batched_tokens, seqs)
    return [min(q + (i < r), max_model_len) for i in range(seqs)]


# Host bytes per profiled token the pass holds whatever the model: its id in a Python list (a pointer),
# its position and its slot as int64. A lower bound: torch's intermediates come on top.
_INDEX_BYTES_PER_TOKEN = 24
_FIX = "lower scheduler.max_num_batched_tokens (or scheduler.max_num_seqs, model.max_model_len)"


class ProfileTooLarge(PagedrunError):
    """The recipe's worst step cannot even be profiled on this machine (one line, with the numbers)."""


def profile_floor_bytes(model_cfg, lens: list[int], block_size: int, dtype: torch.dtype, num_layers: int) -> int:
    """What the profile pass allocates at the least: its K/V blocks (exact) and, per token, the ids and the
    tensors that live together inside a layer's MLP: residual, normed input, the activation's output (the
    CPU kernel fuses gate and up into it); in an MoE block, its top_k rows of input, activation and
    output (MoEConfig.activation_elems_per_token), whichever is more."""
    elem = torch.empty((), dtype=dtype).element_size()
    blocks = sum(-(-(n + 1) // block_size) for n in lens)
    kv = 2 * num_layers * blocks * block_size * model_cfg.num_key_value_heads * model_cfg.head_dim * elem
    mlp = model_cfg.intermediate_size
    moe = getattr(model_cfg, "moe", None)
    if moe is not None:
        mlp = max(mlp, moe.activation_elems_per_token(model_cfg.hidden_size))
    per_token = _INDEX_BYTES_PER_TOKEN + elem * (2 * model_cfg.hidden_size + mlp)
    return kv + per_token * sum(lens)


def check_profile_fits(need: int, available: int, lens: list[int], where: str) -> None:
    """Refuse, before allocating anything, a step whose profile pass cannot fit what `where` has
    available: otherwise the allocator fails partway (docs/log/2026-11-27-hardening-round-three.md)."""
    if need <= available:
        return
    tokens = sum(lens)
    fit = max(1, tokens * available // max(need, 1))
    raise ProfileTooLarge(
        f"scheduler.max_num_batched_tokens: a step of {tokens:,} tokens over {len(lens):,} sequences needs at "
        f"least {need / (1 << 30):.2f} GiB to profile, more than the {available / (1 << 30):.2f} GiB {where} has "
        f"available; about {fit:,} tokens fit: {_FIX}")


def _allocation_failed(e: BaseException) -> bool:
    """An allocator's refusal (torch's CPU allocator raises a plain RuntimeError), not a bug."""
    from pagedrun.worker.cache_engine import CUDA_OOM

    text = str(e)
    return isinstance(e, (MemoryError, CUDA_OOM)) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))


def model_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:  # tied embeddings are one tensor
            seen.add(key)
            total += t.nbytes
    return total


def run_profile(model, model_cfg, backend, *, dtype: torch.dtype, device: torch.device, block_size: int,
                max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                num_profile_layers: int = PROFILE_LAYERS) -> MemoryProfile:
    """One forward pass of the worst step the scheduler may build (its first `num_profile_layers`
    decoder layers, the final norm and the LM head), plus the sampler, measured. A step this machine
    cannot hold is refused in one line: before allocating when even its floor does not fit, else when
    an allocation fails."""
    lens = profile_batch(max_num_batched_tokens, max_num_seqs, max_model_len)
    num_layers = min(num_profile_layers, model_cfg.num_hidden_layers)
    need = profile_floor_bytes(model_cfg, lens, block_size, dtype, num_layers)
    if device.type == "cuda":
        check_profile_fits(need, torch.cuda.mem_get_info(device)[0], lens, str(device))
    else:
        check_profile_fits(need, mem_available_bytes(), lens, "RAM")
    try:
        return _run_profile(model, model_cfg, backend, lens, num_layers, dtype=dtype, device=device,
                            block_size=block_size, max_model_len=max_model_len)
    except (RuntimeError, MemoryError) as e:  # the floor fitted, the rest did not: one line too
        if not _allocation_failed(e):
            raise
        gc.collect()
        why = " ".join(str(e).split())[:160]
        raise ProfileTooLarge(f"scheduler.max_num_batched_tokens: the profile pass of a step of {sum(lens):,} "
                              f"tokens over {len(lens):,} sequences ran out of memory ({why}); {_FIX}") from None


def _run_profile(model, model_cfg, backend, lens: list[int], num_layers: int, *, dtype: torch.dtype,
                 device: torch.device, block_size: int, max_model_len: int) -> MemoryProfile:
    from pagedrun.sample.sampler import Sampler, SamplingRow
    from pagedrun.sampling_params import SamplingParams
    from pagedrun.worker.cache_engine import CacheEngine
    from pagedrun.worker.model_runner import ModelInput, ModelRunner

    # The pass writes its K/V somewhere: a cache of exactly the blocks it needs, set up (and on the
    # CPU, its pages committed) before the baseline, so it is not counted as activations.
    need = [-(-(n + 1) // block_size) for n in lens]  # the prompt and the one token decoded after it
    cache = CacheEngine(num_layers, model_cfg.num_key_value_heads, model_cfg.head_dim,
                        block_size, sum(need), 0, dtype, device)
    cache.gpu_kv_cache.zero_()
    dummy_bytes = cache.gpu_kv_cache.nbytes
    runner = ModelRunner(model, cache.gpu_cache, backend, block_size, device)
    inputs, decode, b = [], [], 0
    for i, (n, k) in enumerate(zip(lens, need)):
        inputs.append(ModelInput([(i * 7919 + j) % model_cfg.vocab_size for j in range(n)], 0,
                                 [list(range(b, b + k))], True))
        if n < max_model_len:  # a position past max_model_len may be past the rotary table
            decode.append(ModelInput([i % model_cfg.vocab_size], n, [list(range(b, b + k))], True))
        b += k
    params = SamplingParams(**_PROFILE_SAMPLING)
    sampler = Sampler(0)  # its own generator: the profile draws nothing from the run's streams

    def step() -> None:
        # MoE layers route every step so that every expert is active (moe.worst_case_routing): the
        # peak then covers any routing a real step brings, not what these dummy tokens happen to pick.
        # A prefill step, then a decode step of the same sequences: on a GPU each path loads its own
        # kernels on first launch (CUDA loads code lazily; cuBLAS picks other kernels for few rows),
        # and what is loaded stays in use beside the KV cache. On an H200, with the prefill alone the
        # run used more than gpu_memory_utilization allowed once it decoded
        # (docs/log/2026-11-26-h200-first-session.md).
        with _first_layers(model, num_layers), worst_case_routing():
            for batch in (inputs, decode) if decode else (inputs,):
                logits = runner.execute(batch)
                sampler(logits, [SamplingRow(params, None) for _ in batch])
        warm_up = getattr(backend, "load_decode_kernels", None)
        if warm_up is not None:
            warm_up(cache.gpu_cache[0][0], cache.gpu_cache[0][1], dtype)

    weights = model_bytes(model)
    t0 = time.perf_counter()
    if device.type == "cuda":
        readings = _read_cuda(step, device, dummy_bytes)
        del cache, runner
        readings.update(_read_cuda_after(device))
        prof = cuda_profile(CudaReadings(**readings), weights, device=str(device))
    else:
        prof = cpu_profile(_read_cpu(step, dummy_bytes), weights)
        del cache, runner
        _malloc_trim()
    prof.profile_tokens, prof.profile_seqs = sum(lens), len(lens)
    prof.profile_s = time.perf_counter() - t0
    return prof


@contextlib.contextmanager
def _first_layers(model, n: int):
    """The model with only its first n decoder layers for the duration (weights untouched)."""
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList(list(layers)[:n])
    try:
        yield
    finally:
        model.model.layers = layers


@dataclass
class CudaReadings:
    """Raw numbers of a CUDA profile: cudaMemGetInfo and torch.cuda.memory_stats."""
    total: int
    free_before: int
    free_after: int  # after the pass, its cache freed and torch's cache emptied
    torch_allocated_before: int  # weights + the pass's dummy KV cache
    torch_peak_allocated: int
    torch_reserved_after: int
    dummy_kv_bytes: int
    cupy_pool_bytes: int = 0
    torch_peak_reserved: int = 0  # max_memory_reserved over the pass (0: not read)


def cuda_index(device: torch.device) -> int:
    """The device's ordinal: set_per_process_memory_fraction refuses a bare torch.device("cuda")
    (H200, 2026-11-26), which is what the engine holds when the recipe says `cuda`."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _read_cuda(step, device, dummy_bytes: int) -> dict:
    torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(device))  # an earlier engine's cap (worker/torch_cap.py)
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return dict(total=total, free_before=free_before, torch_allocated_before=allocated_before,
                torch_peak_allocated=torch.cuda.max_memory_allocated(device), dummy_kv_bytes=dummy_bytes,
                torch_peak_reserved=torch.cuda.max_memory_reserved(device))


def _read_cuda_after(device) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(device)
    pool = 0
    import sys

    if "cupy" in sys.modules:  # only if the backend loaded it; its pool keeps what it allocated
        with contextlib.suppress(Exception):
            pool = int(sys.modules["cupy"].get_default_memory_pool().total_bytes())
    return dict(free_after=free_after, torch_reserved_after=torch.cuda.memory_reserved(device), cupy_pool_bytes=pool)


def cuda_profile(r: CudaReadings, weights_bytes: int, device: str = "cuda:0") -> MemoryProfile:
    # Driver-level use that torch does not hold: the CUDA context, CuPy's pool and modules, other
    # processes on the device. Reserved rather than allocated: torch's cached blocks are torch's.
    non_torch = max(0, (r.total - r.free_after) - r.torch_reserved_after)
    return MemoryProfile(
        device=device, method="torch.cuda max_memory_allocated + cudaMemGetInfo", total_bytes=r.total,
        free_before_bytes=r.free_before, free_after_bytes=r.free_after, weights_bytes=weights_bytes,
        activation_peak_bytes=max(0, r.torch_peak_allocated - r.torch_allocated_before),
        non_torch_bytes=non_torch,
        torch_other_bytes=max(0, r.torch_allocated_before - r.dummy_kv_bytes - weights_bytes),
        cupy_pool_bytes=r.cupy_pool_bytes, profile_tokens=0, profile_seqs=0, profile_s=0.0,
        reserved_slack_bytes=max(0, r.torch_peak_reserved - r.torch_peak_allocated),
    )


@dataclass
class CpuReadings:
    mem_total: int
    available_before: int
    available_after: int
    rss_before: int  # weights + runtime + the pass's dummy KV cache (committed)
    peak_rss: int
    dummy_kv_bytes: int
    method: str


def _read_cpu(step, dummy_bytes: int) -> CpuReadings:
    gc.collect()
    _malloc_trim()
    info = meminfo()
    rss_before = rss_bytes()
    with PeakRSS() as peak:
        step()
    return CpuReadings(mem_total=info.get("MemTotal", 0), available_before=info.get("MemAvailable", 0),
                       available_after=mem_available_bytes(), rss_before=rss_before, peak_rss=peak.peak,
                       dummy_kv_bytes=dummy_bytes, method=peak.method)


def cpu_profile(r: CpuReadings, weights_bytes: int) -> MemoryProfile:
    return MemoryProfile(
        device="cpu", method=r.method, total_bytes=r.mem_total, free_before_bytes=r.available_before,
        free_after_bytes=r.available_after, weights_bytes=weights_bytes,
        activation_peak_bytes=max(0, r.peak_rss - r.rss_before),
        # The interpreter, torch's and transformers' code and data, the tokenizer, allocator slack.
        non_torch_bytes=max(0, r.rss_before - r.dummy_kv_bytes - weights_bytes),
        torch_other_bytes=0, cupy_pool_bytes=0, profile_tokens=0, profile_seqs=0, profile_s=0.0,
    )
