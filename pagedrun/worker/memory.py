"""How much memory the KV cache may take, measured the way vLLM's determine_num_available_blocks does.

    1. profile: one forward pass of max_num_batched_tokens dummy tokens spread over max_num_seqs
       sequences, logits of each sequence's last token, the sampler on them; measure the peak.
    2. budget:  CUDA  floor(total x gpu_memory_utilization) - peak in use - attention scratch
                      (the worst case at max_model_len, which the profile pass cannot reach)
                CPU   cache.kv_cache_memory (bytes, or a fraction of MemAvailable after the pass)
    3. blocks:  floor(budget / block_bytes),
                block_bytes = 2 (K, V) x slots x kv_heads x head_dim x block_size x dtype bytes
                (slots: the layers one block id covers, all of them unless sliding-window layers
                have KV cache groups of their own, kv/groups.py)
    `cache.num_blocks` overrides step 3 (the profile still runs, for the report and the checks).

Measuring and deciding are separate: pagedrun/worker/profiler.py reads the machine into a
MemoryProfile, and `plan_memory` here is pure arithmetic on it, so tests inject numbers a GPU
would report.
Every way the plan can fail raises KVBudgetError, one line naming the missing bytes and the recipe
field to change, before a single request runs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from pagedrun.attention.kv_cache_spec import KVCacheSpec
from pagedrun.errors import PagedrunError
from pagedrun.kv.groups import KVCacheGroups
from pagedrun.worker.profiler import MemoryProfile, mem_available_bytes, run_profile

MiB = 1 << 20
GiB = 1 << 30
HIGH_UTILIZATION = 0.95  # above this, warn: the unprofiled remainder has almost no room
TORCH_HEADROOM_MIN = 256 * MiB  # or 1% of the limit, whichever is more (MemoryPlan.torch_headroom_bytes)


# ---------------------------------------------------------------- the plan

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
    # Derived, not measured: the most one decode call of the torch path allocates (its gather of
    # K/V, chunked at attention/scratch.py's DECODE_GATHER_TOKENS rows, and SDPA's work on it).
    # 0 when the backend reads the cache in place (the C++ and CUDA kernels).
    decode_gather_bytes: int = 0
    kv_cache_dtype: str = ""  # how the cache stores K/V (attention/kv_cache_spec.py), resolved; "" = not given
    # Formula, not measured (CUDA): the most the attention of one layer call allocates beyond what
    # the profile pass exercised, at max_model_len (attention/scratch.py); inside the budget.
    attention_scratch_bytes: int = 0
    # CUDA, from the plan: what torch's caching allocator may hold in all (gpu_memory_utilization x
    # total - what the profile measured outside torch), set once the cache is allocated
    # (worker/torch_cap.py). 0: no cap (CPU, cache.num_blocks). Without it torch kept freed blocks of
    # many step shapes and went over the limit with no more live memory than the plan holds
    # (docs/log/2026-11-26-h200-first-session.md).
    torch_cap_bytes: int = 0
    # Derived, not measured: kept out of the KV budget under the cap for what torch holds beyond the
    # profile's peak (blocks cached for step shapes the profile did not run, prefix gathers). With
    # the cap and no headroom an H200 run ran out of memory at a 1,024-token step, and uncapped,
    # torch had reserved beyond the profile's peak too
    # (docs/log/2026-11-26-h200-second-session-grouped-decode.md,
    # docs/log/2026-11-27-figures-from-code-comments.md).
    torch_headroom_bytes: int = 0
    # CUDA graphs of decode steps (worker/cuda_graphs.py): an estimate kept out of the KV budget
    # before the cache is sized (derived), then what capture took once the cache exists (measured:
    # the device's free memory before and after, as vLLM measures its graphs); 0: no graphs.
    cuda_graph_bytes: int = 0
    cuda_graph_measured_bytes: int = 0
    swap_used: bool = False  # scheduler.preemption_mode is swap: the swap blocks are allocated
    # Derived: blocks one sequence of max_model_len holds at most, over the KV cache groups (a
    # sliding group holds its window); 0 = ceil(max_model_len / block_size), one full group. Alone
    # in the cache it may prefill max_num_batched_tokens in one step (seq_blocks); in a batch each
    # decoding sequence holds its window (decode_seq_blocks) and the step's chunk, shared by the
    # batch, needs chunk_blocks more in the sliding groups.
    seq_blocks: int = 0
    decode_seq_blocks: int = 0
    kv_slots: int = 0  # layers one block holds (kv/groups.py); 0 = every layer
    full_block_bytes: int = 0  # a block of every layer (= block_bytes unless KV cache groups share slots)
    chunk_blocks: int = 0
    # The KV cache groups (kv/groups.py), one line each, e.g. "sliding 512: layers 0-4" (empty: one
    # full group). With several, what the same memory would hold with every block kept (derived):
    kv_groups: list[str] = field(default_factory=list)
    max_concurrency_without_hybrid: float = 0.0
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
        return self.seq_blocks or -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens the cache holds at once (vLLM's number)."""
        return self.concurrency(self.num_gpu_blocks)

    def concurrency(self, num_blocks: int) -> float:
        """max_concurrency for a cache of num_blocks blocks of this plan's kind."""
        if not self.max_model_len:
            return 0.0
        if self.decode_seq_blocks:
            return max(0, num_blocks - self.chunk_blocks) / self.decode_seq_blocks
        return num_blocks / self.blocks_per_seq

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
            + (f"; decode gather est. {fmt_bytes(self.decode_gather_bytes)}" if self.decode_gather_bytes else "")
            + (f"; attention scratch at max_model_len est. {fmt_bytes(self.attention_scratch_bytes)}"
               if self.attention_scratch_bytes else "")
            + (f"; cuda graphs est. {fmt_bytes(self.cuda_graph_bytes)}" if self.cuda_graph_bytes else "")
            + (f"; torch held to {fmt_bytes(self.torch_cap_bytes)} (derived: the limit - outside torch)"
               if self.torch_cap_bytes else ""))
        if self.kv_groups:
            lines.append(f"KV cache groups: {'; '.join(self.kv_groups)}; max concurrency "
                         f"{self.max_concurrency:.2f}x with the hybrid manager, "
                         f"{self.max_concurrency_without_hybrid:.2f}x with every block kept (derived)")
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


def model_block_bytes(model_cfg, block_size: int, dtype: torch.dtype, kv_spec: KVCacheSpec | None = None,
                      num_slots: int | None = None) -> int:
    """One block's bytes, K and V in every layer (or num_slots layers: kv/groups.py), as the cache
    stores them (int8 scales included)."""
    layers = num_slots or model_cfg.num_hidden_layers
    if kv_spec is None:
        return 2 * layers * model_cfg.num_key_value_heads * model_cfg.head_dim * dtype_bytes(dtype) * block_size
    return kv_spec.bytes_per_token(layers, model_cfg.num_key_value_heads, model_cfg.head_dim) * block_size


def plan_memory(*, profile: MemoryProfile, block_bytes: int, cache_cfg, max_model_len: int, max_num_seqs: int,
                uses_swap: bool, host_available_bytes: int, decode_gather: int = 0,
                attention_scratch: int = 0, seq_blocks: int = 0, cuda_graphs: int = 0) -> MemoryPlan:
    """Pure arithmetic: a measured profile + the recipe -> the plan. Raises KVBudgetError.
    attention_scratch (CUDA) and decode_gather (where decode gathers K/V, else 0): attention/scratch.py.
    seq_blocks: blocks a max_model_len sequence holds (KV cache groups), 0 = ceil(len / block_size).
    cuda_graphs: bytes to keep for the decode graphs' capture (CUDA; worker/cuda_graphs.py)."""
    bb, bs = block_bytes, cache_cfg.block_size
    cuda = profile.device.startswith("cuda")
    blocks_per_seq = seq_blocks or -(-max_model_len // bs)
    seq_bytes = blocks_per_seq * bb
    # A layer's decode gather ends before its prefills' scratch is allocated: never live at once.
    scratch = max(attention_scratch, decode_gather) if cuda else 0
    graphs = cuda_graphs if cuda else 0
    peak = profile.peak_in_use_bytes + scratch + graphs
    capped = cuda and cache_cfg.num_blocks is None  # worker/torch_cap.py holds torch
    headroom = 0
    if cuda:
        u = cache_cfg.gpu_memory_utilization
        allowed = int(profile.total_bytes * u)
        headroom = max(TORCH_HEADROOM_MIN, allowed // 100) if capped else 0
        budget = allowed - peak - headroom
        source = f"{u:g} x {fmt_bytes(profile.total_bytes)} total - {fmt_bytes(peak)} peak in use"
        if scratch:
            source += f" (incl. {fmt_bytes(scratch)} attention scratch at max_model_len)"
        if graphs:
            source += f" (incl. {fmt_bytes(graphs)} for cuda graphs, est.)"
        if headroom:
            source += f" - {fmt_bytes(headroom)} headroom for torch's cache (derived)"
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
        attention_scratch_bytes=scratch, torch_headroom_bytes=headroom, decode_gather_bytes=decode_gather,
        seq_blocks=seq_blocks, cuda_graph_bytes=graphs,
    )
    if cuda and cache_cfg.gpu_memory_utilization > HIGH_UTILIZATION:
        plan.warnings.append(
            f"cache.gpu_memory_utilization={cache_cfg.gpu_memory_utilization:g} leaves under "
            f"{(1 - HIGH_UTILIZATION) * 100:.0f}% of the device for what the profile cannot see (cuBLAS "
            f"workspaces, kernels loaded later, fragmentation, other processes); an out-of-memory mid-run "
            f"is likely: 0.9 is the default")
    if plan.overridden:
        plan.num_gpu_blocks = cache_cfg.num_blocks
        if plan.num_gpu_blocks < blocks_per_seq:
            plan.warnings.append(f"cache.num_blocks={plan.num_gpu_blocks} holds less than one sequence of "
                                 f"max_model_len={max_model_len} ({blocks_per_seq} blocks); longer requests abort")
    else:
        _check_budget(plan, budget, seq_bytes, peak + headroom, cuda, cache_cfg)
        # More blocks than 2 x max_num_seqs full-length sequences only keep stale prefix-cache entries;
        # on the CPU, where the budget is a guess shared with the rest of the machine, do not reserve them.
        cap = 2 * max_num_seqs * blocks_per_seq
        if not cuda and plan.num_gpu_blocks > cap:
            plan.capped_to_blocks = plan.num_gpu_blocks = cap
    # Swap space beyond the device cache's size can never be filled.
    plan.num_cpu_blocks = min(swap, plan.num_gpu_blocks)
    plan.swap_used = uses_swap
    if capped:
        plan.torch_cap_bytes = allowed - profile.non_torch_bytes
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
                f"{fmt_bytes(p.activation_peak_bytes)}, outside torch {fmt_bytes(p.non_torch_bytes)}"
                + (f", attention scratch {fmt_bytes(plan.attention_scratch_bytes)}" if plan.attention_scratch_bytes else "")
                + (f", cuda graphs {fmt_bytes(plan.cuda_graph_bytes)}" if plan.cuda_graph_bytes else "")
                + (f", headroom for torch's cache {fmt_bytes(plan.torch_headroom_bytes)}" if plan.torch_headroom_bytes else "")
                + "); "
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


# ---------------------------------------------------------------- the engine's entry point

def plan_kv_cache(recipe, model_cfg, model, dtype: torch.dtype, device: torch.device,
                  max_model_len: int, kv_spec: KVCacheSpec, groups: KVCacheGroups | None = None,
                  cuda_graphs: int = 0) -> MemoryPlan:
    """Profile the loaded model and turn the recipe's budget into blocks (Worker.__init__); kv_spec:
    the cache's storage, resolved once from the recipe by the worker; groups: the KV cache groups
    (kv/groups.py; None: one full group); cuda_graphs: the decode graphs' estimated bytes (0: none)."""
    from pagedrun.attention.registry import make_backend
    from pagedrun.attention.scratch import plan_scratch

    name = recipe.model.attention_backend
    # The emulator runs the CUDA kernels instruction by instruction: far too slow for a 2k-token
    # pass, and its memory says nothing about a GPU's. Profile the CPU with the torch backend.
    backend = make_backend("torch" if name == "emulated" else name, device)
    sched = recipe.scheduler
    profile = run_profile(model, model_cfg, backend, dtype=dtype, device=device,
                          block_size=recipe.cache.block_size, max_num_batched_tokens=sched.max_num_batched_tokens,
                          max_num_seqs=sched.max_num_seqs, max_model_len=max_model_len)
    scratch, gather = plan_scratch(
        model_cfg=model_cfg, block_size=recipe.cache.block_size, max_model_len=max_model_len,
        max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
        elem_bytes=dtype_bytes(dtype), cache_elem_bytes=dtype_bytes(kv_spec.storage), cuda=device.type == "cuda",
        paged_decode=backend.name == "cupy", gathers=_gathers_on_decode(backend, device), quantized=kv_spec.quantized)
    bs = recipe.cache.block_size
    slots = groups.num_slots if groups is not None else None
    hybrid = groups is not None and groups.hybrid
    seq_blocks = groups.blocks_per_seq(max_model_len, bs, sched.max_num_batched_tokens) if hybrid else 0
    plan = plan_memory(profile=profile, block_bytes=model_block_bytes(model_cfg, bs, dtype, kv_spec, slots),
                       cache_cfg=recipe.cache, max_model_len=max_model_len, max_num_seqs=sched.max_num_seqs,
                       uses_swap=sched.preemption_mode == "swap", host_available_bytes=mem_available_bytes(),
                       decode_gather=gather, attention_scratch=scratch, seq_blocks=seq_blocks,
                       cuda_graphs=cuda_graphs)
    plan.kv_cache_dtype = kv_spec.name
    plan.full_block_bytes = model_block_bytes(model_cfg, bs, dtype, kv_spec)
    plan.kv_slots = slots or model_cfg.num_hidden_layers
    if hybrid:
        plan.decode_seq_blocks = groups.blocks_per_seq(max_model_len, bs, 1)
        plan.chunk_blocks = groups.chunk_blocks(sched.max_num_batched_tokens, bs)
        describe_groups(plan, groups, plan.full_block_bytes)
    return plan


def describe_groups(plan: MemoryPlan, groups: KVCacheGroups, full_block_bytes: int) -> None:
    """The plan's group lines, and the concurrency the same bytes give with every block kept."""
    plan.kv_groups = [f"{g.kind}: layers {','.join(map(str, g.layers))}" for g in groups.groups]
    full_seq = -(-plan.max_model_len // plan.block_size)
    plan.max_concurrency_without_hybrid = plan.kv_cache_bytes / (full_block_bytes * full_seq)


def _gathers_on_decode(backend, device: torch.device) -> bool:
    """The pure-torch decode path copies each layer's K/V; the C++ CPU kernel and the CUDA kernels
    read them in place."""
    if backend.name != "torch":
        return False
    return not (device.type == "cpu" and backend.load_cpu_kernel() is not None)
