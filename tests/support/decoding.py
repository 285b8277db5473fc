"""Decoding helpers the exactness tests share: the first tokens of a decode loop, the
autoregressive reference, answers run to the context's end, and the target's own distribution
of the first three tokens with a chi-square check of drawn counts against it."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.errors import ContextFull
from support import decoder_for, run_steps


def take(steps, n):
    """First ``n`` tokens of a step generator, and the number of decode steps used."""
    out, count = [], -1  # the prefill's step is not a decode step
    for step in steps:
        out += step.tokens
        count += 1
        if len(out) >= n:
            return out[:n], count


def autoregressive(model, prompt, n):
    return take(run_steps(model, prompt), n)[0]


def remembered_answers(model):
    """``answer(prompt, n)``: ``model``'s greedy autoregressive answer of ``n`` tokens to
    ``prompt`` (a tuple), decoded once per prompt and length; for a module fixture whose tests
    compare many shapes and plans with the same few answers."""

    @functools.cache
    def answer(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        return tuple(autoregressive(model, list(prompt), n))

    return answer


PADDED = (4, 8, 16, 32, 64, 128)  # pads most trees: exactness must not depend on padding


def answers_to_the_context_end(model, drafter, shape, prompt, limit):
    """``(tokens, cache length)`` of the autoregressive and the speculative answer, each run
    until ContextFull at a ``limit``-token context."""
    answers = []
    for speculative in (False, True):
        decoder = decoder_for(model, drafter, max_context=limit)
        cache, out = decoder.new_sequence(), []
        steps = run_steps(
            model,
            prompt,
            drafter,
            shape,
            max_context=limit,
            cache=cache,
            autoregressive=not speculative,
        )
        with pytest.raises(ContextFull):
            for step in steps:
                out += step.tokens
        answers.append((out, cache.offset))
    return answers


VOCAB = 8


def target_probs(model, sampler_filter, temp, prefix):
    """The target's next-token probabilities after ``prefix`` ``(V,)``, float64, as the sampler
    draws them (``sampler_filter`` over the log-probs, then the temperature)."""
    cache = llm.new_sequence(model)
    n = len(prefix)
    hidden = llm.forward(model, mx.array(prefix), mx.arange(n), llm.chain_mask(0, n), cache)
    logits = llm.lm_head(model, hidden[-1])
    logprobs = sampler_filter(logits - mx.logsumexp(logits))
    return np.array(mx.softmax(logprobs / temp), dtype=np.float64)


def first_three_token_probs(model, filt, temp, prompt) -> list[np.ndarray]:
    """The target's marginal distributions of the 1st, 2nd and 3rd token after ``prompt``."""
    p1 = target_probs(model, filt, temp, prompt)
    p2_given = [target_probs(model, filt, temp, prompt + [x]) for x in range(VOCAB)]
    p2 = sum(p1[x] * p2_given[x] for x in range(VOCAB))
    p3 = sum(
        p1[x] * p2_given[x][y] * target_probs(model, filt, temp, prompt + [x, y])
        for x in range(VOCAB)
        for y in range(VOCAB)
        if p1[x] * p2_given[x][y] > 0
    )
    return [p1, p2, p3]


def assert_drawn_from(counts: np.ndarray, probs: list[np.ndarray], runs: int) -> None:
    """Chi-square test of each position's token counts ``counts (3, V)`` against ``probs``."""
    for observed, expected in zip(counts, probs, strict=True):
        keep = expected * runs >= 5  # pool rare cells so the chi-square approximation holds
        obs = np.append(observed[keep], observed[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum()) * runs
        obs, exp = obs[exp > 0], exp[exp > 0]
        exp = exp / exp.sum() * obs.sum()  # float rounding of the probabilities
        assert observed[expected == 0].sum() == 0  # top-p never lets a filtered token through
        assert chisquare(obs, exp).pvalue > 1e-3
