"""LLMEngine.step(): one iteration of continuous batching.

    1. scheduler.schedule()            -> SchedulerOutput (tensor-free decision)
    2. cache_engine swap in / swap out / copy, in that order
    3. model_runner.execute()          -> logits of the sequences that produce a token
    4. sampler                          -> token ids (n rows for a prompt that forks into n)
    5. advance progress, register full blocks in the prefix cache, fork, check stops, free blocks
    6. record a StepRecord              -> the run's report
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from pagedrun.attention.kv_cache_spec import check_scales, kv_cache_spec
from pagedrun.config.recipe import Recipe
from pagedrun.engine.occupancy import occupancy
from pagedrun.engine.output_processor import check_stop, final_text
from pagedrun.engine.parallel_sampling import CHILD_SEED_STRIDE, ParentRequest, child_sampling
from pagedrun.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedrun.engine.sequence import Sequence, SequenceGroup
from pagedrun.errors import PagedrunError
from pagedrun.kv.manager import KVCacheManager
from pagedrun.outputs import CompletionOutput, RequestOutput
from pagedrun.report.metrics import StepRecord
from pagedrun.sample.sampler import Sampler, SamplingRow, make_generator
from pagedrun.sampling_params import SamplingParams
from pagedrun.structured.grammar import StructuredOutputManager
from pagedrun.worker.cache_engine import CUDA_OOM, CacheEngine
from pagedrun.worker.malloc_tuning import tune_glibc_malloc
from pagedrun.worker.memory import MemoryPlan, plan_kv_cache
from pagedrun.worker.model_runner import ModelInput, ModelRunner
from pagedrun.worker.populate import CachePopulator
from pagedrun.worker.torch_cap import cap_torch_memory, step_out_of_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise PagedrunError("model.device: cuda was asked for but torch sees no CUDA GPU; use auto or cpu")
    return torch.device(name)


def resolve_model_dir(path: str) -> Path:
    if path == "default":
        from pagedrun.models.default_model import default_model_dir

        return default_model_dir()
    return Path(path)


class LLMEngine:
    def __init__(self, recipe: Recipe):
        from pagedrun.attention.registry import make_backend
        from pagedrun.models.loader import load_model, load_tokenizer

        self.recipe = recipe
        if recipe.model.threads:
            torch.set_num_threads(recipe.model.threads)
        self.device = resolve_device(recipe.model.device)
        # Before the memory profile, so that it sees the heap the steps will use.
        self.malloc_tuning = tune_glibc_malloc() if self.device.type == "cpu" else None
        self.dtype = DTYPES[recipe.model.dtype]
        self.model_dir = resolve_model_dir(recipe.model.path)
        self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device, recipe.model.max_model_len)
        self.tokenizer = load_tokenizer(self.model_dir)
        cfg = self.model_config
        self.max_model_len = recipe.model.max_model_len or min(cfg.max_position_embeddings, 8192)
        if self.max_model_len > cfg.max_position_embeddings:
            raise PagedrunError(
                f"model.max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        sched = recipe.scheduler
        self.memory: MemoryPlan = plan_kv_cache(recipe, cfg, self.model, self.dtype, self.device,
                                                self.max_model_len)
        num_cpu_blocks = self.memory.num_cpu_blocks if sched.preemption_mode == "swap" else 0
        self.kv_spec = kv_cache_spec(recipe.cache.kv_cache_dtype, self.dtype)
        self.backend = make_backend(recipe.model.attention_backend, self.device, self.kv_spec, self.dtype)
        self.cache_engine = CacheEngine(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                        recipe.cache.block_size, self.memory.num_gpu_blocks, num_cpu_blocks,
                                        self.dtype, self.device, self.kv_spec,
                                        (recipe.cache.k_scale, recipe.cache.v_scale))
        cap_torch_memory(self.memory, self.device)
        self.populator = CachePopulator([gpu for gpu, _ in self.cache_engine.block_tensors],
                                        threads=torch.get_num_threads())
        self._scales_checked = self.cache_engine.layer_scales is None
        self.kv = KVCacheManager(self.memory.num_gpu_blocks, recipe.cache.block_size, num_cpu_blocks,
                                 enable_prefix_caching=recipe.cache.enable_prefix_caching,
                                 watermark=recipe.cache.watermark)
        self.scheduler = Scheduler(
            SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, sched.preemption_mode),
            self.kv, self.max_model_len,
        )
        self.runner = ModelRunner(self.model, self.cache_engine.gpu_cache, self.backend, recipe.cache.block_size,
                                  self.device)
        self.sampler = Sampler(recipe.seed)
        eos = set(cfg.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self.generators: dict[int, torch.Generator] = {}
        self.structured: StructuredOutputManager | None = None  # built by the first constrained request
        self.steps: list[StepRecord] = []
        self.t0 = time.perf_counter()
        self._next_seq_id = 0
        self._last_stats = self._stats_snapshot()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, index: int, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        if sampling.n > self.scheduler.config.max_num_seqs:
            # A group is admitted whole: n sequences at once could never be. Fan out instead.
            parent = ParentRequest(sampling.n)
            for k in range(sampling.n):
                self._add_group(request_id, index, prompt_token_ids, child_sampling(sampling, k), parent, k)
            return
        self._add_group(request_id, index, prompt_token_ids, sampling)

    def _add_group(self, request_id: str, index: int, prompt_token_ids: list[int], sampling: SamplingParams,
                   parent: ParentRequest | None = None, child_index: int = 0) -> None:
        seq = Sequence(self._new_seq_id(), len(prompt_token_ids), list(prompt_token_ids))
        group = SequenceGroup(request_id, index, sampling, [seq], parent=parent, child_index=child_index)
        if sampling.seed is not None:
            self.generators[seq.seq_id] = make_generator(sampling.seed)
        if sampling.structured_outputs is not None:
            if self.structured is None:
                self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_ids)
            self.structured.add(seq.seq_id, sampling.structured_outputs)
        self.scheduler.add_group(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    # ---- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        out = self.scheduler.schedule()
        finished = [o for g, reason in out.aborted if (o := self._error_output(g, reason)) is not None]
        if out.is_empty:
            finished += self._unblock()
            return finished

        self.populator.ensure(self.kv.num_gpu_blocks_touched)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.copy(out.blocks_to_copy)

        inputs = [
            ModelInput(s.seq.token_ids[s.seq.num_computed_tokens : s.seq.num_computed_tokens + s.num_new_tokens],
                       s.seq.num_computed_tokens, self.kv.get_block_table(s.seq.seq_id), s.samples)
            for s in out.scheduled
        ]
        try:
            logits = self.runner.execute(inputs)
        except CUDA_OOM as e:
            raise step_out_of_memory(self.memory, sum(len(i.token_ids) for i in inputs), e) from None
        if not self._scales_checked:  # fp8: every layer's scale was set by this first step's writes
            given = self.recipe.cache.k_scale is not None and self.recipe.cache.v_scale is not None
            check_scales(self.cache_engine.layer_scales, "from the recipe" if given else "calibrated on the first step")
            self._scales_checked = True

        # Rows to sample: one per sampling sequence, n for a prompt that is about to fork into n.
        row_of, rows, row_owner = [], [], []
        r = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            group = s.group
            fan = group.sampling.n if (group.sampling.n > 1 and not group.forked) else 1
            gens = self._generators(s.seq, group, fan)
            grammar = self.structured.row_grammar(s.seq) if self.structured is not None else None
            for k in range(fan):
                row_of.append(r)
                rows.append(SamplingRow(group.sampling, gens[k], (s.seq.token_ids, s.seq.prompt_len),
                                        grammar=grammar))
            row_owner.append((s, fan, gens))
            r += 1
        result = None
        if rows:
            expanded = logits if len(row_of) == logits.shape[0] else logits[torch.tensor(row_of, device=logits.device)]
            result = self.sampler(expanded, rows)

        now = time.perf_counter()
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.group.first_scheduled_time is None:
                s.group.first_scheduled_time = t_start
        j = 0
        touched_groups: list[SequenceGroup] = []
        for s, fan, gens in row_owner:
            tokens = result.token_ids[j : j + fan]
            lps = result.logprobs[j : j + fan]
            j += fan
            group = s.group
            seqs = [s.seq]
            if fan > 1:
                seqs += self._fork(group, gens[1:])
            for seq, tok, lp in zip(seqs, tokens, lps):
                seq.append_token(tok)
                if lp is not None:
                    seq.logprobs.append(lp)
                check_stop(seq, group.sampling, self.eos_token_ids, self.max_model_len, self.tokenizer)
                if self.structured is not None:
                    self.structured.after_token(seq)
                if seq.is_finished:
                    self.scheduler.free_seq(seq)
            if group.first_token_time is None:
                group.first_token_time = now
            if group not in touched_groups:
                touched_groups.append(group)
                group.token_times.append(now)
        done = self.scheduler.remove_finished()
        for g in done:
            g.finished_time = now
            o = self._request_output(g)
            if o is not None:
                finished.append(o)
        self._record(out, t_start, len(finished), len(rows))
        return finished

    def _generators(self, seq: Sequence, group: SequenceGroup, fan: int) -> list[torch.Generator | None]:
        """The sequence's own generator; for a prompt about to fork, one new stream per child."""
        if group.sampling.seed is None:
            return [None] * fan
        return [self.generators[seq.seq_id]] + [
            make_generator(group.sampling.seed + k * CHILD_SEED_STRIDE) for k in range(1, fan)
        ]

    def _fork(self, group: SequenceGroup, gens: list[torch.Generator | None]) -> list[Sequence]:
        parent = group.seqs[0]
        children = []
        for g in gens:
            child = Sequence(self._new_seq_id(), parent.prompt_len, list(parent.token_ids),
                             num_computed_tokens=parent.num_computed_tokens)
            if g is not None:
                self.generators[child.seq_id] = g
            if self.structured is not None:  # before the parent accepts its token: each child its own
                self.structured.fork(parent.seq_id, child.seq_id)
            children.append(child)
        self.scheduler.fork(group, children)
        return children

    def _unblock(self) -> list[RequestOutput]:
        """Nothing could be scheduled: if nothing runs either, the head of the queue can never fit."""
        sch = self.scheduler
        if sch.running or not sch.waiting:
            return []
        group = sch.waiting.popleft()
        for seq in group.unfinished_seqs():
            seq.finish("abort")
        o = self._error_output(group, f"cannot be admitted: {self.kv.num_free_gpu_blocks} KV blocks free of "
                                      f"{self.kv.num_gpu_blocks}; raise the KV budget")
        return [o] if o is not None else []

    # ---- outputs --------------------------------------------------------------------------------
    def _request_output(self, g: SequenceGroup) -> RequestOutput | None:
        """The finished request's output; None for a fanned-out child whose siblings still run."""
        self._release(g)
        groups = [g]
        if g.parent is not None:
            groups = g.parent.child_done(g)
            if groups is None:
                return None
            if g.parent.error is not None:
                return self._error(g, g.parent.error)
        first = groups[0]
        seqs = [s for grp in groups for s in grp.seqs]
        completions = [
            CompletionOutput(i, final_text(s, self.tokenizer), s.output_token_ids, s.finish_reason, s.stop_reason,
                             s.logprobs if first.sampling.logprobs is not None else None)
            for i, s in enumerate(seqs)
        ]
        arrival = first.arrival_time
        t = sorted({x for grp in groups for x in grp.token_times})  # steps that produced a token
        itl = [b - a for a, b in zip(t, t[1:])]
        metrics = {
            "queued_s": _round(min(grp.first_scheduled_time or arrival for grp in groups) - arrival),
            "ttft_s": _round(min(grp.first_token_time or arrival for grp in groups) - arrival),
            "e2e_s": _round(max(grp.finished_time or arrival for grp in groups) - arrival),
            "mean_itl_s": _round(sum(itl) / len(itl)) if itl else None,
            "itl_s": [_round(x) for x in itl],
        }
        return RequestOutput(first.request_id, first.index, first.seqs[0].token_ids[: first.prompt_len],
                             completions, first.num_cached_prompt_tokens,
                             sum(grp.num_preemptions for grp in groups), metrics)

    def _error_output(self, g: SequenceGroup, reason: str) -> RequestOutput | None:
        """An error record for a request that cannot run (None while a fanned-out one has children left)."""
        self._release(g)
        if g.parent is not None and g.parent.child_done(g, reason) is None:
            return None
        return self._error(g, g.parent.error if g.parent is not None else reason)

    def _release(self, g: SequenceGroup) -> None:
        for s in g.seqs:
            self.generators.pop(s.seq_id, None)
            if self.structured is not None:
                self.structured.free(s.seq_id)

    @staticmethod
    def _error(g: SequenceGroup, reason: str) -> RequestOutput:
        return RequestOutput(g.request_id, g.index, g.seqs[0].token_ids[: g.prompt_len], [], error=reason)

    # ---- metrics --------------------------------------------------------------------------------
    def _stats_snapshot(self) -> dict:
        st = self.kv.stats
        return {k: getattr(st, k) for k in ("prefix_query_tokens", "prefix_hit_tokens", "cow_copies")}

    def _record(self, out: SchedulerOutput, t_start: float, num_finished: int, num_sampled: int) -> None:
        stats = self._stats_snapshot()
        delta = {k: stats[k] - self._last_stats[k] for k in stats}
        self._last_stats = stats
        sch = self.scheduler
        self.steps.append(StepRecord(
            step=len(self.steps),
            t_start=t_start - self.t0,
            t_end=time.perf_counter() - self.t0,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_seqs=len(out.scheduled),
            num_sampled_tokens=num_sampled,
            blocks_in_use=self.kv.num_used_gpu_blocks,
            blocks_cached_free=self.kv.num_cached_free_blocks,
            num_running=sch.num_running_seqs,
            num_waiting=sch.waiting.num_seqs,
            num_swapped=sch.swapped.num_seqs,
            preempted_recompute=out.preempted_recompute,
            preempted_swap=out.preempted_swap,
            swap_fallbacks=out.swap_fallbacks,
            prefix_query_tokens=delta["prefix_query_tokens"],
            prefix_hit_tokens=delta["prefix_hit_tokens"],
            cow_copies=delta["cow_copies"],
            swap_in_blocks=len(out.blocks_to_swap_in),
            swap_out_blocks=len(out.blocks_to_swap_out),
            num_finished=num_finished,
            **self._occupancy(),
        ))

    def _occupancy(self) -> dict:
        return occupancy(self.scheduler.running, self.kv, self.max_model_len)


def _round(x: float) -> float:
    return round(x, 6)
