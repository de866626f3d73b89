"""A Hugging Face model id (`Qwen/Qwen3-0.6B`) found in the local Hugging Face cache, offline.

vLLM users pass `--model Qwen/Qwen3-0.6B`, and vLLM downloads it. pagedrun never downloads: an id
is looked up in the cache that `huggingface-cli download` (or any earlier transformers or vLLM run)
filled, as huggingface_hub lays it out:

    $HF_HUB_CACHE (else $HF_HOME/hub, else ~/.cache/huggingface/hub)
      models--Qwen--Qwen3-0.6B/refs/main          the commit the id means now
      models--Qwen--Qwen3-0.6B/snapshots/<commit>/ config.json, *.safetensors, tokenizer files

An id absent from the cache is a one-line error that says how to download it. A snapshot folder,
however it was named, is reported by its id (outputs' `model`, the report), not by its commit hash.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REVISION = re.compile(r"^[0-9a-f]{40}$")


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def looks_like_id(value: str) -> bool:
    """`org/name`, as the Hub spells ids (a relative path of two parts looks the same: a folder of
    that name, where there is one, wins)."""
    return bool(_ID.match(value)) and ".." not in value


def snapshot_of(model_id: str) -> Path | None:
    """The cached snapshot folder of `model_id` at refs/main, else the only snapshot there, else None."""
    repo = hub_cache() / ("models--" + model_id.replace("/", "--"))
    try:
        ref = (repo / "refs" / "main").read_text().strip()
    except OSError:
        ref = ""
    if _REVISION.match(ref) and (repo / "snapshots" / ref / "config.json").is_file():
        return repo / "snapshots" / ref
    try:
        snapshots = [p for p in (repo / "snapshots").iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return snapshots[0] if len(snapshots) == 1 else None


def missing_message(model_id: str) -> str:
    return (f"{model_id!r} is neither a folder nor in the Hugging Face cache ({hub_cache()}); pagedrun never "
            f"downloads: fetch it once with `huggingface-cli download {model_id}` (or pass the model's folder)")


def model_id_of(folder: Path) -> str | None:
    """`org/name` for a Hub cache snapshot folder (.../models--org--name/snapshots/<commit>), else None."""
    parts = Path(folder).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        org_name = parts[-3][len("models--"):].split("--", 1)
        if len(org_name) == 2:
            return "/".join(org_name)
    return None
