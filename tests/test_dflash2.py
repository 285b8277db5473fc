"""DFlash2 drafters, speculators' DFlash layouts, sliding drafter layers, and the DFlash-family
folders refused by name: mlx-vlm's logits and proposals, exact decoding, batches.

The reference tests need mlx-vlm 0.7.10 (`make test-deps`); they skip without it.
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
from support.drafters import generate_with_folder, second_token_pvalue
from support.families import build
from test_dflash import HIDDEN, VOCAB, dflash_folder, fed

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.dflash2 import grouped_causal
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind, load_dflash, load_dflash2

KERNEL, GROUP, RANK, TOP_K = 3, 16, 8, 6


def dflash2_folder(out: Path, *, block=6, seed=0, vocab=VOCAB, **own) -> Path:
    """A random DFlash2 drafter as z-lab saves one: DFlash's folder plus each layer's
    ``attention_conv`` / ``mlp_conv`` (``base_kernel (2, C, H)``, ``kernel_projection``) and
    the ``candidate_selector`` (codebooks without ``.weight``), its sizes in ``dflash_config``
    and a ``DFlash2DraftModel`` architecture."""
    dflash_folder(out, block=block, seed=seed)
    rng = np.random.default_rng(seed + 100)

    def w(*shape, scale=0.15):
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    tensors = dict(mx.load(str(out / "model.safetensors")))
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            tensors[p + "base_kernel"] = w(2, KERNEL, HIDDEN, scale=0.5)
            tensors[p + "kernel_projection.weight"] = w(2 * KERNEL * HIDDEN // GROUP, HIDDEN)
    tensors |= {
        "candidate_selector.predecessor_codebook": w(vocab, RANK, scale=1.0),
        "candidate_selector.successor_codebook": w(vocab, RANK, scale=1.0),
        "candidate_selector.hidden_projection.weight": w(RANK, HIDDEN, scale=0.5),
    }
    mx.save_safetensors(str(out / "model.safetensors"), tensors)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] |= {
        "conv_kernel_size": KERNEL,
        "conv_group_size": GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
        "input_embedding_scale": 1.3,
        "output_multiplier": 0.8,
        **own,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def speculators(folder: Path, kind: str, **extra) -> Path:
    """``folder``'s drafter rewritten in speculators' layout: the layer sizes nested under
    ``transformer_layer_config``, the target layers as ``aux_hidden_state_layer_ids`` (HF
    hidden-state indices: one more than the layer), the DFlash keys at the top level."""
    config = json.loads((folder / "config.json").read_text())
    dflash = config.pop("dflash_config")
    layer = {k: v for k, v in config.items() if k not in ("architectures", "block_size")}
    ids = [i + 1 for i in dflash.pop("target_layer_ids")]
    out = {
        "speculators_model_type": kind,
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": config["vocab_size"],
        "block_size": config["block_size"],
        "aux_hidden_state_layer_ids": ids,
        **dflash,
        **extra,
    }
    (folder / "config.json").write_text(json.dumps(out))
    return folder


def open_spec(folder: Path, method: str, **extra) -> Path:
    """``folder``'s drafter in the Open Spec Config speculators writes: the layer sizes at
    the top level, a ``DflashDraftModel`` architecture, the rest under ``speculative_config``
    (``target_layer_ids`` counted from ``target_layer_start_idx`` 1)."""
    config = json.loads((folder / "config.json").read_text())
    dflash = config.pop("dflash_config")
    spec = {
        "method": method,
        "speculative_tokens": config.pop("block_size") - 1,
        "target_layer_ids": [i + 1 for i in dflash.pop("target_layer_ids")],
        "target_layer_start_idx": 1,
        **dflash,
        **extra,
    }
    config |= {"architectures": ["DflashDraftModel"], "speculative_config": spec}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edit(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3")


def reference(folder: Path, target, module: str):
    """mlx-vlm's drafter of ``module`` on ``folder``'s weights, bound to ``target`` without
    its speculative-cache check (the tiny target has no rollback method)."""
    drafters = pytest.importorskip(
        f"mlx_vlm.speculative.drafters.{module}", reason="mlx-vlm 0.7.10 not installed"
    )
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    model = drafters.Model(
        drafters.ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    )
    model.load_weights(list(model.sanitize(mx.load(str(folder / "model.safetensors"))).items()))
    mx.eval(model.parameters())
    DFlashDraftModel.bind(model, target)
    return model


def states(rng, n, taps):
    return [mx.array(rng.normal(0, 1, (n, HIDDEN)).astype(np.float32)) for _ in taps]


def first_draft(drafter, sequence, reading, block):
    return drafter.chain(sequence, reading, block).tolist()


def test_the_grouped_convolution_is_mlx_vlms():
    dflash2 = pytest.importorskip("mlx_vlm.speculative.drafters.dflash2")
    rng = np.random.default_rng(2)
    hidden = mx.array(rng.normal(0, 1, (1, 5, 32)).astype(np.float32))
    dynamic = mx.array(rng.normal(0, 1, (1, 5, 3, 4)).astype(np.float32))
    base = mx.array(rng.normal(0, 1, (3, 32)).astype(np.float32))
    want = dflash2._grouped_dynamic_convolve(hidden, dynamic, base, 8)
    np.testing.assert_allclose(
        np.array(grouped_causal(hidden, dynamic, base, 8)), np.array(want), atol=1e-5
    )


def test_logits_and_proposals_equal_mlx_vlms_dflash2_over_two_rounds(tmp_path, qwen3):
    folder = dflash2_folder(tmp_path / "d")
    ref = reference(folder, qwen3, "dflash2")
    logits_cache, draft_cache = ref.make_cache(), ref.make_cache()
    ours = load_dflash2(folder, qwen3)
    assert ours.kind == "dflash2"
    rng = np.random.default_rng(1)
    prompt, bonus, block = [int(t) for t in rng.integers(0, 90, 7)], 11, 6
    first = states(rng, len(prompt), ours.taps)
    context = mx.concatenate(first, -1)[None]
    expected = ref(mx.array([[bonus] + [96] * (block - 1)]), context, logits_cache)
    proposal = ref.draft_block(bonus, context, draft_cache, block, lambda x: mx.argmax(x, -1))
    sequence = fed(ours, first, prompt)
    reading = Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(bonus))
    got = ours.logits(sequence, reading)
    np.testing.assert_allclose(np.array(got), np.array(expected[0, 1:]), atol=1e-4)
    assert first_draft(ours, sequence, reading, block) == proposal[0].tolist()

    # a step verifies [bonus, d1..d4]; 2 drafts accepted: the context grows by 3 rows
    verify, next_token = states(rng, block - 1, ours.taps), 23
    ours.observe(sequence, dict(zip(ours.taps, verify, strict=True)), mx.arange(block - 1))
    step = Reading(
        mx.zeros((HIDDEN,)),
        mx.array(next_token),
        mx.arange(5),
        mx.array([bonus, 40, 41, 42, 43]),
        mx.array(3),
    )
    rows = mx.concatenate(verify, -1)[None, :3]
    expected = ref(mx.array([[next_token] + [96] * (block - 1)]), rows, logits_cache)
    proposal = ref.draft_block(next_token, rows, draft_cache, block, lambda x: mx.argmax(x, -1))
    np.testing.assert_allclose(
        np.array(ours.logits(sequence, step)), np.array(expected[0, 1:]), atol=1e-4
    )
    assert first_draft(ours, sequence, step, block) == proposal[0].tolist()


def test_the_tree_is_closed_and_its_top_beam_is_the_selectors_chain(tmp_path, qwen3):
    """Every tree's best node is mlx-vlm's first draft, every node's parent is in the tree,
    and a node's log-prob is its path's under the selector's chain (finite only on a path)."""
    ours = load_dflash2(dflash2_folder(tmp_path / "d"), qwen3)
    rng = np.random.default_rng(5)
    sequence = fed(ours, states(rng, 6, ours.taps), [3, 4, 5, 6, 7, 8])
    reading = Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(9))
    chain = first_draft(ours, sequence, reading, 6)
    for width in (4, 9, 30):
        beams, logprobs, _ = ours.draft(sequence, reading, width=width, length=6)
        paths = [tuple(t for t in row[1:] if t >= 0) for row in beams.tolist()]
        assert paths[0] == tuple(chain[:1])  # the best node: the chain's first
        assert all(p[:-1] in paths or len(p) <= 1 for p in paths) and len(set(paths)) == width
        finite = np.isfinite(np.array(logprobs))
        assert (finite == (np.array(beams[:, 1:]) >= 0)).all()


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu-plan", "generic-plan"])
@pytest.mark.parametrize(
    "shape", [BeamShape(1, 4), BeamShape(6, 5), BeamShape(8, 6, lookup=1)], ids=str
)
def test_greedy_with_dflash2_equals_autoregressive(tmp_path, qwen3, plan, shape):
    drafter = load_dflash2(dflash2_folder(tmp_path / "d"), qwen3)
    prompt = [5, 17, 33, 2, 41, 8]
    expected, _ = take(run_steps(qwen3, prompt, plan=plan), 40)
    got, steps = take(run_steps(qwen3, prompt, drafter, shape, plan=plan), 40)
    assert got == expected


@pytest.mark.distribution
def test_sampling_with_dflash2_keeps_the_targets_distribution(tmp_path, qwen3):
    drafter = load_dflash2(dflash2_folder(tmp_path / "d", selector_top_k=48), qwen3)
    assert second_token_pvalue(qwen3, drafter, VOCAB, temp=1.0) > 1e-3


@pytest.mark.parametrize("make", ["dflash2", "speculators-dflash"])
def test_a_batch_with_a_dflash_family_drafter_answers_each_as_alone(tmp_path, qwen3, make):
    """Several sequences stepped as one batch (what ``serve`` runs) give each its answer alone."""
    folder = dflash2_folder(tmp_path / "d")
    if make == "speculators-dflash":
        folder = speculators(dflash_folder(tmp_path / "s"), "dflash")
    drafter = create_drafter(folder, qwen3)
    decoder = decoder_for(qwen3, drafter)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    decodings = [
        decoding_of(drafter, BeamShape(4, 4)),
        decoding_of(drafter, BeamShape(2, 3)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
    ]
    want = [alone(decoder, d, p, 20) for d, p in zip(decodings, prompts, strict=True)]
    got, _ = batched(decoder, decodings, prompts, 20)
    assert got == want


def test_generate_with_a_dflash2_folder_says_so(tmp_path, capsys):
    def make(vocab):
        folder = dflash2_folder(tmp_path / "dflash2", vocab=vocab)
        config = json.loads((folder / "config.json").read_text())
        config["dflash_config"]["mask_token_id"] = vocab - 1
        return edit(folder, vocab_size=vocab, dflash_config=config["dflash_config"])

    generate_with_folder(tmp_path, capsys, make, [BeamShape(6, 4), BeamShape(4, 3)], "DFlash2")


def test_a_dflash2_folder_is_never_read_as_dflash(tmp_path, qwen3):
    """It was: DFlash's loader then refused its tensors as unknown."""
    folder = dflash2_folder(tmp_path / "d")
    assert drafter_kind(folder) == "dflash2"
    assert create_drafter(folder, qwen3).kind == "dflash2"
    assert (
        drafter_kind(edit(dflash2_folder(tmp_path / "e"), architectures=["DFlashDraftModel"]))
        == "dflash2"
    )
    assert drafter_kind(dflash_folder(tmp_path / "plain")) == "dflash"
    deep = dflash2_folder(tmp_path / "deep", target_layer_ids=[0, 5])
    with pytest.raises(DrafterError, match=r"DFlash2 drafter reads target layers \[0, 5\], but"):
        load_dflash2(deep, qwen3)


@pytest.mark.parametrize(
    "own,message",
    [
        ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size"),
        ({"selector_top_k": 0}, "selector_top_k 0: need an integer >= 1"),
        ({"selector_top_k": 500}, "selector_top_k 500 exceeds the vocabulary"),
    ],
)
def test_a_malformed_dflash2_config_is_a_one_line_error(tmp_path, qwen3, own, message):
    with pytest.raises(DrafterError, match=f"config.json: not a DFlash2 config: {message}"):
        load_dflash2(dflash2_folder(tmp_path / "d", **own), qwen3)


@pytest.mark.parametrize("layout", [speculators, open_spec], ids=["speculators", "open-spec"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_speculators_configs_load_as_their_type(tmp_path, qwen3, kind, layout):
    """They failed with KeyError('hidden_size'): the sizes are nested in
    ``transformer_layer_config``. The same weights give the same logits as z-lab's layout."""
    write = dflash_folder if kind == "dflash" else dflash2_folder
    zlab = (load_dflash if kind == "dflash" else load_dflash2)(write(tmp_path / "z"), qwen3)
    folder = layout(write(tmp_path / "s"), kind)
    assert drafter_kind(folder) == kind
    theirs = create_drafter(folder, qwen3)
    assert theirs.kind == kind and theirs.taps == zlab.taps == (0, 1)
    rng = np.random.default_rng(7)
    context = states(rng, 5, zlab.taps)
    reading = Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(12))
    want = zlab.logits(fed(zlab, context, [1, 2, 3, 4, 5]), reading)
    got = theirs.logits(fed(theirs, context, [1, 2, 3, 4, 5]), reading)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"draft_vocab_size": 64}, "a draft vocabulary of 64 \\(not the target's 97\\)"),
        ({"sample_from_anchor": True}, "blocks drafted from the anchor \\(sample_from_anchor\\)"),
    ],
)
@pytest.mark.parametrize("layout", [speculators, open_spec], ids=["speculators", "open-spec"])
def test_a_speculators_dflash_this_runtime_cannot_run_is_refused(
    tmp_path, qwen3, layout, extra, message
):
    folder = layout(dflash_folder(tmp_path / "s"), "dflash", **extra)
    with pytest.raises(DrafterError, match=f"not a DFlash config: {message}"):
        create_drafter(folder, qwen3)


def test_a_speculators_dspark_is_not_read_as_dflash(tmp_path, qwen3):
    """Its method names DSpark's loader (tests/test_dspark.py), which asks for the Markov head
    a DFlash folder lacks: not read as DFlash, nor left to ReDrafter's loader."""
    folder = open_spec(dflash_folder(tmp_path / "s"), "dspark")
    assert drafter_kind(folder) == "dspark"
    with pytest.raises(DrafterError, match=r"DSpark weights: .*markov_head"):
        create_drafter(folder, qwen3)


def sliding(folder: Path, types, window) -> Path:
    return edit(folder, layer_types=types, sliding_window=window)


def speculators_sliding(folder: Path, types, window, causal: bool) -> Path:
    """``folder`` in speculators' layout with sliding layers, causal or not inside the block."""
    folder = speculators(folder, "dflash", sliding_window_non_causal=not causal)
    layer = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    return edit(
        folder, transformer_layer_config={**layer, "layer_types": types, "sliding_window": window}
    )


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("window", [3, 5, 64])
def test_sliding_layers_equal_mlx_vlms_after_a_prompt(tmp_path, qwen3, window, kind):
    """Gemma 4's z-lab DFlash drafters: a sliding layer sees the last ``window - 1`` context
    positions (and the whole block), as mlx-vlm's, after a prompt (its chunked cache then
    keeps a varying number: no reference after). DFlash2's layers slide alike."""
    write = dflash_folder if kind == "dflash" else dflash2_folder
    folder = sliding(write(tmp_path / "d"), ["sliding_attention", "full_attention"], window)
    ref = reference(folder, qwen3, "qwen3_dflash" if kind == "dflash" else "dflash2")
    ours = create_drafter(folder, qwen3)
    assert ours.kind == kind
    rng = np.random.default_rng(3)
    context = states(rng, 9, ours.taps)
    expected = ref(mx.array([[21] + [96] * 5]), mx.concatenate(context, -1)[None], ref.make_cache())
    got = ours.logits(
        fed(ours, context, list(range(9))), Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(21))
    )
    np.testing.assert_allclose(np.array(got), np.array(expected[0, 1:]), atol=1e-4)


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_a_sliding_layer_sees_only_its_window_after_steps(tmp_path, qwen3, causal):
    """After a prompt and a step, an all-sliding drafter's logits are those of a fresh one fed
    only the last ``window - 1`` committed rows (attention depends on relative positions):
    the older context is out of reach. With full layers, it is not (the test can fail)."""
    window = 4
    folder = speculators_sliding(
        dflash_folder(tmp_path / "d"), ["sliding_attention"] * 2, window, causal
    )
    ours = create_drafter(folder, qwen3)
    assert ours.module.args.causal_sliding is causal
    rng = np.random.default_rng(8)
    prompt, verify = states(rng, 7, ours.taps), states(rng, 4, ours.taps)
    sequence = fed(ours, prompt, list(range(7)))
    ours.observe(sequence, dict(zip(ours.taps, verify, strict=True)), mx.arange(4))
    step = Reading(
        mx.zeros((HIDDEN,)), mx.array(30), mx.arange(4), mx.array([5, 6, 7, 8]), mx.array(2)
    )
    got = ours.logits(sequence, step)
    rows = [mx.concatenate([p[-1:], v[:2]]) for p, v in zip(prompt, verify, strict=True)]
    recent = fed(ours, rows, [0, 1, 2])
    want = ours.logits(recent, Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(30)))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)
    full = load_dflash(dflash_folder(tmp_path / "f"), qwen3)
    sequence = fed(full, prompt, list(range(7)))
    full.observe(sequence, dict(zip(full.taps, verify, strict=True)), mx.arange(4))
    far = full.logits(sequence, step)
    near = full.logits(
        fed(full, rows, [0, 1, 2]), Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(30))
    )
    assert not np.allclose(np.array(far), np.array(near), atol=1e-4)


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu-plan", "generic-plan"])
def test_greedy_with_sliding_layers_equals_autoregressive(tmp_path, qwen3, plan):
    folder = sliding(dflash_folder(tmp_path / "d"), ["sliding_attention", "full_attention"], 3)
    drafter = load_dflash(folder, qwen3)
    prompt = [5, 17, 33, 2, 41, 8]
    expected, _ = take(run_steps(qwen3, prompt, plan=plan), 40)
    assert take(run_steps(qwen3, prompt, drafter, BeamShape(6, 5), plan=plan), 40)[0] == expected


@pytest.mark.parametrize(
    "changes,message",
    [
        # DSpark's loader takes these, and says what a DFlash folder lacks for it
        ({"markov_rank": 256}, "not a DSpark config|DSpark weights"),
        ({"architectures": ["DSparkDraftModel"]}, "not a DSpark config|DSpark weights"),
        ({"model_type": "laguna"}, "Laguna DFlash drafter: not supported"),
        (
            {"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 1], "causal": True}},
            "DFlash drafter: causal draft blocks are not supported",
        ),
        (
            {"layer_types": ["sliding_attention", "full_attention"]},
            "sliding_window None: need an integer >= 2",
        ),
        ({"layer_types": ["chunked_attention"] * 2, "sliding_window": 4}, "layer_types"),
    ],
)
def test_dflash_family_folders_this_runtime_does_not_load_are_refused_by_name(
    tmp_path, qwen3, changes, message
):
    folder = edit(dflash_folder(tmp_path / "d"), **changes)
    with pytest.raises(DrafterError, match=message) as refused:
        create_drafter(folder, qwen3)
    assert "\n" not in str(refused.value)


def test_one_host_read_per_step_with_dflash2(tmp_path, qwen3, monkeypatch):
    """The selector's chain and its tree stay on the device: the step's one read."""
    import itertools

    from redrafter_mlx.core.decode import speculative as tree_step

    drafter = load_dflash2(dflash2_folder(tmp_path / "d"), qwen3)
    reads = []
    real = tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    steps = list(itertools.islice(run_steps(qwen3, [5, 17, 33], drafter, BeamShape(6, 5)), 8))
    assert len(reads) == len(steps)
    assert all(step.tree_size <= 1 + 6 for step in steps[1:])


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_sliding_masks_equal_a_brute_force_window(tmp_path, qwen3, causal):
    """Query ``i`` of the block (position ``offset + i``) sees a context key iff it joins and
    lies within ``w - 1`` of the block's first position (non-causal) or of its own (causal),
    and block key ``j`` always (non-causal) or iff ``i - w < j <= i`` (causal)."""
    window, size = 3, 6
    types = ["sliding_attention", "full_attention"]
    module = create_drafter(
        speculators_sliding(dflash_folder(tmp_path / "d"), types, window, causal), qwen3
    ).module
    assert module.args.causal_sliding is causal
    visible = mx.array([True] * 7 + [True, True, False])  # 7 committed, 2 of 3 staged join
    slid, full = module.masks(visible, mx.arange(10), 9)
    assert np.array(full).tolist() == [True] * 9 + [False] + [True] * size
    want = np.zeros((size, 10 + size), bool)
    for i in range(size):
        query = 9 + (i if causal else 0)
        for k in range(10):
            want[i, k] = bool(visible[k].item()) and k > query - window
        for j in range(size):
            want[i, 10 + j] = (i - window < j <= i) if causal else True
    assert (np.array(slid) == want).all()
