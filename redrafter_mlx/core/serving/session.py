"""A :class:`Session` is one conversation with a
:class:`~redrafter_mlx.core.decode.decoder.Decoder`: the
:class:`~redrafter_mlx.core.decode.sequence.Sequence` of its tokens, the decoding it runs now
(mode, beam shape, sampler), warmed up whenever that changes, and generation that reuses the
longest cached prefix of each prompt.

Chat, the server, bench, autotune's measurement, eval-drafter's real loop and the Python API
all generate through it. Stopping early (closing the generator, Ctrl-C, a client gone) leaves
the conversation intact: the sequence holds what was committed, ids, K/V and states together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import mlx.core as mx

from redrafter_mlx.core.decode.adaptive import Adaptive
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.step import Decoding, PhaseTimer, Step
from redrafter_mlx.core.decode.stream import StepResponse, decode_steps, stream_steps
from redrafter_mlx.core.errors import Cancelled


@dataclass(frozen=True)
class AnswerSpec:
    """What one answer is asked for: its token budget, stop strings and decoding."""

    max_tokens: int
    stop_strings: tuple[str, ...]
    decoding: Decoding
    adaptive: Adaptive | None = None  # each step's mode chosen by it (from its start on)


class Session:
    """A conversation's sequence and decoding over one decoder.

    ``seed`` re-seeds MLX's generator after each warm-up (whose draws would otherwise shift
    the answers); ``warm``: warm the first decoding up now (False where the caller has
    already, e.g. a benchmark that warms every method once).
    """

    can_adapt = True  # whether :attr:`adaptive` may choose each step's mode here
    # whether an answer, once begun (:meth:`begin`), runs to its end when its caller leaves
    whole_answers = False

    def __init__(
        self,
        decoder: Decoder,
        tokenizer,
        decoding: Decoding,
        *,
        seed: int | None = None,
        warm: bool = True,
    ):
        decoder.check(decoding)
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.seed = seed
        self.sequence = decoder.new_sequence()
        self._decoding = decoding
        self.reused = 0  # prompt tokens the last generation found in the sequence
        # of the prompt tokens the sequence shared, those fed again: recurrent layers keep
        # their state only at the end of each prompt and at the sequence's end
        self.reread = 0
        # context length -> this answer's decoding (an autotune profile's shape per context
        # band, ``tuning.profiles.decoding_by_context``); None: the session's for every answer
        self.by_context: Callable[[int], Decoding] | None = None
        # past a context length, each step's mode chosen by the speed each got (None: the
        # answer's decoding throughout); answers whose decoding the caller gives never adapt
        self.adaptive: Adaptive | None = None
        if warm:
            self.warm_up()
        elif seed is not None:
            mx.random.seed(seed)

    @property
    def decoding(self) -> Decoding:
        return self._decoding

    def set_decoding(self, decoding: Decoding) -> None:
        """Run ``decoding`` from now on, warmed up (ValueError, and nothing changed, if the
        decoder cannot run it)."""
        self.decoder.check(decoding)
        self._decoding = decoding
        self.by_context = self.adaptive = None  # an explicit choice holds for every answer
        self.warm_up()

    def change(self, **fields) -> None:
        """:meth:`set_decoding` with some of :class:`Decoding`'s fields replaced."""
        self.set_decoding(replace(self._decoding, **fields))

    def warm_up(self) -> None:
        """Compile what the current decoding runs (:meth:`Decoder.warm_up`), then re-seed."""
        self.decoder.warm_up(self._decoding)
        if self.seed is not None:
            mx.random.seed(self.seed)

    def reset(self) -> None:
        """Forget the conversation's tokens."""
        self.sequence.rewind(0)

    def decoding_at(self, context: int) -> Decoding:
        """The decoding of an answer after ``context`` prompt tokens: :attr:`by_context`'s
        choice where one is set, else the session's."""
        return self._decoding if self.by_context is None else self.by_context(context)

    def prepare(self, ids: list[int]) -> list[int]:
        """Rewind the sequence to the longest prefix it shares with ``ids`` (a whole prompt)
        and return the tokens still to feed (at least one: its hidden state predicts the
        answer)."""
        self.reused, self.reread = self.sequence.reuse_prefix(ids)
        return ids[self.reused :]

    def begin(self, ids: list[int], answer: AnswerSpec) -> list[int]:
        """Begin answering the prompt ``ids`` elsewhere (a batch steps it): :meth:`prepare`'s
        tokens to feed. Each answer begun is ended with :meth:`end`."""
        return self.prepare(ids)

    def end(self, clean: bool) -> None:
        """The answer begun last has ended; ``clean``: at its end, or at an error every copy
        of this session meets (a full context), not at a bug."""

    def generate(
        self,
        ids: list[int],
        *,
        max_tokens: int = 256,
        stop_strings: tuple[str, ...] = (),
        decoding: Decoding | None = None,
        timer: PhaseTimer | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[StepResponse]:
        """Answer the prompt ``ids`` (the whole conversation's token ids), one response per
        step, after reusing its cached prefix. ``decoding``: this answer's own (already warmed
        up, e.g. a request's sampler), else the session's. ``cancelled`` is asked between
        prompt chunks: when it says so the generator ends with no response."""
        adaptive = self.adaptive if decoding is None else None
        if adaptive is not None:
            decoding = adaptive.decoding(len(ids))
        decoding = decoding or self.decoding_at(len(ids))
        answer = AnswerSpec(max_tokens, tuple(stop_strings), decoding, adaptive)
        return self.answer(ids, answer, timer=timer, cancelled=cancelled)

    def answer(
        self,
        ids: list[int],
        answer: AnswerSpec,
        *,
        timer: PhaseTimer | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[StepResponse]:
        """:meth:`generate` with its answer's settings in one record."""
        new = self.prepare(ids)
        steps = stream_steps(
            self.decoder,
            self.tokenizer,
            new,
            answer.decoding,
            sequence=self.sequence,
            max_tokens=answer.max_tokens,
            stop_strings=answer.stop_strings,
            timer=timer,
            cancelled=cancelled,
            adaptive=answer.adaptive,
        )
        try:
            yield from steps
        except Cancelled:
            return

    def steps(self, ids: list[int], *, decoding: Decoding | None = None) -> Iterator[Step]:
        """The raw decode loop after ``ids`` (prefix reused): the prefill's first token, then
        one :class:`Step` per decode step, no stop rule (eval-drafter counts them itself)."""
        new = self.prepare(ids)
        return decode_steps(self.decoder, self.sequence, new, decoding or self._decoding)
