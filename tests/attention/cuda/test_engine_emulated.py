"""Issue 4's end-to-end check: the engine with its attention done by the unchanged CUDA kernels,
executed on the CPU by the emulator (recipe switch model.attention_backend=emulated), produces the
same greedy tokens as the torch backend and as HF transformers."""
from __future__ import annotations

import random
import shutil

import pytest
from tiny_models import make_tiny_model

from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA-on-CPU harness needs g++")


@pytest.mark.slow


def test_generate_with_emulated_cuda_kernels_equals_torch_backend(tmp_path):
    # head_dim 32: the smallest head size the kernels are compiled for.
    d = make_tiny_model("llama", tmp_path / "m", seed=11, hidden_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 640) for _ in range(n)] for n in (1, 7, 16, 23, 40)]
    sets = [f"model.path={d}", "cache.block_size=8", "cache.num_blocks=48", "sampling.max_tokens=8",
            "sampling.ignore_eos=true"]
    # The second prompt repeats the first 16 tokens of the fourth: a prefix-cache hit, so the kernels'
    # prefill path also reads cached blocks through the block table.
    prompts.append(prompts[3][:16] + [5, 6, 7])
    torch_out = LLM(load_recipe(None, sets + ["model.attention_backend=torch"])).generate(prompts)
    llm = LLM(load_recipe(None, sets + ["model.attention_backend=emulated"]))
    assert llm.engine.worker.backend.name == "emulated"
    emu_out = llm.generate(prompts)
    assert [o.outputs[0].token_ids for o in emu_out] == [o.outputs[0].token_ids for o in torch_out]
    assert sum(s.prefix_hit_tokens for s in llm.engine.steps) >= 16


@pytest.mark.slow


def test_gpu_path_sdpa_prefill_with_emulated_decode_kernels_equals_hf(tmp_path):
    """The CuPy backend's path on a GPU (prefill through torch SDPA, decode through the paged
    kernels, the step's kernel inputs built once for every layer) run on the CPU: greedy tokens
    equal HF transformers' and the torch backend's."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    d = make_tiny_model("llama", tmp_path / "m", seed=5, hidden_size=128, num_attention_heads=4,
                        num_key_value_heads=1, num_hidden_layers=3)  # MQA, head_dim 32
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 640) for _ in range(n)] for n in (1, 9, 24, 33)]
    prompts.append(prompts[2][:16] + [8, 9])  # a prefix-cache hit: SDPA over a gathered cached prefix
    sets = [f"model.path={d}", "cache.block_size=8", "cache.num_blocks=40", "sampling.max_tokens=6",
            "sampling.ignore_eos=true", "model.attention_backend=emulated", "scheduler.max_num_batched_tokens=20"]
    llm = LLM(load_recipe(None, sets))
    llm.engine.worker.backend = llm.engine.worker.runner.backend = EmulatedAttentionBackend(prefill="sdpa")
    out = [o.outputs[0].token_ids for o in llm.generate(prompts)]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
           for p in prompts]
    assert out == ref
    assert llm.engine.worker.backend.last_version == "v1"  # decodes went through the kernels
    assert sum(s.prefix_hit_tokens for s in llm.engine.steps) >= 16


@pytest.mark.slow
def test_varlen_prefill_kernel_in_the_engine_equals_torch_backend(tmp_path, monkeypatch):
    """The CuPy backend's default path (prefill="varlen": one prefill kernel launch per layer for every
    prefilling sequence, decode through the paged kernels) run on the CPU: greedy tokens equal the
    torch backend's, over fresh prompts, a prefix-cache hit and chunked prefills (a context that ends
    inside a cache block), with GQA groups of 3 (SmolLM2's 9 / 3 heads)."""
    from pagedrun.attention.cuda import kernels as K
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    launched = []  # (tiles, queries behind a cached context) of every prefill launch
    real = K.PagedKernels.prefill_attention

    def spy(self, out, query, kc, vc, tables, tiles, *args, **kw):
        launched.append((len(tiles), int(((tiles[:, 3] > 0) * tiles[:, 2]).sum())))
        return real(self, out, query, kc, vc, tables, tiles, *args, **kw)

    monkeypatch.setattr(K.PagedKernels, "prefill_attention", spy)
    d = make_tiny_model("llama", tmp_path / "m", seed=7, hidden_size=288, num_attention_heads=9,
                        num_key_value_heads=3, num_hidden_layers=2)  # head_dim 32
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 640) for _ in range(n)] for n in (1, 12, 27, 45)]
    prompts.append(prompts[3][:24] + [11, 12, 13])  # a prefix-cache hit of 3 blocks
    sets = [f"model.path={d}", "cache.block_size=8", "cache.num_blocks=64", "sampling.max_tokens=6",
            "sampling.ignore_eos=true", "scheduler.max_num_batched_tokens=24"]
    torch_out = LLM(load_recipe(None, sets + ["model.attention_backend=torch"])).generate(prompts)
    llm = LLM(load_recipe(None, sets + ["model.attention_backend=emulated"]))
    backend = EmulatedAttentionBackend(prefill="varlen")
    llm.engine.worker.backend = llm.engine.worker.runner.backend = backend
    out = llm.generate(prompts)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in torch_out]
    assert sum(s.prefix_hit_tokens for s in llm.engine.steps) >= 16
    assert backend.last_version == "v1"  # decodes went through the decode kernels
    assert launched and sum(n for _, n in launched) > 0  # prefills behind a cached prefix / earlier chunk
