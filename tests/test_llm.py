"""The Python API is vLLM's shape: LLM(model=..., engine args), generate with one prompt or many and
one SamplingParams or one per prompt, chat with the template's arguments, RequestOutput.prompt and
CompletionOutput.cumulative_logprob (issue 39, item 1)."""
from __future__ import annotations

import math
import shutil

import pytest
from tiny_models import add_word_tokenizer

from pagedrun.config.engine_args import ENGINE_ARGS, engine_args_overrides
from pagedrun.errors import PagedrunError
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams

WORDS = ["hello", "there", "how", "are", "you", "fine"]
ARGS = dict(device="cpu", max_model_len=64, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("llm") / "m"
    shutil.copytree(tiny_model("llama"), d)  # the shared model stays without a tokenizer
    return add_word_tokenizer(d, WORDS)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **ARGS)


def test_engine_arguments_map_onto_the_recipe(model_dir):
    llm = LLM(model_dir, max_num_seqs=8, block_size=8, kv_cache_dtype="int8", seed=3, enable_prefix_caching=False,
              max_num_batched_tokens=256, **ARGS)
    r = llm.recipe
    assert r.model.path == str(model_dir) and r.model.device == "cpu" and r.model.max_model_len == 64
    assert (r.scheduler.max_num_seqs, r.scheduler.max_num_batched_tokens) == (8, 256)
    assert (r.cache.block_size, r.cache.kv_cache_dtype, r.cache.enable_prefix_caching, r.cache.num_blocks) == \
        (8, "int8", False, 64)
    assert r.seed == 3


def test_every_engine_argument_names_a_recipe_key():
    from pagedrun.config.recipe import load_recipe

    values = {"model": "default", "dtype": "bfloat16", "max_model_len": 128, "device": "cpu",
              "gpu_memory_utilization": 0.5, "kv_cache_memory": 1 << 30, "block_size": 32,
              "num_gpu_blocks_override": 10, "swap_space": 2.0, "enable_prefix_caching": False,
              "kv_cache_dtype": "fp8", "max_num_seqs": 3, "max_num_batched_tokens": 512, "seed": 9,
              "async_scheduling": "true",
              "generation_config": "vllm"}
    assert set(values) == set(ENGINE_ARGS)
    r = load_recipe(None, engine_args_overrides(dict(values)))
    for arg, key in ENGINE_ARGS.items():
        got = r
        for part in key.split("."):
            got = getattr(got, part)
        assert got == values[arg], (arg, key, got)
    assert load_recipe(None, engine_args_overrides({"disable_hybrid_kv_cache_manager": True})).cache.hybrid_kv is False


def test_what_pagedrun_lacks_is_one_clear_error():
    with pytest.raises(PagedrunError, match="tensor_parallel_size=2: .*--ray --replicas"):
        engine_args_overrides({"tensor_parallel_size": 2})
    with pytest.raises(PagedrunError, match="unknown argument.*pipeline_parallel_size"):
        engine_args_overrides({"pipeline_parallel_size": 1})
    assert engine_args_overrides({"tensor_parallel_size": 1, "seed": None}) == []


def test_a_string_is_one_prompt_not_its_characters(llm):
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = llm.generate("hello there", sp, use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt == "hello there" and len(outs[0].outputs[0].token_ids) == 3
    assert llm.generate([5, 6, 7], sp, use_tqdm=False)[0].prompt_token_ids == [5, 6, 7]  # token ids: one prompt
    assert [o.prompt for o in llm.generate(["hello", "how are you"], sp)] == ["hello", "how are you"]


def test_one_sampling_params_per_prompt(llm):
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 5, 1)]
    outs = llm.generate(["hello", "there", "fine"], sps, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5, 1]
    with pytest.raises(PagedrunError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["hello", "there", "fine"], sps[:2])


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens(llm):
    (o,) = llm.generate("how are you", SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True), use_tqdm=False)
    c = o.outputs[0]
    assert math.isclose(c.cumulative_logprob, sum(e["logprob"] for e in c.logprobs), rel_tol=1e-12)
    assert c.cumulative_logprob < 0
    (plain,) = llm.generate("how are you", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].token_ids == c.token_ids  # asking for logprobs changes no token


def test_chat_renders_with_the_template_arguments(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "how are you"}]
    template = "{% if greet %}hello {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    (o,) = llm.chat(conv, sp, use_tqdm=False, chat_template=template, chat_template_kwargs={"greet": True},
                    add_generation_prompt=False)
    want = tok.apply_chat_template(conv, chat_template=template, greet=True, tokenize=False)
    assert o.prompt == want == "hello how are you "
    assert o.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    # The model's own template, and a batch of conversations: the same as one request each.
    (a,) = llm.chat(conv, sp, use_tqdm=False)
    both = llm.chat([conv, conv], sp, use_tqdm=False)
    assert a.prompt.endswith("<|im_start|> assistant ") and [b.outputs[0].token_ids for b in both] == \
        [a.outputs[0].token_ids] * 2
    with pytest.raises(PagedrunError, match="exclude each other"):
        llm.chat(conv, sp, continue_final_message=True)
