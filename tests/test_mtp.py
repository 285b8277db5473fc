"""Qwen3.5's native MTP head: mlx-vlm's numbers, both layouts, exact decoding.

The reference test needs mlx-vlm 0.7.10 (`make test-deps`); it skips without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.drafters import (
    assert_same_arrays,
    greedy_equals_autoregressive,
    second_token_pvalue,
    second_turn,
)
from support.families import build, config

from redrafter_mlx.core.drafting import Reading
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.core.llm import inner_model
from redrafter_mlx.core.sequence import Sequence
from redrafter_mlx.core.shape import BeamShape
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind, load_mtp

HIDDEN, HEADS, KV, DIM, INTER = 64, 4, 2, 16, 96


def mtp_tensors(seed: int = 0) -> dict[str, mx.array]:
    """A random MTP head as a Qwen3.5 checkpoint holds it: ``mtp.*``, norms as offsets
    from 1, queries twice as wide (their gate)."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.15):
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": w(HIDDEN, 2 * HIDDEN),
        "mtp.pre_fc_norm_embedding.weight": w(HIDDEN, scale=0.3),
        "mtp.pre_fc_norm_hidden.weight": w(HIDDEN, scale=0.3),
        "mtp.norm.weight": w(HIDDEN, scale=0.3),
        p + "input_layernorm.weight": w(HIDDEN, scale=0.3),
        p + "post_attention_layernorm.weight": w(HIDDEN, scale=0.3),
        p + "self_attn.q_proj.weight": w(2 * HEADS * DIM, HIDDEN),
        p + "self_attn.k_proj.weight": w(KV * DIM, HIDDEN),
        p + "self_attn.v_proj.weight": w(KV * DIM, HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * DIM),
        p + "self_attn.q_norm.weight": w(DIM, scale=0.3),
        p + "self_attn.k_norm.weight": w(DIM, scale=0.3),
        p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
        p + "mlp.up_proj.weight": w(INTER, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTER),
    }


def original_folder(out: Path) -> Path:
    """A Qwen3.5 checkpoint's folder as far as its MTP head goes: its config (declaring one
    MTP layer) and the ``mtp.*`` tensors beside the model's own."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**config("qwen3_5"), "head_dim": DIM, "mtp_num_hidden_layers": 1}
    (out / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(out / "model-mtp.safetensors"), mtp_tensors())
    return out


def split_folder(out: Path, reference_model) -> Path:
    """The folder mlx-vlm's splitter writes: ``qwen3_5_mtp``, unprefixed, norms + 1."""
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    text = {**config("qwen3_5"), "head_dim": DIM, "mtp_num_hidden_layers": 1}
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp", "text_config": text}))
    params = dict(tree_flatten(reference_model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


@pytest.fixture(scope="module")
def qwen3_5():
    return build("qwen3_5")


def reference(target):
    mtp = pytest.importorskip(
        "mlx_vlm.speculative.drafters.qwen3_5_mtp", reason="mlx-vlm 0.7.10 not installed"
    )
    text = {**config("qwen3_5"), "head_dim": DIM, "mtp_num_hidden_layers": 1}
    model = mtp.Model(mtp.ModelConfig.from_dict({"model_type": "qwen3_5_mtp", "text_config": text}))
    model.load_weights(list(model.sanitize(mtp_tensors()).items()))
    mx.eval(model.parameters())
    model.reset(target)
    return model


@pytest.mark.parametrize("layout", ["original", "split"])
def test_logits_and_proposals_equal_mlx_vlms(tmp_path, qwen3_5, layout):
    ref = reference(qwen3_5)
    folder = original_folder(tmp_path / "o") if layout == "original" else None
    folder = folder or split_folder(tmp_path / "s", ref)
    assert drafter_kind(folder) == "mtp"
    assert create_drafter(folder, qwen3_5).kind == "mtp"
    ours = load_mtp(folder, qwen3_5)
    rng = np.random.default_rng(1)
    n, length = 7, 5
    tokens = [int(t) for t in rng.integers(0, 90, n)]
    bonus = 13
    last = mx.array(rng.normal(0, 1, (n, HIDDEN)).astype(np.float32))  # the last layer's
    final = inner_model(qwen3_5).norm(last)  # output, and the target's final hidden

    shifted = mx.array(tokens[1:] + [bonus])[None]
    ref.reset(qwen3_5)
    expected = ref._lm_head_fn(ref._forward_tokens(shifted, final[None], mx.int32))[0]
    module = ours.module
    empty = [(mx.zeros((1, KV, 0, DIM)),) * 2]
    causal = mx.arange(n)[None] <= mx.arange(n)[:, None]
    got = module.logits(module.run(shifted, final[None], 0, empty, causal)[0])[0]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4)

    ref.reset(qwen3_5)
    ref.prefill_from_target_hidden(mx.array(tokens)[None], final[None], bonus, None, greedy=True)
    chain = ref.draft_block(bonus, None, None, length, None, greedy=True)
    sequence = Sequence(1, mx.float32)
    sequence.parts.append(ours.new_part())
    ours.observe(sequence, {ours.taps[0]: last}, mx.arange(n))
    sequence.commit(tokens)
    reading = Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(bonus))
    beams, _, _ = ours.draft(sequence, reading, width=1, length=length)
    assert beams[0].tolist() == [bonus] + chain[0].tolist()


def test_a_checkpoint_without_its_mtp_tensors_is_refused_in_one_line(tmp_path, qwen3_5):
    folder = tmp_path / "converted"
    folder.mkdir()
    cfg = {**config("qwen3_5"), "head_dim": DIM, "mtp_num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), {"other.weight": mx.zeros((2,))})
    with pytest.raises(DrafterError, match="MTP weights"):
        load_mtp(folder, qwen3_5)


@pytest.mark.parametrize("shape", [BeamShape(1, 3), BeamShape(4, 4)], ids=str)
def test_greedy_with_mtp_equals_autoregressive(tmp_path, qwen3_5, shape):
    drafter = load_mtp(original_folder(tmp_path / "o"), qwen3_5)
    assert greedy_equals_autoregressive(qwen3_5, drafter, shape)


def test_a_second_turn_drafts_as_a_fresh_prompt_does(tmp_path, qwen3_5):
    """On the hybrid target a second turn rewinds to a snapshot of the recurrent layers and
    the head's K/V with it: the same entries as the whole conversation fed at once."""
    drafter = load_mtp(original_folder(tmp_path / "o"), qwen3_5)
    # the next turn extends the conversation
    turn, ours, theirs, again, once = second_turn(
        qwen3_5, drafter, BeamShape(3, 4), 3, lambda ids: [*ids, 7, 8, 9]
    )
    assert (
        (ours.length, ours.entries) == (theirs.length, theirs.entries) == (len(turn), len(turn) - 1)
    )
    assert_same_arrays(ours, theirs)
    assert again.pending == once.pending


@pytest.mark.distribution
def test_sampling_with_mtp_keeps_the_targets_distribution(tmp_path, qwen3_5):
    """As for EAGLE-3 and DFlash: 40 first drafts per step, chi-square against the target's
    marginal of the second emitted token, on the hybrid."""
    drafter = load_mtp(original_folder(tmp_path / "o"), qwen3_5)
    # this target is near uniform at temperature 1
    assert second_token_pvalue(qwen3_5, drafter, 97, temp=0.3) > 1e-3


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("mtp_num_hidden_layers", "1", "mtp_num_hidden_layers '1': need an integer >= 1"),
        ("mtp_num_hidden_layers", -1, "mtp_num_hidden_layers -1: need an integer >= 1"),
        ("num_attention_heads", 0, "num_attention_heads 0: need an integer >= 1"),
        ("hidden_size", "64", "hidden_size '64': need an integer >= 1"),
    ],
)
def test_a_malformed_mtp_config_is_a_one_line_error(tmp_path, qwen3_5, field, value, message):
    """``"mtp_num_hidden_layers": "1"`` ended in a TypeError from telling the drafter's type,
    zero heads in a ZeroDivisionError inside mlx-lm's args."""
    from redrafter_mlx.io.field_drafters import create_drafter

    folder = original_folder(tmp_path / "o")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    assert drafter_kind(folder) == "mtp"
    with pytest.raises(DrafterError, match=f"not a Qwen3.5 MTP config \\({message}\\)"):
        create_drafter(folder, qwen3_5)
