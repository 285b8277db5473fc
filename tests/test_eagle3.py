"""EAGLE-3 drafters: the same numbers as mlx-vlm's reference, loading checks, exact decoding.

The reference tests need mlx-vlm 0.7.10 (a test-only dependency: `make test-deps`); they skip
without it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import run_steps
from support.drafters import (
    assert_same_arrays,
    generate_with_folder,
    greedy_equals_autoregressive,
    second_token_pvalue,
    second_turn,
)
from support.families import build

from redrafter_mlx.core.decode.llm import embedding
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind, load_eagle3

VOCAB, DRAFT_VOCAB = 97, 40


def eagle3_folder(
    out: Path,
    *,
    target_hidden: int = 64,
    hidden: int = 64,
    layer_ids=(1, 2, 3),
    norm_before_residual: bool = True,
    seed: int = 0,
    vocab: int = VOCAB,
) -> Path:
    """A random EAGLE-3 drafter written as the speculators layout holds one on the Hub:
    ``config.json`` with ``transformer_layer_config``, tensors ``fc``, ``layers.0.*``
    (``hidden_norm``, a ``2 H``-wide attention), ``norm``, ``lm_head`` over the draft
    vocabulary, ``embed_tokens``, ``d2t`` (int64) and ``t2d`` (bool)."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim, inter = 4, 2, 16, 96

    def w(*shape, scale=0.15):
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    def norm(n):
        return mx.array(rng.normal(1, 0.3, n).astype(np.float32))

    kept = np.sort(rng.choice(vocab, DRAFT_VOCAB, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[kept] = True
    p = "layers.0."
    tensors = {
        "fc.weight": w(hidden, 3 * target_hidden),
        "embed_tokens.weight": w(vocab, hidden, scale=0.5),
        "norm.weight": norm(hidden),
        "lm_head.weight": w(DRAFT_VOCAB, hidden, scale=0.3),
        "d2t": mx.array((kept - np.arange(DRAFT_VOCAB)).astype(np.int64)),
        "t2d": mx.array(t2d),
        p + "hidden_norm.weight": norm(hidden),
        p + "input_layernorm.weight": norm(hidden),
        p + "post_attention_layernorm.weight": norm(hidden),
        p + "self_attn.q_proj.weight": w(heads * dim, 2 * hidden),
        p + "self_attn.k_proj.weight": w(kv_heads * dim, 2 * hidden),
        p + "self_attn.v_proj.weight": w(kv_heads * dim, 2 * hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * dim),
        p + "mlp.gate_proj.weight": w(inter, hidden),
        p + "mlp.up_proj.weight": w(inter, hidden),
        p + "mlp.down_proj.weight": w(hidden, inter),
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": target_hidden,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": dim,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab,
            "rope_theta": 10000.0,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors)
    (out / "config.json").write_text(json.dumps(config))
    return out


def reference(folder: Path, target_embed: nn.Module):
    """mlx-vlm's EAGLE-3 drafter loaded from ``folder`` and reset against a target stand-in
    (it takes the target's embedding where the shapes fit, as we do)."""
    eagle3 = pytest.importorskip(
        "mlx_vlm.speculative.drafters.eagle3", reason="mlx-vlm 0.7.10 not installed"
    )
    config = json.loads((folder / "config.json").read_text())
    model = eagle3.Model(eagle3.ModelConfig.from_dict(config))
    weights = mx.load(str(folder / "model.safetensors"))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    model.reset(SimpleNamespace(embed_tokens=target_embed))
    return model


def converted(folder: Path, out: Path, target_embed: nn.Module) -> Path:
    """The folder mlx-vlm writes for ``folder``: its sanitized parameters (``t2d`` dropped,
    ``d2t`` int32) and the same config."""
    model = reference(folder, target_embed)
    out.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("embed")}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text((folder / "config.json").read_text())
    return out


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3")


def prompt_state(drafter, target_hidden, tokens, pending):
    """A sequence holding ``tokens`` whose drafter part observed ``target_hidden``."""
    sequence = Sequence(1, mx.float32)
    sequence.parts.append(drafter.new_part())
    taps = {layer: target_hidden[i] for i, layer in enumerate(drafter.taps)}
    drafter.observe(sequence, taps, mx.arange(len(tokens)))
    sequence.commit(tokens)
    return sequence, Reading.after_prompt(mx.zeros((64,)), mx.array(pending))


@pytest.mark.parametrize(
    "layout,target_hidden,norm_before_residual",
    [("hub", 64, True), ("hub", 48, False), ("converted", 64, False)],
)
def test_logits_and_proposals_equal_mlx_vlms(
    tmp_path, qwen3, layout, target_hidden, norm_before_residual
):
    folder = eagle3_folder(
        tmp_path / "hub", target_hidden=target_hidden, norm_before_residual=norm_before_residual
    )
    embed = nn.Embedding(VOCAB, 64)
    embed.weight = embedding(qwen3).weight
    ref = reference(folder, embed)
    if layout == "converted":
        folder = converted(folder, tmp_path / "converted", embed)
    target = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=embed, layers=[None] * 4),
        args=SimpleNamespace(hidden_size=target_hidden, vocab_size=VOCAB),
    )
    ours = load_eagle3(folder, target)
    rng = np.random.default_rng(1)
    n, length = 7, 5
    tokens = [int(t) for t in rng.integers(0, VOCAB, n)]
    bonus = int(rng.integers(0, VOCAB))
    target_hidden_states = [
        mx.array(rng.normal(0, 1, (n, target_hidden)).astype(np.float32)) for _ in range(3)
    ]

    # per-position logits over the prompt: entry t pairs hidden t with token t + 1
    fused = mx.concatenate(target_hidden_states, axis=-1)[None]
    shifted = mx.array(tokens[1:] + [bonus])[None]
    ref.reset(SimpleNamespace(embed_tokens=embed))
    expected = ref._logits(ref._forward_tokens(shifted, fused, mx.int32))[0]
    module = ours.module
    hidden = module.fuse([h for h in target_hidden_states])[None]
    empty = [(mx.zeros((1, 2, 0, 16)),) * 2]
    causal = mx.arange(n)[None] <= mx.arange(n)[:, None]
    got = module.logits(module.run(shifted, hidden, 1, empty, causal)[0])[0]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4)

    # proposals after the prompt: greedy chain == our best beam at width 1
    ref.reset(SimpleNamespace(embed_tokens=embed))
    ref.prefill_from_target_hidden(mx.array(tokens)[None], fused, bonus, None, greedy=True)
    chain = ref.draft_block(bonus, None, None, length, None, greedy=True)
    sequence, reading = prompt_state(ours, target_hidden_states, tokens, bonus)
    beams, logprobs, syncs = ours.draft(sequence, reading, width=1, length=length)
    assert beams[0].tolist() == [bonus] + chain[0].tolist()
    assert syncs == 0

    # a verify step: the root and 2 of 4 drafts accepted, then the target's next token
    verify_hidden = [
        mx.array(rng.normal(0, 1, (length, target_hidden)).astype(np.float32)) for _ in range(3)
    ]
    drafts = chain[0].tolist()
    accepted, next_token = 2, int(rng.integers(0, VOCAB))
    fused_verify = mx.concatenate(verify_hidden, axis=-1)[None]
    ref.accept_verified_tokens(
        fused_verify, chain, accepted, drafts[:accepted] + [next_token], None, greedy=True
    )
    chain2 = ref.draft_block(next_token, None, None, length, None, greedy=True)
    taps = {layer: verify_hidden[i] for i, layer in enumerate(ours.taps)}
    ours.observe(sequence, taps, mx.arange(length))
    step = Reading(
        mx.zeros((64,)),
        mx.array(next_token),
        mx.arange(length),
        mx.array([bonus] + drafts),
        mx.array(accepted + 1),
    )
    beams, _, _ = ours.draft(sequence, step, width=1, length=length)
    assert beams[0].tolist() == [next_token] + chain2[0].tolist()
    sequence.commit([bonus] + drafts[:accepted])
    assert ours.part(sequence).entries == sequence.offset - 1


def test_wider_beams_are_distinct_and_scored_best_first(tmp_path, qwen3):
    ours = load_eagle3(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), qwen3)
    rng = np.random.default_rng(2)
    states = [mx.array(rng.normal(0, 1, (6, 64)).astype(np.float32)) for _ in range(3)]
    sequence, reading = prompt_state(ours, states, [3, 4, 5, 6, 7, 8], 9)
    beams, logprobs, _ = ours.draft(sequence, reading, width=4, length=4)
    assert beams.shape == (4, 4) and logprobs.shape == (4, 3)
    assert (np.array(beams[:, 0]) == 9).all()
    assert len({tuple(row) for row in beams.tolist()}) == 4
    scores = np.array(logprobs.sum(axis=1))
    assert (np.diff(scores) <= 1e-6).all() and np.isfinite(scores).all()


def test_a_drafter_for_another_target_is_refused_in_one_line(tmp_path, qwen3):
    folder = eagle3_folder(tmp_path / "wide", target_hidden=48, layer_ids=(1, 2, 2))
    assert drafter_kind(folder) == "eagle3"
    with pytest.raises(DrafterError, match="reads hidden size 48, but the target's is 64"):
        load_eagle3(folder, qwen3)
    with pytest.raises(DrafterError, match="EAGLE-3 drafter reads hidden size 48"):
        create_drafter(folder, qwen3)  # the factory hands the folder to EAGLE-3's loader
    deep = eagle3_folder(tmp_path / "deep", layer_ids=(2, 5, 9))
    with pytest.raises(DrafterError, match=r"reads target layers \[1, 4, 8\], but the target"):
        load_eagle3(deep, qwen3)


SHAPES = [BeamShape(1, 4), BeamShape(3, 4), BeamShape(4, 5, search_width=8)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_with_eagle3_equals_autoregressive(tmp_path, family, shape):
    target = build(family)
    drafter = load_eagle3(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), target)
    assert greedy_equals_autoregressive(target, drafter, shape)


@pytest.mark.distribution
def test_sampling_with_eagle3_keeps_the_targets_distribution(tmp_path, qwen3):
    """The drafter's proposals are not the target's; the second emitted token must still
    follow the target's marginal (a chi-square test over 300 answers)."""
    drafter = load_eagle3(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), qwen3)
    assert second_token_pvalue(qwen3, drafter, VOCAB, temp=1.0) > 1e-3


def test_one_host_read_per_step_with_eagle3(tmp_path, qwen3, monkeypatch):
    from redrafter_mlx.core.decode import speculative as tree_step

    drafter = load_eagle3(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), qwen3)
    reads = []
    real = tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    steps = list(itertools.islice(run_steps(qwen3, [5, 17, 33], drafter, BeamShape(3, 4)), 8))
    assert len(reads) == len(steps)  # the prefill's read, then one per step


def test_a_reused_prefix_leaves_the_drafter_as_a_fresh_prompt_does(tmp_path, qwen3):
    """A second turn reuses the first's K/V: the drafter's part is rewound and caught up to
    what feeding the whole conversation at once gives it (tree- and chain-computed target
    states agree to float error)."""
    drafter = load_eagle3(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), qwen3)
    # the next prompt shares all but the last 2 ids
    turn, ours, theirs, again, once = second_turn(
        qwen3, drafter, BeamShape(3, 4), 4, lambda ids: [*ids[:-2], 7, 8, 9]
    )
    assert (
        (ours.length, ours.entries) == (theirs.length, theirs.entries) == (len(turn), len(turn) - 1)
    )
    assert_same_arrays(ours, theirs)
    assert again.pending == once.pending


def test_generate_with_an_eagle3_folder_says_so_and_equals_autoregressive(tmp_path, capsys):
    def make(vocab):
        return eagle3_folder(tmp_path / "eagle3", layer_ids=(1, 2, 2), vocab=vocab)

    generate_with_folder(tmp_path, capsys, make, [BeamShape(3, 4), BeamShape(2, 3)], "EAGLE-3")


def test_sglang_midlayer_names_load_to_the_same_drafter(tmp_path, qwen3):
    """SGLang and the original EAGLE-3 name the decoder layer ``midlayer``."""
    folder = eagle3_folder(tmp_path / "speculators", layer_ids=(1, 2, 2))
    sglang = tmp_path / "sglang"
    sglang.mkdir()
    weights = mx.load(str(folder / "model.safetensors"))
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
    mx.save_safetensors(str(sglang / "model.safetensors"), renamed)
    (sglang / "config.json").write_text((folder / "config.json").read_text())
    a, b = load_eagle3(folder, qwen3), load_eagle3(sglang, qwen3)
    for (name, x), (_, y) in zip(
        tree_flatten(a.module.parameters()), tree_flatten(b.module.parameters()), strict=True
    ):
        assert mx.array_equal(x, y), name


@pytest.mark.filterwarnings("ignore:MLX was imported before")  # tests import MLX first
def test_the_python_api_loads_an_eagle3_folder(tmp_path):
    from support import shared_data
    from support.families import model_folder

    from redrafter_mlx import generate, load

    model = model_folder("qwen3", tmp_path / "qwen3", shared_data("vicuna-7b-v1.3-tokenizer"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    drafter = eagle3_folder(tmp_path / "eagle3", layer_ids=(1, 2, 2), vocab=vocab)
    target, tokenizer = load(str(model), drafter=str(drafter))
    assert target.runtime.drafter.kind == "eagle3"
    plain, _ = load(str(model), drafter="none")
    prompt = "Hi there"
    assert generate(target, tokenizer, prompt, max_tokens=12) == generate(
        plain, tokenizer, prompt, max_tokens=12
    )


def edit_config(folder: Path, edit) -> Path:
    """``folder`` with ``edit(config, its transformer_layer_config)`` applied to its config.json."""
    config = json.loads((folder / "config.json").read_text())
    edit(config, config["transformer_layer_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c, t: t.update(num_attention_heads=0), "num_attention_heads 0: need an integer"),
        (lambda c, t: t.update(hidden_size="64"), "hidden_size '64': need an integer >= 1"),
        (lambda c, t: t.update(intermediate_size=True), "intermediate_size True: need an integer"),
        (lambda c, t: t.update(num_key_value_heads=3), "4 is not a multiple of num_key_value_"),
        (lambda c, t: c.update(norm_before_fc="false"), "norm_before_fc 'false': need true or"),
        (lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[1, "2", 2]), "layer indices"),
        (lambda c, t: t.update(rope_parameters=[1]), r"rope_parameters \[1\]: need a JSON object"),
    ],
)
def test_a_malformed_eagle3_config_is_a_one_line_error(tmp_path, qwen3, edit, message):
    """Zero heads ended in ZeroDivisionError; a string or a JSON true was coerced silently
    (``"false"`` read as true); heads the K/V heads do not divide failed at the first draft."""
    folder = edit_config(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), edit)
    with pytest.raises(DrafterError, match=f"config.json: not an EAGLE-3 config: .*{message}"):
        load_eagle3(folder, qwen3)


def with_tensors(folder: Path, change) -> Path:
    """``folder`` with its weights replaced by ``change(weights)``."""
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), change(weights))
    return folder


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda w: {k: v for k, v in w.items() if k != "fc.weight"}, "missing fc.weight"),
        (lambda w: w | {"layers.0.mlp.up_proj.weight": mx.zeros((50, 64))},
         r"layers.0.mlp.up_proj.weight has shape \(50, 64\), the config needs \(96, 64\)"),
    ],
)  # fmt: skip
def test_eagle3_weights_that_do_not_fit_its_config_are_named(tmp_path, qwen3, change, message):
    """A misshapen tensor loaded silently and failed at the first draft."""
    folder = with_tensors(eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2)), change)
    with pytest.raises(DrafterError, match=f"EAGLE-3 weights: {message}"):
        load_eagle3(folder, qwen3)


def test_tensors_the_config_has_no_place_for_are_left_out(tmp_path, qwen3):
    """A stray tensor beside the config's (``lm_head.0.linear.weight`` where ``lm_head`` is
    one layer) ended in MLX's ``KeyError: 0``; the drafter is the one without it."""
    folder = eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2))
    plain = load_eagle3(folder, qwen3)
    with_tensors(folder, lambda w: w | {"lm_head.0.linear.weight": mx.zeros((4, 4))})
    stray = load_eagle3(folder, qwen3)
    ours, theirs = (tree_flatten(d.module.parameters()) for d in (plain, stray))
    for (name, x), (_, y) in zip(ours, theirs, strict=True):
        assert mx.array_equal(x, y), name


def test_generate_with_an_eagle3_folder_of_other_weights_says_so_in_one_line(tmp_path, capsys):
    from support import shared_data
    from support.families import model_folder

    from redrafter_mlx.cli import main
    from redrafter_mlx.core.drafters.redrafter import random_drafter, save_drafter

    model = model_folder("qwen3", tmp_path / "qwen3", shared_data("vicuna-7b-v1.3-tokenizer"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    folder = eagle3_folder(tmp_path / "eagle3", layer_ids=(1, 2, 2), vocab=vocab)
    save_drafter(random_drafter(64, vocab), tmp_path / "redrafter")
    other = mx.load(str(tmp_path / "redrafter" / "model.safetensors"))
    with_tensors(folder, lambda w: other)  # a ReDrafter drafter's weights: KeyError: 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(["generate", "--model", str(model), "--drafter", str(folder), "--prompt", "Hi"])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: {folder}: EAGLE-3 weights: missing d2t, fc.weight, ")
    assert line.endswith(" more (not this config's drafter?)")


def test_a_drafter_type_that_is_no_string_is_left_to_redrafters_loader(tmp_path):
    """``"model_type": ["eagle3"]`` ended in ``TypeError: unhashable type: 'list'``."""
    folder = eagle3_folder(tmp_path / "d", layer_ids=(1, 2, 2))
    config = json.loads((folder / "config.json").read_text())
    config.pop("speculators_model_type")
    (folder / "config.json").write_text(json.dumps({**config, "model_type": ["eagle3"]}))
    assert drafter_kind(folder) == "redrafter"
