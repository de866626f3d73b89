"""The hybrid KV manager's memory claim, as a user sees it in `pagedrun profile-memory`: a
gemma-3-270m-shaped model (18 layers, every 6th full, the others sliding with a 512-token window,
1 KV head of 256) at max_model_len 8192 holds at least 4x the sequences with the hybrid manager
than with every block kept (cache.hybrid_kv: false), from the same KV budget.

The KV shape is the real one; the rest of the model is tiny (hidden 64, vocabulary 640): neither
changes a byte of the KV cache. Both figures come from one budget and are derived, not measured.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYER_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]


@pytest.fixture(scope="module")
def gemma3_270m_kv_shape(tiny_model):
    return tiny_model("gemma3", seed=31, num_hidden_layers=18, layer_types=LAYER_TYPES, sliding_window=512,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192)


def _profile(model_dir: Path, tmp_path: Path, name: str, *sets: str) -> dict:
    args = ["--set", f"model.path={model_dir}", "--set", "model.threads=1", "--set", "model.max_model_len=8192",
            "--set", "cache.kv_cache_memory=1GiB", *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-m", "pagedrun", "profile-memory", *args, "--json", str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return {**json.loads(out.read_text()), "stdout": r.stdout}


@pytest.mark.slow
def test_profile_memory_shows_4x_concurrency_at_8k(gemma3_270m_kv_shape, tmp_path):
    on = _profile(gemma3_270m_kv_shape, tmp_path, "on")
    off = _profile(gemma3_270m_kv_shape, tmp_path, "off", "cache.hybrid_kv=false")
    x, y = on["derived"], off["derived"]
    assert x["layers_per_block"] == 3 and len(x["kv_groups"]) == 6 and "kv_groups" not in y
    # A block of the hybrid cache holds 3 layers, one of the full cache all 18.
    assert y["block_bytes"] == 6 * x["block_bytes"]
    # Decoding at 8192 tokens: 512 blocks in the full group, 33 in each of the 5 sliding ones.
    assert x["decode_blocks_per_seq"] == 512 + 5 * 33 and y["blocks_per_max_len_seq"] == 512
    assert x["max_concurrency_at_max_model_len"] >= 4 * y["max_concurrency_at_max_model_len"]
    # The "every block kept" figure of the hybrid run is the switched-off run's, from the same bytes.
    assert x["max_concurrency_every_block_kept"] == pytest.approx(y["max_concurrency_at_max_model_len"], rel=0.01)
    assert "KV cache groups" in on["stdout"] and "every block kept" in on["stdout"]
