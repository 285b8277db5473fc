"""``--shard tensor|pipeline`` for generate, chat and serve under ``mlx.launch``: every rank
loads its share of the target; rank 0 runs the command (prints, reads input, serves), the other
ranks follow its orders (``core/serving/distributed.py``) and print nothing but their own failure.

A rank that fails says so in one line naming itself and exits 1; ``mlx.launch`` then ends
the others (``redrafter-mlx launch`` also exits non-zero then). A rank that loses another
mid-run (killed, its machine gone) ends with one line too, instead of a traceback; one that
hears nothing from another for ``--rank-timeout`` seconds (hung: ``cli/rankwatch.py``) too.
Outside a launched group ``--shard`` says in one line that it runs as one process.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading

from redrafter_mlx.cli import flags, rankwatch
from redrafter_mlx.core.errors import ReDrafterError
from redrafter_mlx.io import runtime as rt

SHARD_HELP = (
    "run under mlx.launch with the target split over its ranks: tensor (each layer's heads "
    "and MLP split; llama, qwen2, qwen3, ...) or pipeline (the layers split into stages; "
    "qwen2, qwen3-moe, deepseek, ...); rank 0 prints, see docs/distributed.md"
)


def add_shard_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard", choices=("tensor", "pipeline"), help=SHARD_HELP)
    parser.add_argument(
        "--rank-timeout",
        type=flags.non_negative,
        default=rankwatch.timeout_default(),
        help="with --shard: seconds a rank may stop answering (stopped, hung) before every "
        f"rank ends with a line naming it (0: wait forever; default: ${rankwatch.ENV} or "
        f"{rankwatch.DEFAULT_TIMEOUT:g})",
    )


def follower(args: argparse.Namespace) -> bool:
    """Whether this process is a rank other than 0 of a sharded run."""
    if not getattr(args, "shard", None):
        return False
    import mlx.core as mx

    if mx.distributed.init().rank() != 0:
        return True
    _ctrl_c_on_lead()
    return False


def _ctrl_c_on_lead() -> None:
    """mlx.launch starts the ranks with Ctrl-C ignored (in the background of its shell):
    rank 0 takes it back (the others end with it); only the main thread can."""
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def load_runtime(args: argparse.Namespace, *, need_drafter: bool) -> rt.Runtime:
    """The command's runtime: loaded whole, or with ``--shard`` split over the ranks. Only rank
    0 returns: the others follow its orders until it stops, then exit."""
    if not getattr(args, "shard", None):
        return flags.load_runtime(args.model, args.drafter, need_drafter=need_drafter)
    flags.say_loading(args.model)
    import mlx.core as mx

    from redrafter_mlx.core.serving.distributed import PeerFailed, follow
    from redrafter_mlx.io.sharded import load_runtime as load_sharded

    if mx.distributed.init().size() == 1:
        print(
            f"note: --shard {args.shard}: one process (not started by mlx.launch or "
            "redrafter-mlx launch), so the whole model loads and runs here",
            file=sys.stderr,
        )
    try:
        runtime, orders = load_sharded(
            args.model, args.drafter, args.shard, need_drafter=need_drafter
        )
    except PeerFailed:
        raise SystemExit(1) from None  # the failed rank said why
    if orders.size > 1:
        _one_line_when_a_rank_is_lost(orders.rank, orders.size)
        off = rankwatch.start(orders.group, getattr(args, "rank_timeout", 0.0))
        if off and orders.lead:
            print(f"note: {off}", file=sys.stderr)
    if orders.lead:
        flags.say_skipped(runtime)
        _ctrl_c_on_lead()
        atexit.register(orders.stop)
        return runtime
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the run ends
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (rank 0 alone prints answers)
    follow(runtime.decoder, runtime.tokenizer, orders)
    raise SystemExit(0)


def _one_line_when_a_rank_is_lost(rank: int, size: int) -> None:
    """A collective that loses its peer (``[ring] connection to a peer was lost``) ends this
    rank with one line naming it, not a traceback; anything else is reported as before."""
    previous = sys.excepthook

    def hook(kind, error, tb):
        text = " ".join(str(error).split())
        if isinstance(error, RuntimeError) and text.startswith("[ring]"):
            other = f"rank {1 - rank}" if size == 2 else "another rank"
            print(
                f"error: rank {rank} of {size}: lost {other} ({text}): every rank ends",
                file=sys.stderr,
            )
            return
        if isinstance(error, ReDrafterError):
            print(f"error: rank {rank} of {size}: {error}", file=sys.stderr)
            return
        previous(kind, error, tb)

    sys.excepthook = hook
