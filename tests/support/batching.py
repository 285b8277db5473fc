"""Builders for the batch tests: a sequence's answer stepped alone and stepped in a batch."""

from __future__ import annotations

from redrafter_mlx.core.serving.batch import Member, batch_step


def alone(decoder, decoding, prompt: list[int], n: int) -> list[int]:
    """The first ``n`` tokens of ``prompt``'s answer, its sequence stepped by itself."""
    state, first = decoder.prefill(decoder.new_sequence(), prompt, decoding)
    tokens = [] if first is None else list(first.tokens)
    while len(tokens) < n:
        state, step = decoder.step(state)
        tokens += step.tokens
    return tokens[:n]


def batched(decoder, decodings, prompts, n: int, *, keys=None) -> tuple[list[list[int]], list]:
    """Each prompt's first ``n`` tokens, all sequences stepped together by
    :func:`batch_step`, and every step's results."""
    members, tokens, results = [], [], []
    for i, (decoding, prompt) in enumerate(zip(decodings, prompts, strict=True)):
        state, first = decoder.prefill(decoder.new_sequence(), prompt, decoding)
        members.append(Member(state, None if keys is None else keys[i]))
        tokens.append([] if first is None else list(first.tokens))
    while min(len(t) for t in tokens) < n:
        steps = batch_step(decoder, members)
        results.append(steps)
        for answer, step in zip(tokens, steps, strict=True):
            answer += step.tokens
    return [t[:n] for t in tokens], results
