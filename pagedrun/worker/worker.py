"""Worker: everything of a run that holds tensors, behind the few calls the engine makes.

vLLM v1's split: the engine (engine/, kv/) decides which tokens of which sequences run this step
and in which KV blocks, without a tensor; the worker owns the device, the model, the KV cache
tensors and the sampler, and turns each decision into token ids.

    Worker(recipe)            device, model and tokenizer, memory plan (profiled), KV tensors
    worker.prepare(out, n)    commit KV pages, then swap in / swap out / copy blocks, in that order
    worker.execute(inputs, rows)
                              the forward pass of the scheduled tokens, then the sampler's token ids
    worker.launch(inputs, rows, feed)
                              the same, queued: read back later (async scheduling, engine/engine.py)
    worker.make_generator(s)  a seeded random stream for one sequence (opaque to the engine)

What crosses the wall is plain data: the scheduler's block lists, per-sequence tuples of token ids,
positions and block tables, per-row sampling parameters, and the sampled ids back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrun.attention.kv_cache_spec import check_scales, kv_cache_spec
from pagedrun.attention.registry import make_backend
from pagedrun.config.recipe import Recipe
from pagedrun.errors import PagedrunError
from pagedrun.kv.groups import KVCacheGroups, plan_groups
from pagedrun.models.config import resolve_max_model_len
from pagedrun.models.loader import load_model, load_tokenizer, resolve_model_dir
from pagedrun.sample.sampler import PendingSample, Sampler, SampleResult, SamplingRow, make_generator
from pagedrun.sample.transfer import to_device
from pagedrun.worker.cache_engine import CUDA_OOM, CacheEngine
from pagedrun.worker.cuda_graphs import DecodeGraphs, estimate_pool_bytes, graphs_off_reason
from pagedrun.worker.decode_buffers import DecodeShape
from pagedrun.worker.malloc_tuning import tune_glibc_malloc
from pagedrun.worker.memory import MemoryPlan, plan_kv_cache
from pagedrun.worker.model_runner import Feed, ModelInput, ModelRunner
from pagedrun.worker.populate import CachePopulator
from pagedrun.worker.torch_cap import cap_torch_memory, count_cuda_graphs, step_out_of_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# fp8 scales are calibrated on this text (the first CALIBRATION_TOKENS of its tokens), whatever is asked.
CALIBRATION_TEXT = ("The committee met on Tuesday to review the budget. After a long discussion of schools, "
                    "roads and water, it voted to publish the full report, with its tables, next month.")
CALIBRATION_TOKENS = 16
PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at once (prompt_logprobs)


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The fixed calibration prompt's token ids (fixed ids within the vocabulary without a tokenizer)."""
    ids: list[int] = []
    if tokenizer is not None:
        ids = [i for i in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False) if 0 <= i < vocab_size]
    if not ids:
        ids = [(17 + 7919 * i) % vocab_size for i in range(CALIBRATION_TOKENS)]
    return (ids * CALIBRATION_TOKENS)[:CALIBRATION_TOKENS]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise PagedrunError("model.device: cuda was asked for but torch sees no CUDA GPU; use auto or cpu")
    return torch.device(name)


@dataclass
class LaunchedStep:
    """A step queued on the device: its samples (None where nothing samples) and prompt logprobs."""
    pending: PendingSample | None
    prompt_logprobs: dict

    def result(self) -> SampleResult | None:
        """Wait for this step's samples (only them: a step queued after it keeps running)."""
        if self.pending is None:
            return SampleResult([], [], prompt_logprobs=self.prompt_logprobs) if self.prompt_logprobs else None
        result = self.pending.result()
        result.prompt_logprobs = self.prompt_logprobs
        return result


class Worker:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        if recipe.model.threads:
            torch.set_num_threads(recipe.model.threads)
        self.device = resolve_device(recipe.model.device)
        # Before the memory profile, so that it sees the heap the steps will use.
        self.malloc_tuning = tune_glibc_malloc() if self.device.type == "cpu" else None
        self.model_dir = resolve_model_dir(recipe.model.path)
        dtype = recipe.model.dtype
        if dtype == "auto":  # a Recipe that did not come through LLM (models/model_defaults.py)
            from pagedrun.models.model_defaults import resolve_auto_dtype

            dtype, _ = resolve_auto_dtype(None if recipe.model.path == "default" else self.model_dir,
                                          self.device.type)
        self.dtype = DTYPES[dtype]
        self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device, recipe.model.max_model_len)
        self.tokenizer = load_tokenizer(self.model_dir, recipe.model.chat_template)
        cfg = self.model_config
        self.max_model_len = resolve_max_model_len(recipe.model.max_model_len, cfg)
        # The KV cache spec (element type, scales, bytes per token) resolved once, here, and passed
        # as an object to the memory plan, the backend and the cache engine.
        self.kv_spec = kv_cache_spec(recipe.cache.kv_cache_dtype, self.dtype)
        # Layers grouped by attention window (kv/groups.py): the engine's KV manager keeps a block
        # table per group, and the cache a tensor slot per layer of a group.
        layers = cfg.num_hidden_layers
        self.kv_groups: KVCacheGroups = plan_groups([cfg.window_of(i) for i in range(layers)],
                                                    recipe.cache.hybrid_kv)
        self.backend = make_backend(recipe.model.attention_backend, self.device, self.kv_spec, self.dtype)
        # Decode-only steps on static buffers where the backend takes them (worker/decode_buffers.py),
        # captured as CUDA graphs unless graphs_off_reason says why not (worker/cuda_graphs.py).
        self.decode_shape = (DecodeShape(recipe.scheduler.max_num_seqs, self.max_model_len, recipe.cache.block_size,
                                         len(self.kv_groups.groups))
                             if getattr(self.backend, "static_decode", False) else None)
        self.graphs_off = graphs_off_reason(recipe.model.cuda_graphs, self.device, self.backend.name, cfg,
                                            self.kv_spec.name, self.dtype)
        graph_bytes = 0
        if self.graphs_off is None and self.decode_shape is not None:
            graph_bytes = self.decode_shape.nbytes() + estimate_pool_bytes(self.decode_shape, cfg,
                                                                           torch.empty((), dtype=self.dtype).element_size())
        self.memory: MemoryPlan = plan_kv_cache(recipe, cfg, self.model, self.dtype, self.device,
                                                self.max_model_len, self.kv_spec, self.kv_groups, graph_bytes)
        self.num_cpu_blocks = self.memory.num_cpu_blocks if recipe.scheduler.preemption_mode == "swap" else 0
        self.cache_engine = CacheEngine(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                        recipe.cache.block_size, self.memory.num_gpu_blocks, self.num_cpu_blocks,
                                        self.dtype, self.device, self.kv_spec,
                                        (recipe.cache.k_scale, recipe.cache.v_scale),
                                        self.kv_groups.slot_of(layers))
        cap_torch_memory(self.memory, self.device)
        self.populator = CachePopulator([gpu for gpu, _ in self.cache_engine.block_tensors],
                                        threads=torch.get_num_threads())
        self.runner = ModelRunner(self.model, self.cache_engine.gpu_cache, self.backend, recipe.cache.block_size,
                                  self.device, self.kv_groups.group_of(layers), self.decode_shape)
        self.sampler = Sampler(recipe.seed)
        self._last_samples: torch.Tensor | None = None  # the last launch's sampled ids, on the device
        self._calibrate_fp8_scales()
        self.cuda_graphs_line = self._capture_graphs()

    def _capture_graphs(self) -> str:
        """Capture the decode graphs (after the KV cache and the fp8 scales exist); the start-up line
        saying whether steps replay graphs, and if not, why."""
        if self.graphs_off is None and self.runner.buffers is None:
            self.graphs_off = f"the {self.backend.name} attention backend takes no static decode buffers"
        if self.graphs_off is not None:
            return f"cuda graphs: off ({self.graphs_off})"
        try:
            stats = DecodeGraphs(self.runner).capture()
        except CUDA_OOM as e:  # the estimate kept too little: eager steps, said so
            self.runner.graphs = None
            torch.cuda.empty_cache()
            self.graphs_off = f"capture ran out of device memory: {str(e).splitlines()[0][:120]}"
            return f"cuda graphs: off ({self.graphs_off})"
        count_cuda_graphs(self.memory, stats.pool_bytes, stats.device_bytes, self.device)
        return stats.line(self.memory.cuda_graph_bytes)

    def _calibrate_fp8_scales(self) -> None:
        """fp8 layer scales the recipe leaves unset, from one fixed prompt run now: a function of the
        model alone, never of which requests come first, the block count or a resume (each layer's
        backend calibrates a still-unset scale on its first write, which is this prompt's). Where the
        prompt cannot run (a cache smaller than its 16 tokens) the scale is 1.0, vLLM's
        default without checkpoint scales."""
        scales = self.cache_engine.layer_scales
        if scales is None:
            return
        if bool((scales == 0).any()):
            ids = calibration_ids(self.tokenizer, self.model_config.vocab_size)
            blocks = -(-len(ids) // self.recipe.cache.block_size)
            if len(ids) <= self.max_model_len and blocks <= self.memory.num_gpu_blocks:
                self.populator.ensure(blocks)
                # Every KV cache group writes the same blocks: each layer reads only what it wrote.
                self.runner.execute([ModelInput(ids, 0, [list(range(blocks))] * self.runner.num_groups, False)])
            scales[scales == 0] = 1.0  # a layer the prompt could not reach (none, normally)
        given = self.recipe.cache.k_scale is not None and self.recipe.cache.v_scale is not None
        check_scales(scales, "from the recipe" if given else "calibrated on a fixed prompt at start-up")

    def make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed)

    def prepare(self, out, num_gpu_blocks_touched: int) -> None:
        """The KV blocks this step uses exist and hold what they should: pages committed up to the
        highest block the manager has handed out, then the scheduler's swaps and copies."""
        self.populator.ensure(num_gpu_blocks_touched)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.copy(out.blocks_to_copy)

    def execute(self, inputs: list[tuple[list[int], int, list[int], bool]],
                row_of: list[int], rows: list[tuple]) -> SampleResult | None:
        """inputs: per scheduled sequence (new token ids, first position, block tables (one per KV
        cache group), samples[, prompt logprobs: None or (top-N, the next prompt token of each of
        the chunk's leading positions)]);
        rows: per sampled row (params, generator, history, grammar, bad words, position), row_of[i]
        the logits row of rows[i] (a prompt about to fork into n samples n rows from its one row
        of logits)."""
        return self.launch(inputs, row_of, rows).result()

    def launch(self, inputs: list[tuple], row_of: list[int], rows: list[tuple],
               feed: list[tuple[int, int]] = ()) -> LaunchedStep:
        """execute's work queued on the device, read back by LaunchedStep.result(). feed: (input,
        row) pairs, the inputs whose last new token (written PENDING) is row `row` of the samples
        of the step launched just before, still on the device (async scheduling)."""
        model_inputs = [ModelInput(*i[:4], len(i[4][1]) if len(i) > 4 and i[4] else 0) for i in inputs]
        fed = None
        if feed:
            ends, at = [], 0
            for m in model_inputs:
                at += len(m.token_ids)
                ends.append(at - 1)
            fed = Feed([ends[i] for i, _ in feed], [r for _, r in feed], self._last_samples)
        try:
            logits = self.runner.execute(model_inputs, fed)
            prompt_lps = {j: self._prompt_logprobs(self.runner.last_prompt_hidden[j], *inputs[j][4])
                          for j in self.runner.last_prompt_hidden}
        except CUDA_OOM as e:
            raise step_out_of_memory(self.memory, sum(len(i.token_ids) for i in model_inputs), e) from None
        self._last_samples = None
        if not rows:
            return LaunchedStep(None, prompt_lps)
        expanded = logits if len(row_of) == logits.shape[0] else logits[to_device(row_of, torch.long, logits.device)]
        pending = self.sampler.launch(expanded, [SamplingRow(*r) for r in rows])
        self._last_samples = pending.ids
        return LaunchedStep(pending, prompt_lps)

    @torch.inference_mode()
    def _prompt_logprobs(self, hidden: torch.Tensor, top_n: int, targets: list[int]) -> list[dict]:
        """Per position of `hidden`: the log-softmax (float32) of its logits at `targets[k]` (the next
        prompt token), that token's rank (1 = the most likely), and the top_n tokens. Logits are
        made PROMPT_LOGITS_ROWS positions at a time, so a long prefill chunk never holds
        [chunk, vocab] of them at once."""
        out: list[dict] = []
        for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
            lp = self.model.compute_logits(hidden[a : a + PROMPT_LOGITS_ROWS]).float().log_softmax(dim=-1)
            tgt = torch.tensor(targets[a : a + PROMPT_LOGITS_ROWS], device=lp.device)
            chosen = lp.gather(1, tgt.unsqueeze(1))
            ranks = (lp > chosen).sum(dim=1) + 1
            top_vals = top_ids = None
            if top_n > 0:
                top_vals, top_ids = lp.topk(top_n, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for k, (t, v, r) in enumerate(zip(tgt.tolist(), chosen.squeeze(1).tolist(), ranks.tolist())):
                top = [[i, x] for i, x in zip(top_ids[k], top_vals[k])] if top_n > 0 else []
                out.append({"token_id": t, "logprob": v, "rank": r, "top": top})
        return out
