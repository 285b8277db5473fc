"""Prompt templates: Vicuna v1.1 with the real Vicuna-7B v1.3 SentencePiece tokenizer."""

from __future__ import annotations

import pytest
from support import shared_data

from redrafter_mlx.io.templates import (
    VICUNA_SYSTEM,
    apply_chat_template,
    is_vicuna,
    vicuna_prompt,
)

CONVERSATION = [
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "I am Vicuna, a language model."},
    {"role": "user", "content": "What is 12+30?"},
]


@pytest.fixture(scope="module")
def vicuna_tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(shared_data("vicuna-7b-v1.3-tokenizer/tokenizer.model").parent)


@pytest.fixture(scope="module")
def sentencepiece_model():
    import sentencepiece as spm

    path = shared_data("vicuna-7b-v1.3-tokenizer/tokenizer.model")
    return spm.SentencePieceProcessor(model_file=str(path))


def test_vicuna_prompt_text():
    assert vicuna_prompt(CONVERSATION) == (
        VICUNA_SYSTEM + " USER: Hello! Who are you? ASSISTANT: I am Vicuna, a language model."
        "</s>USER: What is 12+30? ASSISTANT:"
    )
    assert (
        vicuna_prompt(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        )
        == "Be brief. USER: Hi ASSISTANT:"
    )


def test_vicuna_conversation_ids(vicuna_tokenizer, sentencepiece_model):
    sp = sentencepiece_model
    first = f"{VICUNA_SYSTEM} USER: Hello! Who are you? ASSISTANT: I am Vicuna, a language model."
    second = "USER: What is 12+30? ASSISTANT:"
    expected = [sp.bos_id()] + sp.encode(first) + [sp.eos_id()] + sp.encode(second)
    assert expected[:3] == [1, 319, 13563]  # <s> ▁A ▁chat
    assert (
        apply_chat_template(vicuna_tokenizer, CONVERSATION, name="lmsys/vicuna-7b-v1.3") == expected
    )
    # detected from the tokenizer alone too (Llama SentencePiece, 32000 tokens, no template)
    assert is_vicuna(vicuna_tokenizer, model_type="llama")
    assert apply_chat_template(vicuna_tokenizer, CONVERSATION, model_type="llama") == expected


def test_single_turn_ids(vicuna_tokenizer, sentencepiece_model):
    sp = sentencepiece_model
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    expected = [1] + sp.encode(f"{VICUNA_SYSTEM} USER: What is the capital of France? ASSISTANT:")
    assert apply_chat_template(vicuna_tokenizer, msgs, model_path="models/vicuna-7b") == expected


class _TemplatedTokenizer:
    """A stand-in for a HF tokenizer that has its own chat template."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return [7, len(messages)]


def test_own_template_wins():
    tok = _TemplatedTokenizer()
    assert not is_vicuna(tok, name="vicuna")
    assert apply_chat_template(tok, CONVERSATION, name="vicuna-7b") == [7, 3]


def test_training_masks_vicuna_answers(vicuna_tokenizer, sentencepiece_model):
    """`train` on a model without a chat template (Vicuna) reads conversations in Vicuna's
    template and learns from exactly the assistant's tokens (it used to fail in
    transformers: no chat template)."""
    from redrafter_mlx.training.data import encode_conversation

    sp = sentencepiece_model
    ids, mask = encode_conversation(vicuna_tokenizer, CONVERSATION[:2])
    assert ids == apply_chat_template(
        vicuna_tokenizer, CONVERSATION[:2], add_generation_prompt=False
    )
    answer = [i for i, m in zip(ids, mask, strict=True) if m]
    assert answer == sp.encode("I am Vicuna, a language model.") + [sp.eos_id()]
