"""--model with a Hugging Face id: found in the local HF cache, never downloaded (issue 39)."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from pagedrun.cli.app import app
from pagedrun.config.hf_cache import model_id_of, snapshot_of
from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(tmp_path, monkeypatch, model_dir, model_id="acme/tiny-llama"):
    hub = tmp_path / "hub"
    repo = hub / ("models--" + model_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # no folder named acme/ here
    return repo / "snapshots" / COMMIT


def test_an_id_resolves_to_its_cached_snapshot(tiny_model, tmp_path, monkeypatch):
    snap = _cache(tmp_path, monkeypatch, tiny_model("llama"))
    assert snapshot_of("acme/tiny-llama") == snap
    assert load_recipe(None, ["model.path=acme/tiny-llama"]).model.path == str(snap.resolve())
    assert model_id_of(snap) == "acme/tiny-llama" and model_id_of(tmp_path) is None


def test_generate_with_an_id_names_the_model_by_it(tiny_model, tmp_path, monkeypatch):
    _cache(tmp_path, monkeypatch, tiny_model("llama"))
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "acme/tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2}}) + "\n")
    res = CliRunner().invoke(app, ["generate", str(batch), "-o", str(tmp_path / "o.jsonl"), "--model",
                                   "acme/tiny-llama", "--set", "cache.num_blocks=16"])
    assert res.exit_code == 0, res.output
    line = json.loads((tmp_path / "o.jsonl").read_text())
    assert line["response"]["body"]["model"] == "acme/tiny-llama"  # not the commit hash
    assert json.loads((tmp_path / "o.jsonl.report.json").read_text())["run"]["model"] == "acme/tiny-llama"


def test_an_id_not_in_the_cache_is_one_line_saying_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PagedrunError) as e:
        load_recipe(None, ["model.path=Qwen/Qwen3-0.6B"])
    msg = str(e.value)
    assert "\n" not in msg and "huggingface-cli download Qwen/Qwen3-0.6B" in msg and "never downloads" in msg
    res = CliRunner().invoke(app, ["generate", str(tmp_path / "p.jsonl"), "--model", "Qwen/Qwen3-0.6B"])
    assert res.exit_code == 2 and "huggingface-cli download Qwen/Qwen3-0.6B" in res.output
