"""`redrafter-mlx launch`: ``mlx.launch`` with an exit status that says when a rank failed.

``mlx.launch`` ends every rank once one exits non-zero or is killed, and says so on stderr
(``Node with rank 1 exited with code -9``), but itself exits 0, so a script reads a lost rank
as success. This command runs ``mlx.launch`` (its own options, unchanged) in this process,
notes the ranks it reports as failed and exits non-zero when one did: the first failed
rank's code (128 + N for a rank killed by signal N, 1 when it was ended by the launcher)."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  # mlx.launch's options, then -- and the command every rank runs (docs/distributed.md)
  redrafter-mlx launch --hosts 127.0.0.1 -n 2 --backend ring -- \\
      redrafter-mlx chat --shard tensor --model models/demo || echo "a rank failed: $?"
"""


class PassThrough(argparse.ArgumentParser):
    """Every argument goes to mlx.launch as given (``--help`` first shows this help)."""

    def parse_args(self, args=None, namespace=None):  # noqa: ARG002
        args = list(sys.argv[1:] if args is None else args)
        if not args or args[0] in ("-h", "--help"):
            self.print_help()
            raise SystemExit(0)
        return argparse.Namespace(argv=args)


def setup_arg_parser() -> argparse.ArgumentParser:
    return PassThrough(
        description="Run mlx.launch (same options: --hosts/--hostfile, -n, --backend, ...; "
        "`mlx.launch --help` lists them) and exit non-zero when a rank failed, which "
        "mlx.launch itself does not.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(args: argparse.Namespace) -> None:
    try:
        from mlx._distributed_utils import launch
    except ImportError as e:
        print(f"error: this MLX has no mlx.launch ({e})", file=sys.stderr)
        raise SystemExit(1) from None
    failed: list[tuple[int, int | None]] = []  # (rank, exit code; None: ended by the launcher)
    warn = launch.log_warning

    def noting(*parts, **kwargs):
        failed.extend(_failure(" ".join(map(str, parts))))
        warn(*parts, **kwargs)

    launch.log_warning = noting
    argv, sys.argv = sys.argv, ["mlx.launch", *args.argv]
    try:
        launch.main()
    finally:
        sys.argv, launch.log_warning = argv, warn
    if failed:
        raise SystemExit(exit_status(failed))


def _failure(text: str) -> list[tuple[int, int | None]]:
    """``[(rank, code)]`` from one of mlx.launch's warnings about a rank, else ``[]``."""
    words = text.split()
    if "Node with rank" not in text or len(words) < 5:
        return []
    rank = int(words[3])
    if text.rstrip().endswith("was killed"):
        return [(rank, None)]
    if "exited with code" in text:
        return [(rank, int(words[-1]))]
    return []


def exit_status(failed: list[tuple[int, int | None]]) -> int:
    """The first failed rank's status as a shell reports it: its code, 128 + N when signal N
    ended it, 1 when the launcher ended it (because another rank failed first)."""
    codes = [code for _, code in failed if code is not None]
    if not codes:
        return 1
    code = codes[0]
    return 128 - code if code < 0 else code if 0 < code < 256 else 1
