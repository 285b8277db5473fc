"""Decoding with a target sharded over ``mx.distributed`` ranks: every rank runs the same decode
loop, rank 0 (the *lead*) alone decides what to run and shows the answers.

Legend: N ranks.

The target's forward exchanges activations between ranks (tensor parallel: an all-sum per
attention and MLP block; pipeline: one send per stage and an all-gather of the last hidden
state), so every rank must run the same forwards in the same order, with the same shapes. Every
rank holds the whole drafter and n-gram index and ends each forward with the same hidden state,
so the same step on every rank makes the same tree, the same acceptance and the same next
beams: each step needs no exchange beyond the forward's own.

What is run comes from rank 0 as *orders* (small JSON messages, broadcast once per generation,
never per step): warm up a decoding, answer these token ids in session k, forget session k's
tokens, stop. The followers (:func:`follow`) wait for the next order and run it as the lead does.

Sampling stays identical on every rank because each ``generate`` order carries the lead's
random state (MLX's key, which :func:`mlx.core.random.seed` can set exactly): the followers
start each answer from the lead's generator, and draw what it draws. Nothing is sent per step
(a broadcast accepted step would cost one more round trip each step, the latency speculation
is here to save). A sharded answer is never cut short on one rank alone: a lead that stops
reading one (a client gone, Ctrl-C in chat) runs it to its end silently, as the others do.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.accept import greedy, make_sampler
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.step import Decoding, PhaseTimer
from redrafter_mlx.core.decode.stream import StepResponse
from redrafter_mlx.core.errors import ReDrafterError
from redrafter_mlx.core.serving.session import AnswerSpec, Session


class PeerFailed(ReDrafterError):
    """Another rank failed where all ranks meet; it says why itself."""


class Orders:
    """Rank 0's orders to the other ranks of ``group``, and the lead's live sessions."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.busy = False  # the lead is inside a warm-up or an answer (no stop order now)
        self._sessions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._next_key = 0

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def send(self, order: dict) -> None:
        """Broadcast ``order`` from rank 0 (every other rank is in :meth:`receive`)."""
        broadcast(json.dumps(order).encode(), self.group)

    def receive(self) -> dict:
        """The next order from rank 0 (waits for it)."""
        return json.loads(broadcast(None, self.group))

    def stop(self) -> None:
        """Tell the followers to end, unless the lead stopped mid-answer (its collectives
        would meet a forward's: the followers end when its connection drops instead)."""
        if not self.busy:
            with contextlib.suppress(RuntimeError):  # a follower already gone
                self.send({"op": "stop"})

    @contextlib.contextmanager
    def running(self):
        """Busy while the lead runs the target: after an unexpected error (a bug, a lost
        rank) it stays busy, as the followers may be mid-forward."""
        self.busy = True
        try:
            yield
        except (GeneratorExit, ReDrafterError):  # ended alike on every rank (a full context)
            self.busy = False
            raise
        self.busy = False

    def register(self, session: Session) -> int:
        key, self._next_key = self._next_key, self._next_key + 1
        self._sessions[key] = session
        return key

    def live(self) -> list[int]:
        """Keys of the lead's sessions still held (the followers drop the others)."""
        return sorted(self._sessions.keys())


def broadcast(data: bytes | None, group: mx.distributed.Group) -> bytes:
    """Rank 0's ``data`` on every rank (the others pass None): its length, then its bytes, as
    sums where only rank 0 adds anything (exact for integers)."""
    lead = group.rank() == 0
    size = len(data) if lead else 0
    size = int(_all_sum(np.array([size], np.int64), group)[0])
    payload = np.frombuffer(data, np.uint8) if lead else np.zeros(size, np.uint8)
    return _all_sum(payload, group).tobytes()


def _all_sum(values: np.ndarray, group: mx.distributed.Group) -> np.ndarray:
    with mx.stream(mx.cpu):  # int64 is a CPU type on every backend
        return np.array(mx.distributed.all_sum(mx.array(values), group=group))


def meet(group: mx.distributed.Group | None, error: ReDrafterError | None) -> None:
    """A point where all ranks meet: raise ``error`` (naming this rank) on the rank that has
    one and :class:`PeerFailed` on the others, so that none waits for a failed rank."""
    if group is None or group.size() == 1:
        if error is not None:
            raise error
        return
    failed = _all_sum(np.array([error is not None], np.int64), group)[0]
    if error is not None:
        raise type(error)(f"rank {group.rank()} of {group.size()}: {error}") from error
    if failed:
        raise PeerFailed("another rank failed (it says why)")


# -- what an order says


def sampler_settings(sampler) -> dict:
    """The ``make_sampler`` keywords of a sampler it made (ValueError for another)."""
    if sampler is greedy:
        return {"temp": 0.0}
    settings = getattr(sampler, "settings", None)
    if settings is None:
        raise ValueError("a sharded run samples with make_sampler's samplers only")
    return dict(settings)


def decoding_order(decoding: Decoding) -> dict:
    return {
        "mode": decoding.mode.value,
        "shape": asdict(decoding.shape),
        "sampler": sampler_settings(decoding.sampler),
        "logprobs": decoding.logprobs,
    }


def decoding_from(order: dict) -> Decoding:
    sampler = make_sampler(**order["sampler"])
    return Decoding(Mode(order["mode"]), BeamShape(**order["shape"]), sampler, order["logprobs"])


def random_state() -> int:
    """The seed that sets MLX's generator to where it is now (its key is ``(hi, lo)``;
    ``mx.random.seed(hi << 32 | lo)`` sets exactly that key). One small host read."""
    hi, lo = mx.random.state[0].tolist()
    return (hi << 32) | lo


# -- the lead


@dataclass(frozen=True)
class LeadDecoder(Decoder):
    """Rank 0's :class:`Decoder`: a warm-up (which runs the target) is an order first."""

    orders: Orders | None = None

    @classmethod
    def over(cls, decoder: Decoder, orders: Orders) -> LeadDecoder:
        values = {f.name: getattr(decoder, f.name) for f in fields(decoder)}
        return cls(**values, orders=orders)

    def warm_up(self, decoding: Decoding) -> None:
        self.orders.send({"op": "warm", "decoding": decoding_order(decoding)})
        with self.orders.running():
            super().warm_up(decoding)


class MirroredSession(Session):
    """Rank 0's :class:`Session`: each answer (and each reset) is an order first, so the other
    ranks run the same in their copy of this session. An answer the caller stops reading is
    run to its end (the others do not know it was stopped)."""

    can_adapt = False  # a mode chosen by rank 0's timings would not be the others' steps
    whole_answers = True  # the other ranks run each answer to its end

    def __init__(self, decoder: LeadDecoder, tokenizer, decoding: Decoding, **options):
        self.orders = decoder.orders
        self.key = self.orders.register(self)
        super().__init__(decoder, tokenizer, decoding, **options)

    def reset(self) -> None:
        self.orders.send({"op": "reset", "session": self.key})
        super().reset()

    def answer(
        self,
        ids: list[int],
        answer: AnswerSpec,
        *,
        timer: PhaseTimer | None = None,
        cancelled=None,  # not asked: the other ranks could not stop with rank 0
    ) -> Iterator[StepResponse]:
        self._order(ids, answer)
        with self.orders.running():
            steps = super().answer(ids, answer, timer=timer)
            for response in steps:
                try:
                    yield response
                except GeneratorExit:  # the caller stopped reading: finish as the others do
                    for _ in steps:
                        pass
                    raise

    def begin(self, ids: list[int], answer: AnswerSpec) -> list[int]:
        """The other ranks ordered to run this answer (from MLX's generator as it is now),
        then :meth:`Session.begin`; the lead is busy until :meth:`end`."""
        self._order(ids, answer)
        self.orders.busy = True
        return super().begin(ids, answer)

    def end(self, clean: bool) -> None:
        if clean:  # after a bug the others may be mid-forward: the lead stays busy
            self.orders.busy = False

    def _order(self, ids: list[int], answer: AnswerSpec) -> None:
        self.orders.send(
            {
                "op": "generate",
                "session": self.key,
                "live": self.orders.live(),
                "ids": list(ids),
                "max_tokens": answer.max_tokens,
                "stop_strings": list(answer.stop_strings),
                "decoding": decoding_order(answer.decoding),
                "random": random_state(),
            }
        )

    def steps(self, ids, *, decoding=None):
        raise NotImplementedError("a sharded session answers with generate() only")


def session_for(decoder: Decoder, tokenizer, decoding: Decoding, **options) -> Session:
    """A :class:`MirroredSession` over a lead's decoder, else a plain :class:`Session`."""
    if isinstance(decoder, LeadDecoder):
        return MirroredSession(decoder, tokenizer, decoding, **options)
    return Session(decoder, tokenizer, decoding, **options)


# -- the followers


def follow(decoder: Decoder, tokenizer, orders: Orders) -> list[list[int]]:
    """Run rank 0's orders until it says stop: the tokens of each answer, in order."""
    sessions: dict[int, Session] = {}
    answers = []
    while (order := orders.receive())["op"] != "stop":
        if order["op"] == "warm":
            decoder.warm_up(decoding_from(order["decoding"]))
        elif order["op"] == "reset" and order["session"] in sessions:
            sessions[order["session"]].reset()
        elif order["op"] == "generate":
            for key in set(sessions) - set(order["live"]):
                del sessions[key]  # the lead dropped it
            answers.append(_answer(decoder, tokenizer, sessions, order))
    return answers


def _answer(decoder: Decoder, tokenizer, sessions: dict[int, Session], order: dict) -> list:
    """Run one ``generate`` order in its session (made on first use): the tokens emitted."""
    decoding = decoding_from(order["decoding"])
    key = order["session"]
    if key not in sessions:
        sessions[key] = Session(decoder, tokenizer, decoding, warm=False)
    mx.random.seed(order["random"])
    tokens = []
    steps = sessions[key].generate(
        order["ids"],
        max_tokens=order["max_tokens"],
        stop_strings=tuple(order["stop_strings"]),
        decoding=decoding,
    )
    with contextlib.suppress(ReDrafterError):  # rank 0 met the same (a full context) and says so
        for response in steps:
            tokens.extend(response.tokens)
    return tokens
