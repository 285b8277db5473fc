"""The verify forward and the KV cache against plain sequential decoding."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from support import run_steps, tiny_llama

from redrafter_mlx.backend.cpu.fused import ONE_TOKEN_EXP2_MIN, attention, exp2, rope_tables
from redrafter_mlx.backend.cpu.kernels import cpu_kernels
from redrafter_mlx.backend.plan import CPU_PLAN, make_forward
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.tree import pack_beams, tree_mask

PREFIX = [3, 14, 15, 9, 2, 6]


def _sequential(model, tokens):
    """Hidden states and logits of a fresh causal forward over ``tokens``."""
    cache = llm.new_sequence(model)
    n = len(tokens)
    hidden = llm.forward(model, mx.array(tokens), mx.arange(n), llm.chain_mask(0, n), cache)
    return hidden, llm.lm_head(model, hidden), cache


def _verify_tree(model, beams):
    """Prefill PREFIX, then verify the packed tree of ``beams`` in one forward."""
    tree = pack_beams(beams)
    _, _, cache = _sequential(model, PREFIX)
    cache.commit(PREFIX)
    positions = mx.array(len(PREFIX) + tree.depths)
    hidden = llm.forward(
        model, mx.array(tree.tokens), positions, tree_mask(tree, cache.offset), cache
    )
    return tree, hidden, llm.lm_head(model, hidden), cache


@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_equals_sequential_paths(seed):
    model = tiny_llama(seed=seed, tie=bool(seed % 2))
    rng = np.random.default_rng(seed)
    beams = rng.integers(0, 4, size=(6, 5))  # small alphabet: many shared prefixes
    tree, hidden, logits, _ = _verify_tree(model, beams)
    assert tree.size < beams.size
    for w in range(beams.shape[0]):
        ref_hidden, ref_logits, _ = _sequential(model, PREFIX + beams[w].tolist())
        nodes = mx.array(tree.unpack[w])
        np.testing.assert_allclose(hidden[nodes], ref_hidden[len(PREFIX) :], atol=1e-4)
        np.testing.assert_allclose(logits[nodes], ref_logits[len(PREFIX) :], atol=1e-4)


def test_compaction_equals_recomputed_kv():
    model = tiny_llama(seed=5)
    beams = np.array([[7, 1, 2, 3], [7, 1, 4, 5], [7, 6, 2, 3]])
    tree, _, _, cache = _verify_tree(model, beams)
    keep = 3  # root + 2 accepted drafts of beam 1
    cache.stage(mx.array(tree.unpack[1]))
    cache.commit(beams[1, :keep].tolist())
    _, _, ref = _sequential(model, PREFIX + beams[1, :keep].tolist())
    n = len(PREFIX) + keep
    assert cache.offset == n and list(cache.ids) == PREFIX + beams[1, :keep].tolist()
    for got, want in zip(cache.kv.arrays(), ref.kv.arrays(), strict=True):
        np.testing.assert_allclose(got[..., :n, :], want[..., :n, :], atol=1e-5)


def _mlx_lm_greedy(model, prompt, n):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(token) for token, _ in steps]


def _ours_greedy(model, prompt, n):
    out = []
    for step in run_steps(model, prompt, sampler=make_sampler(0.0)):
        out += step.tokens
        if len(out) >= n:
            return out[:n]


@pytest.mark.parametrize("seed", range(3))
def test_autoregressive_equals_mlx_lm(seed):
    model = tiny_llama(seed=seed, tie=seed == 1)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 64, size=7)]
    assert _ours_greedy(model, prompt, 32) == _mlx_lm_greedy(model, prompt, 32)


def test_quantized_target_gets_float_cache_and_same_tokens():
    model = tiny_llama(seed=2)
    nn.quantize(model, group_size=32, bits=8)
    cache = llm.new_sequence(model)
    assert cache.kv.dtype == mx.float32
    assert _ours_greedy(model, PREFIX, 24) == _mlx_lm_greedy(model, PREFIX, 24)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("plan", [Plan(llama_layers=True), CPU_PLAN])
def test_compiled_small_forwards_equal_module_forward(quantized, plan):
    """On the specialised Llama path decode-sized forwards run compiled layer halves (on the
    CPU plan with W @ x.T projections at 2-3 rows); they must match running mlx-lm's modules
    directly (the prefill path)."""
    model = tiny_llama(seed=7, tie=True)
    if quantized:
        nn.quantize(model, group_size=32, bits=8)
    forwards = {
        rows: make_forward(model, replace(plan, compiled_max_rows=rows))
        for rows in (plan.compiled_max_rows, 0)
    }
    rng = np.random.default_rng(7)
    for t in (1, 2, 3, 4, 9):
        tokens = [int(x) for x in rng.integers(0, 64, size=len(PREFIX) + t)]
        results = []
        for max_rows in (plan.compiled_max_rows, 0):  # 0: every forward runs the modules
            _, _, cache = _sequential(model, tokens[: len(PREFIX)])
            cache.commit(tokens[: len(PREFIX)])
            n = len(PREFIX)
            hidden = forwards[max_rows](
                mx.array(tokens[n:]), mx.arange(n, n + t), llm.chain_mask(n, t), cache
            )
            results.append((hidden, cache.kv.keys[1][..., : n + t, :]))
        (got, got_keys), (want, want_keys) = results
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(got_keys, want_keys, atol=1e-4, rtol=1e-4)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope", [{}, {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, {"rope_traditional": True}]
)
def test_rope_tables_rotate_as_the_layers_rope(rope):
    """On the CPU a forward computes RoPE's cos/sin once for all layers (``rope_tables``); the
    result is the same as each layer running its RoPE module, bit for bit, for plain and
    llama3-scaled RoPE (traditional RoPE keeps the module)."""
    model = tiny_llama(seed=5, **rope)
    tables = rope_tables(model.model.layers[0].self_attn, mx.arange(3), mx.float32)
    assert (tables is None) == bool(rope.get("rope_traditional"))
    forwards = {flag: make_forward(model, replace(CPU_PLAN, rope_tables=flag)) for flag in (1, 0)}
    for t in (1, 2, 40):  # compiled decode steps and a module-run prompt
        results = []
        for flag in (True, False):
            cache = llm.new_sequence(model)
            positions = mx.arange(100, 100 + t)  # after 100 (empty) cached positions
            cache.commit([0] * 100)
            mask = llm.chain_mask(100, t)
            hidden = forwards[flag](mx.arange(t) % 64, positions, mask, cache)
            results.append((hidden, cache.kv.keys[0][..., 100 : 100 + t, :]))
        (got, got_keys), (want, want_keys) = results
        assert mx.array_equal(got, want).item() and mx.array_equal(got_keys, want_keys).item()


@pytest.mark.parametrize("kernel", [False, True], ids=["mlx-ops", "cpu-kernels"])
@pytest.mark.parametrize("cached", [0, 5, 700, 2100, 7000])
@pytest.mark.parametrize("t", [1, 3, 16, 40])
def test_split_attention_equals_masked_attention(t, cached, kernel):
    """The CPU's attention (grouped query heads, the cached prefix unmasked and the new block
    under its (T, T) mask, one softmax over both, :func:`exp2`) computes what
    ``mx.fast.scaled_dot_product_attention`` does with the whole (T, S + T) mask: tree rows
    (random ancestor sets, each node seeing itself) and a prompt chunk's causal rows; a
    one-token step (no mask) as one softmax, and from ``ONE_TOKEN_EXP2_MIN`` scores (7,000
    cached tokens here) as the split's one block. With the CPU kernels
    (:func:`kernel_attention`: ``tree_attention`` up to 32 rows per K/V head, else the grouped
    products around ``masked_softmax``) alike."""
    kernels = cpu_kernels() if kernel else None
    if kernel and kernels is None:
        pytest.skip("no CPU kernels on this platform")
    rng = np.random.default_rng(t + cached)
    queries, keys, values = (
        mx.array(3 * rng.standard_normal(shape).astype(np.float32))
        for shape in ((1, 6, t, 8), (1, 2, cached + t, 8), (1, 2, cached + t, 8))
    )
    if cached == 7000:  # the one-token step's case runs the split: 2 K/V heads x 3 rows
        assert 2 * 3 * (cached + t) >= ONE_TOKEN_EXP2_MIN
    tree = mx.array(rng.random((t, t)) < 0.5) | mx.eye(t, dtype=mx.bool_)
    masks = [None, llm.chain_mask(cached, t)] if t == 1 else [llm.chain_mask(cached, t)]
    if t > 1:
        masks.append(mx.concatenate([mx.ones((t, cached), mx.bool_), tree], axis=1))
    for mask in masks:
        want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=mask)
        got = attention(queries, keys, values, 0.3, mask, grouped=True, kernels=kernels)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_exp2_is_a_power_of_two_to_float32_precision():
    """:func:`exp2` over the range a softmax's shifted scores take (0 down to -inf): relative
    error within a few float32 ulps where 2**x is a normal float, 0 below 2**-127."""
    x = np.concatenate([-np.geomspace(1e-8, 126, 20000), np.linspace(-126, 0, 20000), [0.0]])
    got = np.array(exp2(mx.array(x.astype(np.float32))))
    want = np.exp2(x.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=3e-7)
    assert np.array(exp2(mx.array([-127.5, -200.0, -np.inf], mx.float32))).tolist() == [0, 0, 0]


def test_fused_projections_keep_module_weights():
    """The compiled forward stacks q/k/v and gate/up into one matmul each on its copy of the
    model; the copy's modules' weights (which its prefill and mlx-lm's forward use) keep their
    values and shapes, and the model itself is untouched."""
    model = tiny_llama(seed=3)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    forward = make_forward(model, CPU_PLAN)
    cache = llm.new_sequence(model)
    tokens, mask = mx.array([1, 2]), llm.chain_mask(0, 2)
    mx.eval(forward(tokens, mx.arange(2), mask, cache))
    for params in (model.parameters(), forward.model.parameters()):
        after = dict(tree_flatten(params))
        assert after.keys() == before.keys()
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value)
    assert _mlx_lm_greedy(forward.model, PREFIX, 16) == _mlx_lm_greedy(model, PREFIX, 16)
    assert _ours_greedy(model, PREFIX, 16) == _mlx_lm_greedy(model, PREFIX, 16)


def test_the_generic_forward_dispatches_its_first_layer_at_once():
    """The device starts after one layer's graph (not ``every`` layers': the wait a tree step
    exposes), then every ``every``-th layer; never the last, whose output the caller hands
    over."""
    assert llm.dispatched_layers(30, 5) == [0, 4, 9, 14, 19, 24]
    assert llm.dispatched_layers(6, 2) == [0, 1, 3]
    assert llm.dispatched_layers(1, 5) == []
    model = tiny_llama(layers=4)
    layers = llm.inner_model(llm.Forward(model, dispatch_every=2).model).layers
    assert [isinstance(x, llm.Dispatched) for x in layers] == [True, True, False, False]
