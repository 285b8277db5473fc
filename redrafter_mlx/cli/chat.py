"""`redrafter-mlx chat`: a terminal chat with ReDrafter that reuses the conversation's KV cache.

One ``Sequence`` lives for the whole session. Each turn templates the full conversation, keeps
the longest prefix the sequence already holds, rewinds to it and feeds only the rest.
When the conversation outgrows the model's context the oldest turns are dropped (the cache then
re-prefills from the first differing token). Ctrl-C stops an answer and keeps what was shown.

With ``--lookup K`` each step also verifies up to K prompt-lookup beams (continuations copied
from the conversation); a model without a drafter then decodes with those beams alone.

With a pipe on stdin it is a plain line-by-line session: one answer per input line on stdout,
notices and stats on stderr, no colours or prompts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from redrafter_mlx.cli import flags, sharding
from redrafter_mlx.cli.progress import SaidIfSlow, progress
from redrafter_mlx.core.atomic import write_text
from redrafter_mlx.core.decode.accept import make_sampler
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.stream import SOURCES, GenerationStats, StepResponse, tokens_per_step
from redrafter_mlx.core.errors import ConfigError, ContextFull
from redrafter_mlx.core.serving.distributed import MirroredSession, session_for
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.templates import check_text
from redrafter_mlx.tuning.measure import time_steps
from redrafter_mlx.tuning.profiles import follow_context, resolve_shape

EXAMPLES = """examples:
  redrafter-mlx chat
  redrafter-mlx chat --system "Answer in one sentence." --beam-width 2 --beam-length 4
  redrafter-mlx chat --autoregressive --max-tokens 128
  redrafter-mlx chat --lookup 4      # prompt-lookup beams too (without a drafter: alone)
  redrafter-mlx chat --model models/demo --max-tokens 32   # see demo-model --help
  printf 'My name is Ada.\\nWhat is my name?\\n' | redrafter-mlx chat
"""

LEAVE_HINT = "cancelled; to leave the chat: Ctrl-D or /quit"  # Ctrl-C at the prompt
COMMANDS = {
    "help": "this list",
    "reset": "forget the conversation (keeps the system prompt)",
    "stats": "session totals: tokens, tokens/step histogram, accepted drafts by source, "
    "speedup estimate",
    "beam": "W L [P [S]]: beam width, length (path-probability floor, search width) for the "
    "next answers (without a drafter only L counts)",
    "lookup": "K: prompt-lookup beams per step, copied from the conversation (0 = off)",
    "temp": "T: sampling temperature (0 = greedy)",
    "system": "TEXT: set the system prompt (no text: show it)",
    "save": "PATH: write the conversation as JSON",
    "quit": "leave (also Ctrl-D, or Ctrl-C at the prompt)",
}

Encode = Callable[[list[dict]], list[int]]


# ---------------------------------------------------------------- parsing (pure)


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


def parse_command(line: str) -> Command | None:
    """``"/beam 2 4"`` -> ``Command("beam", "2 4")``; ``None`` for a plain message."""
    if not line.startswith("/"):
        return None
    name, _, arg = line[1:].strip().partition(" ")
    return Command(name.lower(), arg.strip())


def parse_beam(arg: str, min_prob: float = 0.0, search_width: int = 0) -> BeamShape:
    """``"W L [P [S]]"`` -> BeamShape (``min_prob`` unless P is given, ``search_width`` unless S
    is); ValueError with a usage message otherwise."""
    usage = (
        "usage: /beam W L [P [S]]  (two integers, optional path-probability floor and search "
        "width: /beam 2 4 0.3, /beam 4 5 0 16)"
    )
    parts = arg.split()
    integers = [parts[i] for i in (0, 1, 3) if i < len(parts)]
    if len(parts) not in (2, 3, 4) or not all(p.isdigit() for p in integers):
        raise ValueError(usage)
    try:
        floor = float(parts[2]) if len(parts) >= 3 else min_prob
    except ValueError:
        raise ValueError(usage) from None
    search = int(parts[3]) if len(parts) == 4 else search_width
    return BeamShape(int(parts[0]), int(parts[1]), floor, search)


def parse_lookup(arg: str) -> int:
    """``"4"`` -> 4; ValueError unless one integer >= 0."""
    if not (arg.isascii() and arg.isdigit()):  # no sign, decimal point, extra word, "²"
        raise ValueError("usage: /lookup K  (an integer >= 0: lookup beams per step, 0 = off)")
    return int(arg)


def accepted_sources(counts: Counter, drafted: bool = True) -> str:
    """``"drafter 40, lookup 12, both 3"``: accepted drafted tokens by the beams that held them
    (``both``: a drafter beam and a lookup beam). Without a drafter every one is lookup's, so
    the other two are left out."""
    sources = SOURCES if drafted else ("lookup",)
    return ", ".join(f"{source} {counts[source]}" for source in sources)


def parse_temp(arg: str) -> float:
    """``"0.7"`` -> 0.7; ValueError unless a number >= 0."""
    try:
        value = float(arg)
    except ValueError:
        raise ValueError("usage: /temp T  (a number >= 0, 0 = greedy)") from None
    if not 0 <= value < math.inf:  # also rejects nan
        raise ValueError("usage: /temp T  (a number >= 0, 0 = greedy)")
    return value


def unknown_hint(name: str) -> str:
    """A one-line hint for an unknown command, suggesting the closest known one."""
    close = difflib.get_close_matches(name, COMMANDS, n=1)
    guess = f" did you mean /{close[0]}?" if close else ""
    return f"unknown command /{name}.{guess} /help lists the commands"


# ---------------------------------------------------------------- history + cache (pure)


def drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """``messages`` without its oldest turn (a user message and the replies up to the next user
    message); ``None`` when only the last turn is left. A leading system message stays."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    users = [i for i, m in enumerate(messages) if i >= head and m["role"] == "user"]
    if len(users) < 2:
        return None
    return messages[:head] + messages[users[1] :]


def fit_history(
    messages: list[dict], encode: Encode, limit: int | None
) -> tuple[list[dict], list[int], int]:
    """Drop oldest turns until the templated conversation has at most ``limit`` tokens.

    Returns ``(messages, ids, dropped_turns)``; raises ContextFull when the last turn alone is
    too long.
    """
    ids = encode(messages)
    dropped = 0
    while limit is not None and len(ids) > limit:
        shorter = drop_oldest_turn(messages)
        if shorter is None:
            raise ContextFull(
                f"this message needs {len(ids)} tokens in the chat template; the room left "
                f"for it in the model's context is {limit}"
            )
        messages, dropped = shorter, dropped + 1
        ids = encode(messages)
    return messages, ids, dropped


# ---------------------------------------------------------------- session (no printing)


@dataclass
class Totals:
    """Counters over every answer of the session."""

    answers: int = 0
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0  # decode seconds after each answer's first token
    prompt_tokens: int = 0
    reused_tokens: int = 0
    histogram: Counter = field(default_factory=Counter)
    accepted_from: Counter = field(default_factory=Counter)  # accepted drafts by source

    def add(self, stats: GenerationStats, reused: int) -> None:
        self.answers += 1
        self.tokens += stats.generation_tokens
        self.steps += stats.steps
        self.seconds += stats.generation_seconds
        self.prompt_tokens += stats.prompt_tokens
        self.reused_tokens += reused
        self.histogram.update(stats.accept_histogram)
        self.accepted_from.update(stats.accepted_from)

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.histogram, self.steps)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)


@dataclass
class Turn:
    """What one answer did: its stats, how the cache was reused, and how it ended."""

    prompt_tokens: int = 0  # tokens fed this turn (after the reused prefix)
    reused_tokens: int = 0  # tokens of the conversation already in the cache
    reread_tokens: int = 0  # cached tokens fed again (recurrent state kept at turn ends only)
    dropped_turns: int = 0  # oldest turns dropped to fit the context
    stats: GenerationStats | None = None
    finish_reason: str | None = None  # None when interrupted
    # the session speculates but this answer's context band decodes plainly (the default's
    # plain_from, where trees still run in the blocks they measure faster, or an autotune
    # profile's bands)
    plain_here: bool = False


class ChatSession:
    """A conversation's messages over a :class:`Session` (its cache, decoding and warm-up)."""

    def __init__(
        self,
        session: Session,
        encode: Encode,
        *,
        max_tokens: int = 256,
        system: str | None = None,
    ):
        self.session = session
        self.encode = encode
        self.max_tokens = max_tokens
        self.system = system
        self.messages: list[dict] = []  # user / assistant turns, no system message
        self.totals = Totals()
        self.last: Turn | None = None

    @property
    def mode(self) -> Mode:
        return self.session.decoding.mode

    @property
    def shape(self) -> BeamShape:
        return self.session.decoding.shape

    @property
    def autoregressive(self) -> bool:
        return not self.mode.speculative

    @property
    def lookup_only(self) -> bool:
        """Whether answers speculate with lookup beams alone (no drafter)."""
        return self.mode is Mode.LOOKUP

    def set_shape(self, shape: BeamShape) -> None:
        """Switch to ``shape`` (ValueError, and the shape unchanged, if the drafter can't or,
        without a drafter, if it has no lookup beams: nothing would be left to speculate with
        and the next answer would fail)."""
        if self.lookup_only and not shape.lookup:
            raise ValueError(
                "no drafter: the lookup beams are all this session speculates with, so it keeps "
                f"{self.shape.lookup} (K >= 1; for plain decoding restart with "
                "--autoregressive)"
            )
        self.session.change(shape=shape)

    def set_temperature(self, temp: float, top_p: float = 0.0, top_k: int = 0) -> None:
        self.session.change(sampler=make_sampler(temp, top_p=top_p, top_k=top_k))

    def conversation(self) -> list[dict]:
        """The messages as the template sees them (system prompt first, when set)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def reset(self) -> None:
        """Forget the conversation and the cache (the system prompt stays)."""
        self.messages = []
        self.session.reset()

    def room(self) -> int | None:
        """Most tokens a templated conversation may have so that an answer still fits."""
        context = self.session.decoder.max_context
        if context is None:
            return None
        # an answer's last steps verify shorter beams: it needs no more room than plain decoding
        return max(context - min(self.max_tokens, context // 2) - 1, 1)

    def prepare(self, user_text: str) -> tuple[list[int], Turn]:
        """Append the user message (trimming old turns to fit): the whole prompt's token ids and
        the turn (how much of them the cache holds). ContextFull if it can't fit (the
        conversation is then unchanged)."""
        asked = self.conversation() + [{"role": "user", "content": user_text}]
        kept, ids, dropped = fit_history(asked, self.encode, self.room())
        self.messages = [m for m in kept if m["role"] != "system"]
        fed = len(self.session.prepare(ids))
        return ids, Turn(fed, len(ids) - fed, self.session.reread, dropped)

    def reply(
        self, user_text: str, on_prompt: Callable[[int, int], None] | None = None
    ) -> Iterator[StepResponse]:
        """Answer ``user_text``, streaming responses. Closing the generator early (Ctrl-C) keeps
        the partial answer in the conversation. ``self.last`` describes the turn.
        ``on_prompt(read, total)`` is called between prompt chunks with the new prompt tokens
        read so far and their number (e.g. :class:`PromptProgress`)."""
        ids, turn = self.prepare(user_text)
        turn.plain_here = self.mode.speculative and not (
            self.session.decoding_at(len(ids)).mode.speculative
        )
        self.last = turn
        parts: list[str] = []
        between_chunks = None
        if on_prompt is not None:
            cached = len(ids) - turn.prompt_tokens

            def between_chunks() -> bool:  # asked whether to cancel: never, but it reports
                on_prompt(self.session.sequence.offset - cached, turn.prompt_tokens)
                return False

        answer = self.session.generate(ids, max_tokens=self.max_tokens, cancelled=between_chunks)
        try:
            for response in answer:
                parts.append(response.text)
                turn.stats, turn.finish_reason = response.stats, response.finish_reason
                yield response
        finally:
            self.messages.append({"role": "assistant", "content": "".join(parts)})
            if turn.stats is not None:
                self.totals.add(turn.stats, turn.reused_tokens)


# A prompt whose reading takes longer than this (seconds) gets a progress line
PROMPT_NOTE_AFTER = 1.0


class PromptProgress:
    """How much of a long prompt has been read, on stderr (:func:`cli.progress.progress`: a
    transient bar on a terminal, a plain line into a pipe), from when reading it has taken
    :data:`PROMPT_NOTE_AFTER` seconds; prompts read faster show nothing. Called between prompt
    chunks (``ChatSession.reply``'s ``on_prompt``); :meth:`close` before the answer shows."""

    def __init__(self, console: Console):
        self.console = console
        self.start = time.perf_counter()
        self.bar = None
        self.task = 0
        self.read = 0

    def __call__(self, read: int, total: int) -> None:
        if self.bar is None:
            if time.perf_counter() - self.start < PROMPT_NOTE_AFTER:
                return
            self.bar = progress(self.console).__enter__()
            self.task = self.bar.add_task(f"reading the prompt ({total} tokens)", total=total)
            if hasattr(self.bar, "line"):  # plain lines: the first one now, not in 15 s
                self.bar.update(self.task, advance=read)
                print(self.bar.line(self.task), file=sys.stderr, flush=True)
                self.read = read
                return
        self.bar.update(self.task, advance=read - self.read)
        self.read = read

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def save_conversation(path: Path, record: dict) -> None:
    """Write ``record`` as JSON atomically: a temp file in the same folder, then rename."""
    write_text(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- terminal UI (prints)


class CtrlC:
    """SIGINT handler: raises ``KeyboardInterrupt`` like Python's default, and remembers it.

    Code running between two streamed tokens may swallow the exception (a C extension that
    clears errors while converting an argument, ``except BaseException`` in a library); the
    answer loop then still stops at the next token, as the user asked."""

    def __init__(self) -> None:
        self.pending = False

    def __call__(self, signum: int, frame: object) -> None:
        self.pending = True
        raise KeyboardInterrupt

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)


@dataclass
class ChatOptions:
    """What the chat's commands need from its command line: the sampler's other knobs, the
    shape flags given (BeamShape fields; None: from the profile) and flags ignored."""

    top_p: float = 0.0
    top_k: int = 0
    shape_overrides: dict = field(default_factory=dict)
    ignored: tuple[str, ...] = ()


class ChatUI:
    """Reads lines, runs commands, streams answers. ``interactive`` False = piped stdin."""

    def __init__(
        self,
        session: ChatSession,
        runtime: rt.Runtime,
        options: ChatOptions,
        shape_source: str,
        *,
        interactive: bool,
        ctrl_c: CtrlC | None = None,
    ):
        self.session = session
        self.ctrl_c = ctrl_c or CtrlC()
        self.runtime = runtime
        self.options = options
        self.shape_source = shape_source  # where W, L, P, S came from
        self.lookup_by_command = False  # whether /lookup set K (the source then says so)
        self.interactive = interactive
        plain = {} if interactive else {"no_color": True, "force_terminal": False}
        self.out = Console(highlight=False, soft_wrap=True, **plain)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True, **plain)
        self.info = self.out if interactive else self.err  # notices: stderr when piped

    # -- small helpers

    def note(self, text: str, style: str = "dim") -> None:
        self.info.print(escape(text), style=style)

    def source(self) -> str:
        """Where the beam shape came from (``/lookup`` added once that command set K)."""
        return self.shape_source + (" + /lookup" if self.lookup_by_command else "")

    def describe(self, shape: BeamShape) -> str:
        """``shape`` as this session uses it: without a drafter only L and K count."""
        return shape.describe_lookup_only() if self.session.lookup_only else shape.describe()

    def mode(self) -> str:
        if self.session.autoregressive:
            return "autoregressive (no drafter)"
        described = self.session.mode.describe(self.session.shape, flags.drafter_name(self.runtime))
        return f"{described} ({self.source()})"

    def lookup_on(self) -> bool:
        """Whether answers verify lookup beams now (then stats say where accepts came from)."""
        return not self.session.autoregressive and self.session.shape.lookup > 0

    # -- main loop

    def run(self) -> None:
        if self.interactive:
            self.banner()
        while True:
            try:
                if not self.take_line():
                    return
            except KeyboardInterrupt:  # after Enter, before the answer began: as at the prompt
                if not self.interactive:
                    raise  # a piped chat ends (main says so)
                self.out.print()
                self.note(LEAVE_HINT)

    def take_line(self) -> bool:
        """Read one line and answer or run it; False means quit."""
        line = self.read_line()
        if line is None:
            return False
        line = line.strip()
        if not line:
            return True
        try:
            check_text(line, "input")
        except ConfigError as e:  # the conversation goes on
            self.note(f"error: {e}", "red")
            return True
        command = parse_command(line)
        if command is None:
            self.answer(line)
            return True
        return self.run_command(command)

    def banner(self) -> None:
        drafter = None if self.session.autoregressive else self.runtime.drafter_id
        drafter = drafter or "none"
        self.out.print(f"[bold]redrafter-mlx chat[/] · model {escape(self.runtime.model_id)}")
        self.note(f"drafter {drafter} · {self.mode()} · /help for commands, Ctrl-D to quit")
        if ignored := self.options.ignored:
            self.note(f"ignored with --autoregressive: {', '.join(ignored)}", "yellow")

    def read_line(self) -> str | None:
        """The next input line; None at end of input (Ctrl-D at the prompt). Ctrl-C at the
        prompt cancels the line typed and says how to leave, as Python's REPL does."""
        if not self.interactive:
            line = sys.stdin.readline()
            return line if line else None
        while True:
            try:
                return self.out.input("[bold green]>>> [/]")
            except EOFError:
                self.out.print()
                return None
            except KeyboardInterrupt:
                self.out.print()
                self.note(LEAVE_HINT)

    def answer(self, text: str) -> None:
        """Stream one answer, then its stats line; Ctrl-C stops it and keeps the partial text.
        A long prompt shows a progress line while it is read."""
        reading = PromptProgress(self.err)
        responses = self.session.reply(text, on_prompt=reading)
        shown = False
        self.ctrl_c.pending = False
        try:
            for response in responses:
                reading.close()
                self.show(response.text)
                shown = True
                if self.ctrl_c.pending:  # a Ctrl-C whose exception something swallowed
                    raise KeyboardInterrupt
        except ContextFull as e:
            reading.close()
            if shown or not self.interactive:  # piped: still one output line per input line
                self.end_answer()
            self.note(f"cannot answer: {e}. Shorten the message or lower --max-tokens.", "bold red")
            return
        except KeyboardInterrupt:
            reading.close()
            responses.close()
            self.end_answer()
            self.note("[interrupted: the partial answer stays in the conversation]", "yellow")
        else:
            reading.close()
            self.end_answer()
        self.report(self.session.last)

    def show(self, text: str) -> None:
        if self.interactive:
            self.out.print(text, end="", markup=False)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def end_answer(self) -> None:
        if self.interactive:
            self.out.print()
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()

    def report(self, turn: Turn | None) -> None:
        """The dim line after an answer: speed, tokens/step, beam shape, cache reuse and, with
        lookup beams, where the accepted drafts came from."""
        if turn is None or turn.stats is None:
            return
        stats = turn.stats
        if turn.dropped_turns:
            self.note(f"context full: dropped the {turn.dropped_turns} oldest turn(s)", "yellow")
        if turn.finish_reason == "context":
            self.note(
                "context full: the answer was cut; older turns are dropped next time", "yellow"
            )
        # else a cut answer reads like one that ended itself
        cut = " (cut at --max-tokens)" if turn.finish_reason == "length" else ""
        mode, trees = self.mode(), any(size > 1 for size in stats.tree_sizes)
        if turn.plain_here:  # past plain_from: trees only where they measured faster
            mode = (
                f"{mode} where faster than plain"
                if trees
                else "plain decoding at this context length"
            )
        line = (
            f"{stats.generation_tokens} tokens{cut} · {stats.generation_tps:.1f} tok/s · "
            f"{stats.tokens_per_step:.2f} tokens/step · {mode} · "
            f"prompt {turn.prompt_tokens} new + {turn.reused_tokens} cached"
        )
        if turn.reread_tokens:  # a recurrent state cannot be cut back to any token
            line += f" ({turn.reread_tokens} re-read: recurrent state is kept at turn ends)"
        if self.lookup_on() and trees:  # the lookup beams' share, the drafter's
            drafted = self.session.mode.drafted
            line += f" · accepted: {accepted_sources(stats.accepted_from, drafted)}"
        self.note(line)

    # -- commands

    def run_command(self, command: Command) -> bool:
        """Run a /command; False means quit."""
        if command.name in ("quit", "exit", "q"):
            return False
        handler = getattr(self, f"cmd_{command.name}", None)
        if command.name not in COMMANDS or handler is None:
            self.note(unknown_hint(command.name), "yellow")
            return True
        try:
            handler(command.arg)
        except ValueError as e:
            self.note(str(e), "yellow")
        return True

    def cmd_help(self, arg: str) -> None:
        for name, text in COMMANDS.items():
            self.info.print(f"  [bold]/{name:<7}[/] {escape(text)}")
        self.info.print("  Ctrl-C stops an answer (it stays in the conversation)")

    def cmd_reset(self, arg: str) -> None:
        self.session.reset()
        self.note("conversation cleared")

    def cmd_beam(self, arg: str) -> None:
        current = self.session.shape
        shape = parse_beam(arg, current.min_prob, current.search_width)
        shape = replace(shape, lookup=current.lookup)  # /lookup sets K, /beam the rest
        self.session.set_shape(shape)
        self.shape_source = "/beam"
        self.note(f"beam shape {self.describe(shape)}{self.shape_note()}")

    def cmd_lookup(self, arg: str) -> None:
        shape = replace(self.session.shape, lookup=parse_lookup(arg))
        self.session.set_shape(shape)  # a lookup-only session refuses K = 0
        self.lookup_by_command = True
        state = f"{shape.lookup} per step" if shape.lookup else "off"
        self.note(f"lookup beams {state} · beam shape {self.describe(shape)}{self.shape_note()}")

    def shape_note(self) -> str:
        """What a shape change means for this session, if anything beyond the shape."""
        if self.session.autoregressive:
            return " (ignored: --autoregressive)"
        if self.session.lookup_only:
            return " (no drafter: W, P and S are unused)"
        return ""

    def cmd_temp(self, arg: str) -> None:
        temp = parse_temp(arg)
        self.session.set_temperature(temp, self.options.top_p, self.options.top_k)
        self.note(f"temperature {temp:g}" + (" (greedy)" if temp == 0 else ""))
        if self.shape_source != "/beam" and not self.session.autoregressive:
            # greedy and sampling may have their own autotune profiles
            current = self.session.shape
            shape, source = resolve_shape(
                self.runtime, overrides=self.options.shape_overrides, temp=temp
            )
            if self.lookup_by_command:  # K chosen by /lookup: a profile's K must not undo it
                shape = replace(shape, lookup=current.lookup)
            if (shape, source) != (current, self.shape_source):
                self.session.set_shape(shape)
                self.shape_source = source
                self.note(f"beam shape {self.describe(shape)} ({self.source()})")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.note(f"system prompt: {self.session.system or '(none: the template default)'}")
            return
        self.session.system = arg
        self.note("system prompt set (the next answer re-reads the conversation after it)")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise ValueError("usage: /save PATH")
        record = {
            "model": self.runtime.model_id,
            "drafter": None if self.session.autoregressive else self.runtime.drafter_id,
            "mode": self.mode(),
            "messages": self.session.conversation(),
        }
        folder = Path(arg).expanduser().parent
        if not folder.is_dir():
            raise ValueError(f"cannot save to {arg}: no folder {folder}")
        try:
            save_conversation(Path(arg), record)
        except OSError as e:
            raise ValueError(f"cannot save to {arg}: {e.strerror or e}") from None
        self.note(f"saved {len(record['messages'])} messages to {arg}")

    def cmd_stats(self, arg: str) -> None:
        totals = self.session.totals
        lines = [
            f"answers {totals.answers} · tokens {totals.tokens} · decode steps {totals.steps} · "
            f"prompt tokens fed {totals.prompt_tokens} (+ {totals.reused_tokens} reused from "
            f"the cache)",
            f"tokens/step {totals.tokens_per_step:.2f} · histogram (tokens per step: steps) "
            + (", ".join(f"{k}: {n}" for k, n in sorted(totals.histogram.items())) or "none"),
        ]
        counts = totals.accepted_from
        if self.lookup_on() or counts["lookup"] or counts["both"]:
            sources = accepted_sources(counts, self.session.mode.drafted)
            lines.append(f"accepted drafted tokens by source: {sources}")
        lines.append(self.speedup_line(totals))
        for line in lines:
            self.info.print(escape(line))

    def speedup_line(self, totals: Totals) -> str:
        """Speedup estimate = tokens/step ÷ (ReDrafter step time / one-token step time), both
        step times measured now, alike (the answers' own step times include terminal output)."""
        if self.session.autoregressive:
            return "speedup: none (autoregressive mode, 1 token per step)"
        if totals.steps == 0:
            return "speedup: no decode steps yet"
        if isinstance(self.session.session, MirroredSession):  # its probe runs on rank 0 only
            return "speedup: not measured on a sharded target (see the answers' tokens/s)"
        try:
            single, step = time_steps(self.session.session)
        except ContextFull:
            return "speedup: not measured (the context is full)"
        ratio = step / single
        kind = "lookup" if self.session.lookup_only else "ReDrafter"
        return (
            f"speedup estimate {totals.tokens_per_step / ratio:.2f}x = tokens/step "
            f"{totals.tokens_per_step:.2f} ÷ step cost ratio {ratio:.2f} (a {kind} step "
            f"{step * 1e3:.1f} ms vs a one-token step {single * 1e3:.1f} ms, both timed now; "
            f"in the answers a step took {totals.seconds_per_step * 1e3:.1f} ms, terminal "
            f"output included)"
        )


# ---------------------------------------------------------------- command entry


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Chat in the terminal with ReDrafter speculative decoding (lossless).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model_args(parser)
    parser.add_argument("--system", help="system prompt")
    flags.add_decode_args(parser, max_tokens=256)
    flags.add_speculation_args(parser)
    sharding.add_shard_arg(parser)
    return parser


def encoder(runtime: rt.Runtime) -> Encode:
    """messages -> token ids with the model's chat template and a generation prompt."""

    def encode(messages: list[dict]) -> list[int]:
        return list(rt.encode_chat(runtime, messages))

    return encode


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    # Ctrl-C stops an answer: a chat started from a script in the background inherits SIGINT
    # ignored (POSIX, for `cmd &` without job control), which would make it uninterruptible.
    ctrl_c = CtrlC()
    ctrl_c.install()
    sys.stdin.reconfigure(errors="surrogateescape")  # a bad byte is one error line: check_text
    # without a drafter (none found, or --drafter none) it speculates with lookup beams alone
    runtime = sharding.load_runtime(args, need_drafter=False)  # rank 0 alone returns
    flags.say_drafter(runtime, autoregressive=args.autoregressive)
    overrides = flags.shape_overrides(args)
    shape, source = flags.lookup_when_no_drafter(
        runtime, *resolve_shape(runtime, overrides=overrides, temp=args.temp)
    )
    mode = runtime.mode(shape, autoregressive=args.autoregressive)
    decoding = rt.decoding(
        runtime, shape, temp=args.temp, top_p=args.top_p, top_k=args.top_k, mode=mode
    )
    with SaidIfSlow("compiling the decode step (once per model and shape)"):
        inner = session_for(runtime.decoder, runtime.tokenizer, decoding, seed=args.seed)
    follow_context(inner, runtime, source, temp=args.temp)
    session = ChatSession(
        inner,
        encoder(runtime),
        max_tokens=args.max_tokens,
        system=args.system and check_text(args.system, "--system"),
    )
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    try:
        options = ChatOptions(
            args.top_p, args.top_k, overrides, tuple(flags.ignored_when_autoregressive(args))
        )
        ChatUI(session, runtime, options, source, interactive=interactive, ctrl_c=ctrl_c).run()
    except KeyboardInterrupt:  # Ctrl-C outside an answer (e.g. in a piped session)
        print(file=sys.stderr)
