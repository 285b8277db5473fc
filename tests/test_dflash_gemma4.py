"""z-lab's Gemma 4 DFlash drafters (``gemma4_dflash``): a DFlash block whose input is the
Gemma target's embedding as its forward makes it (scaled by ``sqrt(H)``), equal to mlx-vlm's
``Gemma4DFlashDraftModel`` on a tiny random Gemma 4 (mlx-lm's ``gemma4_text``: sliding and
full layers, K/V-shared layers, per-layer inputs), and exact decoding with it.

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
from support.drafters import second_token_pvalue
from support.families import build_config
from test_dflash import HIDDEN, dflash_folder, fed
from test_dflash2 import reference
from test_gemma4_assistant import PROMPT, TARGET, VOCAB

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.llm import Wrapped, inner_model
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.dflash import best_tree
from redrafter_mlx.io import drafter_types
from redrafter_mlx.io.field_drafters import create_drafter, drafter_kind

WINDOW = 3


@pytest.fixture(scope="module")
def gemma4():
    return build_config(TARGET, seed=3)


def gemma4_dflash(out: Path, **changes) -> Path:
    """A random DFlash drafter as z-lab's Gemma 4 repositories hold one (as mlx-vlm reads
    it): ``model_type`` ``gemma4`` with a ``dflash_config`` and no ``mask_token_id`` (Gemma's
    ``<mask>``, 4, is the default), a sliding layer then a full one, a logit soft-cap; it
    reads the target's layers 0 and 2 (tests/test_dflash.py's tensors)."""
    folder = dflash_folder(out, layer_ids=(0, 2), mask=4)
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "model_type": "gemma4",
        "vocab_size": VOCAB,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "final_logit_softcapping": 30.0,
        "dflash_config": {"target_layer_ids": [0, 2]},
        **changes,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_gemma4_dflash_folder_loads_as_dflash(tmp_path, gemma4):
    """It was refused: ``Gemma 4 DFlash drafter: not supported yet (type 'gemma4_dflash')``."""
    folder = gemma4_dflash(tmp_path / "d")
    assert drafter_types.declared(json.loads((folder / "config.json").read_text()))[0] == (
        "gemma4_dflash"
    )
    assert drafter_kind(folder) == "dflash"
    drafter = create_drafter(folder, gemma4)
    assert drafter.kind == "dflash" and drafter.taps == (0, 2)
    assert drafter.module.args.mask_token_id == 4
    own = gemma4_dflash(tmp_path / "own", dflash_config={"target_layer_ids": [0, 2],
                                                          "mask_token_id": 7})  # fmt: skip
    assert create_drafter(own, gemma4).module.args.mask_token_id == 7


def test_logits_equal_mlx_vlms_which_scale_the_gemma_embedding(tmp_path, gemma4):
    """mlx-vlm binds the target's embedding times its ``embed_scale`` (``sqrt(64)`` here);
    unscaled, the block's input was 8 times too small."""
    assert inner_model(gemma4).embed_scale == HIDDEN**0.5
    folder = gemma4_dflash(tmp_path / "d")
    ref = reference(folder, gemma4, "gemma4_dflash")
    assert ref.embed_scale == HIDDEN**0.5
    ours = create_drafter(folder, gemma4)
    rng = np.random.default_rng(2)
    taps = [mx.array(rng.normal(0, 1, (9, HIDDEN)).astype(np.float32)) for _ in ours.taps]
    bonus, size = 13, ours.module.args.block_size
    expected = ref(
        mx.array([[bonus] + [4] * (size - 1)]), mx.concatenate(taps, -1)[None], ref.make_cache()
    )[0, 1:]
    sequence = fed(ours, taps, PROMPT)
    reading = Reading.after_prompt(mx.zeros((HIDDEN,)), mx.array(bonus))
    got = ours.logits(sequence, reading)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4)
    # the tree searched one path deep: its deepest beam is the chain mlx-vlm proposes
    logprobs, tokens = log_softmax(got), mx.arange(VOCAB, dtype=mx.int32)[None]
    beams, _ = best_tree(lambda d, _: (tokens, logprobs[d][None]), size - 1, mx.array(bonus),
                         size - 1, keep=1)  # fmt: skip
    assert beams[-1].tolist() == [bonus] + mx.argmax(expected, -1).tolist()


def test_the_context_is_made_of_the_target_layers_hidden_states(tmp_path, gemma4):
    """Gemma 4's layers return ``(h, kvs, offset)``: the tap recorded the tuple, and the
    prefill failed (core/decode/llm.py: Tap)."""
    drafter = create_drafter(gemma4_dflash(tmp_path / "d"), gemma4)
    decoder = decoder_for(gemma4, drafter)
    sequence = decoder.new_sequence()
    decoder.prefill(sequence, PROMPT, decoding_of(drafter, BeamShape(4, 4)))
    copy = build_config(TARGET, seed=3)  # the same weights, its layers' outputs kept by hand
    layers, outputs = inner_model(copy).layers, {}

    class Kept(Wrapped):
        def __call__(self, *args, **kwargs):
            return outputs.setdefault(self.index, self.inner(*args, **kwargs))

    for i in drafter.taps:
        layers[i] = Kept(layers[i])
        layers[i].index = i
    inner_model(copy)(mx.array(PROMPT)[None])
    features = drafter.module.features([outputs[i][0][0] for i in drafter.taps])
    for (keys, values), (k, v) in zip(
        drafter.part(sequence).cache, drafter.module.context(features, 0), strict=True
    ):
        np.testing.assert_allclose(np.array(keys), np.array(k), atol=1e-4)
        np.testing.assert_allclose(np.array(values), np.array(v), atol=1e-4)


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
@pytest.mark.parametrize("shape", [BeamShape(1, 3), BeamShape(6, 5)], ids=str)
def test_greedy_with_a_gemma4_dflash_equals_autoregressive(tmp_path, gemma4, plan, shape):
    """Past the target's sliding window (5) and the drafter's (3)."""
    drafter = create_drafter(gemma4_dflash(tmp_path / "d"), gemma4)
    expected, _ = take(run_steps(gemma4, PROMPT, plan=plan), 40)
    got, _ = take(run_steps(gemma4, PROMPT, drafter, shape, plan=plan), 40)
    assert got == expected


def test_a_batch_with_a_gemma4_dflash_answers_each_sequence_as_alone(tmp_path, gemma4):
    drafter = create_drafter(gemma4_dflash(tmp_path / "d"), gemma4)
    decoder = decoder_for(gemma4, drafter)
    prompts = [PROMPT, [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    decodings = [
        decoding_of(drafter, BeamShape(6, 5)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
        decoding_of(drafter, BeamShape(4, 4, lookup=1)),
    ]
    expected = [alone(decoder, d, p, 20) for d, p in zip(decodings, prompts, strict=True)]
    assert batched(decoder, decodings, prompts, 20)[0] == expected


@pytest.mark.distribution
def test_sampling_with_a_gemma4_dflash_keeps_the_targets_distribution(tmp_path, gemma4):
    drafter = create_drafter(gemma4_dflash(tmp_path / "d"), gemma4)
    assert second_token_pvalue(gemma4, drafter, VOCAB, temp=0.3) > 1e-3  # its p is flat at 1
