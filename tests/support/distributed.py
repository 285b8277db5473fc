"""Local multi-process runs for the distributed tests: ``mlx.launch`` from this checkout, free
ports for the ring backend, and a rank's process found by its run marker."""

from __future__ import annotations

import socket
from pathlib import Path

LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free now (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n < 65536 and all(_free(port + k) for k in range(n)):
            return port
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def rank_pid(marker: str, rank: int) -> int | None:
    """The process of ``rank`` in the run started with ``marker``."""
    want = {f"REDRAFTER_TEST_RUN={marker}".encode(), f"MLX_RANK={rank}".encode()}
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # not a process, or gone
            continue
        if want <= env and b"redrafter_mlx" in cmdline:
            return int(proc.name)
    return None
