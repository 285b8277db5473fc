"""Speculation that proves itself at long contexts: past a context length, an answer's steps
run in blocks of its speculative decoding or of plain decoding, and the one that has emitted
more tokens per second in this context band (this session's answers so far; the tree by a
``margin``, none by default) runs the next block; every so many blocks the other runs, so a
change (a summary that starts copying its source, a machine that got busy) is seen: after
``explore`` blocks at first, twice as many each time the other stayed slower (up to
``explore_max``), since each such block costs time.

Why measured and not predicted: a verified tree's cost over a long cache and the tokens a
step accepts both vary with the prompt (how much of it the answer copies), the model and the
machine, by more than the gain at stake (on a 2-core CPU at 4K cached tokens the default
shape ran slower than plain decoding before the CPU attention kernels and faster after them:
a kernel alone moves the answer). Either way the answer is the target's own:
switching changes how many tokens a forward verifies, not which (``Decoder.switch``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from redrafter_mlx.core.decode.step import Decoding, Step

# Each record keeps this much of what came before: about the last 20 steps of a mode weigh.
DECAY = 0.95


@dataclass
class Rate:
    """Tokens emitted and seconds taken, both decayed at each record."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Band:
    """A band's exploration: every ``interval``-th block runs the slower mode;
    ``blocks_left`` until the next such; ``faster`` speculative or not, as last chosen;
    ``explored`` whether the block begun last was one."""

    interval: int
    blocks_left: int
    faster: bool
    explored: bool = False


@dataclass
class Adaptive:
    """One session's choice between ``speculative`` and ``plain`` decoding (the same
    sampler and log-probs) from ``start`` cached tokens on, per band of ``band`` tokens: a
    new band tries plain decoding for a block of ``block`` steps, then the speculative one,
    then keeps the faster (the tree only if ``margin`` faster), running the other every
    ``explore``-th block, then every 2 x ``explore``-th and so on up to every
    ``explore_max``-th while it stays slower (back to ``explore`` when it turns faster).
    Below ``start`` every step speculates."""

    speculative: Decoding
    plain: Decoding
    start: int
    band: int = 1024
    block: int = 8
    explore: int = 8
    explore_max: int = 64
    # How much faster the tree must measure to run, none by default: since the CPU kernels
    # the tree measures level or ahead at every long context tried, and a margin kept plain
    # blocks running where the tree alone was faster.
    margin: float = 0.0
    rates: dict[tuple[int, bool], Rate] = field(default_factory=dict)
    bands: dict[int, _Band] = field(default_factory=dict)
    left: int = 0  # steps left in the current block
    speculating: bool = False

    def speculate(self, context: int) -> bool:
        """Whether the step after ``context`` cached tokens speculates."""
        if context < self.start:
            return True
        if self.left == 0:
            self.speculating = self._choose(context // self.band)
            self.left = self.block
        self.left -= 1
        return self.speculating

    def record(self, context: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step after ``context`` cached tokens emitted ``tokens`` in ``seconds``."""
        if context >= self.start:
            self.rates.setdefault((context // self.band, speculated), Rate()).add(tokens, seconds)

    def _choose(self, band: int) -> bool:
        faster = self._tree_faster(band)
        if faster is None:  # plain decoding first (the default there), then the tree
            return (band, False) in self.rates
        # its first two blocks (plain, tree) count towards the first exploration
        state = self.bands.setdefault(band, _Band(self.explore, self.explore - 2, faster))
        if state.explored:  # the block before ran the slower mode: did it stay slower?
            kept = faster == state.faster
            state.interval = min(2 * state.interval, self.explore_max) if kept else self.explore
            state.blocks_left, state.explored = state.interval, False
        state.faster = faster
        state.blocks_left -= 1
        if state.blocks_left > 0:
            return faster
        state.explored = True
        return not faster

    def decoding(self, context: int) -> Decoding:
        """The decoding an answer after ``context`` prompt tokens starts with."""
        if context < self.start:
            return self.speculative
        return self.speculative if self._tree_faster(context // self.band) else self.plain

    def _tree_faster(self, band: int) -> bool | None:
        """Whether the tree emitted ``margin`` more tokens/s than plain decoding in ``band``;
        None until both ran there."""
        plain, spec = self.rates.get((band, False)), self.rates.get((band, True))
        if plain is None or spec is None:
            return None
        return spec.per_second > plain.per_second * (1 + self.margin)


def adaptive_steps(decoder, state, adaptive: Adaptive) -> Iterator[Step]:
    """The decode loop from ``state`` with each step's mode chosen by ``adaptive``, which
    learns the seconds between one step's start and the next's (what the caller spends on a
    step included, as a user waits for it) -> one :class:`Step` per step."""
    last = None  # (context, speculated, tokens, began) of the step before
    while True:
        context = state.sequence.offset
        speculate = adaptive.speculate(context)
        began = time.perf_counter()
        if last is not None:
            adaptive.record(last[0], last[1], last[2], began - last[3])
        decoding = adaptive.speculative if speculate else adaptive.plain
        state, emitted = decoder.switch(state, decoding)
        if emitted is not None:  # turned speculative: the plain state's pending token
            yield emitted
        state, step = decoder.step(state)
        tokens = len(step.tokens) + (len(emitted.tokens) if emitted is not None else 0)
        last = (context, state.decoding.mode.speculative, tokens, began)
        yield step
