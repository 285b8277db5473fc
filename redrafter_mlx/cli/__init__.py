"""`redrafter-mlx <command>`: dispatch to one module per command.

On Linux the CPU backend's matmul speed depends on BLAS: for the commands that decode
(:data:`DECODING`) the console script (:func:`entry`, and ``python -m redrafter_mlx``)
re-executes the process once with Debian's OpenBLAS and the small-row decode kernel in
``LD_PRELOAD`` and malloc's huge pages on, when they are available and not yet set
(``backend/cpu/blas.py``; ``REDRAFTER_CPU_TUNING=0`` opts out of all of it). That must happen
before MLX is imported, and the huge pages' tunable is read only when a process starts: hence
a new process, not a library loaded into this one. Every other command (``--version``,
``--help``, ``convert``, ...) runs in the first process. :func:`main` called from Python never
re-executes: in a notebook that would replace the kernel, from another script rerun that script.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable

# It imports no MLX: the re-exec must come before MLX is loaded.
from redrafter_mlx.backend.cpu.blas import reexec_with_blas

COMMANDS = {
    "generate": ("redrafter_mlx.cli.generate", "generate text (ReDrafter by default)"),
    "chat": ("redrafter_mlx.cli.chat", "terminal chat with ReDrafter"),
    "serve": ("redrafter_mlx.cli.serve", "OpenAI-compatible HTTP server with ReDrafter"),
    "convert": ("redrafter_mlx.cli.convert", "convert a HF folder/hub id, .bin, GGUF or drafter"),
    "train": ("redrafter_mlx.cli.train", "distil a drafter for a target model"),
    "eval-drafter": ("redrafter_mlx.cli.eval_drafter", "mean tokens/step of a drafter per (W, L)"),
    "bench": ("redrafter_mlx.cli.bench", "speed benchmark against mlx-lm"),
    "autotune": ("redrafter_mlx.cli.autotune", "find the fastest beam shape for this chip"),
    "upload": ("redrafter_mlx.cli.upload", "share a drafter on the Hugging Face Hub"),
    "demo-model": ("redrafter_mlx.cli.demo_model", "a tiny random model to try commands offline"),
    "launch": ("redrafter_mlx.cli.launch", "mlx.launch, exiting non-zero when a rank failed"),
}

# The commands that run a model's forward many times: only these are worth a second process.
DECODING = frozenset({"generate", "chat", "serve", "bench", "autotune", "train", "eval-drafter"})

USAGE = """usage: redrafter-mlx <command> [options]

commands:
{commands}

examples (in a clone after `make setup`: .venv/bin/redrafter-mlx, or redrafter-mlx after
`source .venv/bin/activate`):
  redrafter-mlx chat
  redrafter-mlx generate --prompt "What is the capital of France?"
  redrafter-mlx generate --autoregressive --prompt "Tell me a joke." --json
  redrafter-mlx serve --port 8080
  redrafter-mlx demo-model --out models/demo      # a tiny model folder, no network
  redrafter-mlx bench --beam-width 1,2,3 --beam-length 3,4,5

`redrafter-mlx <command> --help` shows each command's options and examples.
"""


def entry() -> None:
    """The console script: for a decoding command, preload the fast BLAS (re-executing once);
    then :func:`main`."""
    if len(sys.argv) > 1 and sys.argv[1] in DECODING:
        reexec_with_blas()
    main(sys.argv[1:])


def main(argv: list[str] | None = None) -> None:
    """Run one command, e.g. ``main(["generate", "--prompt", "Hi"])``; in this process."""
    argv = sys.argv[1:] if argv is None else argv
    listing = "\n".join(f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(commands=listing))
        return
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"redrafter-mlx {version('redrafter-mlx')}")
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"redrafter-mlx: unknown command {name!r}{hint}\n", file=sys.stderr)
        print(USAGE.format(commands=listing), file=sys.stderr)
        raise SystemExit(2)

    def command() -> None:  # importing a command takes seconds: Ctrl-C may come meanwhile
        module, parser = command_parser(name)
        module.main(parser.parse_args(rest))

    run(command)


def command_parser(name: str) -> tuple:
    """``(module, parser)`` of command ``name`` as ``redrafter-mlx name`` parses it: its
    ``prog`` and the help that shows every default (:class:`flags.HelpFormatter`)."""
    module = import_command(COMMANDS[name][0])
    from redrafter_mlx.cli import flags  # after the command's import: MLX may load now

    parser = module.setup_arg_parser()
    parser.prog = f"redrafter-mlx {name}"
    parser.formatter_class = flags.HelpFormatter
    return module, parser


NO_BACKEND = (
    "error: MLX has no backend installed ({error}); on Linux install one extra: "
    "pip install 'redrafter-mlx[cpu]', or 'redrafter-mlx[cuda]' with an NVIDIA GPU "
    "(make setup picks one)"
)


def import_command(module: str):
    """A command's module; a missing MLX backend (a Linux install without the ``cpu`` or
    ``cuda`` extra) ends with one line saying which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if not (e.name or "").startswith("mlx") and "libmlx" not in str(e):
            raise
        print(NO_BACKEND.format(error=" ".join(str(e).split())), file=sys.stderr)
        raise SystemExit(1) from None


def run(command: Callable[[], None]) -> None:
    """Run a command; Ctrl-C and a closed output pipe end it quietly (no traceback). Each
    command's ``main`` turns library errors into their one-line messages itself
    (``flags.reports_errors``), so it says the same when called from Python. Commands that can
    say more about an interrupt (chat, autotune, train) catch it themselves."""
    try:
        command()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # e.g. `redrafter-mlx generate ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit's flush does not fail again
        raise SystemExit(1) from None
