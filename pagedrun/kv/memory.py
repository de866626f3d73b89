"""How much memory the KV cache may take, measured the way vLLM's determine_num_available_blocks does.

    1. profile: one forward pass of max_num_batched_tokens dummy tokens spread over max_num_seqs
       sequences, logits of each sequence's last token, the sampler on them; measure the peak.
    2. budget:  CUDA  floor(total x gpu_memory_utilization) - peak in use
                CPU   cache.kv_cache_memory (bytes, or a fraction of MemAvailable after the pass)
    3. blocks:  floor(budget / block_bytes),
                block_bytes = 2 (K, V) x layers x kv_heads x head_dim x block_size x dtype bytes
    `cache.num_blocks` overrides step 3 (the profile still runs, for the report and the checks).

Measuring and deciding are separate: `profile_*` read the machine into a MemoryProfile, and
`plan_memory` is pure arithmetic on it, so tests inject numbers a GPU would report.
Every way the plan can fail raises KVBudgetError, one line naming the missing bytes and the recipe
field to change, before a single request runs.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from pagedrun.errors import PagedrunError

MiB = 1 << 20
GiB = 1 << 30
# What the profile pass samples with: the sampler's most expensive path (sort for top-k/top-p,
# min-p renormalisation, log-softmax + top-20 logprobs), so its buffers are in the peak.
_PROFILE_SAMPLING = dict(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20)


# ---------------------------------------------------------------- results

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

    @property
    def peak_in_use_bytes(self) -> int:
        """What the KV cache must leave room for: weights + other torch + activation peak + non-torch."""
        return self.weights_bytes + self.torch_other_bytes + self.activation_peak_bytes + self.non_torch_bytes


@dataclass
class MemoryPlan:
    device: str
    block_size: int
    block_bytes: int
    num_gpu_blocks: int  # the KV cache's blocks (device memory on CUDA, RAM on CPU)
    num_cpu_blocks: int  # swap space
    kv_budget_bytes: int  # what the budget allows, before the cap or an override
    budget_source: str  # how the budget was obtained, for the report
    overridden: bool  # cache.num_blocks was set
    capped_to_blocks: int | None  # set when the budget held more blocks than the run can ever use
    max_model_len: int = 0
    max_num_seqs: int = 0
    blocks_from_budget: int = 0  # floor(kv_budget_bytes / block_bytes)
    gpu_memory_utilization: float | None = None  # CUDA only
    host_available_bytes: int = 0  # MemAvailable after the profile (the CPU budget's base)
    # Estimate, not measured: the torch backend's decode gathers each layer's K/V of the running
    # sequences into float32 copies; with a full cache that is about 2 x 4/elem x KV / layers.
    # 0 when the backend reads the cache in place (the CUDA kernels).
    decode_gather_bytes: int = 0
    swap_used: bool = False  # scheduler.preemption_mode is swap: the swap blocks are allocated
    profile: MemoryProfile | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def token_capacity(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_gpu_blocks * self.block_bytes

    @property
    def swap_bytes(self) -> int:
        return self.num_cpu_blocks * self.block_bytes

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens the cache holds at once (vLLM's number)."""
        return self.num_gpu_blocks / self.blocks_per_seq if self.max_model_len else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.profile is not None:
            d["profile"]["peak_in_use_bytes"] = self.profile.peak_in_use_bytes
        d.update(token_capacity=self.token_capacity, kv_cache_bytes=self.kv_cache_bytes,
                 swap_bytes=self.swap_bytes, blocks_per_seq=self.blocks_per_seq,
                 max_concurrency=self.max_concurrency)
        return d

    def summary(self) -> list[str]:
        """The start-up lines of `pagedrun generate` (the long form is `pagedrun profile-memory`)."""
        p = self.profile
        lines = []
        if p is not None:
            lines.append(
                f"weights {fmt_bytes(p.weights_bytes)}, activation peak {fmt_bytes(p.activation_peak_bytes)} "
                f"(profiled {p.profile_tokens} tokens in {p.profile_seqs} seqs, {p.profile_s:.2f}s), "
                f"outside torch {fmt_bytes(p.non_torch_bytes)}")
        blocks = f"{self.num_gpu_blocks:,} blocks"
        if self.overridden:
            blocks += f" (cache.num_blocks override; the budget allows {self.blocks_from_budget:,})"
        elif self.capped_to_blocks is not None:
            blocks += f" (capped; the budget allows {self.blocks_from_budget:,})"
        lines.append(
            f"KV budget {fmt_bytes(self.kv_budget_bytes)} ({self.budget_source}) -> {blocks} x {self.block_size} "
            f"tokens = {self.token_capacity:,} tokens ({fmt_bytes(self.kv_cache_bytes)}, "
            f"{self.block_bytes / 1024:.1f} KiB/block); max concurrency at max_model_len={self.max_model_len}: "
            f"{self.max_concurrency:.2f}x; "
            + (f"swap {self.num_cpu_blocks:,} blocks" if self.swap_used else "no swap (preemption_mode recompute)")
            + (f"; decode gather est. {fmt_bytes(self.decode_gather_bytes)}" if self.decode_gather_bytes else ""))
        return lines + [f"warning: {w}" for w in self.warnings]


class KVBudgetError(PagedrunError):
    """The plan cannot work on this machine; `plan` holds every number, for profile-memory's table."""

    def __init__(self, message: str, plan: MemoryPlan):
        super().__init__(message)
        self.plan = plan


def fmt_bytes(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


# ---------------------------------------------------------------- arithmetic

def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes(dtype)


def model_block_bytes(model_cfg, block_size: int, dtype: torch.dtype) -> int:
    return model_cfg.kv_bytes_per_token(dtype_bytes(dtype)) * block_size


def plan_memory(*, profile: MemoryProfile, block_bytes: int, cache_cfg, max_model_len: int, max_num_seqs: int,
                uses_swap: bool, host_available_bytes: int, gather_layers: int | None = None,
                elem_bytes: int = 4) -> MemoryPlan:
    """Pure arithmetic: a measured profile + the recipe -> the plan. Raises KVBudgetError."""
    bb, bs = block_bytes, cache_cfg.block_size
    cuda = profile.device.startswith("cuda")
    blocks_per_seq = -(-max_model_len // bs)
    seq_bytes = blocks_per_seq * bb
    peak = profile.peak_in_use_bytes
    if cuda:
        u = cache_cfg.gpu_memory_utilization
        allowed = int(profile.total_bytes * u)
        budget = allowed - peak
        source = f"{u:g} x {fmt_bytes(profile.total_bytes)} total - {fmt_bytes(peak)} peak in use"
    else:
        budget = cache_cfg.kv_cache_bytes(host_available_bytes)
        mem = cache_cfg.kv_cache_memory
        source = ("cache.kv_cache_memory" if not isinstance(mem, float) and mem is not None
                  else f"{cache_cfg.kv_cache_memory or 0.25:g} x {fmt_bytes(host_available_bytes)} MemAvailable")
    from_budget = max(budget, 0) // bb
    swap = int(cache_cfg.swap_space * GiB) // bb
    plan = MemoryPlan(
        device=profile.device, block_size=bs, block_bytes=bb, num_gpu_blocks=from_budget, num_cpu_blocks=0,
        kv_budget_bytes=budget, budget_source=source, overridden=cache_cfg.num_blocks is not None,
        capped_to_blocks=None, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        blocks_from_budget=from_budget, gpu_memory_utilization=cache_cfg.gpu_memory_utilization if cuda else None,
        host_available_bytes=host_available_bytes, profile=profile,
    )
    if plan.overridden:
        plan.num_gpu_blocks = cache_cfg.num_blocks
        if plan.num_gpu_blocks < blocks_per_seq:
            plan.warnings.append(f"cache.num_blocks={plan.num_gpu_blocks} holds less than one sequence of "
                                 f"max_model_len={max_model_len} ({blocks_per_seq} blocks); longer requests abort")
    else:
        _check_budget(plan, budget, seq_bytes, peak, cuda, cache_cfg)
        # More blocks than 2 x max_num_seqs full-length sequences only keep stale prefix-cache entries;
        # on the CPU, where the budget is a guess shared with the rest of the machine, do not reserve them.
        cap = 2 * max_num_seqs * blocks_per_seq
        if not cuda and plan.num_gpu_blocks > cap:
            plan.capped_to_blocks = plan.num_gpu_blocks = cap
    # Swap space beyond the device cache's size can never be filled.
    plan.num_cpu_blocks = min(swap, plan.num_gpu_blocks)
    plan.swap_used = uses_swap
    if gather_layers:
        plan.decode_gather_bytes = 2 * plan.kv_cache_bytes * 4 // elem_bytes // gather_layers
    _check_physical(plan, cuda, uses_swap, cache_cfg)
    return plan


def _check_budget(plan: MemoryPlan, budget: int, seq_bytes: int, peak: int, cuda: bool, cache_cfg) -> None:
    p, bb, bs = plan.profile, plan.block_bytes, plan.block_size
    fits_len = max(0, budget) // bb * bs  # the longest max_model_len this budget holds
    lower = f"model.max_model_len to {fits_len}" if fits_len >= 16 else "model.max_model_len"
    if cuda:
        u, total = cache_cfg.gpu_memory_utilization, p.total_bytes
        field_ = "cache.gpu_memory_utilization"
        if budget <= 0:
            need = peak / total
            fix = (f"raise {field_} to at least {math.ceil(need * 100) / 100:.2f}" if need < 1 else
                   "the device cannot hold the weights and the activations at all: lower "
                   "scheduler.max_num_batched_tokens, the dtype or the model")
            raise KVBudgetError(
                f"{field_}: {u:g} x {fmt_bytes(total)} = {fmt_bytes(total * u)} is below the {fmt_bytes(peak)} "
                f"already in use at the profile's peak (weights {fmt_bytes(p.weights_bytes)}, activations "
                f"{fmt_bytes(p.activation_peak_bytes)}, outside torch {fmt_bytes(p.non_torch_bytes)}); "
                f"{fmt_bytes(peak - total * u)} missing: {fix}", plan)
        if budget < seq_bytes:
            need = (peak + seq_bytes) / total
            fix = (f"raise {field_} to at least {math.ceil(need * 100) / 100:.2f} or lower {lower}" if need <= 1
                   else f"lower {lower}")
            raise KVBudgetError(
                f"{field_}: the KV budget ({fmt_bytes(budget)}) cannot hold one sequence of "
                f"model.max_model_len={plan.max_model_len} ({fmt_bytes(seq_bytes)}); "
                f"{fmt_bytes(seq_bytes - budget)} missing: {fix}", plan)
    elif budget < seq_bytes:
        need_mib = math.ceil(seq_bytes / MiB)
        raise KVBudgetError(
            f"cache.kv_cache_memory: the KV budget ({fmt_bytes(budget)}, {plan.budget_source}) cannot hold one "
            f"sequence of model.max_model_len={plan.max_model_len} ({fmt_bytes(seq_bytes)}); "
            f"{fmt_bytes(seq_bytes - budget)} missing: raise cache.kv_cache_memory to at least {need_mib}MiB "
            f"or lower {lower}", plan)


def _check_physical(plan: MemoryPlan, cuda: bool, uses_swap: bool, cache_cfg) -> None:
    """What the plan allocates must exist: an override or a CPU budget can ask for more than there is."""
    p = plan.profile
    swap = plan.swap_bytes if uses_swap else 0
    if cuda:
        room = p.total_bytes - p.peak_in_use_bytes
        if plan.kv_cache_bytes > room:
            raise KVBudgetError(
                f"cache.num_blocks: {plan.num_gpu_blocks} blocks need {fmt_bytes(plan.kv_cache_bytes)} but the "
                f"device has {fmt_bytes(max(room, 0))} beside the {fmt_bytes(p.peak_in_use_bytes)} peak in use; "
                f"{fmt_bytes(plan.kv_cache_bytes - room)} missing: lower cache.num_blocks to at most "
                f"{max(room, 0) // plan.block_bytes}", plan)
        if swap > plan.host_available_bytes:
            raise KVBudgetError(
                f"cache.swap_space: {fmt_bytes(swap)} of pinned host memory but only "
                f"{fmt_bytes(plan.host_available_bytes)} is available; {fmt_bytes(swap - plan.host_available_bytes)}"
                f" missing: lower cache.swap_space", plan)
        return
    # On the CPU the KV pages are committed as blocks are first written, so an impossible budget
    # would not fail here but in the middle of the run: refuse it now.
    room = plan.host_available_bytes - p.activation_peak_bytes - plan.decode_gather_bytes
    need = plan.kv_cache_bytes + swap
    if need > room:
        field_ = "cache.num_blocks" if plan.overridden else "cache.kv_cache_memory"
        if swap:
            field_ += " or cache.swap_space"
        raise KVBudgetError(
            f"{field_}: the KV cache ({fmt_bytes(plan.kv_cache_bytes)}) + swap space ({fmt_bytes(swap)}) + "
            f"activation peak ({fmt_bytes(p.activation_peak_bytes)}) + decode gather "
            f"({fmt_bytes(plan.decode_gather_bytes)}) need {fmt_bytes(need + plan.host_available_bytes - room)}"
            f" but {fmt_bytes(plan.host_available_bytes)} is available (MemAvailable); "
            f"{fmt_bytes(need - room)} missing: lower {field_}", plan)


# ---------------------------------------------------------------- requests of a prompts file

def request_blocks(prompt_len: int, max_tokens: int, n: int, block_size: int, max_model_len: int) -> int:
    """Blocks one request holds at its longest: prompt + max_tokens, n samples sharing the prompt's
    full blocks (the partly filled last prompt block is copied on write by every child)."""
    total = min(prompt_len + max_tokens, max_model_len)
    blocks = -(-total // block_size)
    shared = min(prompt_len, total) // block_size
    return blocks + (n - 1) * (blocks - shared)


@dataclass
class RequestsFit:
    num_requests: int
    total_blocks: int
    mean_blocks: float
    max_blocks: int
    max_concurrency: float  # num_blocks / mean blocks per request
    never_fit: int  # requests needing more blocks than the whole cache (they abort)


def requests_fit(blocks: list[int], num_blocks: int) -> RequestsFit:
    if not blocks:
        return RequestsFit(0, 0, 0.0, 0, 0.0, 0)
    mean = sum(blocks) / len(blocks)
    return RequestsFit(len(blocks), sum(blocks), mean, max(blocks), num_blocks / mean if mean else 0.0,
                       sum(1 for b in blocks if b > num_blocks))


# ---------------------------------------------------------------- measuring

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


def model_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:  # tied embeddings are one tensor
            seen.add(key)
            total += t.nbytes
    return total


def run_profile(model, model_cfg, backend, *, dtype: torch.dtype, device: torch.device, block_size: int,
                max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> MemoryProfile:
    """One forward pass of the worst step the scheduler may build, plus the sampler, measured."""
    from pagedrun.engine.model_runner import ModelInput, ModelRunner
    from pagedrun.kv.cache_engine import CacheEngine
    from pagedrun.sampler import Sampler, SamplingRow
    from pagedrun.sampling_params import SamplingParams

    lens = profile_batch(max_num_batched_tokens, max_num_seqs, max_model_len)
    # The pass writes its K/V somewhere: a cache of exactly the blocks it needs, set up (and on the
    # CPU, its pages committed) before the baseline, so it is not counted as activations.
    need = [-(-n // block_size) for n in lens]
    cache = CacheEngine(model_cfg.num_hidden_layers, model_cfg.num_key_value_heads, model_cfg.head_dim,
                        block_size, sum(need), 0, dtype, device)
    cache.gpu_kv_cache.zero_()
    dummy_bytes = cache.gpu_kv_cache.nbytes
    runner = ModelRunner(model, cache.gpu_cache, backend, block_size, device)
    inputs, b = [], 0
    for i, (n, k) in enumerate(zip(lens, need)):
        inputs.append(ModelInput([(i * 7919 + j) % model_cfg.vocab_size for j in range(n)], 0,
                                 list(range(b, b + k)), True))
        b += k
    params = SamplingParams(**_PROFILE_SAMPLING)
    sampler = Sampler(0)  # its own generator: the profile draws nothing from the run's streams

    def step() -> None:
        logits = runner.execute(inputs)
        sampler(logits, [SamplingRow(params, None) for _ in lens])

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


def _read_cuda(step, device, dummy_bytes: int) -> dict:
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return dict(total=total, free_before=free_before, torch_allocated_before=allocated_before,
                torch_peak_allocated=torch.cuda.max_memory_allocated(device), dummy_kv_bytes=dummy_bytes)


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


# ---------------------------------------------------------------- the engine's entry point

def plan_kv_cache(recipe, model_cfg, model, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> MemoryPlan:
    """Profile the loaded model and turn the recipe's budget into blocks (LLMEngine.__init__)."""
    from pagedrun.attention.registry import make_backend

    name = recipe.model.attention_backend
    # The emulator runs the CUDA kernels instruction by instruction: far too slow for a 2k-token
    # pass, and its memory says nothing about a GPU's. Profile the CPU with the torch backend.
    backend = make_backend("torch" if name == "emulated" else name, device)
    sched = recipe.scheduler
    profile = run_profile(model, model_cfg, backend, dtype=dtype, device=device,
                          block_size=recipe.cache.block_size, max_num_batched_tokens=sched.max_num_batched_tokens,
                          max_num_seqs=sched.max_num_seqs, max_model_len=max_model_len)
    return plan_memory(profile=profile, block_bytes=model_block_bytes(model_cfg, recipe.cache.block_size, dtype),
                       cache_cfg=recipe.cache, max_model_len=max_model_len, max_num_seqs=sched.max_num_seqs,
                       uses_swap=sched.preemption_mode == "swap", host_available_bytes=mem_available_bytes(),
                       gather_layers=model_cfg.num_hidden_layers if backend.name == "torch" else None,
                       elem_bytes=dtype_bytes(dtype))
