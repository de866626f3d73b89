"""Load an HF model directory (config.json + *.safetensors) into our LlamaForCausalLM (the Llama
family), GemmaForCausalLM (Gemma 2, Gemma 3's text model), Phi3ForCausalLM, GraniteForCausalLM or
MoEForCausalLM (the MoE families).

Weights are read with safetensors directly, tensor by tensor, and cast to the requested dtype while
they are copied into place; transformers is used only for the tokenizer, with trust_remote_code=False,
and a folder whose config.json or tokenizer_config.json names custom code (`auto_map`) is refused. Every problem a user can
fix becomes a one-line PagedrunError naming the directory or file.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedrun.errors import PagedrunError
from pagedrun.models.config import ModelConfig
from pagedrun.models.gemma import GemmaForCausalLM
from pagedrun.models.gpt_oss import GptOssForCausalLM
from pagedrun.models.granite import GraniteForCausalLM, GraniteMoeForCausalLM
from pagedrun.models.llama import LlamaForCausalLM
from pagedrun.models.moe_models import MoEForCausalLM
from pagedrun.models.phi3 import Phi3ForCausalLM
from pagedrun.models.shapes import check_config_matches_weights

# The families with a class of their own beside Llama's and Gemma's.
_MODEL_CLASSES = {"Phi3ForCausalLM": Phi3ForCausalLM, "GraniteForCausalLM": GraniteForCausalLM,
                  "GptOssForCausalLM": GptOssForCausalLM, "GraniteMoeForCausalLM": GraniteMoeForCausalLM}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_config(model_dir: Path, max_model_len: int | None = None) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PagedrunError(f"{model_dir}: model directory not found")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise PagedrunError(f"{config_path}: not found (a model directory needs an HF config.json)")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
        raise PagedrunError(f"{config_path}: cannot read JSON: {_one_line(e)}") from None
    refuse_remote_code(config_path, data)
    return ModelConfig.from_hf_dict(data, source=str(config_path), max_model_len=max_model_len)


def refuse_remote_code(path: Path, data: object) -> None:
    """A config naming its own Python classes (`auto_map`) is refused: pagedrun never runs code from
    a model folder (transformers would import it, or ask on a terminal hidden by the spinner)."""
    if isinstance(data, dict) and "auto_map" in data:
        names = data["auto_map"] if isinstance(data["auto_map"], dict) else {}
        what = ", ".join(f"{k}={v}" for k, v in list(names.items())[:3])[:200]
        raise PagedrunError(f"{path}: auto_map: names custom code{' (' + what + ')' if what else ''}; pagedrun "
                            "never runs code from a model folder: use a model that needs none")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files: from model.safetensors.index.json, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PagedrunError(f"{index}: cannot read weight_map: {e}") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise PagedrunError(f"{index}: lists {f.name}, which does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if list(model_dir.glob("pytorch_model*.bin")):
        raise PagedrunError(
            f"{model_dir}: only pytorch_model*.bin weights found; pagedrun reads safetensors only "
            "(pickle files can run code). Convert once with: python -c \"from transformers import "
            f"AutoModelForCausalLM as M; M.from_pretrained('{model_dir}').save_pretrained('{model_dir}', "
            "safe_serialization=True)\""
        )
    raise PagedrunError(f"{model_dir}: no *.safetensors weight files found")


def iter_safetensors(files: list[Path], rename=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor; with `rename` (ModelConfig.text_tensor_name), (rename(name),
    tensor), and the tensors it maps to None are never read (a vision tower beside a text model)."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    new_name = name if rename is None else rename(name)
                    if new_name is not None:
                        yield new_name, f.get_tensor(name)
        except PagedrunError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
            raise PagedrunError(f"{path}: cannot read safetensors: {_one_line(e)}") from None


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
) -> tuple[LlamaForCausalLM | GemmaForCausalLM, ModelConfig]:
    """Build the model for model_dir's config.json and load its safetensors weights in `dtype`."""
    model_dir = Path(model_dir)
    config = read_config(model_dir, max_model_len)
    files = safetensors_files(model_dir)
    check_config_matches_weights(config, files, model_dir)  # before allocating what config.json claims
    model_class = _MODEL_CLASSES.get(config.architecture, MoEForCausalLM if config.moe else
                                     GemmaForCausalLM if config.is_gemma else LlamaForCausalLM)
    model = model_class(config, dtype=dtype, device=device)
    try:
        model.load_weights(iter_safetensors(files, config.text_tensor_name))
    except PagedrunError as e:
        if str(e).startswith(str(model_dir)):
            raise
        raise PagedrunError(f"{model_dir}: {e}") from None
    model.process_weights_after_loading()
    model.eval()
    return model, config


def load_tokenizer(model_dir: Path, chat_template: str | None = None):
    """The directory's HF tokenizer (PreTrainedTokenizerBase), or None when it ships none.
    `chat_template`: a template file (the recipe's model.chat_template) replacing the tokenizer's own."""
    tok = _load_tokenizer(Path(model_dir))
    if chat_template is not None:
        if tok is None:
            raise PagedrunError("model.chat_template: this model has no tokenizer to render a template with")
        try:
            tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PagedrunError(f"model.chat_template: cannot read {chat_template}: {_one_line(e)}") from None
    return tok


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    tok_config = model_dir / "tokenizer_config.json"
    if tok_config.is_file():
        try:
            refuse_remote_code(tok_config, json.loads(tok_config.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
            raise PagedrunError(f"{tok_config}: cannot read JSON: {_one_line(e)}") from None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types here; the user needs the path and why
        raise PagedrunError(
            f"{model_dir}: cannot load tokenizer: {type(e).__name__}: {_one_line(e)}"
        ) from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def resolve_model_dir(path: str) -> Path:
    """The recipe's model.path as a directory: "default" is the default model, materialised once."""
    if path == "default":
        from pagedrun.models.default_model import default_model_dir

        return default_model_dir()
    return Path(path)
