"""DFlash drafters: mlx-vlm's marginals, DDTree's best-first tree, exact decoding.

The reference tests need mlx-vlm 0.7.10 (`make test-deps`); they skip without it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import run_steps
from support.drafters import (
    assert_same_arrays,
    generate_with_folder,
    greedy_equals_autoregressive,
    second_token_pvalue,
    second_turn,
)
from support.families import build

from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.dflash import best_first
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind, load_dflash

VOCAB, HIDDEN = 97, 64


def dflash_folder(
    out: Path, *, hidden=HIDDEN, layer_ids=(0, 1), block=6, mask=96, layers=2, seed=0
) -> Path:
    """A random DFlash drafter as z-lab's repositories hold one: ``config.json`` with
    ``dflash_config`` (``mask_token_id``, ``target_layer_ids``) and ``block_size``; tensors
    ``fc`` (``len(ids) * H -> H``), ``hidden_norm``, ``layers.{i}`` (Qwen3 attention with
    ``q_norm``/``k_norm``, a gated MLP), ``norm``; no embedding or head (the target's)."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim, inter = 4, 2, 16, 96

    def w(*shape, scale=0.15):
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    def norm(n):
        return mx.array(rng.normal(1, 0.3, n).astype(np.float32))

    tensors = {"fc.weight": w(hidden, len(layer_ids) * hidden), "hidden_norm.weight": norm(hidden)}
    tensors["norm.weight"] = norm(hidden)
    for i in range(layers):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": w(heads * dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * dim),
            p + "self_attn.q_norm.weight": norm(dim),
            p + "self_attn.k_norm.weight": norm(dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "block_size": block,
        "num_target_layers": 2,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(layer_ids)},
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3")


def reference(folder: Path, target):
    dflash = pytest.importorskip(
        "mlx_vlm.speculative.drafters.qwen3_dflash", reason="mlx-vlm 0.7.10 not installed"
    )
    config = json.loads((folder / "config.json").read_text())
    model = dflash.Model(dflash.ModelConfig.from_dict(config))
    weights = mx.load(str(folder / "model.safetensors"))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    return model, model.reset(target)


def fed(drafter, states, tokens):
    sequence = Sequence(1, mx.float32)
    sequence.parts.append(drafter.new_part())
    drafter.observe(sequence, dict(zip(drafter.taps, states, strict=True)), mx.arange(len(tokens)))
    sequence.commit(tokens)
    return sequence


def test_marginals_equal_mlx_vlms_over_two_rounds(tmp_path, qwen3):
    folder = dflash_folder(tmp_path / "d")
    ref, cache = reference(folder, qwen3)
    ours = load_dflash(folder, qwen3)
    rng = np.random.default_rng(1)

    def states(n):
        return [mx.array(rng.normal(0, 1, (n, HIDDEN)).astype(np.float32)) for _ in ours.taps]

    prompt, bonus, block = [int(t) for t in rng.integers(0, 90, 7)], 11, 6
    first = states(len(prompt))
    expected = ref(mx.array([[bonus] + [96] * (block - 1)]), mx.concatenate(first, -1)[None], cache)
    sequence = fed(ours, first, prompt)
    got = ours.logits(sequence, Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(bonus)))
    np.testing.assert_allclose(np.array(got), np.array(expected[0, 1:]), atol=1e-4)

    # a step verifies [bonus, d1..d4]; 2 drafts accepted: the context grows by 3 rows
    verify, accepted, next_token = states(block - 1), 2, 23
    ours.observe(sequence, dict(zip(ours.taps, verify, strict=True)), mx.arange(block - 1))
    path_tokens = mx.array([bonus, 40, 41, 42, 43])
    step = Reading(
        mx.zeros((HIDDEN,)), mx.array(next_token), mx.arange(5), path_tokens, mx.array(3)
    )
    got = ours.logits(sequence, step)
    rows = mx.concatenate(verify, -1)[None, : accepted + 1]
    expected = ref(mx.array([[next_token] + [96] * (block - 1)]), rows, cache)
    np.testing.assert_allclose(np.array(got), np.array(expected[0, 1:]), atol=1e-4)
    sequence.commit([bonus, 40, 41])
    again = ours.logits(sequence, Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(23)))
    np.testing.assert_allclose(np.array(again), np.array(got), atol=1e-5)


def test_best_first_tree_is_ddtrees(tmp_path):
    ddtree = pytest.importorskip("mlx_vlm.speculative.ddtree", reason="mlx-vlm not installed")
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(0, 2, (5, VOCAB)).astype(np.float32))
    for budget in (1, 4, 9, 16):
        nodes = ddtree.build_ddtree(logits[None], budget, slot_offset=0)
        want = {node.token_ids for node in nodes}
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        beams, token_logprobs = best_first(logprobs, mx.array(7), budget)
        got = {tuple(t for t in row[1:] if t >= 0) for row in beams.tolist()}
        assert got == want
        finite = np.isfinite(np.array(token_logprobs))
        assert (finite == (np.array(beams[:, 1:]) >= 0)).all()


def test_a_dflash_drafter_for_another_target_is_refused_in_one_line(tmp_path, qwen3):
    assert drafter_kind(dflash_folder(tmp_path / "ok")) == "dflash"
    assert create_drafter(tmp_path / "ok", qwen3).kind == "dflash"
    with pytest.raises(DrafterError, match=r"reads target layers \[0, 5\], but the target has 2"):
        load_dflash(dflash_folder(tmp_path / "deep", layer_ids=(0, 5)), qwen3)
    with pytest.raises(DrafterError, match="has hidden size 32, but the target's is 64"):
        load_dflash(dflash_folder(tmp_path / "narrow", hidden=32), qwen3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize(
    "shape", [BeamShape(1, 4), BeamShape(6, 5), BeamShape(8, 6, lookup=1)], ids=str
)
def test_greedy_with_dflash_equals_autoregressive(tmp_path, family, shape):
    target = build(family)
    assert greedy_equals_autoregressive(
        target, load_dflash(dflash_folder(tmp_path / "d"), target), shape
    )


def test_one_host_read_per_step_with_dflash(tmp_path, qwen3, monkeypatch):
    from redrafter_mlx.core.decode import speculative as tree_step

    drafter = load_dflash(dflash_folder(tmp_path / "d"), qwen3)
    reads = []
    real = tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    steps = list(itertools.islice(run_steps(qwen3, [5, 17, 33], drafter, BeamShape(6, 5)), 8))
    assert len(reads) == len(steps)
    assert all(step.tree_size <= 1 + 6 for step in steps[1:])  # the best-first tree's nodes


@pytest.mark.distribution
def test_sampling_with_dflash_keeps_the_targets_distribution(tmp_path, qwen3):
    drafter = load_dflash(dflash_folder(tmp_path / "d"), qwen3)
    assert second_token_pvalue(qwen3, drafter, VOCAB, temp=1.0) > 1e-3


def test_generate_with_a_dflash_folder_says_so(tmp_path, capsys):
    def make(vocab):
        folder = dflash_folder(tmp_path / "dflash", mask=vocab - 1)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        return folder

    generate_with_folder(tmp_path, capsys, make, [BeamShape(6, 4), BeamShape(4, 3)], "DFlash")


def test_marginals_equal_dflash_mlxs(tmp_path, qwen3):
    """dflash-mlx 0.1.8's drafter over the same prompt states (its cache-free call)."""
    model = pytest.importorskip("dflash_mlx.model", reason="dflash-mlx 0.1.8 not installed")
    from redrafter_mlx.core.decode.llm import embedding, head_linear

    folder = dflash_folder(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    ref = model.DFlashDraftModel(model.DFlashDraftModelArgs.from_dict(config))
    ref.load_weights(list(mx.load(str(folder / "model.safetensors")).items()))
    ours = load_dflash(folder, qwen3)
    rng = np.random.default_rng(4)
    prompt, bonus = [int(t) for t in rng.integers(0, 90, 9)], 31
    states = [mx.array(rng.normal(0, 1, (9, HIDDEN)).astype(np.float32)) for _ in ours.taps]
    block = mx.array([[bonus] + [96] * 5])
    hidden = ref(
        noise_embedding=embedding(qwen3)(block),
        target_hidden=mx.concatenate(states, -1)[None],
    )
    expected = head_linear(qwen3, hidden[0, 1:])
    sequence = fed(ours, states, prompt)
    got = ours.logits(sequence, Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(bonus)))
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4)


def test_beams_longer_than_the_block_are_refused_before_decoding(tmp_path, qwen3):
    from support import decoder_for, decoding_of

    drafter = load_dflash(dflash_folder(tmp_path / "d", block=6), qwen3)
    decoder = decoder_for(qwen3, drafter)
    decoder.check(decoding_of(drafter, BeamShape(4, 6)))
    with pytest.raises(ValueError, match="beam length 7 exceeds the DFlash drafter's block size 6"):
        decoder.check(decoding_of(drafter, BeamShape(4, 7)))


def test_a_reused_prefix_leaves_the_context_as_a_fresh_prompt_does(tmp_path, qwen3):
    """A second turn rewinds the drafter's context with the sequence and feeds the rest: the
    same context K/V as the whole conversation fed at once (to float error)."""
    drafter = load_dflash(dflash_folder(tmp_path / "d"), qwen3)
    turn, ours, theirs, again, once = second_turn(
        qwen3, drafter, BeamShape(6, 4), 4, lambda ids: [*ids[:-2], 7, 8, 9]
    )
    assert ours.length == theirs.length == len(turn)
    assert_same_arrays(ours, theirs)
    assert (again.pending, again.drafted.tolist()) == (once.pending, once.drafted.tolist())


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads 0: need an integer >= 1"),
        ({"head_dim": "16"}, "head_dim '16': need an integer >= 1"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of"),
        (
            {"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, -1]}},
            r"target_layer_ids \[0, -1\]: need a list of layer indices",
        ),
        ({"dflash_config": [1]}, r"dflash_config \[1\]: need a JSON object"),
    ],
)
def test_a_malformed_dflash_config_is_a_one_line_error(tmp_path, qwen3, edit, message):
    """Strings were coerced silently, heads the K/V heads do not divide failed at the first
    draft and a non-object ``dflash_config`` ended in an AttributeError."""
    folder = dflash_folder(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(DrafterError, match=f"config.json: not a DFlash config: {message}"):
        load_dflash(folder, qwen3)
