"""What ``train`` shows while it runs, on stderr (stdout keeps ``--json``'s one line): rich
bars on a terminal; into a file, where rich draws nothing until a phase ends, a plain line
every :data:`PLAIN_EVERY` seconds; and an ETA that holds still."""

from __future__ import annotations

import sys
import time

from rich.console import Console

PLAIN_EVERY = 15.0  # seconds between plain progress lines when stderr is no terminal (a log)

# Into a pipe or a log rich wraps at 80 columns; a line there is wrapped by whoever reads it
UNWRAPPED_WIDTH = 400


def console(*, stderr: bool = True) -> Console:
    """A rich console on stderr (or stdout), the one progress bars draw on: as rich makes it
    on a terminal; elsewhere one that does not wrap lines (rich's default is 80 columns when
    the stream is no terminal)."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True)


def eta(seconds: float, done: float, left: float) -> str:
    """``ETA m:ss`` at the mean pace since the start (``done`` units in ``seconds``): a short
    window swings with every evaluation or long answer; the whole run's mean does not."""
    return eta_text(seconds / done * left if done > 0 else 0)


def eta_text(seconds_left: float) -> str:
    left_s = int(seconds_left)
    return f"ETA {left_s // 60}:{left_s % 60:02d}"


def fitted(
    total: int, *, have: int, done: float, seconds: float, time_left: float | None
) -> tuple[int, str]:
    """``(total, ETA)`` of a run at ``have`` of ``total`` units, at the mean pace (``done``
    units in ``seconds``): with a time budget (``time_left`` seconds, None: none) the total
    is what fits in it and the ETA at most the time left, from the first line on, instead
    of a plan the budget will cut (600,000 tokens, ETA 2007:51, in a 3-minute run)."""
    pace = done / seconds if done > 0 and seconds > 0 else 0.0
    left_s = (total - have) / pace if pace else 0.0
    if time_left is not None and (not pace or left_s > time_left):
        left_s = max(time_left, 0.0)
        if pace:
            total = min(total, have + int(pace * left_s))
    return max(total, have), eta_text(left_s)


def data_bound(total: int, *, have: int, done: int, read: int, unread: int) -> int:
    """``total`` cut to what the data holds, estimated: the ``have`` tokens so far plus the
    ``unread`` conversations at the mean tokens of the ``read`` ones (``done`` tokens), so that
    a line does not plan 600,000 tokens out of data that holds 826."""
    if read <= 0:
        return total
    return min(total, have + round(done / read * max(unread, 0)))


class PlainLines:
    """A plain progress line every :data:`PLAIN_EVERY` seconds, when stderr is no terminal."""

    def __init__(self, quiet: bool):
        self.on = not quiet and not sys.stderr.isatty()
        self.last = time.perf_counter()

    def due(self) -> bool:
        """Whether a line is due now (then the next one is due in PLAIN_EVERY seconds)."""
        now = time.perf_counter()
        if not self.on or now - self.last < PLAIN_EVERY:
            return False
        self.last = now
        return True


def say(line: str) -> None:
    """One progress line on stderr, flushed (a log shows it at once)."""
    print(line, file=sys.stderr, flush=True)
