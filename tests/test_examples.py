"""Every example in the README and in every command's ``--help`` runs as written.

A user copies them into a shell in the clone after ``make setup``. The cheap ones (:data:`RUN`)
run here as they are written, in order, in a scratch folder that holds what a clone holds
(``.venv``, ``weights``, ``README.md``). Every other one must at least parse (argparse accepts
its flags), keep its line breaks, and name only files a user has: ones in the clone, Hub ids,
or what an earlier example wrote (``--out``, ``> FILE``, ``curl -O``).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from redrafter_mlx import cli

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"

# The examples run here, in this order: each must be one of the examples (compared as tokens,
# comments left out), so an example that changes must change here too.
RUN = [
    "redrafter-mlx demo-model --out models/demo",
    "redrafter-mlx generate --model models/demo --prompt Hi! --max-tokens 16",
    "redrafter-mlx train --model models/demo --data models/demo/chats.jsonl --out drafters/demo"
    " --heldout 2 --heldout-tokens 60 --batch-size 16 --epochs 2 --eval-every 10"
    " --eval-prompts 1",
    "printf 'Hi!\\n' | redrafter-mlx chat --model models/demo --max-tokens 16",
    "redrafter-mlx generate --model models/demo --prompt Hi! --max-tokens 16 --drafter none",
    "redrafter-mlx upload --drafter drafters/demo --repo you/demo-redrafter --dry-run",
    "redrafter-mlx eval-drafter --model models/demo --drafter drafters/demo"
    " --prompts runs/distill-demo/heldout_prompts.jsonl --beam-width 2 --beam-length 5 --json",
    "redrafter-mlx generate --prompt 'What is the capital of France?'",
]
# Flags whose value is a file or folder a user must have (or a Hub id)
PATH_FLAGS = ("--model", "--drafter", "--data", "--prompts", "--src", "--target", "--init")
WRITTEN_FLAGS = ("--out", "--cache-dir")
LOCAL = ("models", "drafters", "runs", "weights", ".venv", ".", "..")
CLONE = (".venv", "weights", "README.md", "redrafter_mlx")  # what the scratch folder links to
SHELL_OPS = ("|", ">", "<", "&&", "||", ";")


def commands(text: str) -> list[str]:
    """The shell commands of an example text: continuation lines joined, comment and blank
    lines left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = (line.strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def help_examples() -> list[str]:
    """The commands of every command's help epilog, and of the top-level usage."""
    found = commands(cli.USAGE.split("examples", 1)[1].split("\n", 1)[1])
    for name in cli.COMMANDS:
        epilog = cli.command_parser(name)[1].epilog or ""
        assert "examples:" in epilog, f"{name} --help has no examples"
        found += commands(epilog.split("examples:", 1)[1])
    return [c for c in found if not c.startswith("`redrafter-mlx <command>")]


def readme_examples() -> list[str]:
    """The commands of the README's ``bash`` blocks."""
    text = (ROOT / "README.md").read_text()
    return [c for block in re.findall(r"```bash\n(.*?)```", text, re.S) for c in commands(block)]


def tokens(command: str) -> list[str]:
    return shlex.split(command.replace(".venv/bin/redrafter-mlx", "redrafter-mlx"), comments=True)


def key(command: str) -> str:
    """A command as tokens, comments and the ``.venv/bin/`` prefix left out."""
    return shlex.join(tokens(command))


def argv(command: str) -> tuple[str, list[str]] | None:
    """``(command name, its arguments)`` of a ``redrafter-mlx`` command line, else None."""
    words = tokens(command)
    if "redrafter-mlx" not in words:
        return None
    rest = words[words.index("redrafter-mlx") + 1 :]
    cut = next((i for i, w in enumerate(rest) if w in SHELL_OPS), len(rest))
    return rest[0], rest[1:cut]


def written_by(command: str) -> list[str]:
    """Paths an example writes: its ``--out``/``--cache-dir``, a ``> FILE``, ``curl -O``'s."""
    words = tokens(command)
    out = [words[i + 1] for i, w in enumerate(words[:-1]) if w in (*WRITTEN_FLAGS, ">")]
    if "demo-model" in words and "--drafter" in words and "--out" in words:  # OUT-TYPE
        kind, where = (words[words.index(f) + 1] for f in ("--drafter", "--out"))
        out.append(f"{where.rstrip('/')}-{kind}")
    if words and words[0] == "curl" and "-LO" in words:
        out.append(words[-1].rsplit("/", 1)[-1])
    return out


def is_hub_id(value: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", value)) and value.split("/")[0] not in LOCAL


ALL = readme_examples() + help_examples()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder holding what a clone holds, where the :data:`RUN` examples have run."""
    if not (VENV_BIN / "redrafter-mlx").exists():
        pytest.skip(f"no {VENV_BIN}/redrafter-mlx: run `make setup` first")
    folder = tmp_path_factory.mktemp("clone")
    for name in CLONE:
        (folder / name).symlink_to(ROOT / name)
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # an activated venv
        "PYTHONPATH": str(ROOT),  # this checkout, whatever .venv's editable install points at
    }
    by_key = {key(c): c for c in reversed(ALL)}  # the README's spelling where it has one
    for run in RUN:
        assert key(run) in by_key, f"not an example any more: {run}"
        command = by_key[key(run)]
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return folder


def test_the_cheap_examples_run_as_written(scratch):
    """What the fixture ran left what its later examples and a user read."""
    assert (scratch / "models/demo/config.json").is_file()
    assert (scratch / "drafters/demo/model.safetensors").is_file()
    assert (scratch / "drafters/demo/README.md").is_file()  # train's card


def test_every_example_parses_and_keeps_its_line_breaks():
    seen = 0
    for command in ALL:
        code = command.split(" #", 1)[0]
        assert not re.search(r"\S {4,}-", code), f"lost line break: {command}"
        parsed = argv(command)
        if parsed is None:
            continue
        name, args = parsed
        assert name in cli.COMMANDS, f"unknown command: {command}"
        parser = cli.command_parser(name)[1]
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"argparse refuses: {command}")
        seen += 1
    assert seen > 40  # every command's examples, and the README's


def test_every_example_names_only_files_a_user_has(scratch):
    written: list[str] = []
    for command in ALL:
        words = tokens(command)
        for flag, value in zip(words, words[1:], strict=False):
            if flag not in PATH_FLAGS or value.startswith("-") or value in ("none", "auto"):
                continue  # --drafter is a switch of convert's; --drafter none is no file
            if flag == "--drafter" and "demo-model" in words:
                continue  # demo-model's --drafter names a type, not a folder
            if is_hub_id(value):
                continue
            made = any(value == w or value.startswith(w.rstrip("/") + "/") for w in written)
            assert made or glob.glob(str(scratch / value)), f"{value}: no such file: {command}"
        written += written_by(command)
    assert "../shared" not in "\n".join(ALL)


def test_every_help_shows_the_defaults():
    """e.g. chat's --max-tokens and --temp, serve's --port: the one formatter's work."""
    shown = {
        "chat": ["--max-tokens", "--temp"],
        "generate": ["--max-tokens", "--top-p"],
        "serve": ["--port", "--max-tokens"],
    }
    for name, names in shown.items():
        options = cli.command_parser(name)[1].format_help().split("options:", 1)[1]
        text = " ".join(options.split())
        for flag in names:
            after = text.split(f"{flag} {flag.lstrip('-').replace('-', '_').upper()}", 1)[1]
            assert "(default: " in after.split(" --", 1)[0], f"{name} {flag}"


def test_demo_model_loads_with_mlx_lm_and_its_tokenizer_is_the_embedded_one(scratch):
    from mlx_lm import load

    model, tokenizer = load(str(scratch / "models/demo"))
    assert tokenizer.encode("Hello world") == [19556, 905]  # SmolLM2's own ids
    assert model.args.vocab_size == 49152 and model.args.hidden_size == 64


def test_a_loading_line_comes_before_the_wait(scratch, monkeypatch, capsys):
    monkeypatch.chdir(scratch)
    cli.main(["generate", "--model", "models/demo", "--prompt", "Hi", "--max-tokens", "2"])
    assert capsys.readouterr().err.splitlines()[0] == "loading models/demo..."


if __name__ == "__main__":  # the examples as the test sees them
    print("\n".join(ALL), file=sys.stdout)
