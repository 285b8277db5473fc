"""Qwen3.5's native MTP heads, dense and MoE: mlx-vlm's numbers, both layouts, exact decoding.

The reference test needs mlx-vlm 0.7.10 (`make test-deps`); it skips without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import decoder_for, decoding_of, run_steps
from support.batching import alone, batched
from support.decoding import take
from support.drafters import (
    assert_same_arrays,
    generate_with_config,
    greedy_equals_autoregressive,
    second_token_pvalue,
    second_turn,
)
from support.families import build, config

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.llm import inner_model
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind, load_mtp

HIDDEN, HEADS, KV, DIM, INTER = 64, 4, 2, 16, 96
EXPERTS, MOE_INTER = 4, 32  # tests/support/families.py's qwen3_5_moe


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


def moe_tensors(seed: int = 0, fused: bool = False) -> dict[str, mx.array]:
    """A random MoE MTP head (Qwen3.5 / 3.6-35B-A3B's layout): the dense head's attention and
    norms, a router over ``EXPERTS`` experts, each expert's own projections (``fused``: one
    ``gate_up_proj`` and one ``down_proj`` for all, as newer checkpoints store them) and a
    gated shared expert."""
    rng = np.random.default_rng(seed + 100)

    def w(*shape, scale=0.15):
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    p = "mtp.layers.0.mlp."
    tensors = {k: v for k, v in mtp_tensors(seed).items() if ".mlp." not in k}
    tensors |= {
        p + "gate.weight": w(EXPERTS, HIDDEN, scale=0.5),
        p + "shared_expert.gate_proj.weight": w(MOE_INTER, HIDDEN),
        p + "shared_expert.up_proj.weight": w(MOE_INTER, HIDDEN),
        p + "shared_expert.down_proj.weight": w(HIDDEN, MOE_INTER),
        p + "shared_expert_gate.weight": w(1, HIDDEN),
    }
    gate, up, down = (w(EXPERTS, MOE_INTER, HIDDEN), w(EXPERTS, MOE_INTER, HIDDEN),
                      w(EXPERTS, HIDDEN, MOE_INTER))  # fmt: skip
    if fused:
        tensors[p + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        tensors[p + "experts.down_proj"] = down
        return tensors
    for e in range(EXPERTS):
        for name, stacked in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            tensors[f"{p}experts.{e}.{name}.weight"] = stacked[e]
    return tensors


def text_config(family: str = "qwen3_5") -> dict:
    return {**config(family), "head_dim": DIM, "mtp_num_hidden_layers": 1}


def head_tensors(family: str = "qwen3_5", fused: bool = False) -> dict[str, mx.array]:
    return moe_tensors(fused=fused) if family == "qwen3_5_moe" else mtp_tensors()


def original_folder(out: Path, family: str = "qwen3_5", fused: bool = False) -> Path:
    """A Qwen3.5 checkpoint's folder as far as its MTP head goes: its config (declaring one
    MTP layer) and the ``mtp.*`` tensors beside the model's own."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(text_config(family)))
    mx.save_safetensors(str(out / "model-mtp.safetensors"), head_tensors(family, fused))
    return out


def split_folder(out: Path, reference_model, family: str = "qwen3_5") -> Path:
    """The folder mlx-vlm's splitter writes: ``qwen3_5_mtp``, unprefixed, norms + 1."""
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    text = text_config(family)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp", "text_config": text}))
    params = dict(tree_flatten(reference_model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


@pytest.fixture(scope="module")
def qwen3_5():
    return build("qwen3_5")


@pytest.fixture(scope="module")
def qwen3_5_moe():
    return build("qwen3_5_moe")


def reference(target, family: str = "qwen3_5", fused: bool = False):
    mtp = pytest.importorskip(
        "mlx_vlm.speculative.drafters.qwen3_5_mtp", reason="mlx-vlm 0.7.10 not installed"
    )
    text = text_config(family)
    model = mtp.Model(mtp.ModelConfig.from_dict({"model_type": "qwen3_5_mtp", "text_config": text}))
    model.load_weights(list(model.sanitize(head_tensors(family, fused)).items()), strict=True)
    mx.eval(model.parameters())
    model.reset(target)
    return model


@pytest.mark.parametrize(
    "family,layout",
    [
        ("qwen3_5", "original"),
        ("qwen3_5", "split"),
        ("qwen3_5_moe", "original"),  # each expert's own tensors
        ("qwen3_5_moe", "fused"),  # experts.gate_up_proj / experts.down_proj
        ("qwen3_5_moe", "split"),
    ],
)
def test_logits_and_proposals_equal_mlx_vlms(tmp_path, request, family, layout):
    target = request.getfixturevalue(family)
    ref = reference(target, family, fused=layout == "fused")
    if layout == "split":
        folder = split_folder(tmp_path / "s", ref, family)
    else:
        folder = original_folder(tmp_path / "o", family, fused=layout == "fused")
    assert drafter_kind(folder) == "mtp"
    assert create_drafter(folder, target).kind == "mtp"
    ours = load_mtp(folder, target)
    rng = np.random.default_rng(1)
    n, length = 7, 5
    tokens = [int(t) for t in rng.integers(0, 90, n)]
    bonus = 13
    last = mx.array(rng.normal(0, 1, (n, HIDDEN)).astype(np.float32))  # the last layer's
    final = inner_model(target).norm(last)  # output, and the target's final hidden

    shifted = mx.array(tokens[1:] + [bonus])[None]
    ref.reset(target)
    expected = ref._lm_head_fn(ref._forward_tokens(shifted, final[None], mx.int32))[0]
    module = ours.module
    empty = [(mx.zeros((1, KV, 0, DIM)),) * 2]
    causal = mx.arange(n)[None] <= mx.arange(n)[:, None]
    got = module.logits(module.run(shifted, final[None], 0, empty, causal)[0])[0]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4)

    ref.reset(target)
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


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
@pytest.mark.parametrize("shape", [BeamShape(1, 3), BeamShape(4, 4)], ids=str)
def test_greedy_with_a_moe_head_equals_autoregressive_on_both_plans(
    tmp_path, qwen3_5_moe, plan, shape
):
    """Exact on the CPU plan and on the generic one (what ``REDRAFTER_CPU_TUNING=0`` and
    Metal run), with a MoE head over a MoE target."""
    drafter = load_mtp(original_folder(tmp_path / "o", "qwen3_5_moe"), qwen3_5_moe)
    prompt = [5, 17, 33, 2, 41, 8]
    expected, _ = take(run_steps(qwen3_5_moe, prompt, plan=plan), 40)
    got, steps = take(run_steps(qwen3_5_moe, prompt, drafter, shape, plan=plan), 40)
    assert got == expected
    assert steps < 40  # drafts were accepted: the head was used, not just the target


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_second_turn_drafts_as_a_fresh_prompt_does(tmp_path, request, family):
    """On the hybrid target a second turn rewinds to a snapshot of the recurrent layers and
    the head's K/V with it: the same entries as the whole conversation fed at once."""
    target = request.getfixturevalue(family)
    drafter = load_mtp(original_folder(tmp_path / "o", family), target)
    # the next turn extends the conversation
    turn, ours, theirs, again, once = second_turn(
        target, drafter, BeamShape(3, 4), 3, lambda ids: [*ids, 7, 8, 9]
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


@pytest.mark.distribution
def test_sampling_with_a_moe_head_keeps_the_targets_distribution(tmp_path, qwen3_5_moe):
    """The same chi-square test with a MoE head over the MoE target (flatter than the dense
    one at 0.3: too few tokens would be likely enough to test)."""
    drafter = load_mtp(original_folder(tmp_path / "o", "qwen3_5_moe"), qwen3_5_moe)
    assert second_token_pvalue(qwen3_5_moe, drafter, 97, temp=0.15) > 1e-3


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_mtp_heads_in_a_batch_answer_as_alone(tmp_path, request, family, plan):
    """``serve``'s batches: sequences drafting from one MTP head (trees of two shapes, drafted
    + lookup beams) stepped together answer each as it does alone."""
    target = request.getfixturevalue(family)
    drafter = load_mtp(original_folder(tmp_path / "o", family), target)
    decoder = decoder_for(target, drafter, plan)
    decodings = [
        decoding_of(drafter, BeamShape(2, 3)),
        decoding_of(drafter, BeamShape(1, 4)),
        decoding_of(drafter, BeamShape(2, 3, lookup=1)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
    ]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15], [3, 3, 3]]
    expected = [alone(decoder, d, p, 20) for d, p in zip(decodings, prompts, strict=True)]
    assert batched(decoder, decodings, prompts, 20)[0] == expected


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
    folder = original_folder(tmp_path / "o")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    assert drafter_kind(folder) == "mtp"
    with pytest.raises(DrafterError, match=f"not a Qwen3.5 MTP config \\({message}\\)"):
        create_drafter(folder, qwen3_5)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_experts_per_tok", 5, "num_experts_per_tok 5: more than its 4 experts"),
        ("moe_intermediate_size", 0, "moe_intermediate_size 0: need an integer >= 1"),
        ("num_experts", "4", "num_experts '4': need an integer >= 1"),
    ],
)
def test_a_malformed_moe_head_config_is_a_one_line_error(
    tmp_path, qwen3_5_moe, field, value, message
):
    folder = original_folder(tmp_path / "o", "qwen3_5_moe")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(DrafterError, match=f"not a Qwen3.5 MTP config \\({message}\\)"):
        load_mtp(folder, qwen3_5_moe)


def test_moe_experts_numbered_with_a_gap_are_refused_in_one_line(tmp_path, qwen3_5_moe):
    folder = original_folder(tmp_path / "o", "qwen3_5_moe")
    tensors = moe_tensors()
    for name in ("gate_proj", "up_proj", "down_proj"):  # expert 1 missing: 0, 2, 3
        tensors.pop(f"mtp.layers.0.mlp.experts.1.{name}.weight")
    mx.save_safetensors(str(folder / "model-mtp.safetensors"), tensors)
    with pytest.raises(
        DrafterError, match=r"MTP weights: layers.0.mlp.experts numbered \[0, 2, 3\]"
    ):
        load_mtp(folder, qwen3_5_moe)


def test_generate_with_a_moe_checkpoint_folder_answers_as_the_target(tmp_path, capsys):
    """The CLI path: `generate --model <Qwen3.5 MoE> --drafter <its checkpoint's folder>`."""

    def make(vocab):
        folder = original_folder(tmp_path / "head", "qwen3_5_moe")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        return folder

    generate_with_config(tmp_path, capsys, config("qwen3_5_moe"), make, "MTP")
