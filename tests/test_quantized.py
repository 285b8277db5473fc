"""Quantized targets as Macs run them: a tiny random Llama quantized by mlx-lm's own
``nn.quantize`` (``QuantizedLinear`` projections and LM head, ``QuantizedEmbedding``) to 4 and 8
bits, decoded greedily on both plans with the ReDrafter drafter, lookup beams and each field
drafter type (random stand-ins at their type's default shape): the answer is the quantized
target's own, and its own is mlx-lm's.

Why exactness can hold at all: a tree verify computes T rows at once where the autoregressive
loop computes one, and kernels that round differently for batched and single rows (on a GPU
``qmm`` against ``qmv``) can flip a near-tied argmax (``benchmarks/fp16_divergence.py
--quantize`` measures how often on the embedded model). On the CPU MLX's quantized matmul
computes every row by the same loop whatever the row count, so a node's logits in a tree
verify are bit for bit those of one-token steps along its path; the first test asserts that
much, and the float target's tree rows (BLAS blocks T rows differently from one) are shown to
differ by float error for contrast, so the test can tell the two apart.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support import run_steps, tiny_llama
from support.decoding import take
from support.families import PLANS, PartOracle, mlx_lm_greedy, random_beams

from redrafter_mlx.backend.plan import make_forward
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.tree import pack_beams, tree_mask
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.io.demo_drafters import KINDS, write_demo_drafter
from redrafter_mlx.io.field_drafters import create_drafter

VOCAB, HIDDEN, LAYERS = 96, 64, 3  # three layers: the field drafters tap several
# (bits, group size): mlx-community's 4- and 8-bit default group, and 4-bit's finer one
QUANTIZATIONS = [(4, 64), (8, 64), (4, 32)]
PROMPTS = [[3, 14, 15, 9, 26, 5, 35], [60, 2, 71, 8]]
N = 40


def quantized(bits: int | None, group_size: int = 64, **tiny) -> nn.Module:
    """The tiny Llama (``bits`` None: float32; ``tiny``: other :func:`tiny_llama` arguments),
    quantized as ``mlx_lm.convert -q`` does."""
    model = tiny_llama(**{"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, **tiny})
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
        mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=QUANTIZATIONS, ids=lambda q: f"q{q[0]}g{q[1]}")
def target(request):
    model = quantized(*request.param)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    return model


@pytest.fixture(scope="module")
def answers(target):
    """The quantized target's own greedy answer to each prompt (mlx-lm's ``generate_step``)."""
    return [mlx_lm_greedy(target, prompt, N) for prompt in PROMPTS]


def decoded(target, prompt, drafter=None, shape=None, plan="generic") -> tuple[list[int], int]:
    """The first ``N`` greedy tokens of our loop, and the decode steps they took."""
    return take(run_steps(target, prompt, drafter, shape, plan=PLANS[plan]), N)


# ----------------------------------------------------------------------------------------------
# how a tree verify rounds against one-token steps


def tree_and_steps(model: nn.Module, plan: str, trees: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Logits of every node of ``trees`` random 4 x 5 trees verified after a prompt, and of
    the same nodes reached by one-token steps along each beam -> two ``(trees * 20, V)``."""
    forward, n = make_forward(model, PLANS[plan]), len(PROMPTS[0])

    def prefilled():
        sequence = llm.new_sequence(model)
        forward(mx.array(PROMPTS[0]), mx.arange(n), llm.chain_mask(0, n), sequence)
        sequence.commit(PROMPTS[0])
        return sequence

    rng, verified, stepped = np.random.default_rng(0), [], []
    for _ in range(trees):
        beams = random_beams(rng, 4, 5, VOCAB)
        tree = pack_beams(beams)
        hidden = forward(
            mx.array(tree.tokens), mx.array(n + tree.depths), tree_mask(tree, n), prefilled()
        )
        logits = forward.lm_head(hidden)
        for w, beam in enumerate(beams.tolist()):
            sequence = prefilled()
            for d, token in enumerate(beam):
                one = forward(
                    mx.array([token]), mx.array([n + d]), llm.chain_mask(n + d, 1), sequence
                )
                sequence.commit([token])
                stepped.append(forward.lm_head(one)[0])
                verified.append(logits[tree.unpack[w, d]])
    return np.array(mx.stack(verified)), np.array(mx.stack(stepped))


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_quantized_tree_verify_rounds_as_one_token_steps_on_the_cpu(target, plan):
    if mx.default_device() != mx.cpu:
        pytest.skip("asserted on the CPU: a GPU's qmm (T rows) and qmv (one) may round apart")
    verified, stepped = tree_and_steps(target, plan)
    assert np.array_equal(verified, stepped)


def test_a_float_tree_verify_differs_from_one_token_steps_by_float_error():
    """The contrast that shows the bitwise test can fail: the same attention with float32
    projections (BLAS, whose T-row and one-row products sum in different orders)."""
    verified, stepped = tree_and_steps(quantized(None), "generic")
    assert not np.array_equal(verified, stepped)
    np.testing.assert_allclose(verified, stepped, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# greedy answers equal the quantized target's own


@pytest.mark.parametrize("plan", list(PLANS))
def test_autoregressive_equals_mlx_lm(target, answers, plan):
    for prompt, want in zip(PROMPTS, answers, strict=True):
        assert decoded(target, prompt, plan=plan)[0] == want


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("shape", [BeamShape(1, 2), BeamShape(4, 5)], ids=lambda s: s.label)
def test_greedy_redrafter_equals_the_targets_own(target, answers, plan, shape):
    """The drafter reads the target's quantized embedding (and scores with its head)."""
    drafter = BeamDrafter(random_drafter(HIDDEN, VOCAB, seed=2), target.model.embed_tokens)
    for prompt, want in zip(PROMPTS, answers, strict=True):
        assert decoded(target, prompt, drafter, shape, plan)[0] == want


@pytest.mark.parametrize("plan", list(PLANS))
def test_accepted_drafts_equal_the_targets_own(target, answers, plan):
    """Drafts that match are accepted from the tree verify's rows (a known count a step)."""
    for prompt, want in zip(PROMPTS, answers, strict=True):
        oracle = PartOracle(want, VOCAB, seed=3)
        got, steps = decoded(target, prompt, oracle, BeamShape(3, 5), plan)
        assert got == want
        assert steps < N * 3 // 4  # drafts were accepted


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=lambda q: f"q{q[0]}g{q[1]}")
def test_greedy_lookup_beams_equal_the_targets_own(quantization, plan):
    """An 8-token vocabulary: greedy answers fall into loops that lookup beams copy, so whole
    copied runs are accepted from the tree verify's rows."""
    target = quantized(*quantization, seed=3, vocab=8)
    drafter = BeamDrafter(random_drafter(HIDDEN, 8, seed=4), target.model.embed_tokens)
    want = mlx_lm_greedy(target, [1, 2, 3], N)
    for beams, shape in (
        (None, BeamShape(length=5, lookup=4)),
        (drafter, BeamShape(2, 4, lookup=3)),
    ):
        got, steps = decoded(target, [1, 2, 3], beams, shape, plan)
        assert got == want, shape
        assert steps < N * 3 // 4, shape  # copied loops were accepted


@pytest.fixture(scope="module")
def field_drafters(target, tmp_path_factory):
    """A random drafter of each field type for the target, as its authors lay one out."""
    root = tmp_path_factory.mktemp("drafters")
    config = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_hidden_layers": LAYERS}
    (root / "config.json").write_text(json.dumps(config))
    return {k: create_drafter(write_demo_drafter(root / k, root, k), target) for k in KINDS}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_field_drafters_equal_the_targets_own(target, answers, field_drafters, plan, kind):
    """Each type at its own default shape on the plan."""
    drafter = field_drafters[kind]
    shape = PLANS[plan].shape_for(drafter)
    for prompt, want in zip(PROMPTS, answers, strict=True):
        assert decoded(target, prompt, drafter, shape, plan)[0] == want, shape
