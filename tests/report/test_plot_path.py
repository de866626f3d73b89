"""`--plot` obeys -o's output-path rules (issue 40, item 5): checked before any work (one line, nothing
written, the model never loads), never through a link, never onto an input, OUT or a file beside it,
an existing file replaced only when it is a PNG, written through a temporary file and a rename."""
from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from pagedrun.cli.app import app
from pagedrun.errors import PagedrunError
from pagedrun.io.file_safety import check_plot, is_png

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama", seed=3)


def generate(model_dir, prompts, out, plot, *extra):
    return CliRunner().invoke(app, ["generate", str(prompts), "-o", str(out), "--plot", str(plot), "-q",
                                    "--set", f"model.path={model_dir}", "--set", "model.device=cpu",
                                    "--set", "cache.num_blocks=32", "--set", "model.max_model_len=64",
                                    "--set", "sampling.max_tokens=2", *extra])


@pytest.fixture
def job(tmp_path):
    prompts = tmp_path / "req.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    return prompts, tmp_path / "out.jsonl"


def victim_for(tmp_path, prompts, out, case):
    """(the --plot path, the file that must stay as it is or None, extra CLI args) for one case."""
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's\n")
    if case == "symlink-to-victim":
        (tmp_path / "p.png").symlink_to(victim)
        return tmp_path / "p.png", victim, []
    if case == "dangling-symlink":
        (tmp_path / "p.png").symlink_to(tmp_path / "nowhere.png")
        return tmp_path / "p.png", tmp_path / "nowhere.png", []
    if case == "prompts-named-png":  # the case: a prompts file named req.png
        png = tmp_path / "req.png"
        png.write_text(prompts.read_text())
        return png, png, []
    if case == "prompts-via-other-spelling":
        return tmp_path / "sub" / ".." / prompts.name, prompts, []
    if case == "recipe":
        recipe = tmp_path / "r.png"
        recipe.write_text("sampling:\n  max_tokens: 2\n")
        return recipe, recipe, ["-r", str(recipe)]
    if case == "the-output":
        return out, None, []
    if case == "the-report":
        return tmp_path / "out.jsonl.report.json", None, []
    if case == "the-meta":
        return tmp_path / "out.jsonl.meta.json", None, []
    if case == "a-text-file":
        return victim, victim, []
    if case == "a-directory":
        (tmp_path / "d.png").mkdir()
        return tmp_path / "d.png", None, []
    if case == "parent-is-a-file":
        return victim / "p.png", victim, []
    if case == "fifo":
        os.mkfifo(tmp_path / "f.png")
        return tmp_path / "f.png", None, []
    raise AssertionError(case)


CASES = ["symlink-to-victim", "dangling-symlink", "prompts-named-png", "prompts-via-other-spelling", "recipe",
         "the-output", "the-report", "the-meta", "a-text-file", "a-directory", "parent-is-a-file", "fifo"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_plot_path_is_one_line_before_any_work(model_dir, tmp_path, job, case, monkeypatch):
    from pagedrun.cli import job as cli_job

    prompts, out = job
    plot, victim, extra = victim_for(tmp_path, prompts, out, case)
    before = victim.read_bytes() if victim is not None and victim.exists() else None
    # The refusal comes before the prompts are even checked (and so long before the model loads).
    monkeypatch.setattr(cli_job, "check_requests", lambda *a: pytest.fail("checked the prompts first"))
    res = generate(model_dir, prompts, out, plot, *extra)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert line.startswith(f"error: {plot}") and "\n" not in line and "Traceback" not in res.output, res.output
    assert not out.exists() and not (tmp_path / "out.jsonl.report.json").exists()
    if victim is not None:
        assert (victim.read_bytes() if victim.exists() else None) == before


@pytest.mark.parametrize("case", ["new", "new-in-new-dir", "old-png", "empty-file"])
def test_a_good_plot_path_is_drawn_through_a_rename(model_dir, tmp_path, job, case):
    prompts, out = job
    plot = tmp_path / ("a/b/p.png" if case == "new-in-new-dir" else "p.png")
    if case == "old-png":
        plot.write_bytes(PNG)
    elif case == "empty-file":
        plot.write_bytes(b"")
    ino = plot.stat().st_ino if plot.exists() else None
    res = generate(model_dir, prompts, out, plot)
    assert res.exit_code == 0, res.output
    assert is_png(plot) and plot.stat().st_size > 1000
    assert plot.stat().st_ino != ino  # a new file renamed over, never written in place
    assert [p.name for p in plot.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_plot_path_spoiled_during_the_run_is_one_line_and_keeps_the_outputs(model_dir, tmp_path, job,
                                                                             monkeypatch):
    prompts, out = job
    plot = tmp_path / "p.png"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    from pagedrun.cli.generate import LocalRun

    real = LocalRun.report

    def report_then_spoil(self, *a, **kw):  # while the run goes, someone puts a link at --plot
        plot.symlink_to(victim)
        return real(self, *a, **kw)

    monkeypatch.setattr(LocalRun, "report", report_then_spoil)
    res = generate(model_dir, prompts, out, plot)
    assert res.exit_code == 0, res.output
    assert f"error: --plot not written: {plot}" in res.output and "Traceback" not in res.output
    assert victim.read_text() == "keep\n" and plot.is_symlink()
    assert len(out.read_text().splitlines()) == 1


def test_check_plot_accepts_a_new_path_and_refuses_one_under_an_unwritable_dir(tmp_path):
    out = tmp_path / "o.jsonl"
    check_plot(tmp_path / "x" / "y.png", out, ())
    if os.geteuid() == 0:
        return  # root writes anywhere
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(PagedrunError, match="no permission"):
        check_plot(ro / "p.png", out, ())
