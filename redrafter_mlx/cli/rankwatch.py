"""A sharded run's watch on its ranks: a rank that stops answering, alive but hung (stopped
with SIGSTOP, frozen, its machine asleep), ends every rank within a bound the user sets.

MLX's collectives wait for every rank without a time limit, so a hung rank would hold the
others forever (a dead one is seen at once: its connection drops). Each rank therefore sends a
small UDP heartbeat to every other one every :data:`BEAT` seconds from a thread of its own (it
beats while the rank computes: MLX releases the GIL while it evaluates); a rank that has heard
nothing from another for ``--rank-timeout`` seconds says so in one line naming it, ends a hung
rank on its own machine (a stopped process ignores the launcher's SIGTERM) and exits 1, upon
which ``mlx.launch`` ends the rest. The heartbeat addresses are exchanged once, with an
all-sum, where all ranks meet after loading; the hosts' IPs are the ring backend's hostfile's.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time

import mlx.core as mx
import numpy as np

BEAT = 0.5  # seconds between heartbeats
DEFAULT_TIMEOUT = 30.0  # seconds of silence before a rank counts as hung
ENV = "REDRAFTER_RANK_TIMEOUT"  # the default of --rank-timeout
BYE = -1  # a rank that ends cleanly says so: the others stop watching it


def timeout_default() -> float:
    """$REDRAFTER_RANK_TIMEOUT, else :data:`DEFAULT_TIMEOUT` (an unreadable value: the
    default, said by :func:`check_timeout` when parsed as a flag)."""
    try:
        return float(os.environ.get(ENV, DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def ring_ips(size: int) -> list[str] | None:
    """Each rank's IP from the ring backend's hostfile (``$MLX_HOSTFILE``: a JSON list per rank
    of ``"ip:port"``); None when there is none to read (another backend)."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        ips = [str(node[0]).rsplit(":", 1)[0] for node in hosts]
    except (KeyError, OSError, ValueError, TypeError, IndexError):
        return None
    return ips if len(ips) == size else None


def _host_id() -> int:
    """This machine, as a number the ranks can sum (which ranks share a machine)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:7], "little")


def exchange(group: mx.distributed.Group, mine: list[int]) -> np.ndarray:
    """Every rank's ``mine`` (a few integers), ``(N, len(mine))``: one all-sum."""
    table = np.zeros((group.size(), len(mine)), np.int64)
    table[group.rank()] = mine
    with mx.stream(mx.cpu):  # int64 is a CPU type on every backend
        return np.array(mx.distributed.all_sum(mx.array(table), group=group))


def start(group: mx.distributed.Group, timeout: float) -> str | None:
    """Watch every other rank of ``group`` (all ranks call this at the same point); None, or
    why the watch is off, in words, for a note."""
    if group.size() == 1 or timeout <= 0:
        return None
    ips = ring_ips(group.size())
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    table = exchange(group, [sock.getsockname()[1], os.getpid(), _host_id()])
    if ips is None:
        sock.close()
        return "no ring hostfile to find the ranks' hosts: a hung rank is not detected"
    peers = {r: (ips[r], int(table[r, 0])) for r in range(group.size()) if r != group.rank()}
    local = {r: int(table[r, 1]) for r in peers if int(table[r, 2]) == _host_id()}
    watch = Watch(group.rank(), group.size(), sock, peers, local, timeout)
    threading.Thread(target=watch.run, name="rankwatch", daemon=True).start()
    atexit.register(watch.bye)
    return None


class Watch:
    """The heartbeat thread of one rank (see the module docstring)."""

    def __init__(self, rank, size, sock, peers: dict, local: dict, timeout: float):
        self.rank, self.size, self.sock, self.peers = rank, size, sock, peers
        self.local, self.timeout = local, timeout
        self.heard = dict.fromkeys(peers, time.monotonic())
        self.sock.settimeout(BEAT)

    def send(self, message: int) -> None:
        for address in self.peers.values():
            try:
                self.sock.sendto(message.to_bytes(8, "little", signed=True), address)
            except OSError:
                pass  # a peer's host unreachable now: its silence is what counts

    def bye(self) -> None:
        self.send(BYE)

    def run(self) -> None:
        last = 0.0
        while True:
            now = time.monotonic()
            if now - last >= BEAT:
                self.send(self.rank)
                last = now
            try:
                data, _ = self.sock.recvfrom(8)
                sender = int.from_bytes(data, "little", signed=True)
            except (TimeoutError, OSError, ValueError):
                sender = None
            if sender == BYE:
                self.heard.clear()  # a rank ends cleanly: the run is ending, watch no more
            elif sender in self.heard:
                self.heard[sender] = time.monotonic()
            silent = [r for r, t in self.heard.items() if time.monotonic() - t > self.timeout]
            if silent:
                self.end(silent[0])

    def end(self, hung: int) -> None:
        """Say which rank stopped answering, end it if it runs on this machine, exit 1."""
        print(
            f"error: rank {self.rank} of {self.size}: rank {hung} has not answered for "
            f"{self.timeout:g} s (stopped or hung; --rank-timeout): every rank ends",
            file=sys.stderr,
            flush=True,
        )
        if hung in self.local:
            try:
                os.kill(self.local[hung], signal.SIGKILL)
            except OSError:
                pass  # already gone
        os._exit(1)
