"""Plain progress lines (stderr into a pipe or log): a line at least every PLAIN_EVERY seconds,
an ETA that converges, no wrapping. Stand-ins for the slow work: sleeps and a fake clock."""

from __future__ import annotations

import io
import time

from redrafter_mlx.cli import progress
from redrafter_mlx.cli.progress import PlainProgress, eta_seconds


def test_a_line_at_least_every_period_while_one_unit_runs_long():
    """``make bench | cat`` gave its first line at 56 s and then gaps of 78-110 s: lines came
    only when a generation finished. A slow stand-in measurement (0.7 s per unit, 3.5 periods)
    must still give a line every period."""
    every, stamps, said = 0.2, [], []

    def say(line: str) -> None:
        stamps.append(time.perf_counter())
        said.append(line)

    start = time.perf_counter()
    with PlainProgress(every=every, say=say) as bar:
        task = bar.add_task("benchmarking", total=3)
        for _ in range(3):
            time.sleep(0.7)  # the slow fake measurement
            bar.update(task, advance=1)
    gaps = [b - a for a, b in zip([start, *stamps], stamps + [time.perf_counter()], strict=True)]
    assert max(gaps) < every + 0.15, (gaps, said)
    assert len(said) >= 9
    assert said[-1].startswith("benchmarking: 3/3 (100%), ETA 0:00")


def test_no_heartbeat_lines_after_the_block():
    said = []
    with PlainProgress(every=0.05, say=said.append) as bar:
        bar.add_task("x", total=1)
    count = len(said)
    time.sleep(0.2)
    assert len(said) == count


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_eta_converges_and_counts_down_between_units():
    """A 60 s warm-up phase, then 10 units of 10 s: the measuring phase's ETA is exact from
    its first unit on (the warm-up is not in its pace, as it was in the first ETAs of 26:24
    and 36:09 for a 14:54 run), and it counts down while a unit runs."""
    clock = FakeClock()
    bar = PlainProgress(every=1e9, clock=clock, say=lambda line: None)
    warm = bar.add_task("warming up", total=1)
    clock.now += 60
    bar.update(warm, advance=1)
    task = bar.add_task("measuring", total=10)
    assert "ETA -:--" in bar.line(task)
    for unit in range(1, 11):
        clock.now += 4
        if unit > 1:  # mid-unit: 10 s per unit so far, so the units left minus the 4 s in
            left = (11 - unit) * 10 - 4
            assert bar.line(task).split(", ")[1] == f"ETA {left // 60}:{left % 60:02d}"
        clock.now += 6
        bar.update(task, advance=1)
        left = (10 - unit) * 10
        assert bar.line(task).split(", ")[1] == f"ETA {left // 60}:{left % 60:02d}"


def test_eta_never_below_the_whole_units_left():
    # 10 s per unit so far; the running unit already took 30 s: 2 more units still take 20 s
    assert eta_seconds(elapsed=50, done=5, total=8, since_last=30) == 20
    assert eta_seconds(elapsed=50, done=5, total=8, since_last=3) == 27
    assert eta_seconds(elapsed=0, done=0, total=8, since_last=3) is None


def test_consoles_into_a_pipe_do_not_wrap(monkeypatch):
    """rich wraps at 80 columns when its stream is no terminal; a log line must stay whole."""
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    text = "word " * 40
    progress.console().print(text)
    assert stream.getvalue().strip() == text.strip()


def test_bench_into_a_pipe_prints_a_line_every_period_while_generations_run_long(
    tmp_path, monkeypatch
):
    """The 15 s rule through the command itself: every generation made slow (a stand-in
    sleep of 2.5 periods before the real, tiny one), the lines still come every period."""
    from test_cli import pair

    from redrafter_mlx.cli import main
    from redrafter_mlx.training import progress as lines
    from redrafter_mlx.tuning import measure

    every, stamps = 0.2, []
    real = measure.measure

    def slow(*args, **kwargs):
        time.sleep(2.5 * every)
        return real(*args, **kwargs)

    monkeypatch.setattr(lines, "PLAIN_EVERY", every)
    monkeypatch.setattr(lines, "say", lambda line: stamps.append((time.perf_counter(), line)))
    monkeypatch.setattr(measure, "measure", slow)
    given, prompts = pair(tmp_path)
    main([
        "bench", *given, "--prompts", prompts, "--num-prompts", "1", "--max-tokens", "6",
        "--repetitions", "1", "--beam-width", "1", "--beam-length", "2", "--timed-prompts", "0",
        "--this-plan-only", "--out", str(tmp_path / "bench"),
    ])  # fmt: skip
    times = [t for t, _ in stamps]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(stamps) >= 10 and max(gaps) < every + 0.25, (gaps, stamps)
    assert any(": measuring: " in line for _, line in stamps)


def test_a_slow_phase_is_said_and_a_quick_one_is_not():
    """A first run's compile (tens of seconds) said what it was doing nothing of; later runs,
    which reuse it, print nothing."""
    import time

    from redrafter_mlx.cli.progress import SaidIfSlow

    said = []
    with SaidIfSlow("compiling", after=0.05, write=said.append):
        time.sleep(0.3)
    assert said[0] == "compiling..." and said[1].startswith("compiling: done in ")
    quiet = []
    with SaidIfSlow("compiling", after=5.0, write=quiet.append):
        pass
    time.sleep(0.1)
    assert quiet == []
