"""models/layer_runner.py (kernels/cpu/layer_runner_cpu.cpp): the decoder layers in one C call give
the Python loop's logits bit for bit, on prefill, mixed and decode steps of every family it takes;
it stands aside where it does not apply."""
from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, make_tiny_model

from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.llm import LLM
from pagedrun.models import layer_runner, ops
from pagedrun.worker.model_runner import ModelInput

pytestmark = pytest.mark.skipif(layer_runner.load() is None or ops.load() is None,
                                reason="no C++ compiler for the CPU kernels")

BLOCK = 16
# Three sequences, each with three blocks of its own: a prefill step (varlen kernel), a step mixing
# a prefill chunk with two decodes (varlen), then a decode-only step (decode kernel).
STEPS = [
    [(list(range(3, 8)), 0, [0, 1, 2]), (list(range(10, 27)), 0, [3, 4, 5]), (list(range(40, 73)), 0, [6, 7, 8])],
    [([9], 5, [0, 1, 2]), (list(range(30, 34)), 17, [3, 4, 5]), ([11], 33, [6, 7, 8])],
    [([12], 6, [0, 1, 2]), ([13], 21, [3, 4, 5]), ([14], 34, [6, 7, 8])],
]


def _engine(tmp_path, family: str, dtype: str):
    path = make_tiny_model(family, tmp_path / family, seed=3)
    return LLM(None, [f"model.path={path}", f"model.dtype={dtype}", "model.threads=2",
                      f"cache.block_size={BLOCK}", "cache.num_blocks=32"]).engine


class _Counting:
    """Wraps the library's entry point to count the calls that reached C."""

    def __init__(self, lib):
        self.inner, self.calls = lib.run, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_runner_gives_the_loops_logits(tmp_path, family, dtype):
    eng = _engine(tmp_path, family, dtype)
    runner = eng.worker.model.layer_runner
    assert runner is not None
    counter = _Counting(runner.lib)
    runner.lib = type("Lib", (), {"run": staticmethod(counter)})()
    for n, step in enumerate(STEPS, 1):
        inputs = [ModelInput(ids, start, [table], sample=True) for ids, start, table in step]
        fast = eng.worker.runner.execute(inputs)
        assert counter.calls == n and eng.worker.backend.last_path == "cpu_kernel"
        eng.worker.model.layer_runner = None
        try:
            # The loop writes the same K/V into the same slots, then attends over them.
            slow = eng.worker.runner.execute(inputs)
        finally:
            eng.worker.model.layer_runner = runner
        assert counter.calls == n
        assert fast.shape == (3, eng.worker.model.config.vocab_size)
        assert torch.equal(fast, slow), f"step {n}: max |diff| {(fast.float() - slow.float()).abs().max()}"


def test_runner_stands_aside(tmp_path, monkeypatch):
    eng = _engine(tmp_path, "llama", "bfloat16")
    runner = eng.worker.model.layer_runner
    counter = _Counting(runner.lib)
    runner.lib = type("Lib", (), {"run": staticmethod(counter)})()
    inputs = [ModelInput(ids, start, [table], sample=True) for ids, start, table in STEPS[0]]
    with ops.torch_only():  # the ops' torch path: the runner must not run the kernels behind its back
        eng.worker.runner.execute(inputs)
    ran = []
    hook = eng.worker.model.model.layers[1].register_forward_hook(lambda *a: ran.append(1))
    eng.worker.runner.execute(inputs)  # a hooked layer must be called
    hook.remove()
    assert ran == [1]
    monkeypatch.setattr(eng.worker.backend, "use_cpu_kernel", False)
    eng.worker.runner.execute(inputs)
    assert counter.calls == 0
    monkeypatch.undo()
    eng.worker.runner.execute(inputs)
    assert counter.calls == 1  # the same engine, nothing in the way: the runner again


def test_runner_reports_a_refused_call(tmp_path):
    eng = _engine(tmp_path, "llama", "float32")
    inputs = [ModelInput([5, 6], 0, [[999]], sample=True)]  # a block far outside the 32-block cache
    with pytest.raises(RuntimeError, match=r"layer runner: layer 0, call \d+ refused"):
        eng.worker.runner.execute(inputs)


# Sliding windows and KV cache groups (the hybrid KV manager): layer 0 full attention in group A,
# layers 1 and 2 sliding (window 7; layer 2 also soft-capped) in group B, whose tables hold a
# placeholder (block 0, NaN in those layers' caches) for every block wholly below the window of the
# sequence's first query in the step. Block size 8; (token ids, start, own blocks) as STEPS.
WINDOW, SMALL_BLOCK = 7, 8
GROUP_STEPS = [
    [(list(range(3, 8)), 0), (list(range(10, 27)), 0), (list(range(40, 73)), 0)],
    [([9], 5), (list(range(30, 34)), 17), ([11], 33)],
    [([12], 6), ([13], 21), ([14], 34)],
]


def _group_tables(base: int, starts: list[int], window: int) -> list[list[int]]:
    """Five blocks per sequence from `base`; with a window, block 0 below each first query's window."""
    tables = []
    for i, start in enumerate(starts):
        table = list(range(base + 5 * i, base + 5 * i + 5))
        below = max(0, start - window + 1) // SMALL_BLOCK if window else 0
        tables.append([0] * below + table[below:])
    return tables


def _set_variant(attn, window: int, softcap: float) -> None:
    attn.window, attn.softcap = window, softcap


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_windows_and_groups_give_the_loops_hidden_states(tmp_path, dtype):
    path = make_tiny_model("llama", tmp_path / "llama", seed=5)
    eng = LLM(None, [f"model.path={path}", f"model.dtype={dtype}", "model.threads=2",
                     f"cache.block_size={SMALL_BLOCK}", "cache.num_blocks=48"]).engine
    model, kv_caches, backend = eng.worker.model, eng.worker.runner.kv_caches, eng.worker.backend
    variants = [(0, 0.0), (WINDOW, 0.0), (WINDOW, 5.0)]
    for layer, (window, softcap) in zip(model.model.layers, variants):
        _set_variant(layer.self_attn, window, softcap)
    for key_cache, value_cache in kv_caches[1:]:  # the sliding layers' placeholder block
        key_cache[0], value_cache[0] = float("nan"), float("nan")
    runner = model.layer_runner
    runner._kv_key = None  # the layer table is rebuilt with the windows
    counter = _Counting(runner.lib)
    runner.lib = type("Lib", (), {"run": staticmethod(counter)})()
    for n, step in enumerate(GROUP_STEPS, 1):
        starts = [start for _, start in step]
        inputs = [ModelInput(ids, start, [table], sample=True)
                  for (ids, start), table in zip(step, _group_tables(1, starts, 0))]
        ids, positions, meta_a = eng.worker.runner.build_metadata(inputs)
        meta_b = AttentionMetadata.build([len(ids) for ids, _ in step], starts, _group_tables(20, starts, WINDOW),
                                         SMALL_BLOCK)
        assert n == 1 or (meta_b.block_tables == 0).any()  # placeholders from the second step on
        metas = [meta_a, meta_b, meta_b]
        fast = model(ids, positions, kv_caches, metas, backend)
        assert counter.calls == n and backend.last_path == "cpu_kernel"
        model.layer_runner = None
        try:
            slow = model(ids, positions, kv_caches, metas, backend)
        finally:
            model.layer_runner = runner
        assert torch.isfinite(fast).all()
        assert torch.equal(fast, slow), f"step {n}: max |diff| {(fast.float() - slow.float()).abs().max()}"
    # The last step again (it rewrites its own slots only), through the torch reference: the same
    # states within rounding; and without the windows, over the whole tables: other states.
    auto, backend.use_cpu_kernel = backend.use_cpu_kernel, False
    try:
        ref = model(ids, positions, kv_caches, metas, backend)
        assert backend.last_path == "torch"
        torch.testing.assert_close(fast.float(), ref.float(), atol=1e-4 if dtype == "float32" else 0.1, rtol=0.02)
        for layer in model.model.layers:
            _set_variant(layer.self_attn, 0, 0.0)
        meta_full = AttentionMetadata.build([len(ids) for ids, _ in step], starts, _group_tables(20, starts, 0),
                                            SMALL_BLOCK)
        full = model(ids, positions, kv_caches, [meta_a, meta_full, meta_full], backend)
    finally:
        backend.use_cpu_kernel = auto
    assert torch.isfinite(full).all() and (full.float() - fast.float()).abs().max() > 1e-2


# Attention sinks (GPT-OSS): a float32 sink per query head on each layer's attention module (None:
# off), whatever the model's dtype; the runner passes the layer's pointer to the attention kernels.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_sinks_give_the_loops_logits(tmp_path, dtype):
    eng = _engine(tmp_path, "llama", dtype)
    model = eng.worker.model
    runner = model.layer_runner
    heads = model.model.layers[0].self_attn.num_heads
    gen = torch.Generator().manual_seed(1)
    layers = model.model.layers
    for i, layer in enumerate(layers):  # the last layer keeps none: off where absent
        if i < len(layers) - 1:
            layer.self_attn.sinks = torch.nn.Parameter(torch.randn(heads, generator=gen) * 2, requires_grad=False)
    runner._kv_key = None  # the layer table is rebuilt with the sinks
    counter = _Counting(runner.lib)
    runner.lib = type("Lib", (), {"run": staticmethod(counter)})()
    for n, step in enumerate(STEPS, 1):
        inputs = [ModelInput(ids, start, [table], sample=True) for ids, start, table in step]
        fast = eng.worker.runner.execute(inputs)
        assert counter.calls == n and eng.worker.backend.last_path == "cpu_kernel"
        model.layer_runner = None
        try:
            slow = eng.worker.runner.execute(inputs)
        finally:
            model.layer_runner = runner
        assert torch.isfinite(fast).all()
        assert torch.equal(fast, slow), f"step {n}: max |diff| {(fast.float() - slow.float()).abs().max()}"
    # The decode step again without the sinks (it rewrites its own slots only): other logits.
    for layer in layers:
        layer.self_attn.sinks = None
    runner._kv_key = None
    plain = eng.worker.runner.execute(inputs)
    assert counter.calls == len(STEPS) + 1
    assert (plain.float() - fast.float()).abs().max() > 1e-3
