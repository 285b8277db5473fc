"""DSpark drafters: mlx-vlm's logits and proposals, the best-first tree under the Markov chain,
exact decoding alone and batched, and the folders of every type not loaded here refused.

The reference tests need mlx-vlm 0.7.10 (`make test-deps`); they skip without it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import decoder_for, decoding_of, run_steps
from support.batching import alone, batched
from support.decoding import take
from support.drafters import generate_with_folder, second_token_pvalue
from support.families import build
from test_dflash import HIDDEN, VOCAB, dflash_folder

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.dflash import best_tree
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io import drafter_types
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind, load_dspark

MASK, RANK = 96, 8
PLANS = pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])


def dspark_folder(out: Path, *, proposals=5, anchored=True, confidence=False, **dflash) -> Path:
    """A random DSpark drafter as mlx-vlm reads one: DFlash's tensors (tests/test_dflash.py)
    plus ``markov_head.markov_w1`` (V, r) and ``markov_w2`` (V, r) (and a confidence head's
    ``proj`` when asked); ``dflash_config`` with ``projector_type: dspark``, the checkpoint's
    ``block_size`` counting the proposals (gamma)."""
    folder = dflash_folder(out, mask=MASK, **dflash)
    rng = np.random.default_rng(7)
    tensors = dict(mx.load(str(folder / "model.safetensors")))
    tensors["markov_head.markov_w1.weight"] = mx.array(rng.normal(0, 1, (VOCAB, RANK)), mx.float32)
    tensors["markov_head.markov_w2.weight"] = mx.array(rng.normal(0, 1, (VOCAB, RANK)), mx.float32)
    if confidence:
        tensors["confidence_head.proj.weight"] = mx.zeros((1, HIDDEN + RANK))
        tensors["confidence_head.proj.bias"] = mx.zeros((1,))
    config = json.loads((folder / "config.json").read_text())
    del config["block_size"]
    config["architectures"] = ["DSparkDraftModel"]
    config["dflash_config"] |= {
        "projector_type": "dspark",
        "block_size": proposals,
        "markov_rank": RANK,
        "sample_from_anchor": anchored,
        "enable_confidence_head": confidence,
    }
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3")


def reference(folder: Path, target):
    """mlx-vlm's DSpark model on ``folder``'s weights, bound to ``target`` (its DFlash bind:
    DSpark's adds a check of mlx-vlm's own target classes) and a fresh context cache."""
    dspark = pytest.importorskip(
        "mlx_vlm.speculative.drafters.dspark", reason="mlx-vlm 0.7.10 not installed"
    )
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

    model = dspark.Model(
        dspark.ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    )
    weights = mx.load(str(folder / "model.safetensors"))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    DFlashDraftModel.bind(model, target)
    return model


def fed(drafter, states, tokens):
    sequence = Sequence(1, mx.float32)
    sequence.parts.append(drafter.new_part())
    drafter.observe(sequence, dict(zip(drafter.taps, states, strict=True)), mx.arange(len(tokens)))
    sequence.commit(tokens)
    return sequence


def greedy_chain(ref, bonus, context, proposals):
    """mlx-vlm's proposals after ``bonus`` over ``context (1, S, 2H)`` (its argmax chain)."""
    block = ref.draft_block(bonus, context, ref.make_cache(), proposals + 1, lambda x: x.argmax(-1))
    return block[0].tolist()


def our_chain(drafter, sequence, reading, proposals):
    """Our tree searched one path deep (``keep=1``): the nodes are the greedy chain's."""
    base = drafter.logits(sequence, reading).astype(mx.float32)
    step = drafter.after(base)
    beams, _ = best_tree(step, base.shape[0], reading.pending, proposals, keep=1)
    return max(beams.tolist(), key=lambda b: sum(t >= 0 for t in b))[1:]


@pytest.mark.parametrize("anchored", [True, False], ids=["anchored", "masked-first"])
def test_logits_and_proposals_equal_mlx_vlms_over_two_rounds(tmp_path, qwen3, anchored):
    folder = dspark_folder(tmp_path / "d", anchored=anchored, confidence=anchored)
    ref = reference(folder, qwen3)
    ours = load_dspark(folder, qwen3)
    assert ours.kind == "dspark" and ours.module.block_length == 5 + (not anchored)
    rng = np.random.default_rng(1)

    def states(n):
        return [mx.array(rng.normal(0, 1, (n, HIDDEN)).astype(np.float32)) for _ in ours.taps]

    prompt, bonus, proposals = [int(t) for t in rng.integers(0, 90, 7)], 11, 5
    first = states(len(prompt))
    context = mx.concatenate(first, -1)[None]
    block = [bonus] + [MASK] * (proposals - anchored)
    expected = ref(mx.array([block]), context, ref.make_cache())[0, 1 - anchored :]
    sequence = fed(ours, first, prompt)
    reading = Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(bonus))
    np.testing.assert_allclose(
        np.array(ours.logits(sequence, reading)), np.array(expected), atol=1e-4
    )
    assert our_chain(ours, sequence, reading, proposals) == greedy_chain(
        ref, bonus, context, proposals
    )

    # a step verifies [bonus, d1..d4]; 2 drafts accepted: the context grows by 3 rows
    verify, next_token = states(5), 23
    ours.observe(sequence, dict(zip(ours.taps, verify, strict=True)), mx.arange(5))
    step = Reading(
        mx.zeros((HIDDEN,)), mx.array(next_token), mx.arange(5), mx.array([bonus, 40, 41, 42, 43]),
        mx.array(3),
    )  # fmt: skip
    whole = mx.concatenate([context, mx.concatenate(verify, -1)[None, :3]], axis=1)
    block = [next_token] + [MASK] * (proposals - anchored)
    expected = ref(mx.array([block]), whole, ref.make_cache())[0, 1 - anchored :]
    np.testing.assert_allclose(np.array(ours.logits(sequence, step)), np.array(expected), atol=1e-4)
    assert our_chain(ours, sequence, step, proposals) == greedy_chain(
        ref, next_token, whole, proposals
    )


def speculators_dspark(folder: Path, layout: str, target) -> Path:
    """``folder``'s DSpark (mlx-vlm's layout) rewritten as speculators 0.9.0 saves one:
    ``speculators_model_type: dspark`` with the layer sizes under ``transformer_layer_config``
    (``"speculators"``), or its Open Spec Config (``"open-spec"``: the sizes at the top level,
    the rest under ``speculative_config``); ``block_size`` the block's rows (anchor and
    masks), the target layers as HF hidden-state indices; the frozen ``embed_tokens`` and
    ``lm_head`` copies of the target's saved with the weights."""
    from redrafter_mlx.core.decode.llm import embedding

    config = json.loads((folder / "config.json").read_text())
    dflash = config.pop("dflash_config")
    anchored, proposals = dflash["sample_from_anchor"], dflash["block_size"]
    del config["architectures"], dflash["projector_type"], dflash["block_size"]
    ids = [i + 1 for i in dflash.pop("target_layer_ids")]
    own = {**dflash, "markov_head_type": "vanilla", "confidence_head_with_markov": True}
    if layout == "speculators":
        config = {
            "speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": config, "draft_vocab_size": config["vocab_size"],
            "block_size": proposals + (not anchored), "aux_hidden_state_layer_ids": ids, **own,
        }  # fmt: skip
    else:
        spec = {"method": "dspark", "speculative_tokens": proposals, "target_layer_ids": ids,
                "target_layer_start_idx": 1, **own}  # fmt: skip
        config |= {"architectures": ["DSparkDraftModel"], "speculative_config": spec}
    tensors = dict(mx.load(str(folder / "model.safetensors")))
    tensors["embed_tokens.weight"] = tensors["lm_head.weight"] = embedding(target).weight
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layout", ["speculators", "open-spec"])
@pytest.mark.parametrize("anchored", [True, False], ids=["anchored", "masked-first"])
def test_speculators_dspark_drafts_as_mlx_vlms_layout_of_the_same_weights(
    tmp_path, qwen3, layout, anchored
):
    """It was refused (``DSpark (speculators) drafter: not supported yet``): its block counts
    rows, not proposals, and its anchor's row proposes by default."""
    zlab = load_dspark(dspark_folder(tmp_path / "z", anchored=anchored, confidence=True), qwen3)
    folder = dspark_folder(tmp_path / "s", anchored=anchored, confidence=True)
    folder = speculators_dspark(folder, layout, qwen3)
    assert drafter_kind(folder) == "dspark"
    theirs = create_drafter(folder, qwen3)
    assert theirs.kind == "dspark" and theirs.taps == zlab.taps == (0, 1)
    assert theirs.module.args.proposals == zlab.module.args.proposals == 5
    assert theirs.module.block_length == zlab.module.block_length == 5 + (not anchored)
    rng = np.random.default_rng(5)
    context = [mx.array(rng.normal(0, 1, (6, HIDDEN)).astype(np.float32)) for _ in zlab.taps]
    prompt, reading = [4, 8, 15, 16, 23, 42], Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(9))
    ours, want = fed(theirs, context, prompt), fed(zlab, context, prompt)
    np.testing.assert_allclose(
        np.array(theirs.logits(ours, reading)), np.array(zlab.logits(want, reading)), atol=1e-5
    )
    got = theirs.draft(ours, reading, width=6, length=5)
    expected = zlab.draft(want, reading, width=6, length=5)
    assert got[0].tolist() == expected[0].tolist()
    np.testing.assert_allclose(np.array(got[1]), np.array(expected[1]), atol=1e-5)


@PLANS
@pytest.mark.parametrize("anchored", [True, False], ids=["anchored", "masked-first"])
def test_greedy_with_a_speculators_dspark_equals_autoregressive(tmp_path, qwen3, plan, anchored):
    folder = dspark_folder(tmp_path / "d", anchored=anchored)
    drafter = create_drafter(speculators_dspark(folder, "speculators", qwen3), qwen3)
    prompt = [5, 17, 33, 2, 41, 8]
    expected = take(run_steps(qwen3, prompt, plan=plan), 40)[0]
    assert take(run_steps(qwen3, prompt, drafter, BeamShape(6, 5), plan=plan), 40)[0] == expected


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"markov_head_type": "rnn"}, "DSpark drafters with markov_head_type are not supported"),
        ({"markov_rank": 0}, "markov_rank 0"),
        ({"draft_vocab_size": 64}, r"a draft vocabulary of 64 \(not the target's 97\)"),
    ],
)
def test_a_speculators_dspark_this_runtime_cannot_run_is_a_one_line_error(
    tmp_path, qwen3, edit, message
):
    """speculators' gated / rnn Markov heads and a head disabled (rank 0), as mlx-vlm's."""
    folder = speculators_dspark(dspark_folder(tmp_path / "d"), "speculators", qwen3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | edit))
    with pytest.raises(DrafterError, match=f"config.json: not a DSpark config: .*{message}"):
        create_drafter(folder, qwen3)


def test_the_tree_is_the_most_probable_prefixes_under_the_markov_chain():
    """Brute force over every prefix of 3 tokens: a top-N node's parent is in its depth's top
    N, so the width-N search finds them, though a depth's marginals depend on the path."""
    rng = np.random.default_rng(3)
    vocab, depth = 23, 3
    base = rng.normal(0, 2, (depth, vocab))
    markov = rng.normal(0, 2, (vocab, vocab))

    def logprobs(d, last):
        logits = base[d] + markov[last]
        return logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    tokens = mx.arange(vocab, dtype=mx.int32)[None]

    def after(d, last):
        return tokens, mx.array(logprobs(d, np.array(last)).astype(np.float32))

    scores = {}
    for n in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=n):
            last = [7, *path]
            scores[path] = sum(logprobs(d, last[d])[path[d]] for d in range(n))
    ranked = sorted(scores, key=scores.get, reverse=True)
    for budget in (1, 4, 9, 16, 30):
        beams, token_logprobs = best_tree(after, depth, mx.array(7), budget)
        got = {tuple(t for t in row[1:] if t >= 0) for row in beams.tolist()}
        assert got == set(ranked[:budget])
        for row, lps in zip(beams.tolist(), np.array(token_logprobs), strict=True):
            path = tuple(t for t in row[1:] if t >= 0)
            np.testing.assert_allclose(lps[: len(path)].sum(), scores[path], rtol=1e-4)


@PLANS
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize(
    "shape", [BeamShape(1, 4), BeamShape(6, 5), BeamShape(8, 6, lookup=1)], ids=str
)
def test_greedy_with_dspark_equals_autoregressive(tmp_path, family, shape, plan):
    target = build(family)
    drafter = load_dspark(dspark_folder(tmp_path / "d"), target)
    prompt = [5, 17, 33, 2, 41, 8]
    expected = take(run_steps(target, prompt, plan=plan), 40)[0]
    assert take(run_steps(target, prompt, drafter, shape, plan=plan), 40)[0] == expected


@pytest.mark.parametrize("anchored", [True, False], ids=["anchored", "masked-first"])
@pytest.mark.parametrize("window", [3, 64])
def test_greedy_with_sliding_dspark_layers_equals_autoregressive(tmp_path, qwen3, anchored, window):
    """DSpark's config parses as DFlash's (core/drafters/dflash.py: parsed), so its layers may
    slide; the sliding masks cover its block (``P`` rows when anchored), not DFlash's ``P + 1``."""
    folder = dspark_folder(tmp_path / "d", anchored=anchored)
    config = json.loads((folder / "config.json").read_text())
    config |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window}
    (folder / "config.json").write_text(json.dumps(config))
    drafter = create_drafter(folder, qwen3)
    assert drafter.kind == "dspark" and drafter.module.args.sliding(0)
    prompt = [5, 17, 33, 2, 41, 8]
    expected = take(run_steps(qwen3, prompt), 40)[0]
    assert take(run_steps(qwen3, prompt, drafter, BeamShape(6, 5)), 40)[0] == expected


@pytest.mark.parametrize(
    "key,kind",
    [
        ("dflash2", "dflash2"),
        ("speculators:dflash", "dflash"),
        ("speculators:dflash2", "dflash2"),
        ("speculators:dspark", "dspark"),
    ],
)
def test_types_that_now_load_are_routed_to_their_loader(tmp_path, key, kind):
    """DFlash2 and speculators' DFlash / DSpark layouts load (core/drafters/dflash2.py,
    core/drafters/dflash.py: flattened): their rows name their loader, so a folder declaring them
    is not refused."""
    assert drafter_types.TYPES[key].kind == kind
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(declaring(key)))
    assert drafter_kind(folder) == kind


def test_a_dflash_config_with_dflash2s_own_sizes_is_dflash2():
    config = {"model_type": "qwen3", "dflash_config": {"mask_token_id": 1, "selector_top_k": 4}}
    assert drafter_types.declared(config) == ("dflash2", drafter_types.TYPES["dflash2"])


def test_each_step_verifies_a_drafted_tree_and_reads_the_host_once(tmp_path, qwen3, monkeypatch):
    """Every step after the prompt verifies a tree of drafted nodes (at most the width's),
    with one host read, as DFlash's."""
    from redrafter_mlx.core.decode import speculative as tree_step

    drafter = load_dspark(dspark_folder(tmp_path / "d"), qwen3)
    reads = []
    real = tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    steps = list(itertools.islice(run_steps(qwen3, [5, 17, 33], drafter, BeamShape(6, 5)), 8))
    assert len(reads) == len(steps)
    assert all(1 < step.tree_size <= 1 + 6 for step in steps[1:])


@pytest.mark.distribution
def test_sampling_with_dspark_keeps_the_targets_distribution(tmp_path, qwen3):
    drafter = load_dspark(dspark_folder(tmp_path / "d"), qwen3)
    assert second_token_pvalue(qwen3, drafter, VOCAB, temp=1.0) > 1e-3


@PLANS
def test_a_batch_with_dspark_answers_each_sequence_as_alone(tmp_path, qwen3, plan):
    drafter = load_dspark(dspark_folder(tmp_path / "d"), qwen3)
    decoder = decoder_for(qwen3, drafter, plan)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    decodings = [
        decoding_of(drafter, BeamShape(6, 5)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
        decoding_of(drafter, BeamShape(4, 4, lookup=1)),
    ]
    expected = [alone(decoder, d, p, 20) for d, p in zip(decodings, prompts, strict=True)]
    assert batched(decoder, decodings, prompts, 20)[0] == expected


def test_generate_with_a_dspark_folder_says_so(tmp_path, capsys):
    def make(vocab):
        folder = dspark_folder(tmp_path / "dspark")
        config = json.loads((folder / "config.json").read_text())
        config["dflash_config"]["mask_token_id"] = vocab - 1
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        tensors = dict(mx.load(str(folder / "model.safetensors")))
        for name in ("markov_w1", "markov_w2"):
            tensors[f"markov_head.{name}.weight"] = mx.zeros((vocab, RANK))
        mx.save_safetensors(str(folder / "model.safetensors"), tensors)
        return folder

    generate_with_folder(tmp_path, capsys, make, [BeamShape(6, 4), BeamShape(4, 3)], "DSpark")


def test_dspark_folders_are_told_from_dflash_and_refused_when_they_do_not_fit(tmp_path, qwen3):
    """A DSpark folder has a ``dflash_config`` too: it was read as DFlash (and refused for its
    Markov tensors)."""
    folder = dspark_folder(tmp_path / "d")
    assert drafter_kind(folder) == "dspark"
    assert drafter_kind(dflash_folder(tmp_path / "plain")) == "dflash"
    for config in ({"model_type": "qwen3_dspark"}, {"architectures": ["Qwen3DSparkModel"]}):
        assert drafter_types.declared(config)[1].kind == "dspark"
    assert create_drafter(folder, qwen3).kind == "dspark"
    with pytest.raises(DrafterError, match="DSpark drafter has hidden size 32, but the target's"):
        load_dspark(dspark_folder(tmp_path / "narrow", hidden=32), qwen3)
    with pytest.raises(ValueError, match="beam length 7 exceeds the DSpark drafter's block size 6"):
        load_dspark(folder, qwen3).check_shape(BeamShape(4, 7))


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"markov_head_type": "gated"}, "DSpark drafters with markov_head_type are not supported"),
        ({"attention_sink_bias": True}, "with attention sinks are not supported yet"),
        ({"block_size": None}, r"KeyError\('block_size'\) missing or malformed"),
        ({"markov_rank": "8"}, "markov_rank '8': need an integer"),
    ],
)
def test_a_dspark_config_this_runtime_cannot_run_is_a_one_line_error(
    tmp_path, qwen3, edit, message
):
    folder = dspark_folder(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"] = {
        k: v for k, v in {**config["dflash_config"], **edit}.items() if v is not None
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=f"config.json: not a DSpark config: .*{message}"):
        create_drafter(folder, qwen3)


# every type mlx-vlm 0.7.10 lists and speculators ships that no loader here takes
UNLOADED = [key for key, kind in drafter_types.TYPES.items() if kind.kind is None]


def declaring(key: str) -> dict:
    """A config that declares type ``key`` as its publishers write it."""
    if key.startswith("speculators:"):
        kind = key.split(":")[1]
        layer = {"model_type": "qwen3", "vocab_size": VOCAB}
        return {"speculators_model_type": kind, "transformer_layer_config": layer}
    by_architecture = {v: k for k, v in drafter_types.ARCHITECTURES.items()}
    if key in by_architecture:
        return {"architectures": [by_architecture[key]], "model_type": "qwen3",
                "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0]}}  # fmt: skip
    if key.endswith("_dflash"):
        return {"model_type": key.removesuffix("_dflash"), "dflash_config": {"mask_token_id": 1}}
    return {"model_type": key, "hidden_size": HIDDEN, "num_hidden_layers": 1}


def test_every_drafter_type_mlx_vlm_lists_has_a_row():
    kinds = pytest.importorskip("mlx_vlm.speculative.drafters", reason="mlx-vlm not installed")
    assert set(kinds.DRAFTER_KIND_BY_MODEL_TYPE) <= set(drafter_types.TYPES)


@pytest.mark.parametrize("key", UNLOADED)
def test_a_folder_of_a_type_not_loaded_is_refused_naming_its_type(tmp_path, qwen3, key):
    """Before: a ``gemma4_assistant`` folder was read as ReDrafter's, a DFlash2 one as
    DFlash's (a missing-parameter message), speculators' as ReDrafter's (KeyError)."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(declaring(key)))
    mx.save_safetensors(str(folder / "model.safetensors"), {"fc.weight": mx.zeros((2, 2))})
    name = drafter_types.TYPES[key].name
    with pytest.raises(DrafterError) as refused:
        create_drafter(folder, qwen3)
    line = str(refused.value)
    assert "\n" not in line
    source = "speculators_model_type" if key.startswith("speculators:") else "type"
    said = f"{folder}: {name} drafter: not supported yet ({source} {key.split(':')[-1]!r})"
    why = drafter_types.TYPES[key].why
    assert line == (f"{said}: {why}" if why else said)
    assert drafter_kind(folder) == key


@pytest.mark.parametrize(
    "config,why",
    [
        ({"model_type": "glm4_moe_lite_mtp"}, "mlx-vlm 0.7.10 has only a splitter for GLM-4"),
        ({"model_type": "glm4_moe", "num_nextn_predict_layers": 1}, "glm4_moe / glm4_moe_lite"),
        ({"model_type": "glm4_moe_lite", "num_nextn_predict_layers": 1}, "drop the head's"),
        ({"model_type": "glm_moe_dsa", "num_nextn_predict_layers": 1}, "MLA attention with a"),
        ({"model_type": "glm_moe_dsa_mtp"}, "sparse indexer, each with its own cache"),
        ({"model_type": "glm5_next_mtp"}, "mlx-lm 0.32 has no glm5_next target"),
    ],
)
def test_a_glm_mtp_head_is_refused_in_one_line_saying_why(tmp_path, qwen3, config, why):
    """They were refused as not supported, with no reason (docs/drafters.md, Limits)."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config | {"hidden_size": HIDDEN}))
    with pytest.raises(DrafterError) as refused:
        create_drafter(folder, qwen3)
    line = str(refused.value)
    assert "\n" not in line and "not supported yet (type " in line and why in line


def test_a_checkpoint_with_its_own_nextn_mtp_head_is_refused_naming_it(tmp_path, qwen3):
    """A GLM / DeepSeek checkpoint declaring ``num_nextn_predict_layers`` (mlx-vlm loads its
    head as an MTP drafter) was read as a ReDrafter folder."""
    folder = tmp_path / "d"
    folder.mkdir()
    config = {"model_type": "glm4_moe", "hidden_size": HIDDEN, "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=r"glm4_moe MTP head \(num_nextn_predict_layers\) "):
        create_drafter(folder, qwen3)
    assert drafter_types.declared({**config, "num_nextn_predict_layers": 0}) is None


def test_an_unknown_speculators_type_is_refused_naming_it(tmp_path, qwen3):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "hydra"}))
    with pytest.raises(
        DrafterError, match=r"speculators 'hydra' drafter: not supported yet \(speculators_model"
    ):
        create_drafter(folder, qwen3)


def peagle_folder(out: Path) -> Path:
    """A speculators P-EAGLE folder: EAGLE-3's (tests/test_eagle3.py) typed ``peagle``, with
    its ``mask_hidden`` (1, 1, 3 H) for parallel drafting and its own trained embedding."""
    from test_eagle3 import eagle3_folder

    folder = eagle3_folder(out, layer_ids=(1, 2, 2))
    config = json.loads((folder / "config.json").read_text())
    config |= {"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"]}
    (folder / "config.json").write_text(json.dumps(config | {"mask_token_id": MASK}))
    tensors = dict(mx.load(str(folder / "model.safetensors")))
    tensors["mask_hidden"] = mx.zeros((1, 1, 3 * HIDDEN))
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    return folder


def test_a_speculators_peagle_folder_loads_as_eagle3_with_its_own_embedding(tmp_path, qwen3):
    """It failed with ``KeyError('hidden_size')`` (read as ReDrafter's)."""
    from redrafter_mlx.core.decode.llm import embedding
    from redrafter_mlx.io.field_drafters import load_eagle3

    folder = peagle_folder(tmp_path / "p")
    assert drafter_kind(folder) == "peagle"
    drafter = create_drafter(folder, qwen3)
    assert drafter.kind == "peagle" and drafter.taps == load_eagle3(folder, qwen3).taps
    own = mx.load(str(folder / "model.safetensors"))["embed_tokens.weight"]
    assert mx.array_equal(drafter.module.embed_tokens.weight, own)
    assert not mx.array_equal(own, embedding(qwen3).weight)
    assert greedy_drafted(qwen3, drafter, BeamShape(4, 4))


def greedy_drafted(target, drafter, shape) -> bool:
    prompt = [5, 17, 33, 2, 41, 8]
    return (
        take(run_steps(target, prompt, drafter, shape), 30)[0]
        == take(run_steps(target, prompt), 30)[0]
    )


def source_service(target, drafter, **bounds):
    """A started generation service over ``target`` drafting with the source ``drafter``
    (tests/support/serving.py's, which wraps a ReDrafter module), trees of ``(4, 4)``."""
    from support import toy_tokenizer

    from redrafter_mlx.core.decode.mode import Mode
    from redrafter_mlx.core.serving.service import Engine, GenerationService

    shape = BeamShape(4, 4)

    def setup():
        decoder = decoder_for(target, drafter)
        return Engine(decoder, toy_tokenizer(), list, Mode.REDRAFTER, shape, shape)

    service = GenerationService(setup, **bounds)
    service.start()
    return service


@pytest.mark.parametrize("make", [dspark_folder, peagle_folder], ids=["dspark", "peagle"])
def test_the_batching_service_answers_as_the_serial_one(tmp_path, qwen3, make):
    from support.serving import run

    from redrafter_mlx.core.serving.service import Request, Sampling

    drafter = create_drafter(make(tmp_path / "d"), qwen3)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13], [3, 3, 3], [5, 6]]
    requests = [
        Request(p, max_tokens=16, sampling=Sampling(0.8, seed=10 + i) if i % 2 else Sampling())
        for i, p in enumerate(prompts)
    ]
    serial = source_service(qwen3, drafter, queue_size=8)
    try:
        expected = [run(serial.submit(r)) for r in requests]
    finally:
        serial.close()
    service = source_service(qwen3, drafter, max_batch=4, queue_size=8)
    try:
        jobs = [service.submit(r) for r in requests]
        answers = [run(job) for job in jobs]
    finally:
        service.close()
    assert answers == expected


@pytest.mark.parametrize("key", ["gemma4_unified_assistant", "laguna", "speculators:eagle"])
def test_generate_with_a_folder_of_a_type_not_loaded_says_which_in_one_line(tmp_path, capsys, key):
    """The folder's own sizes (a Gemma 4 assistant's are not the target's) were compared
    first: the line named sizes, not the type."""
    from support import tiny_model_folder

    from redrafter_mlx.cli import main

    model = tiny_model_folder(tmp_path / "model")
    folder = tmp_path / "d"
    folder.mkdir()
    config = declaring(key) | {"hidden_size": 1536, "vocab_size": 262144}
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(["generate", "--model", str(model), "--drafter", str(folder), "--prompt", "Hi"])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    name = drafter_types.TYPES[key].name
    assert f": {name} drafter: not supported yet (" in line
