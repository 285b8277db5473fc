"""stream_generate: stop strings cut ReDrafter's answer exactly where they cut the baseline's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_llama, toy_tokenizer

from redrafter_mlx.accept import greedy
from redrafter_mlx.decode import BeamShape, Decoder
from redrafter_mlx.draft import BeamDrafter
from redrafter_mlx.drafter import random_drafter
from redrafter_mlx.generate import stream_generate

PROMPT = [5, 17, 33, 2, 41]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def reference(model):
    """The target's own greedy continuation of PROMPT (60 tokens: answers take 40)."""
    decoder, out = Decoder(model, greedy), []
    for step in decoder.autoregressive(decoder.new_cache(), PROMPT):
        out += step.tokens
        if len(out) >= 60:
            return out[:60]


class Oracle:
    """Drafts the target's own continuation: every step accepts all L tokens, so a stop
    string falls inside a multi-token step."""

    def __init__(self, continuation):
        self.continuation, self.pos = continuation, 0

    def __call__(self, context, pending, *, width, length, min_prob=0.0, search_width=0):
        beam = self.continuation[self.pos : self.pos + length]
        self.pos += length
        return mx.array(np.tile(np.array(beam), (width, 1)), dtype=mx.int32), None


def answer(decoder, stop_strings, autoregressive=False):
    text, tokens = "", []
    for response in stream_generate(
        decoder,
        toy_tokenizer(),
        PROMPT,
        max_tokens=40,
        autoregressive=autoregressive,
        stop_strings=stop_strings,
    ):
        text += response.text
        tokens += response.tokens
    return text, tokens, response.stats.generation_tokens, response.finish_reason


@pytest.mark.parametrize("span", [(0, 1), (5, 7), (3, 6), (10, 11), (38, 40)])
def test_stop_strings_cut_redrafter_where_they_cut_the_baseline(model, reference, span):
    """Text, tokens and counts are the same for every grouping of tokens into steps; the text
    stops before the stop string, the tokens at the one that completes it."""
    stop = toy_tokenizer().decode(reference[span[0] : span[1]])
    baseline = answer(Decoder(model, greedy), (stop,), autoregressive=True)
    text, tokens, count, reason = baseline
    assert reason == "stop" and stop not in text and count == len(tokens)
    decode = toy_tokenizer().decode
    assert stop in decode(tokens) and stop not in decode(tokens[:-1])
    random = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    for drafter, shape in ((Oracle(reference), BeamShape(1, 4)), (random, BeamShape(2, 3))):
        assert answer(Decoder(model, greedy, drafter, shape), (stop,)) == baseline


def test_text_that_may_begin_a_stop_string_is_held_back_then_released(model, reference):
    """A stop string that never completes costs nothing: the whole answer comes out."""
    tok = toy_tokenizer()
    never = tok.decode(reference[4:6]) + " w999"  # begins like the answer, never completes
    full = answer(Decoder(model, greedy), (), autoregressive=True)
    oracle = Decoder(model, greedy, Oracle(reference), BeamShape(1, 4))
    assert answer(oracle, (never,)) == full
    assert full[0] == tok.decode(full[1]) and full[3] == "length"
