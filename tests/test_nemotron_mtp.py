"""Nemotron-H's native MTP head (an attention block and a MoE block): mlx-vlm's numbers, both
layouts, exact decoding on the tiny Nemotron-H hybrid, sampling, batches.

The reference test needs mlx-vlm 0.7.10 (`make test-deps`); it skips without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import decoder_for, decoding_of, run_steps
from support.batching import alone, batched
from support.decoding import take
from support.drafters import generate_with_config, second_token_pvalue
from support.families import build, config

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.llm import inner_model
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.nemotron_mtp import NemotronMTPHead
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.field_drafters import NemotronArgs, create_drafter, drafter_kind

EXPERTS = 4
HEAD = {  # the checkpoint's config: the target's, its MTP layer and the head's MoE sizes
    **config("nemotron_h"),
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
}


def head_tensors(seed: int = 0) -> dict[str, mx.array]:
    """A random head as the checkpoint holds it: ``mtp.*``, each expert's own tensors."""
    args = NemotronArgs.from_dict({**HEAD, "hybrid_override_pattern": ["*", "E"]})
    module = NemotronMTPHead(args, ["*", "E"])
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in tree_flatten(module.parameters()):
        scale = 0.5 if "norm" in name else 0.15
        x = mx.array(rng.normal(0, scale, value.shape).astype(np.float32))
        for stacked, own in (("switch_mlp.fc1", "up_proj"), ("switch_mlp.fc2", "down_proj")):
            if stacked in name:
                for e in range(EXPERTS):
                    out["mtp." + name.replace(stacked, f"experts.{e}.{own}")] = x[e]
                break
        else:
            out["mtp." + name] = x
    return out


def original_folder(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(HEAD))
    mx.save_safetensors(str(out / "model-mtp.safetensors"), head_tensors())
    return out


def split_folder(out: Path, reference_model) -> Path:
    """The folder mlx-vlm's splitter writes: ``nemotron_h_mtp``, unprefixed, experts stacked."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "nemotron_h_mtp", "text_config": HEAD}
    (out / "config.json").write_text(json.dumps(cfg))
    params = dict(tree_flatten(reference_model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


@pytest.fixture(scope="module")
def nemotron():
    return build("nemotron_h")


def reference(target):
    mtp = pytest.importorskip(
        "mlx_vlm.speculative.drafters.nemotron_h_mtp", reason="mlx-vlm 0.7.10 not installed"
    )
    model = mtp.Model(
        mtp.ModelConfig.from_dict({"model_type": "nemotron_h_mtp", "text_config": HEAD})
    )
    tensors = {k.removeprefix("mtp."): v for k, v in head_tensors().items()}
    model.load_weights(list(model.sanitize(tensors).items()), strict=True)
    mx.eval(model.parameters())
    # its bind() asks for mlx-vlm's Nemotron-H class: the same embedding and head, by hand
    model._input_embed, model._lm_head_fn = target.backbone.embeddings, target.lm_head
    model._cache = model.make_cache()
    return model


@pytest.mark.parametrize("layout", ["original", "split"])
def test_logits_and_proposals_equal_mlx_vlms(tmp_path, nemotron, layout):
    ref = reference(nemotron)
    folder = original_folder(tmp_path / "o") if layout == "original" else None
    folder = folder or split_folder(tmp_path / "s", ref)
    assert drafter_kind(folder) == "nemotron_h_mtp"
    ours = create_drafter(folder, nemotron)
    assert ours.kind == "nemotron_h_mtp"
    rng = np.random.default_rng(1)
    n, length, bonus = 7, 5, 13
    tokens = [int(t) for t in rng.integers(0, 90, n)]
    last = mx.array(rng.normal(0, 1, (n, HEAD["hidden_size"])).astype(np.float32))
    final = inner_model(nemotron).norm_f(last)  # the target's final hidden states

    shifted = mx.array(tokens[1:] + [bonus])[None]
    expected = ref._lm_head_fn(ref._forward_tokens(shifted, final[None], mx.int32)[0])[0]
    module = ours.module
    causal = mx.arange(n)[None] <= mx.arange(n)[:, None]
    got = module.logits(module.run(shifted, final[None], 0, ours._empty_cache(), causal)[0])[0]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4)

    ref._cache = ref.make_cache()
    ref.prefill_from_target_hidden(mx.array(tokens)[None], final[None], bonus, None, greedy=True)
    chain = ref.draft_block(bonus, None, None, length, None, greedy=True)
    sequence = Sequence(1, mx.float32)
    sequence.parts.append(ours.new_part())
    ours.observe(sequence, {ours.taps[0]: last}, mx.arange(n))
    sequence.commit(tokens)
    reading = Reading.after_prompt(mx.zeros((HEAD["hidden_size"],)), mx.array(bonus))
    beams, _, _ = ours.draft(sequence, reading, width=1, length=length)
    assert beams[0].tolist() == [bonus] + chain[0].tolist()


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
@pytest.mark.parametrize("shape", [BeamShape(1, 3), BeamShape(4, 4)], ids=str)
def test_greedy_with_the_head_equals_autoregressive_on_both_plans(tmp_path, nemotron, plan, shape):
    drafter = create_drafter(original_folder(tmp_path / "o"), nemotron)
    prompt = [5, 17, 33, 2, 41, 8]
    expected, _ = take(run_steps(nemotron, prompt, plan=plan), 40)
    assert take(run_steps(nemotron, prompt, drafter, shape, plan=plan), 40)[0] == expected


@pytest.mark.distribution
def test_sampling_with_the_head_keeps_the_targets_distribution(tmp_path, nemotron):
    drafter = create_drafter(original_folder(tmp_path / "o"), nemotron)
    assert second_token_pvalue(nemotron, drafter, 97, temp=0.3) > 1e-3


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
def test_the_head_in_a_batch_answers_as_alone(tmp_path, nemotron, plan):
    drafter = create_drafter(original_folder(tmp_path / "o"), nemotron)
    decoder = decoder_for(nemotron, drafter, plan)
    decodings = [
        decoding_of(drafter, BeamShape(2, 3)),
        decoding_of(drafter, BeamShape(1, 4)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
    ]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3, 3]]
    expected = [alone(decoder, d, p, 20) for d, p in zip(decodings, prompts, strict=True)]
    assert batched(decoder, decodings, prompts, 20)[0] == expected


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers 2: only 1 is supported"),
        ({"mtp_hybrid_override_pattern": "M*"}, "MTP layer pattern 'M\\*'"),
    ],
)
def test_a_head_we_cannot_run_is_refused_in_one_line(tmp_path, nemotron, change, message):
    folder = original_folder(tmp_path / "o")
    (folder / "config.json").write_text(json.dumps({**HEAD, **change}))
    assert drafter_kind(folder) == "nemotron_h_mtp"
    with pytest.raises(DrafterError, match=f"not a Nemotron-H MTP config \\({message}"):
        create_drafter(folder, nemotron)


def test_a_head_for_another_target_is_refused_in_one_line(tmp_path):
    with pytest.raises(DrafterError, match="drafts for Nemotron-H targets only"):
        create_drafter(original_folder(tmp_path / "o"), build("qwen3_5"))


def test_generate_with_a_head_folder_answers_as_the_target(tmp_path, capsys):
    """The CLI path: `generate --model <Nemotron-H> --drafter <its checkpoint's folder>`."""

    def make(vocab):
        folder = original_folder(tmp_path / "head")
        (folder / "config.json").write_text(json.dumps({**HEAD, "vocab_size": vocab}))
        return folder

    generate_with_config(tmp_path, capsys, config("nemotron_h"), make, "Nemotron-H MTP")
