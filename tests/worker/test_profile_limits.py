"""A step the machine cannot hold is refused in one line naming scheduler.max_num_batched_tokens, never
an allocator traceback: before allocating when the profile pass's floor exceeds what is available, else
when an allocation fails (issue 40, item 8)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedrun.config.checks import MAX_BATCHED_TOKENS
from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.models.loader import read_config
from pagedrun.worker import memory, profiler

# memory.py binds profiler's mem_available_bytes when first imported: imported here, before any test patches
# profiler's, it keeps the real one (the KV plan after a pass reads the machine, not a test's number).
assert memory.mem_available_bytes is profiler.mem_available_bytes


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("prof") / "m", seed=2)


def start(model, *sets):
    return LLM(load_recipe(None, [f"model.path={model}", "model.threads=1", *sets]))


@pytest.mark.parametrize("sets", [
    [f"scheduler.max_num_batched_tokens={MAX_BATCHED_TOKENS}", "scheduler.max_num_seqs=65536",
     "model.max_model_len=512"],  # the cap itself
    [f"scheduler.max_num_batched_tokens={MAX_BATCHED_TOKENS}", "model.max_model_len=512"],  # 256 seqs x 512
    ["scheduler.max_num_batched_tokens=4096", "scheduler.max_num_seqs=8", "model.max_model_len=512"],
])
@pytest.mark.parametrize("available", [0, 1 << 20, 4 << 20])
def test_a_step_above_what_is_available_is_refused_before_allocating(model, monkeypatch, sets, available):
    monkeypatch.setattr(profiler, "mem_available_bytes", lambda: available)

    def never(*a, **kw):
        raise AssertionError("allocated")

    monkeypatch.setattr(profiler, "_run_profile", never)
    with pytest.raises(PagedrunError) as e:
        start(model, *sets)
    msg = str(e.value)
    assert msg.startswith("scheduler.max_num_batched_tokens: a step of ") and "\n" not in msg
    assert "tokens fit: lower scheduler.max_num_batched_tokens" in msg


def test_a_step_whose_floor_fits_is_profiled(model, monkeypatch):
    cfg = read_config(model, None)
    lens = profiler.profile_batch(4096, 8, 512)
    floor = profiler.profile_floor_bytes(cfg, lens, 16, torch.float32, 2)
    monkeypatch.setattr(profiler, "mem_available_bytes", lambda: floor)
    ran = []
    real = profiler._run_profile
    monkeypatch.setattr(profiler, "_run_profile", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    llm = start(model, "scheduler.max_num_batched_tokens=4096", "scheduler.max_num_seqs=8", "model.max_model_len=512",
                "cache.num_blocks=64")
    assert ran == [1] and llm.engine.memory.profile.profile_tokens == 4096


def test_the_floor_is_below_what_a_real_pass_measures(model):
    """The refusal is never wrong: the floor is under the measured peak plus the pass's K/V."""
    cfg = read_config(model, None)
    for tokens, seqs in ((256, 4), (2048, 16), (4096, 256)):
        lens = profiler.profile_batch(tokens, seqs, 512)
        floor = profiler.profile_floor_bytes(cfg, lens, 16, torch.float32, 2)
        llm = start(model, f"scheduler.max_num_batched_tokens={tokens}", f"scheduler.max_num_seqs={seqs}",
                    "model.max_model_len=512", "cache.num_blocks=64")
        prof = llm.engine.memory.profile
        kv = 2 * 2 * sum(-(-(n + 1) // 16) for n in lens) * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
        assert floor <= prof.activation_peak_bytes + kv, (tokens, seqs)


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 9126805504 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 10.90 GiB"),
])
def test_an_allocation_that_fails_during_the_pass_is_one_line(model, monkeypatch, error):
    def fail(*a, **kw):
        raise error

    monkeypatch.setattr(profiler, "_run_profile", fail)
    with pytest.raises(PagedrunError) as e:
        start(model, "cache.num_blocks=64")
    msg = str(e.value)
    assert msg.startswith("scheduler.max_num_batched_tokens: the profile pass of a step of ") and "\n" not in msg
    assert "ran out of memory" in msg


def test_a_bug_is_not_mistaken_for_a_full_machine(model, monkeypatch):
    def fail(*a, **kw):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(profiler, "_run_profile", fail)
    with pytest.raises(RuntimeError, match="shapes"):
        start(model, "cache.num_blocks=64")
