"""The Python API's batched call (``batch_generate``) and the end-token rule that
``stream_generate`` and usage share."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from support import tiny_llama, toy_hf_tokenizer, toy_tokenizer

import redrafter_mlx
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3, 3, 3]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def ending_tokenizer(model, prompt: list[int], at: int) -> TokenizerWrapper:
    """The toy tokenizer with the ``at``-th token of ``prompt``'s greedy answer made an
    end-of-sequence token (so that answer ends by it)."""
    answer = list(mlx_lm_tokens(model, prompt, at + 1))
    return TokenizerWrapper(toy_hf_tokenizer(), eos_token_ids=[answer[at]])


def mlx_lm_tokens(model, prompt: list[int], n: int) -> list[int]:
    import mlx_lm

    stream = mlx_lm.stream_generate(model, toy_tokenizer(), mx.array(prompt), max_tokens=n)
    return [r.token for r in stream]


@pytest.mark.parametrize("lookup", [0, 2])
def test_batch_generate_answers_each_prompt_as_stream_generate(model, lookup):
    drafter = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    tokenizer = toy_tokenizer()
    options = {"drafter": drafter, "beam_width": 2, "beam_length": 3, "lookup": lookup}
    streams = [
        list(redrafter_mlx.stream_generate(model, tokenizer, p, max_tokens=n, **options))
        for p, n in zip(PROMPTS, (20, 9, 20, 14), strict=True)
    ]
    eos = tokenizer.eos_token_ids
    alone = [[r.token for r in stream if r.token not in eos] for stream in streams]
    done = redrafter_mlx.batch_generate(
        model, tokenizer, PROMPTS, max_tokens=[20, 9, 20, 14], return_token_ids=True, **options
    )
    assert done.token_ids == alone
    assert done.texts == [tokenizer.decode(t) for t in alone]
    assert done.stats.generation_tokens == sum(stream[-1].generation_tokens for stream in streams)
    assert all(run.steps > 0 for run in done.stats.answers)


def test_an_answer_ended_by_its_end_token_carries_it_last_and_counts_it_as_mlx_lm(model):
    import mlx_lm

    prompt = PROMPTS[0]
    tokenizer = ending_tokenizer(model, prompt, 6)
    theirs = list(mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=30))
    drafter = BeamDrafter(random_drafter(64, 64, seed=1), model.model.embed_tokens)
    for options in ({"autoregressive": True}, {"drafter": drafter, "beam_width": 2}):
        ours = list(
            redrafter_mlx.stream_generate(
                model, tokenizer, prompt, max_tokens=30, logprobs=True, **options
            )
        )
        assert [r.token for r in ours] == [r.token for r in theirs]
        for mine, want in zip(ours, theirs, strict=True):  # the end token's log-probs too
            np.testing.assert_allclose(mine.logprobs, want.logprobs, atol=1e-4)
        assert ours[-1].token in tokenizer.eos_token_ids and ours[-1].finish_reason == "stop"
        assert ours[-1].generation_tokens == theirs[-1].generation_tokens == 7
        assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
        stats = ours[-1].stats
        assert stats.generation_tokens == 6 and stats.completion_tokens == 7
    done = redrafter_mlx.batch_generate(model, tokenizer, [prompt], max_tokens=30)
    assert done.stats.generation_tokens == 7  # the end token counted, as mlx-lm's stats
