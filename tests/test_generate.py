"""stream_steps: stop strings cut ReDrafter's answer exactly where they cut the baseline's (the text
rules themselves: test_stops.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from support import decoder_for, decoding_of, run_steps, tiny_llama, toy_tokenizer

from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import SearchSource
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session

PROMPT = [5, 17, 33, 2, 41]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def reference(model):
    """The target's own greedy continuation of PROMPT (60 tokens: answers take 40)."""
    out = []
    for step in run_steps(model, PROMPT):
        out += step.tokens
        if len(out) >= 60:
            return out[:60]


class Oracle(SearchSource):
    """Drafts the target's own continuation: every step accepts all L tokens, so a stop
    string falls inside a multi-token step."""

    kind = "oracle"

    def __init__(self, continuation):
        self.continuation, self.pos = continuation, 0

    def search(self, context, pending, *, width, length, min_prob=0.0, search_width=0):
        beam = self.continuation[self.pos : self.pos + length]
        self.pos += length
        return mx.array(np.tile(np.array(beam), (width, 1)), dtype=mx.int32), None, 0


def answer(model, stop_strings, drafter=None, shape=None):
    """The answer to PROMPT (autoregressive without a drafter) in a fresh session."""
    decoding = decoding_of(drafter, shape)
    session = Session(decoder_for(model, drafter), toy_tokenizer(), decoding, warm=False)
    text, tokens = "", []
    for response in session.generate(PROMPT, max_tokens=40, stop_strings=stop_strings):
        text += response.text
        tokens += response.tokens
    return text, tokens, response.stats.generation_tokens, response.finish_reason


@pytest.mark.parametrize("span", [(0, 1), (5, 7), (3, 6), (10, 11), (38, 40)])
def test_stop_strings_cut_redrafter_where_they_cut_the_baseline(model, reference, span):
    """Text, tokens and counts are the same for every grouping of tokens into steps; the text
    stops before the stop string, the tokens at the one that completes it."""
    stop = toy_tokenizer().decode(reference[span[0] : span[1]])
    baseline = answer(model, (stop,))
    text, tokens, count, reason = baseline
    assert reason == "stop" and stop not in text and count == len(tokens)
    decode = toy_tokenizer().decode
    assert stop in decode(tokens) and stop not in decode(tokens[:-1])
    random = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    for drafter, shape in ((Oracle(reference), BeamShape(1, 4)), (random, BeamShape(2, 3))):
        assert answer(model, (stop,), drafter, shape) == baseline


def test_text_that_may_begin_a_stop_string_is_held_back_then_released(model, reference):
    """A stop string that never completes costs nothing: the whole answer comes out."""
    tok = toy_tokenizer()
    never = tok.decode(reference[4:6]) + " w999"  # begins like the answer, never completes
    full = answer(model, ())
    assert answer(model, (never,), Oracle(reference), BeamShape(1, 4)) == full
    assert full[0] == tok.decode(full[1]) and full[3] == "length"


@pytest.mark.parametrize("shape", [BeamShape(1, 3), BeamShape(3, 4)])
def test_stream_generate_yields_mlx_lm_style_responses_token_by_token(model, shape):
    """Code written against ``mlx_lm.stream_generate`` can switch: one response per token with
    mlx-lm's fields, the same tokens and text as mlx-lm's own greedy stream, the last response
    carrying the finish reason, and ``from_draft`` set on accepted drafted tokens."""
    import mlx_lm

    import redrafter_mlx

    tokenizer = toy_tokenizer()
    theirs = list(mlx_lm.stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=24))
    drafter = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    ours = list(
        redrafter_mlx.stream_generate(
            model,
            tokenizer,
            PROMPT,
            max_tokens=24,
            drafter=drafter,
            beam_width=shape.width,
            beam_length=shape.length,
            lookup=0,
        )
    )
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
    assert [r.generation_tokens for r in ours] == list(range(1, 25))
    assert ours[-1].finish_reason == theirs[-1].finish_reason == "length"
    assert all(r.finish_reason is None for r in ours[:-1])
    assert not ours[0].from_draft  # the prefill's token is the target's own
    drafted = sum(r.from_draft for r in ours)
    assert drafted == 24 - ours[-1].stats.steps - 1  # every step's last token is the target's
    fields = {"text", "token", "logprobs", "from_draft", "prompt_tokens", "prompt_tps"}
    fields |= {"generation_tokens", "generation_tps", "peak_memory", "finish_reason"}
    assert fields <= set(vars(ours[0])) and ours[0].prompt_tokens == len(PROMPT)


@pytest.mark.parametrize("lookup", [0, 2])
def test_stream_generate_on_a_plain_mlx_lm_model_equals_mlx_lm(model, lookup):
    """A plain mlx-lm model (no drafter), a text prompt and mlx-lm's own sampler: the same
    tokens and text as ``mlx_lm.stream_generate``, decoding plainly or with lookup beams."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    import redrafter_mlx

    tokenizer, prompt = toy_tokenizer(), "w5 w17 w33 w2 w41 w5 w17"
    options = {"max_tokens": 20, "sampler": make_sampler(0.0)}
    theirs = list(mlx_lm.stream_generate(model, tokenizer, prompt, **options))
    ours = list(redrafter_mlx.stream_generate(model, tokenizer, prompt, lookup=lookup, **options))
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
    assert ours[-1].prompt_tokens == theirs[-1].prompt_tokens
    text = redrafter_mlx.generate(model, tokenizer, prompt, lookup=lookup, **options)
    assert text == "".join(r.text for r in theirs)


@pytest.mark.parametrize("shape", [None, BeamShape(1, 3), BeamShape(3, 4, lookup=2)])
def test_logprobs_equal_mlx_lm_s_token_by_token(model, shape, monkeypatch):
    """With ``logprobs=True`` every response carries the target's log-probs its token was
    chosen from: in float32 those of mlx-lm's own stream (plain decoding, or rows of the
    verified tree), at no extra host read."""
    import mlx_lm

    import redrafter_mlx
    from redrafter_mlx.core.decode import speculative as tree_step

    tokenizer = toy_tokenizer()
    theirs = list(mlx_lm.stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=20))
    drafter = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    options = (
        {"autoregressive": True}
        if shape is None
        else {
            "drafter": drafter,
            "beam_width": shape.width,
            "beam_length": shape.length,
            "lookup": shape.lookup,
        }
    )
    reads, real = [], tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    ours = list(
        redrafter_mlx.stream_generate(
            model, tokenizer, PROMPT, max_tokens=20, logprobs=True, **options
        )
    )
    assert [r.token for r in ours] == [r.token for r in theirs]
    for mine, want in zip(ours, theirs, strict=True):
        assert mine.logprobs.shape == want.logprobs.shape == (64,)
        np.testing.assert_allclose(mine.logprobs, want.logprobs, atol=1e-4)
    if shape is not None:
        assert len(reads) == ours[-1].stats.steps + 1  # one per step, plus the prefill's
    plain = list(redrafter_mlx.stream_generate(model, tokenizer, PROMPT, max_tokens=4))
    assert all(r.logprobs is None for r in plain)  # off by default


@pytest.mark.parametrize("temp", [1e-40, 1e-8])
def test_a_temperature_too_small_to_scale_logits_by_decodes_greedily(model, reference, temp):
    """1 / 1e-40 is inf in float32: mlx-lm's draw from the scaled logits returned garbage.
    The one rule (accept.is_greedy) makes the sampler argmax, plain and speculative alike."""
    from redrafter_mlx.core.decode.accept import greedy, is_greedy, make_sampler

    assert is_greedy(temp) and make_sampler(temp) is greedy
    drafter = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    for beams, shape in ((None, None), (drafter, BeamShape(2, 3))):
        decoding = decoding_of(beams, shape, make_sampler(temp))
        session = Session(decoder_for(model, beams), toy_tokenizer(), decoding, warm=False)
        tokens = [t for r in session.generate(PROMPT, max_tokens=40) for t in r.tokens]
        assert tokens == reference[:40]
