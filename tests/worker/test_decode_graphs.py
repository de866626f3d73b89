"""Static decode buffers, the static-buffer decode path and the CUDA-graph plumbing, on the CPU
(issue 36 items 1 and 2; pagedrun/worker/{decode_buffers,cuda_graphs,model_runner}.py).

- buckets, and DecodeBuffers.fill against AttentionMetadata.build (slots, tables, lengths, padding);
- the static-buffer path (emulated CUDA kernels) gives today's path's greedy tokens bit for bit, fp32
  and bf16, at batch sizes that pad, with sequences gaining blocks and being preempted;
- no host synchronisation and no tensor from a Python list inside a static decode step (a planted
  .item() is caught);
- model.cuda_graphs: the recipe check, why graphs are off, the memory plan's reservation, and the
  capture / replay / fallback control flow with torch.cuda's graph API faked (the real capture is
  tests/gpu/test_cuda_graphs.py).
"""
from __future__ import annotations

import contextlib
import random
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.worker import cuda_graphs as CG
from pagedrun.worker.decode_buffers import DecodeBuffers, DecodeShape, bucket_for, decode_buckets
from pagedrun.worker.model_runner import ModelInput

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA-on-CPU harness needs g++")

# ---------------------------------------------------------------- buckets and buffers


def test_buckets_are_vllms_sizes_up_to_max_num_seqs():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(1) == [1]
    b = decode_buckets(256)
    assert b[-1] == 256 and len(b) == 35
    assert [bucket_for(n, b) for n in (1, 3, 5, 9, 17, 255, 256, 257)] == [1, 4, 8, 16, 24, 256, 256, None]


def _random_step(rng: random.Random, n: int, block_size: int, width: int, groups: int):
    """n decode rows: positions, and per group tables long enough for them (some longer)."""
    pos = [rng.randrange(0, width * block_size) for _ in range(n)]
    tables = [[[rng.randrange(1, 1000) for _ in range(min(width, p // block_size + 1 + rng.randrange(2)))]
               for p in pos] for _ in range(groups)]
    return [rng.randrange(640) for _ in range(n)], pos, tables


@pytest.mark.parametrize("groups", [1, 3])
def test_fill_matches_attention_metadata_and_pads(groups):
    rng = random.Random(groups)
    shape = DecodeShape(max_rows=16, max_model_len=100, block_size=8, num_groups=groups)
    buf = DecodeBuffers(shape, torch.device("cpu"))
    for n in (16, 5, 11, 0, 1):  # shrinking and growing batches: what a row held before must not leak
        ids, pos, tables = _random_step(rng, n, 8, shape.width, groups)
        buf.fill(ids, pos, tables)
        assert buf.input_ids[:n].tolist() == ids and buf.positions[:n].tolist() == pos
        assert (buf.input_ids[n:] == 0).all() and (buf.positions[n:] == 0).all()
        assert buf.seq_lens[:n].tolist() == [p + 1 for p in pos] and (buf.seq_lens[n:] == 0).all()
        assert buf.context_lens[:n].tolist() == pos
        for g in range(groups):
            assert (buf.slot_mapping[g, n:] == -1).all()
            if not n:
                continue
            ref = AttentionMetadata.build([1] * n, pos, tables[g], 8)
            assert buf.slot_mapping[g, :n].tolist() == ref.slot_mapping.tolist()
            for i, t in enumerate(tables[g]):
                assert buf.block_tables[g, i, : len(t)].tolist() == t


def test_only_changed_rows_are_rewritten_and_in_place_edits_are_seen(monkeypatch):
    buf = DecodeBuffers(DecodeShape(8, 64, 8), torch.device("cpu"))
    tables = [[10 * i + 1, 10 * i + 2] for i in range(8)]
    buf.fill(list(range(8)), [9] * 8, [[list(t) for t in tables]])
    writes: list[int] = []
    real = buf._write_tables

    def spy(g, group, counts):
        before = buf.htab.copy()
        real(g, group, counts)
        writes.append(int((buf.htab != before).any(axis=2).sum()))

    monkeypatch.setattr(buf, "_write_tables", spy)
    grown = [list(t) for t in tables]
    grown[3].append(99)  # row 3 gained a block: the only row written
    buf.fill(list(range(8)), [9] * 7 + [16], [grown[:7] + [grown[7] + [77]]])  # and row 7, at its 3rd block
    assert writes == [2]
    assert buf.block_tables[0, 3, :3].tolist() == [31, 32, 99] and buf.block_tables[0, 7, 2] == 77
    assert buf.slot_mapping[0, 7] == 77 * 8 + 0
    same = buf._prev[0]
    same[0][1] = 55  # the same list object, edited in place: rewritten, never trusted
    buf.fill(list(range(8)), [9] * 8, [same])
    assert buf.block_tables[0, 0, 1] == 55 and buf.slot_mapping[0, 0] == 55 * 8 + 1


def test_fill_refuses_a_table_shorter_than_its_position():
    buf = DecodeBuffers(DecodeShape(4, 64, 8), torch.device("cpu"))
    with pytest.raises(ValueError, match="shorter than its position"):
        buf.fill([5], [16], [[[1, 2]]])  # position 16 is in block 2: a third block is needed


# ---------------------------------------------------------------- the static path vs today's


@pytest.fixture(scope="module")
def emu_model(tmp_path_factory) -> Path:
    # head_dim 32: the smallest head size the kernels are compiled for; max_model_len 512 keeps v1,
    # which today's path also takes for these lengths, so the tokens can be compared bit for bit.
    return make_tiny_model("llama", tmp_path_factory.mktemp("emu") / "m", seed=11, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def _run(model: Path, dtype: str, static: bool, prompts, max_num_seqs: int, num_blocks: int, max_tokens: int = 14,
         extra: tuple = ()):
    llm = LLM(load_recipe(None, [f"model.path={model}", f"model.dtype={dtype}", "cache.block_size=8",
                                 f"cache.num_blocks={num_blocks}", f"sampling.max_tokens={max_tokens}",
                                 "sampling.ignore_eos=true", "model.attention_backend=emulated",
                                 f"scheduler.max_num_seqs={max_num_seqs}", *extra]))
    runner = llm.engine.worker.runner
    assert runner.buffers is not None  # the emulated backend takes static buffers
    used: list[tuple[int, int]] = []  # (rows, bucket) of each static step
    if static:
        real, fill = runner.forward_static, runner.buffers.fill
        rows: list[int] = []
        runner.buffers.fill = lambda ids, *a: (rows.append(len(ids)), fill(ids, *a))[1]
        runner.forward_static = lambda bucket: (used.append((rows[-1], bucket)), real(bucket))[1]
    else:
        runner.buffers = None  # today's path
    out = [o.outputs[0].token_ids for o in llm.generate(prompts)]
    return out, used, llm


@needs_gxx
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_decode_tokens_equal_todays_path(emu_model, dtype):
    """Batches of 3, 5, 6 rows (buckets 4, 8, 8: padding rows), sequences crossing block boundaries
    (block 8, 14 tokens), and a cache too small for all of them at once (preemption)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 640) for _ in range(n)] for n in (1, 5, 9, 14, 17, 22)]
    padded = 0
    for max_num_seqs, num_blocks in ((3, 40), (8, 40), (6, 14)):
        want, _, _ = _run(emu_model, dtype, False, prompts, max_num_seqs, num_blocks)
        got, used, llm = _run(emu_model, dtype, True, prompts, max_num_seqs, num_blocks)
        assert got == want, (max_num_seqs, num_blocks)
        assert used and all(b == bucket_for(n, decode_buckets(max_num_seqs)) for n, b in used)
        padded += sum(b > n for n, b in used)
        if num_blocks == 14:
            assert sum(s.preempted_recompute for s in llm.engine.steps) > 0
    assert padded  # some steps ran with padding rows


@needs_gxx
@pytest.mark.slow
def test_static_decode_takes_v2_at_a_long_max_model_len(emu_model, tmp_path):
    """max_model_len 1,024 > one partition: the static path launches v2 for every decode (sized for
    max_model_len, as a graph is), whatever the lengths, and the tokens are today's (which take v1)."""
    d = make_tiny_model("llama", tmp_path / "m", seed=11, hidden_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024)
    prompts = [[7, 8, 9], [11] * 12]
    want, _, _ = _run(d, "float32", False, prompts, 4, 24, 6)
    got, used, llm = _run(d, "float32", True, prompts, 4, 24, 6)
    assert got == want and used == [(2, 2)] * len(used)
    assert llm.engine.worker.backend.last_version == "v2"


@needs_gxx
@pytest.mark.slow
def test_static_decode_with_kv_cache_groups_equals_todays_path(tmp_path):
    """Gemma 2 (sliding and full layers: three KV cache groups, each with its own tables and slots;
    prompts several windows long, so sliding tables hold placeholders)."""
    d = make_tiny_model("gemma2", tmp_path / "m", seed=4, hidden_size=128, num_attention_heads=4,
                        num_key_value_heads=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 640) for _ in range(n)] for n in (3, 19, 30)]
    want, _, _ = _run(d, "float32", False, prompts, 4, 40, 12)
    got, used, llm = _run(d, "float32", True, prompts, 4, 40, 12)
    assert llm.engine.worker.runner.num_groups == 3 and used
    assert got == want


# ---------------------------------------------------------------- no host sync inside a step


class NoSync(TorchDispatchMode):
    """Fails on a device-to-host read (aten.item / aten._local_scalar_dense: .item(), float(t),
    bool(t)) and on a tensor made from Python data (aten.lift_fresh: torch.tensor(list))."""

    FORBIDDEN = ("aten.item.", "aten._local_scalar_dense.", "aten.lift_fresh")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(f) for f in self.FORBIDDEN):
            raise AssertionError(f"host sync or host data inside a static decode step: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_sync():
    """NoSync, plus .tolist() (which reads memory without dispatching) and torch.tensor refused."""
    mp = pytest.MonkeyPatch()

    def refuse(*a, **k):
        raise AssertionError("tolist / torch.tensor inside a static decode step")

    mp.setattr(torch.Tensor, "tolist", refuse)
    mp.setattr(torch, "tensor", refuse)
    try:
        with NoSync():
            yield
    finally:
        mp.undo()


@needs_gxx
@pytest.mark.slow
def test_static_decode_step_has_no_host_sync(emu_model):
    llm = LLM(load_recipe(None, [f"model.path={emu_model}", "cache.block_size=8", "cache.num_blocks=32",
                                 "model.attention_backend=emulated", "scheduler.max_num_seqs=8"]))
    runner = llm.engine.worker.runner
    inputs = [ModelInput([5 + i], 9 + i, [[1 + 2 * i, 2 + 2 * i]], True) for i in range(3)]
    runner.execute(inputs)  # first call: the bucket's metadata and PagedStep are built (once, host data)
    from pagedrun.attention.cuda import paged_step

    def never(*a, **k):
        raise AssertionError("paged_step.build called on a static step: its PagedStep is prebuilt")

    mp = pytest.MonkeyPatch()
    mp.setattr(paged_step, "build", never)
    try:
        with no_sync():
            logits = runner.execute(inputs)
    finally:
        mp.undo()
    assert logits.shape[0] == 3
    # the audit catches what it is for: a planted .item() in the region
    real = runner.model.compute_logits
    runner.model.compute_logits = lambda h: (h.sum().item(), real(h))[1]
    with pytest.raises(AssertionError, match="host sync"), no_sync():
        runner.execute(inputs)
    runner.model.compute_logits = real
    # and today's path is what it catches too (its metadata is tensors made from lists)
    runner.buffers = None
    with pytest.raises(AssertionError), no_sync():
        runner.execute(inputs)


# ---------------------------------------------------------------- model.cuda_graphs


@pytest.mark.parametrize("value, stored", [("auto", "auto"), (True, "true"), (False, "false"), ("FALSE", "false")])
def test_recipe_cuda_graphs_values(value, stored):
    assert load_recipe(None, [f"model.cuda_graphs={str(value).lower() if isinstance(value, bool) else value}"]
                       ).model.cuda_graphs == stored


def test_recipe_cuda_graphs_refuses_other_words_and_is_not_in_the_fingerprint():
    with pytest.raises(PagedrunError, match="model.cuda_graphs=sometimes: must be auto, true or false"):
        load_recipe(None, ["model.cuda_graphs=sometimes"])
    assert load_recipe(None, ["model.cuda_graphs=false"]).fingerprint() == load_recipe(None).fingerprint()


def _cfg(**kw):
    """The config fields the graph decisions and estimates read (SmolLM2-135M's by default)."""
    base = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, moe=None)
    return types.SimpleNamespace(**{**base, **kw})


def test_graphs_off_reasons():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = _cfg()
    assert CG.graphs_off_reason("auto", cuda, "cupy", cfg, "auto") is None
    assert "false" in CG.graphs_off_reason("false", cuda, "cupy", cfg, "auto")
    assert "cpu" in CG.graphs_off_reason("auto", cpu, "emulated", cfg, "auto")
    assert "torch attention backend" in CG.graphs_off_reason("auto", cuda, "torch", cfg, "auto")
    moe = _cfg(moe=types.SimpleNamespace(intermediate_size=768))
    # an MoE model captures only where its experts run grouped (bf16 on sm90 / sm100: no host read)
    assert "MoE" in CG.graphs_off_reason("auto", cuda, "cupy", moe, "auto", torch.float16)
    assert "fp8" in CG.graphs_off_reason("auto", cuda, "cupy", cfg, "fp8_e4m3")
    assert CG.graphs_off_reason("auto", cuda, "cupy", cfg, "int8") is None
    with pytest.raises(PagedrunError, match="model.cuda_graphs: true, but the model runs on cpu"):
        CG.graphs_off_reason("true", cpu, "torch", cfg, "auto")


def test_moe_graphs_follow_the_grouped_experts_path(monkeypatch):
    from pagedrun.models import moe as moe_mod

    cuda = torch.device("cuda")
    moe = _cfg(moe=types.SimpleNamespace(intermediate_size=768))
    monkeypatch.setattr(moe_mod, "_native_grouped_mm", lambda device: True)
    assert CG.graphs_off_reason("auto", cuda, "cupy", moe, "auto", torch.bfloat16) is None
    odd = _cfg(moe=types.SimpleNamespace(intermediate_size=100))  # 200-byte rows: not 16-byte multiples
    assert "MoE" in CG.graphs_off_reason("auto", cuda, "cupy", odd, "auto", torch.bfloat16)
    monkeypatch.setattr(moe_mod, "_native_grouped_mm", lambda device: False)  # e.g. an A100
    assert "MoE" in CG.graphs_off_reason("auto", cuda, "cupy", moe, "auto", torch.bfloat16)


def test_worker_says_why_graphs_are_off_on_the_cpu(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m")
    llm = LLM(load_recipe(None, [f"model.path={d}", "model.device=cpu", "cache.num_blocks=16"]))
    w = llm.engine.worker
    assert w.cuda_graphs_line == "cuda graphs: off (the model runs on cpu, graphs need CUDA)"
    assert w.runner.buffers is None  # the torch backend keeps today's path
    with pytest.raises(PagedrunError, match="model.cuda_graphs: true"):
        LLM(load_recipe(None, [f"model.path={d}", "model.device=cpu", "cache.num_blocks=16", "model.cuda_graphs=true"]))


def test_the_plan_keeps_the_graph_estimate_out_of_the_kv_budget():
    from pagedrun.config.recipe import CacheConfig
    from pagedrun.worker import memory as M
    from pagedrun.worker.profiler import CudaReadings, cuda_profile

    GiB = 1 << 30
    r = CudaReadings(total=80 * GiB, free_before=62 * GiB, free_after=62 * GiB, torch_allocated_before=17 * GiB,
                     torch_peak_allocated=19 * GiB, torch_reserved_after=int(16.5 * GiB), dummy_kv_bytes=1 * GiB)

    def plan(graphs):
        return M.plan_memory(profile=cuda_profile(r, 16 * GiB), block_bytes=1 << 20, cache_cfg=CacheConfig(),
                             max_model_len=8192, max_num_seqs=256, uses_swap=False, host_available_bytes=100 * GiB,
                             cuda_graphs=graphs)

    shape = DecodeShape(256, 8192, 16)
    est = shape.nbytes() + CG.estimate_pool_bytes(shape, _cfg(vocab_size=128256, hidden_size=2048,
                                                                intermediate_size=8192, num_attention_heads=32,
                                                                num_key_value_heads=8), 2)
    assert 100 << 20 < est < 1 << 30  # the 1B shape at 256 rows: logits alone are 63 MiB
    base, with_graphs = plan(0), plan(est)
    assert base.kv_budget_bytes - with_graphs.kv_budget_bytes == est
    assert with_graphs.cuda_graph_bytes == est and "cuda graphs est." in with_graphs.summary()[1]
    assert with_graphs.torch_cap_bytes == base.torch_cap_bytes  # the pool is torch's: under the same cap


def test_measured_graph_memory_outside_torch_comes_off_the_cap(monkeypatch):
    from pagedrun.worker import torch_cap

    caps = []
    monkeypatch.setattr(torch_cap, "cap_torch_memory", lambda plan, device: caps.append(plan.torch_cap_bytes))
    plan = type("P", (), {"torch_cap_bytes": 1000, "cuda_graph_measured_bytes": 0})()
    torch_cap.count_cuda_graphs(plan, pool_bytes=300, device_bytes=340, device=torch.device("cuda"))
    assert plan.cuda_graph_measured_bytes == 340 and plan.torch_cap_bytes == 960 and caps == [960]


# ---------------------------------------------------------------- capture and replay, torch.cuda faked


class FakeGraph:
    made: list = []

    def __init__(self):
        self.replays = 0
        FakeGraph.made.append(self)

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's graph API as recorders: capture runs its body eagerly (on the CPU)."""
    log: list = []
    FakeGraph.made = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        log.append(("capture", pool))
        yield

    @contextlib.contextmanager
    def allocations_refused():
        log.append(("no cupy allocations",))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(CG, "no_cupy_allocations", allocations_refused)
    return log


@needs_gxx
@pytest.mark.slow
def test_capture_largest_first_in_one_pool_then_replay_and_fallbacks(emu_model, fake_cuda):
    llm = LLM(load_recipe(None, [f"model.path={emu_model}", "cache.block_size=8", "cache.num_blocks=32",
                                 "model.attention_backend=emulated", "scheduler.max_num_seqs=5"]))
    runner = llm.engine.worker.runner
    forwards: list[int] = []
    real = runner.forward_static
    runner.forward_static = lambda bucket: (forwards.append(bucket), real(bucket))[1]
    stats = CG.DecodeGraphs(runner).capture()
    assert stats.buckets == [1, 2, 4, 5] and runner.graphs is not None
    # per bucket, largest first: WARMUP_FORWARDS eager forwards, then the captured one
    per = CG.WARMUP_FORWARDS + 1
    assert forwards == [b for b in (5, 4, 2, 1) for _ in range(per)]
    assert [e for e in fake_cuda if e[0] == "capture"] == [("capture", "pool")] * 4  # one pool for all
    assert fake_cuda.count(("no cupy allocations",)) == 4
    assert tuple(runner.graphs.logits.shape) == (5, 640)
    assert (runner.buffers.slot_mapping == -1).all()  # capture ran on padding: the cache untouched
    forwards.clear()
    # a decode step of 3 rows replays bucket 4's graph: no eager forward
    inputs = [ModelInput([5 + i], 9 + i, [[1 + 2 * i, 2 + 2 * i]], True) for i in range(3)]
    out = runner.execute(inputs)
    assert out.shape == (3, 640) and forwards == []
    assert [g.replays for g in FakeGraph.made] == [0, 1, 0, 0]  # captured 5, 4, 2, 1
    # prefill steps and batches past max_num_seqs run eagerly, off the static buffers
    runner.execute([ModelInput([5, 6, 7], 0, [[3]], True)])
    runner.execute([ModelInput([5 + i], 9, [[1 + i, 8 + i]], True) for i in range(6)])
    assert forwards == [] and sum(g.replays for g in FakeGraph.made) == 1
    assert "cuda graphs: 4 buckets up to 5" in stats.line()


def test_cupy_allocations_refused_while_capturing(monkeypatch):
    import sys

    seen = []

    @contextlib.contextmanager
    def using_allocator(fn):
        seen.append(fn)
        yield

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(using_allocator=using_allocator)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with CG.no_cupy_allocations():
        with pytest.raises(RuntimeError, match="CuPy allocation of 64 bytes while capturing"):
            seen[0](64)


def test_decode_buffers_hold_no_python_lists_per_token():
    """fill is numpy over the step's rows: 64 rows of long tables, no per-token loop (host time is in
    docs/log/2026-11-28-decode-graphs.md; here only the result)."""
    shape = DecodeShape(64, 8192, 16)
    buf = DecodeBuffers(shape, torch.device("cpu"))
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 8000, 64).tolist()
    tables = [[list(range(1000 * i, 1000 * i + p // 16 + 1)) for i, p in enumerate(pos)]]
    buf.fill(list(range(64)), pos, tables)
    assert buf.slot_mapping[0, :64].tolist() == [(1000 * i + p // 16) * 16 + p % 16 for i, p in enumerate(pos)]
