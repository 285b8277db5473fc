"""Gemma 4's assistant drafter (``gemma4_assistant``): mlx-vlm's numbers, exact decoding on a
tiny random Gemma 4 (mlx-lm's ``gemma4_text``: sliding and full layers, K/V-shared layers,
per-layer inputs), sampling, batches, refusals.

The reference test needs mlx-vlm 0.7.10 (`make test-deps`); it skips without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from support import decoder_for, decoding_of, run_steps
from support.batching import alone, batched
from support.decoding import take
from support.drafters import generate_with_config, second_token_pvalue
from support.families import BASE, build, build_config

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.llm import inner_model
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.gemma4_assistant import Assistant, AssistantArgs
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind

VOCAB = 96  # divisible by the centroid head's 8 clusters
ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0},
}
# layers [sliding, full, sliding, full]; the last two share the first two's K/V
TARGET = {
    **BASE,
    "model_type": "gemma4_text",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_kv_shared_layers": 2,
    "sliding_window": 5,
    "sliding_window_pattern": 2,
    "hidden_size_per_layer_input": 8,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "use_double_wide_mlp": False,
    "tie_word_embeddings": True,
    "rope_parameters": ROPE,
}
TEXT = {  # the assistant's own layers: narrower, the target's K/V heads and head sizes
    "model_type": "gemma4_text",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 48,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_kv_shared_layers": 0,  # HF: 0 means every layer shares the target's K/V
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 5,
    "hidden_size_per_layer_input": 0,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "use_double_wide_mlp": False,
    "rope_parameters": ROPE,
}
PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 41]  # longer than the window (5)


def assistant_config(**changes) -> dict:
    return {
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": BASE["hidden_size"],
        "tie_word_embeddings": True,
        "use_ordered_embeddings": False,
        "text_config": TEXT,
        **changes,
    }


def random_assistant(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Random weights for ``config`` by HF's names (norms random too)."""
    module = Assistant(AssistantArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(module.parameters()):
        scale = 0.5 if "norm" in name else 0.3
        weights[name] = mx.array(rng.normal(0, scale, value.shape).astype(np.float32))
    if config.get("use_ordered_embeddings"):  # each cluster a block of shuffled token ids
        order = rng.permutation(VOCAB)  # 8 clusters of 12 tokens
        weights["masked_embedding.token_ordering"] = mx.array(order.astype(np.int64))
    return weights


def folder_of(out: Path, config: dict, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), random_assistant(config, seed))
    return out


@pytest.fixture(scope="module")
def gemma4():
    return build_config(TARGET, seed=3)


@pytest.fixture(scope="module")
def assistant_folder(tmp_path_factory):
    return folder_of(tmp_path_factory.mktemp("assistant"), assistant_config())


def reference(target, config: dict, weights: dict):
    pkg = pytest.importorskip(
        "mlx_vlm.speculative.drafters.gemma4_assistant", reason="mlx-vlm 0.7.10 not installed"
    )
    model = pkg.Model(pkg.ModelConfig.from_dict(config))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    model.bind(target)
    return model


def target_kv(target, prompt: list[int]) -> tuple[mx.array, dict]:
    """mlx-lm's own forward over ``prompt``: final-norm hidden ``(n, H)`` and the K/V of the
    last sliding and full layer that compute them (plain caches: every position kept)."""
    cache = [KVCache(), KVCache()]
    hidden = inner_model(target)(mx.array(prompt)[None], cache=cache)[0]
    kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]
    return hidden, {"sliding_attention": kv[0], "full_attention": kv[1]}


@pytest.mark.parametrize("ordered", [False, True], ids=["tied", "centroids"])
def test_proposals_equal_mlx_vlms(tmp_path, gemma4, ordered):
    """The chain mlx-vlm drafts from a prompt's K/V and last hidden state is our beam of
    width 1, drafting from the K/V our prefill wrote (the slots of the target's layers 0
    and 1); the first step's logits are equal too."""
    changes = {"use_ordered_embeddings": True, "num_centroids": 8} if ordered else {}
    config = assistant_config(**changes, centroid_intermediate_top_k=3)
    folder = folder_of(tmp_path / "a", config)
    assert drafter_kind(folder) == "gemma4_assistant"
    ours = create_drafter(folder, gemma4)
    assert ours.kind == "gemma4_assistant"
    ref = reference(gemma4, config, random_assistant(config))
    hidden, kv = target_kv(gemma4, PROMPT)
    n, bonus, length = len(PROMPT), 13, 5

    decoder = decoder_for(gemma4, ours)
    sequence = decoder.new_sequence()
    decoder.prefill(sequence, PROMPT, decoding_of(ours, BeamShape(1, length)))
    for kind, (keys, values) in kv.items():  # the slots it reads hold the target's K/V
        slot = ours.kv_layers[kind]
        np.testing.assert_allclose(sequence.kv.keys[slot][..., :n, :], keys, atol=1e-4)
        np.testing.assert_allclose(sequence.kv.values[slot][..., :n, :], values, atol=1e-4)

    ref.set_shared_kv(kv, n, position=n - 1, kv_valid_len=n)
    last = hidden[-1:][None]  # (1, 1, H)
    embed = ref._input_embed(mx.array([[bonus]])) * ref._input_embed_scale
    _, expected = ref(mx.concatenate([embed, last], -1), kv, mx.array([[n - 1]]))
    masks = {k: mx.arange(n) < n for k in kv}  # the window is wider than what one query sees
    masks["sliding_attention"] &= (n - 1) - mx.arange(n) < 5
    _, got = ours.module.step(mx.array([bonus]), hidden[-1:], kv, masks, mx.array(n - 1))
    np.testing.assert_allclose(np.array(got), np.array(expected[0]), atol=1e-4)

    chain = ref.draft_block(bonus, last, None, length, lambda x: mx.argmax(x, -1), greedy=True)
    reading = Reading.after_prompt(hidden[-1], mx.array(bonus))
    beams, logprobs, reads = ours.draft(sequence, reading, width=1, length=length)
    assert beams[0].tolist() == [bonus] + chain[0].tolist()
    assert reads == 0
    # the chain's log-probs, step by step as mlx-vlm's drafter scores them
    state, expected = last, []
    for token, nxt in zip(beams[0].tolist(), beams[0, 1:].tolist(), strict=False):
        embed = ref._input_embed(mx.array([[token]])) * ref._input_embed_scale
        state, logits = ref(mx.concatenate([embed, state], -1), kv, mx.array([[n - 1]]))
        expected.append(float(log_softmax(logits[0, 0].astype(mx.float32))[nxt]))
    np.testing.assert_allclose(np.array(logprobs[0]), expected, atol=1e-4)


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
@pytest.mark.parametrize("shape", [BeamShape(1, 3), BeamShape(4, 4)], ids=str)
def test_greedy_with_the_assistant_equals_autoregressive_on_both_plans(
    gemma4, assistant_folder, plan, shape
):
    """Exact on the CPU plan and the generic one (``REDRAFTER_CPU_TUNING=0``, Metal), past
    the sliding window."""
    drafter = create_drafter(assistant_folder, gemma4)
    expected, _ = take(run_steps(gemma4, PROMPT, plan=plan), 40)
    got, _ = take(run_steps(gemma4, PROMPT, drafter, shape, plan=plan), 40)
    assert got == expected


def test_after_an_accepted_path_it_drafts_as_from_a_fresh_prompt(gemma4, assistant_folder):
    """Mid-step, the assistant reads the committed K/V and the accepted path's (staged, not
    yet committed) at the last accepted token's position: its beams are those drafted from
    the same tokens fed as a prompt. Lookup beams get paths accepted (random drafts are not)."""
    drafter = create_drafter(assistant_folder, gemma4)
    decoder = decoder_for(gemma4, drafter)
    decoding = decoding_of(drafter, BeamShape(2, 3, lookup=2))
    sequence = decoder.new_sequence()
    state, _ = decoder.prefill(sequence, PROMPT, decoding)
    paths = 0
    for _ in range(30):
        state, step = decoder.step(state)
        if len(step.tokens) > 1:
            paths += 1
            fresh, _ = decoder.prefill(decoder.new_sequence(), list(sequence.ids), decoding)
            assert (fresh.pending, fresh.drafted.tolist()) == (
                state.pending,
                state.drafted.tolist(),
            )
    assert paths >= 1


@pytest.mark.distribution
def test_sampling_with_the_assistant_keeps_the_targets_distribution(gemma4, assistant_folder):
    """40 first drafts per step, chi-square against the target's marginal of the second
    emitted token."""
    drafter = create_drafter(assistant_folder, gemma4)
    assert second_token_pvalue(gemma4, drafter, VOCAB, temp=0.3) > 1e-3


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
def test_the_assistant_in_a_batch_answers_as_alone(gemma4, assistant_folder, plan):
    """``serve``'s batches: members drafting from the assistant, each reading its own K/V,
    answer as they do alone."""
    drafter = create_drafter(assistant_folder, gemma4)
    decoder = decoder_for(gemma4, drafter, plan)
    decodings = [
        decoding_of(drafter, BeamShape(2, 3)),
        decoding_of(drafter, BeamShape(1, 4)),
        decoding_of(drafter, BeamShape(2, 3, lookup=1)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
    ]
    prompts = [PROMPT, [7, 8, 9], [10, 11, 12, 13, 14, 15], [3, 3, 3]]
    expected = [alone(decoder, d, p, 20) for d, p in zip(decodings, prompts, strict=True)]
    assert batched(decoder, decodings, prompts, 20)[0] == expected


def test_in_a_batch_it_reads_each_members_own_path(gemma4, assistant_folder):
    """Stepped in a batch, a member whose path was accepted drafts what a fresh prompt of its
    tokens drafts: the assistant reads that member's K/V, not its neighbours'."""
    from redrafter_mlx.core.serving.batch import Member, batch_step

    drafter = create_drafter(assistant_folder, gemma4)
    decoder = decoder_for(gemma4, drafter)
    decodings = [decoding_of(drafter, BeamShape(2, 3, lookup=2)), decoding_of(drafter)]
    members = [
        Member(decoder.prefill(decoder.new_sequence(), prompt, decoding)[0])
        for prompt, decoding in zip([PROMPT, [7, 8, 9]], decodings, strict=True)
    ]
    paths = 0
    for _ in range(30):
        steps = batch_step(decoder, members)
        for member, step in zip(members, steps, strict=True):
            if len(step.tokens) > 1:
                paths += 1
                ids, state = list(member.state.sequence.ids), member.state
                fresh, _ = decoder.prefill(decoder.new_sequence(), ids, member.decoding)
                assert (fresh.pending, fresh.drafted.tolist()) == (
                    state.pending,
                    state.drafted.tolist(),
                )
    assert paths >= 1


def test_a_folder_for_another_target_is_refused_in_one_line(tmp_path, gemma4, assistant_folder):
    with pytest.raises(DrafterError, match="Gemma 4 assistant drafts for Gemma 4 targets only"):
        create_drafter(assistant_folder, build("llama"))
    wide = folder_of(tmp_path / "w", assistant_config(backbone_hidden_size=128))
    with pytest.raises(DrafterError, match="reads hidden size 128, but the target's is 64"):
        create_drafter(wide, gemma4)
    uneven = assistant_config(use_ordered_embeddings=True, num_centroids=7)
    with pytest.raises(DrafterError, match="splits a vocabulary of 96 into 7 clusters unevenly"):
        create_drafter(folder_of(tmp_path / "u", uneven), gemma4)
    broken = tmp_path / "b"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "gemma4_assistant"}))
    with pytest.raises(DrafterError, match="not a Gemma 4 assistant config \\(no text_config"):
        create_drafter(broken, gemma4)


def test_an_assistant_is_no_longer_misread_as_a_redrafter_drafter(assistant_folder):
    """It was left to ReDrafter's loader, which refused it for missing RNN weights."""
    assert drafter_kind(assistant_folder) == "gemma4_assistant"


def test_generate_with_an_assistant_folder_answers_as_the_target(tmp_path, capsys):
    """The CLI path: `generate --model <Gemma 4> --drafter <assistant>` loads it by its type
    and answers as `--autoregressive` does."""

    def make(vocab):
        text = {**TEXT, "vocab_size": vocab}
        return folder_of(tmp_path / "assistant", assistant_config(text_config=text))

    # no per-layer inputs: their table would be sized by the tokenizer's vocabulary too
    target = {**TARGET, "hidden_size_per_layer_input": 0}
    generate_with_config(tmp_path, capsys, target, make, "Gemma 4 assistant")
