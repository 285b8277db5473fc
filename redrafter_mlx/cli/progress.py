"""Progress of a command that runs for a while (bench, eval-drafter, autotune), on stderr:
a transient rich bar on a terminal; into a pipe or a log, where rich draws nothing until the
end, a plain line every few seconds instead, as ``train`` prints (``training/progress.py``).

:func:`progress` returns either; both take rich's ``add_task`` / ``advance`` / ``update``."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import Progress

from redrafter_mlx.training import progress as lines


def progress(console: Console | None = None) -> Progress | PlainProgress:
    """A transient rich bar on ``console`` (stderr) when stderr is a terminal, else
    :class:`PlainProgress`."""
    if lines.PlainLines(quiet=False).on:
        return PlainProgress()
    return Progress(console=console or lines.console(), transient=True)


class PlainProgress:
    """rich's ``Progress`` API (the part the commands use) as a plain stderr line every
    :data:`~redrafter_mlx.training.progress.PLAIN_EVERY` seconds:
    ``benchmarking (mlx-lm): 3/40 (8%), ETA 2:05``; without a total, the count and time."""

    def __init__(self):
        self.tasks: list[dict] = []
        self.plain = lines.PlainLines(quiet=False)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields) -> int:
        self.tasks.append(
            {"description": description, "total": total, "done": 0, "start": time.perf_counter()}
        )
        return len(self.tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def update(self, task: int, *, advance: float = 0, description: str | None = None, **_):
        state = self.tasks[task]
        state["done"] += advance
        if description is not None:
            state["description"] = description
        if self.plain.due():
            lines.say(self.line(task))

    def line(self, task: int) -> str:
        state = self.tasks[task]
        done, total = state["done"], state["total"]
        seconds = time.perf_counter() - state["start"]
        if not total:
            return f"{state['description']}: {done:g} done, {seconds:.0f} s"
        done = min(done, total)
        eta = lines.eta(seconds, done, total - done)
        return f"{state['description']}: {done:g}/{total:g} ({100 * done / total:.0f}%), {eta}"
