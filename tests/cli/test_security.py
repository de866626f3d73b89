"""Hostile inputs and odd environments (issue 19): a planted cache entry or a model folder with code
never runs, outputs never replace files pagedrun does not own, two runs never share an output, and
losing the C++ kernels is said, never silent. Every input here is generated in tmp_path."""
from __future__ import annotations

import ast
import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedrun.build import cache as build_cache
from pagedrun.build import cpu as cpu_build
from pagedrun.cli import app as cli
from pagedrun.errors import PagedrunError
from pagedrun.io.writer import OutputWriter, meta_path

ROOT = Path(__file__).resolve().parents[2]
FP = {"recipe": "r", "prompts": "p"}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files owned by another user")
needs_cxx = pytest.mark.skipif(shutil.which(cpu_build.compiler()) is None, reason="no C++ compiler")
SOURCE = 'extern "C" __attribute__((visibility("default"))) int answer() { return %d; }\n'


def one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDRUN_CACHE", str(root))
    monkeypatch.setattr(cpu_build, "_outcomes", {})
    return root


@pytest.fixture
def kernel(tmp_path) -> Path:
    src = tmp_path / "src" / "answer.cpp"
    src.parent.mkdir()
    src.write_text(SOURCE % 42)
    return src


def answer_in_fresh_process(so: Path) -> int:
    """What the library at `so` returns, loaded by a new process (dlopen caches by path)."""
    code = f"import ctypes; print(ctypes.CDLL({str(so)!r}).answer())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def evil_library(tmp_path: Path) -> bytes:
    src = tmp_path / "evil" / "answer.cpp"
    src.parent.mkdir(exist_ok=True)
    src.write_text(SOURCE % 666)
    subprocess.run([cpu_build.compiler(), "-shared", "-fPIC", str(src), "-o", str(src.with_suffix(".so"))],
                   check=True, capture_output=True)
    return src.with_suffix(".so").read_bytes()


# ---------------------------------------------------------------- compiled-kernel caches


@needs_cxx
def test_kernel_cache_is_private_and_recorded(cache, kernel):
    lib, why = cpu_build.load("PAGEDRUN_TEST_KERNEL", kernel, ctypes.CDLL)
    assert why is None and lib.answer() == 42 and cpu_build.status() == "on"
    so = cpu_build.build(kernel)
    assert so.parent.parent == cache / "cpu_kernels"
    assert (cache / "cpu_kernels").stat().st_mode & 0o777 == 0o700
    assert so.parent.stat().st_mode & 0o077 == 0
    files = json.loads((so.parent / build_cache.MANIFEST).read_text())["files"]
    assert set(files) == {"answer.cpp", "answer.so"}
    assert files["answer.so"]["sha256"] == build_cache._sha256(so)
    assert build_cache.verify(so.parent) is None


PLANTS = ["content", "file-writable", "dir-writable", "extra-file", "symlink", "no-manifest",
          pytest.param("owner", marks=as_root)]


@needs_cxx
@pytest.mark.parametrize("plant", PLANTS)
def test_planted_library_is_never_loaded_and_is_rebuilt(cache, kernel, tmp_path, plant):
    so = cpu_build.build(kernel)
    good = so.read_bytes()
    evil = evil_library(tmp_path)
    if plant == "content":
        so.write_bytes(evil)  # same owner and mode, other bytes than the build recorded
    elif plant == "file-writable":
        so.write_bytes(evil)
        (so.parent / build_cache.MANIFEST).write_text(json.dumps({"version": 1, "files": {
            "answer.cpp": {"sha256": build_cache._sha256(so.parent / "answer.cpp"),
                           "size": (so.parent / "answer.cpp").stat().st_size, "mtime_ns": 0},
            "answer.so": {"sha256": build_cache._sha256(so), "size": so.stat().st_size, "mtime_ns": 0}}}))
        so.chmod(0o777)  # a recorded hash is worth nothing if anybody may rewrite the file
    elif plant == "dir-writable":
        so.parent.chmod(0o777)
    elif plant == "extra-file":
        (so.parent / "libextra.so").write_bytes(evil)
    elif plant == "symlink":
        elsewhere = tmp_path / "elsewhere.so"
        elsewhere.write_bytes(evil)
        so.unlink()
        so.symlink_to(elsewhere)
    elif plant == "no-manifest":  # what an older pagedrun (or another tool) left: unverifiable
        (so.parent / build_cache.MANIFEST).unlink()
        so.write_bytes(evil)
    elif plant == "owner":
        so.write_bytes(evil)
        os.chown(so, 65534, 65534)
    assert build_cache.verify(so.parent) is not None
    again = cpu_build.build(kernel)
    assert again == so and not again.is_symlink() and again.read_bytes() != evil
    assert build_cache.verify(again.parent) is None
    assert answer_in_fresh_process(again) == 42
    assert len(good) == len(again.read_bytes())


@needs_cxx
@as_root
def test_cache_dir_of_another_user_is_replaced_by_a_private_one(cache, kernel):
    foreign = cache / "cpu_kernels"
    foreign.mkdir(parents=True)
    os.chown(foreign, 65534, 65534)
    so = cpu_build.build(kernel)
    assert so.parent.parent == cache / f"cpu_kernels-uid{os.getuid()}"
    assert so.parent.parent.stat().st_mode & 0o777 == 0o700
    assert not any(foreign.iterdir())


@needs_cxx
def test_a_cache_another_user_owns_turns_the_kernels_off_with_the_reason(cache, kernel, monkeypatch):
    cpu_build.build(kernel)  # built by "them"
    monkeypatch.setattr(build_cache, "current_uid", lambda: os.getuid() + 4242)  # we are someone else
    wrapped = []
    lib, why = cpu_build.load("PAGEDRUN_TEST_KERNEL", kernel, wrapped.append)
    assert lib is None and not wrapped, "a library another user built was loaded"
    assert "owned by uid" in why and build_cache.FIX_HINT in why
    assert cpu_build.status() == f"off ({why})"


def test_a_cache_below_a_writable_non_sticky_directory_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename our cache away and put theirs in its place
    monkeypatch.setenv("PAGEDRUN_CACHE", str(shared / "cache"))
    with pytest.raises(build_cache.CacheError, match="writable by other users .and not sticky"):
        build_cache.private_dir("cpu_kernels")
    shared.chmod(0o1777)  # sticky, as /tmp: only the owner may rename
    assert build_cache.private_dir("cpu_kernels") == shared / "cache" / "cpu_kernels"


def test_own_cache_dir_left_writable_by_others_is_closed(cache):
    kind = cache / "cpu_kernels"
    kind.mkdir(parents=True)
    kind.chmod(0o777)  # e.g. made by an older pagedrun under umask 000
    assert build_cache.private_dir("cpu_kernels") == kind and kind.stat().st_mode & 0o022 == 0


@pytest.mark.parametrize("how", ["below-a-file", pytest.param("read-only", marks=pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes read-only directories"))])
def test_unwritable_cache_turns_the_kernels_off_with_the_reason(tmp_path, monkeypatch, kernel, how):
    if how == "below-a-file":
        (tmp_path / "file").write_text("x")
        base = tmp_path / "file" / "cache"  # not even root can create it
    else:
        base = tmp_path / "ro"
        base.mkdir(mode=0o500)
    monkeypatch.setenv("PAGEDRUN_CACHE", str(base))
    monkeypatch.setattr(cpu_build, "_outcomes", {})
    lib, why = cpu_build.load("PAGEDRUN_TEST_KERNEL", kernel, ctypes.CDLL)
    assert lib is None and str(base) in why and "cannot create" in why
    assert cpu_build.status().startswith("off (cannot create")


def test_cuda_emulator_cache_rebuilds_a_changed_module(cache):
    from pagedrun.build.cudaemu import build as emu_build

    code = "__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n"
    built = emu_build.build(code, [], [], None, "k.cu")
    assert built.so_path.parent.parent == cache / "cudaemu" and build_cache.verify(built.build_dir) is None
    size = built.so_path.stat().st_size
    built.so_path.write_bytes(b"\x7fELF planted")
    again = emu_build.build(code, [], [], None, "k.cu")
    assert again.so_path.stat().st_size == size and build_cache.verify(again.build_dir) is None


# ---------------------------------------------------------------- the converted default model


@pytest.fixture
def fake_conversion(monkeypatch):
    """default_model's conversion replaced by a cheap one writing the same kinds of files."""
    from pagedrun.models import default_model

    calls = []

    def convert(gguf, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_text("{}")
        (out / "chat_template.jinja").write_text("{{ messages }}")
        (out / "model.safetensors").write_bytes(b"\0" * 16)

    monkeypatch.setattr(default_model, "find_gguf", lambda: Path("model.gguf"))
    monkeypatch.setattr(default_model, "convert_gguf", convert)
    return calls


@pytest.mark.parametrize("plant", ["template-changed", "template-added", "dir-writable"])
def test_default_model_with_a_planted_chat_template_is_converted_again(tmp_path, fake_conversion, plant):
    from pagedrun.models.default_model import default_model_dir

    d = default_model_dir(tmp_path)
    assert d.stat().st_mode & 0o077 == 0 and len(fake_conversion) == 1
    assert default_model_dir(tmp_path) == d and len(fake_conversion) == 1  # verified, reused
    if plant == "template-changed":
        (d / "chat_template.jinja").write_text("{{ cycler.__init__.__globals__ }}")
    elif plant == "template-added":
        (d / "chat_template.jinja").unlink()
        (d / "tokenizer_config.json").write_text('{"chat_template": "planted"}')
    else:
        d.chmod(0o777)
    assert default_model_dir(tmp_path) == d and len(fake_conversion) == 2
    assert (d / "chat_template.jinja").read_text() == "{{ messages }}"
    assert not (d / "tokenizer_config.json").exists()


def test_default_model_in_an_unwritable_cache_is_one_line(tmp_path, monkeypatch, fake_conversion):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("PAGEDRUN_CACHE", str(tmp_path / "file" / "cache"))
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(cli.app, ["generate", str(p), "-o", str(tmp_path / "o.jsonl"), "-q"])
    err = one_line_error(result)
    assert "default model: cannot create the cache directory" in err and not fake_conversion


# ---------------------------------------------------------------- code in a model folder


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Path:
    return tiny_model("llama")


def code_folder(tiny: Path, tmp_path: Path, where: str) -> tuple[Path, Path]:
    """A copy of the tiny model whose config.json or tokenizer_config.json names Python code that,
    if it were ever imported, would leave a file behind."""
    d = tmp_path / "with_code"
    shutil.copytree(tiny, d)
    ran = tmp_path / "CODE_RAN"
    (d / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('x')\nclass Evil: pass\n")
    if where == "config":
        cfg = json.loads((d / "config.json").read_text())
        cfg["auto_map"] = {"AutoConfig": "evil.Evil", "AutoModelForCausalLM": "evil.Evil"}
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "Evil", "auto_map": {"AutoTokenizer": ["evil.Evil", None]}}))
    return d, ran


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_model_folder_with_code_is_refused_in_one_line(tiny, tmp_path, where):
    d, ran = code_folder(tiny, tmp_path, where)
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_token_ids": [5, 6]}\n')
    result = CliRunner().invoke(cli.app, ["generate", str(p), "-o", str(tmp_path / "o.jsonl"), "-q", "--set",
                                          f"model.path={d}", "--set", "cache.num_blocks=16"])
    err = one_line_error(result)
    name = "config.json" if where == "config" else "tokenizer_config.json"
    assert f"{d / name}: auto_map: names custom code" in err and "never runs code" in err
    assert not ran.exists()


def test_every_from_pretrained_call_passes_trust_remote_code_false():
    calls = []
    for path in sorted((ROOT / "pagedrun").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is False
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", ok))
    assert calls, "found no from_pretrained calls: the scan is broken"
    assert [c for c, ok in calls if not ok] == []


# ---------------------------------------------------------------- output paths


def generate(prompts: Path, out: Path | str, *extra: str):
    return CliRunner().invoke(cli.app, ["generate", str(prompts), "-o", str(out), "-q", *extra])


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_token_ids": [5, 6]}\n')
    return p


@pytest.mark.parametrize("kind", ["device", "directory", "fifo", "symlink", "dangling-symlink"])
def test_output_that_is_not_a_regular_file_is_refused(tmp_path, prompts, kind):
    target = tmp_path / "target.jsonl"
    target.write_text("someone else's file\n")
    out = tmp_path / "o.jsonl"
    if kind == "device":
        out = Path("/dev/null")
        if not out.exists():
            pytest.skip("no /dev/null")
    elif kind == "directory":
        out.mkdir()
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "symlink":
        out.symlink_to(target)
    else:
        out.symlink_to(tmp_path / "nowhere.jsonl")
    err = one_line_error(generate(prompts, out))
    expected = {"device": "is a character device", "directory": "is a directory", "fifo": "is a FIFO"}
    assert f"error: {out}: " + expected.get(kind, "is a symbolic link") in err
    assert target.read_text() == "someone else's file\n"
    assert not (tmp_path / "nowhere.jsonl").exists()


@pytest.mark.parametrize("victim", ["prompts-as-report", "recipe-as-report", "foreign-report", "foreign-meta",
                                    "foreign-lock", "symlink-report", "prompts-as-meta"])
def test_derived_paths_never_replace_files_pagedrun_did_not_write(tmp_path, victim):
    text = '{"prompt_token_ids": [5, 6]}\n'
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(text)
    out = tmp_path / "job.jsonl"
    extra: list[str] = []
    if victim == "prompts-as-report":  # the case: prompts named job.jsonl.report.json
        prompts = tmp_path / "job.jsonl.report.json"
        prompts.write_text(text)
        victim_file = prompts
    elif victim == "recipe-as-report":
        victim_file = tmp_path / "job.jsonl.report.json"
        victim_file.write_text("sampling:\n  max_tokens: 2\n")
        extra = ["-r", str(victim_file)]
    elif victim == "foreign-report":  # another run's output sitting at our report's path
        victim_file = tmp_path / "job.jsonl.report.json"
        victim_file.write_text('{"id": "0", "text": "another job"}\n')
    elif victim == "foreign-meta":
        victim_file = meta_path(out)
        victim_file.write_text('{"my": "notes"}')
        extra = ["--overwrite"]  # does not make a file we did not write ours
    elif victim == "foreign-lock":
        victim_file = tmp_path / "job.jsonl.lock"
        victim_file.write_text("my lock of something else\n")
    elif victim == "symlink-report":
        victim_file = tmp_path / "elsewhere.json"
        victim_file.write_text("{}")
        (tmp_path / "job.jsonl.report.json").symlink_to(victim_file)
    else:
        prompts = tmp_path / "job.jsonl.meta.json"
        prompts.write_text(text)
        victim_file = prompts
    before = victim_file.read_bytes()
    err = one_line_error(generate(prompts, out, *extra))
    assert "choose another -o" in err
    assert victim_file.read_bytes() == before and not out.exists()


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(tmp_path, prompts):
    out = tmp_path / "o.jsonl"
    hold = ("import sys, time; from pathlib import Path; from pagedrun.io.writer import OutputWriter; "
            f"w = OutputWriter(Path({str(out)!r}), {FP!r}); w.open(); print('ready', flush=True); time.sleep(120)")
    first = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert first.stdout.readline().strip() == "ready"
        err = one_line_error(generate(prompts, out))
        assert f"{out}: in use by another pagedrun run (pid {first.pid}" in err
        with pytest.raises(PagedrunError, match=f"pid {first.pid}"):
            OutputWriter(out, FP)
    finally:
        first.kill()  # SIGKILL: the lock file stays behind, the lock does not
        first.wait()
    assert (tmp_path / "o.jsonl.lock").exists()
    w = OutputWriter(out, FP)
    with pytest.raises(PagedrunError, match=f"in use by another pagedrun run .pid {os.getpid()}"):
        OutputWriter(out, FP)
    w.open()
    w.close()
    assert not (tmp_path / "o.jsonl.lock").exists()
    OutputWriter(out, FP).close()


def test_a_refused_writer_holds_no_lock(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text("not ours\n")
    with pytest.raises(PagedrunError, match="not written by pagedrun"):
        OutputWriter(out, FP)
    assert not (tmp_path / "o.jsonl.lock").exists()
    OutputWriter(out, FP, overwrite=True).close()


# ---------------------------------------------------------------- losing the kernels is said


@pytest.mark.slow


def test_read_only_cache_says_cpu_kernels_off_and_the_run_completes(tiny, tmp_path, prompts):
    """A fresh process (the kernels load once per process): start-up line, report field, no traceback."""
    (tmp_path / "file").write_text("x")
    env = dict(os.environ, PAGEDRUN_CACHE=str(tmp_path / "file" / "cache"), OMP_NUM_THREADS="1")
    out = tmp_path / "o.jsonl"
    res = subprocess.run([sys.executable, "-m", "pagedrun", "generate", str(prompts), "-o", str(out),
                          "--set", f"model.path={tiny}", "--set", "model.device=cpu", "--set", "cache.num_blocks=16",
                          "--set", "sampling.max_tokens=2"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    line = next(x for x in res.stderr.splitlines() if x.startswith("cpu kernels: "))
    assert line.startswith(f"cpu kernels: off (cannot create the cache directory {tmp_path / 'file' / 'cache'}")
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["cpu_kernels"] == line[len("cpu kernels: "):]
    assert len(out.read_text().splitlines()) == 1
