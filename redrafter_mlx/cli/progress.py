"""Progress of a command that runs for a while (bench, eval-drafter, autotune), on stderr:
a transient rich bar on a terminal; into a pipe or a log, where rich draws nothing until the
end, plain lines instead, as ``train`` prints (``training/progress.py``).

Plain lines keep two promises: a line at least every
:data:`~redrafter_mlx.training.progress.PLAIN_EVERY` seconds, even while one unit of work (a
generation, a compile) takes minutes, from a heartbeat thread; and an ETA that converges
(:func:`eta_seconds`). A new task (a phase: warming up, measuring, ...) prints its first line
at once, so no phase is silent.

:func:`progress` returns either; both take rich's ``add_task`` / ``advance`` / ``update``."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import Progress

from redrafter_mlx.training import progress as lines

UNWRAPPED_WIDTH = lines.UNWRAPPED_WIDTH
console = lines.console  # a console that does not wrap into a pipe or a log


def progress(console: Console | None = None) -> Progress | PlainProgress:
    """A transient rich bar on ``console`` (stderr) when stderr is a terminal, else
    :class:`PlainProgress`."""
    if lines.PlainLines(quiet=False).on:
        return PlainProgress()
    return Progress(console=console or lines.console(), transient=True)


def eta_seconds(*, elapsed: float, done: float, total: float, since_last: float) -> float | None:
    """Seconds left after ``done`` of ``total`` units, ``elapsed`` seconds from the phase's
    start to the last finished unit and ``since_last`` seconds after it: the mean pace of the
    units so far (``elapsed / done`` each; a short window swings with each long unit, the mean
    settles as units accumulate) times the units left, counting down while the next unit
    runs, but never below the whole units after it. None before the first unit."""
    if done <= 0:
        return None
    pace = elapsed / done
    left = total - done
    return max(pace * left - since_last, pace * max(left - 1, 0), 0.0)


class PlainProgress:
    """rich's ``Progress`` API (the part the commands use) as plain stderr lines:
    ``benchmarking (mlx-lm): 3/40 (8%), ETA 2:05, 0:42 so far``; without a total, the count and
    time. A line when a task starts, then one at least every ``every`` seconds."""

    def __init__(
        self,
        *,
        every: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        say: Callable[[str], None] | None = None,
    ):
        self.tasks: list[dict] = []
        self.every = lines.PLAIN_EVERY if every is None else every
        self.clock, self.say = clock, say or lines.say
        self.last = clock()  # when the last line was printed
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> PlainProgress:
        if self.every <= 0:  # a line at every update already
            return self
        self.thread = threading.Thread(target=self._heartbeat, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        return None

    def _heartbeat(self) -> None:
        """A line whenever ``every`` seconds passed without one (a unit of work can take
        minutes; a line only per finished unit left gaps of 80-110 s)."""
        while True:
            with self.lock:
                wait = self.last + self.every - self.clock()
                if wait <= 0 and self.tasks:
                    self._print(len(self.tasks) - 1)
                    wait = self.every
            if self.stop.wait(max(wait, 0.01)):
                return

    def add_task(self, description: str, total: float | None = None, **fields) -> int:
        with self.lock:
            now = self.clock()
            self.tasks.append(
                {"description": description, "total": total, "done": 0, "start": now, "at": now}
            )
            self._print(len(self.tasks) - 1)  # a phase announces itself
            return len(self.tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def update(self, task: int, *, advance: float = 0, description: str | None = None, **_):
        with self.lock:
            state = self.tasks[task]
            state["done"] += advance
            if advance:
                state["at"] = self.clock()
            if description is not None:
                state["description"] = description
            finished = state["total"] and state["done"] >= state["total"]
            if finished or self.clock() - self.last >= self.every:
                self._print(task)

    def _print(self, task: int) -> None:
        self.last = self.clock()
        self.say(self.line(task))

    def line(self, task: int) -> str:
        state = self.tasks[task]
        done, total = state["done"], state["total"]
        now = self.clock()
        ran = _clock_text(now - state["start"])
        if not total:
            return f"{state['description']}: {done:g} done, {ran} so far"
        done = min(done, total)
        left = eta_seconds(
            elapsed=state["at"] - state["start"],
            done=done,
            total=total,
            since_last=now - state["at"],
        )
        eta = "ETA -:--" if left is None else lines.eta_text(left)
        percent = 100 * done / total
        return f"{state['description']}: {done:g}/{total:g} ({percent:.0f}%), {eta}, {ran} so far"


def _clock_text(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


class SaidIfSlow:
    """``with SaidIfSlow("compiling ..."):``: the message on stderr once the block has run
    ``after`` seconds, and how long it took when it ends; nothing for a block that ends sooner
    (a first run compiles for tens of seconds, later runs reuse it)."""

    def __init__(self, message: str, after: float = 5.0, write=None):
        self.message, self.after = message, after
        self.write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.said = False

    def __enter__(self) -> SaidIfSlow:
        self.began = time.monotonic()
        self.timer = threading.Timer(self.after, self._say)
        self.timer.daemon = True
        self.timer.start()
        return self

    def _say(self) -> None:
        self.said = True
        self.write(f"{self.message}...")

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        if self.said:
            self.write(f"{self.message}: done in {time.monotonic() - self.began:.0f} s")
