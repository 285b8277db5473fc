"""``stream_generate``: decode steps -> detokenized text, stop rules, timing and statistics.

Stops on an EOS token (never emitting tokens drafted past it), a stop string, ``max_tokens`` or
a full context. Library code: returns numbers, prints nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from redrafter_mlx.cache import KVCache
from redrafter_mlx.decode import ContextFull, Decoder


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0  # decode steps after the prefill (each one target pass)
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    tree_sizes: list[int] = field(default_factory=list)
    accept_histogram: Counter = field(default_factory=Counter)  # tokens emitted per step
    syncs: int = 0
    peak_memory_gb: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / max(self.prompt_seconds, 1e-9)

    @property
    def generation_tps(self) -> float:
        """Tokens after the first one, per second after the first one (as mlx-lm reports it)."""
        return max(self.generation_tokens - 1, 0) / max(self.generation_seconds, 1e-9)

    @property
    def tokens_per_step(self) -> float:
        return sum(k * n for k, n in self.accept_histogram.items()) / max(self.steps, 1)

    @property
    def mean_tree_size(self) -> float:
        return sum(self.tree_sizes) / max(len(self.tree_sizes), 1)

    @property
    def syncs_per_step(self) -> float:
        return self.syncs / max(self.steps, 1)


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response
    tokens: list[int]  # tokens emitted by this step (after stop rules)
    stats: GenerationStats
    finish_reason: str | None = None  # "stop", "length", "context" or None while running


def stream_generate(
    decoder: Decoder,
    tokenizer,
    prompt: list[int],
    *,
    max_tokens: int = 256,
    autoregressive: bool = False,
    stop_strings: tuple[str, ...] = (),
    cache: KVCache | None = None,
) -> Iterator[GenerationResponse]:
    """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids), one response per step.

    ``cache`` may already hold a prefix (a chat); ``prompt`` is then only the new tokens.
    """
    cache = decoder.new_cache() if cache is None else cache
    steps = (decoder.autoregressive if autoregressive else decoder.speculative)(cache, prompt)
    stats = GenerationStats(prompt_tokens=len(prompt))
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    eos = set(tokenizer.eos_token_ids)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    first = True
    while True:
        try:
            step = next(steps)
        except ContextFull:
            yield _finish(detokenizer, stats, tic, "context")
            return
        now = time.perf_counter()
        if first:
            stats.prompt_seconds, tic, first = now - tic, now, False
        else:
            stats.steps += 1
            stats.syncs += step.syncs
            stats.tree_sizes.append(step.tree_size)
            stats.accept_histogram[len(step.tokens)] += 1
            stats.generation_seconds = now - tic
        emitted, reason = _apply_stops(step.tokens, eos, max_tokens - stats.generation_tokens)
        for token in emitted:
            detokenizer.add_token(token)
        stats.generation_tokens += len(emitted)
        text, hit_stop_string = _cut_at_stop_string(detokenizer, stop_strings)
        if hit_stop_string:
            reason = "stop"
        elif reason is not None:
            detokenizer.finalize()
            text += detokenizer.last_segment
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        yield GenerationResponse(text, emitted, stats, reason)
        if reason is not None:
            steps.close()
            return


def _apply_stops(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], str | None]:
    """Cut a step's tokens at the first EOS (excluded) and at the token budget."""
    for i, token in enumerate(tokens[:room]):
        if token in eos:
            return tokens[:i], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def _cut_at_stop_string(detokenizer, stop_strings: tuple[str, ...]) -> tuple[str, bool]:
    """The new text segment, cut before the first stop string if one appeared in the text."""
    segment = detokenizer.last_segment
    text = detokenizer.text
    hits = [text.find(s) for s in stop_strings if s in text]
    if not hits:
        return segment, False
    start = len(text) - len(segment)
    return segment[: max(min(hits) - start, 0)], True


def _finish(detokenizer, stats: GenerationStats, tic: float, reason: str) -> GenerationResponse:
    detokenizer.finalize()
    return GenerationResponse(detokenizer.last_segment, [], stats, reason)
