"""The CPU primitives (backend/cpu/kernels.py, csrc/primitives.cpp): built, loaded, exact to
float32 precision, masked as attention masks, elementwise where they should be, and built
atomically."""

import os
import platform
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.backend.cpu import blas, kernels

BUILDS_HERE = sys.platform.startswith("linux") and platform.machine() == "x86_64"
AVX512 = "avx512f" in blas.cpu_flags()


@pytest.fixture(scope="module")
def built():
    if not BUILDS_HERE:
        pytest.skip("the CPU kernels are built on Linux x86-64 only")
    found = kernels.cpu_kernels()
    assert found is not None, "the CPU kernels should build here (see the note above)"
    return found


@pytest.fixture(scope="module")
def softmax(built):
    return built.masked_softmax


def reference(scores: np.ndarray, visible: np.ndarray | None) -> np.ndarray:
    """float64 softmax over the last axis, row r's last T columns masked by visible[r % T]."""
    x = scores.astype(np.float64)
    if visible is not None:
        t = visible.shape[0]
        rows = np.arange(x.shape[-2]) % t
        masked = np.ones(x.shape[-2:], bool)
        masked[:, -t:] = visible[rows]
        x = np.where(masked, x, -np.inf)
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    ("shape", "t"),
    [
        ((1, 3, 3, 1), None),  # one key
        ((2, 5, 17), None),  # a tail shorter than a vector
        ((1, 3, 9, 8003), 3),  # a 3-node tree after 8,000 keys
        ((1, 2, 32, 40), 16),  # a padded 16-node tree, 24 cached keys
        ((1, 3, 1536, 1024), 512),  # a prompt chunk: many rows, its rows over threads
    ],
)
def test_softmax_matches_float64(softmax, shape, t):
    rng = np.random.default_rng(sum(shape))
    scores = (4 * rng.standard_normal(shape)).astype(np.float32)
    visible = None
    if t is not None:
        visible = (rng.random((t, t)) < 0.5) | np.eye(t, dtype=bool)
    got = np.array(softmax(mx.array(scores), None if visible is None else mx.array(visible)))
    want = reference(scores, visible)
    # float32 scores less their maximum round by up to half an ulp of 32 (2e-6), relative in
    # exp; mx.softmax(precise=True) is within 9e-6 here
    np.testing.assert_allclose(got, want, rtol=5e-6, atol=1e-30)
    if visible is not None:  # masked columns are exact zeros
        rows = np.arange(shape[-2]) % t
        assert (got[..., -t:][..., ~visible[rows]] == 0).all()


def test_softmax_extremes(softmax):
    """Scores far below the row's maximum give 0, not NaN; -inf too; a constant row is
    uniform; a strided (transposed) input is read as its values, not its buffer."""
    scores = mx.array([[0.0, -100.0, -mx.inf, 5.0], [2.0, 2.0, 2.0, 2.0]])
    got = np.array(softmax(scores, None))
    assert got[0, 1] == 0 and got[0, 2] == 0
    np.testing.assert_allclose(got[0, [0, 3]], [1 / (1 + np.exp(5.0)), 1 / (1 + np.exp(-5.0))])
    np.testing.assert_allclose(got[1], 0.25, rtol=1e-7)
    square = mx.arange(16, dtype=mx.float32).reshape(4, 4) / 3
    np.testing.assert_allclose(
        softmax(square.T, None), reference(np.array(square).T, None), rtol=3e-6
    )


def test_softmax_vector_and_tail_round_alike(softmax):
    """A score in the vector lanes and the same score in the scalar tail (column 16 of 17)
    get the same bits: tree and one-token calls put a key in either."""
    rng = np.random.default_rng(7)
    scores = (3 * rng.standard_normal((64, 17))).astype(np.float32)
    scores[:, 16] = scores[:, 0]
    got = np.array(softmax(mx.array(scores), None))
    np.testing.assert_array_equal(got[:, 16], got[:, 0])


def test_softmax_rejects_bad_input(softmax):
    with pytest.raises(ValueError, match="float32"):
        softmax(mx.zeros((2, 4), mx.float16), None)
    with pytest.raises(ValueError, match=r"\(T, T\)"):
        softmax(mx.zeros((3, 4)), mx.ones((2, 2), mx.bool_))  # 2 does not divide 3 rows


def attention_reference(q, k, v, scale, visible):
    """float64 attention: q (1, H, T, D) over k, v (1, KV, S + T, D), query heads grouped per
    K/V head, the last T keys under visible (T, T)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    heads, t = q.shape[1], q.shape[2]
    k = np.repeat(k, heads // k.shape[1], axis=1)
    v = np.repeat(v, heads // v.shape[1], axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)  # (1, H, T, S + T)
    if visible is not None:
        scores[..., -t:] = np.where(visible, scores[..., -t:], -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize(
    ("heads", "kv_heads", "t", "cached", "d"),
    [
        (9, 3, 1, 0, 64),  # the first token: only itself
        (9, 3, 1, 8000, 64),  # a decode step after 8,000 tokens: every chunk, threads
        (9, 3, 3, 515, 64),  # a 3-node tree, a chunk boundary inside the keys
        (9, 3, 8, 1021, 64),  # 24 rows per K/V head, the new keys across two chunks
        (4, 1, 8, 300, 128),  # D 128, 32 rows (the most)
        (2, 2, 5, 37, 64),  # no grouping, keys fewer than a vector
        (2, 2, 1, 700, 128),  # one row per K/V head, values over several tiles
    ],
)
def test_tree_attention_matches_float64(built, heads, kv_heads, t, cached, d):
    """Against float64 attention over the cache's strided views (a buffer with room to
    spare, as the sequence's cache holds them), random ancestor sets as trees have."""
    rng = np.random.default_rng(heads + t + cached)
    room = cached + t + 40
    q = mx.array(2 * rng.standard_normal((1, heads, t, d)).astype(np.float32))
    k_buffer, v_buffer = (
        mx.array(rng.standard_normal((1, kv_heads, room, d)).astype(np.float32)) for _ in "kv"
    )
    k, v = k_buffer[..., : cached + t, :], v_buffer[..., : cached + t, :]
    visible = None
    if t > 1:
        visible = (rng.random((t, t)) < 0.5) | np.eye(t, dtype=bool)
    got = built.tree_attention(q, k, v, 0.2, None if visible is None else mx.array(visible))
    want = attention_reference(q, k, v, 0.2, visible)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("cached", [0, 5, 13, 509, 510, 1021, 4093])
def test_tree_rows_equal_one_token_steps_bit_for_bit(built, cached):
    """A chain's node t, verified in a tree, attends as the one-token step after cached + t
    tokens does, to the bit: plain decoding and a verified tree then choose the same tokens
    even where two logits nearly tie. The tree's masked keys (after each row's own) must not
    move a key into another place of its vector block, nor change the order a row's weights
    are summed in (the cache lengths put the chunk's end before, in and after a block)."""
    rng = np.random.default_rng(cached)
    t = 3
    q = mx.array(rng.standard_normal((1, 9, t, 64)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 3, cached + t, 64)).astype(np.float32)) for _ in "kv")
    tree = built.tree_attention(q, k, v, 0.125, mx.array(np.tril(np.ones((t, t), bool))))
    for node in range(t):
        keys = cached + node + 1
        step = built.tree_attention(
            q[:, :, node : node + 1], k[..., :keys, :], v[..., :keys, :], 0.125, None
        )
        assert np.array_equal(np.array(step), np.array(tree[:, :, node : node + 1])), node


@pytest.mark.skipif(not BUILDS_HERE or not AVX512, reason="needs an AVX-512 x86_64 CPU")
def test_the_8_float_code_where_avx512_is_passes_these_tests_too():
    """AVX-512 machines run the 16-float code and AVX2 machines the 8-float one: each width's
    exactness must hold whichever machine runs the tests (CI's may lack AVX-512: a chunk's
    last, partial block once had its own copy of the score code, which AVX2 machines passed
    and AVX-512 ones failed)."""
    env = {**os.environ, "REDRAFTER_KERNEL_VECTORS": "8"}
    tests = "bit_for_bit or float64 or threaded or joint or swiglu"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout


def test_threaded_calls_repeat_bit_for_bit(built):
    """The kept threads take each call's chunks afresh (a stale claim from the call before
    would compute a chunk of the wrong job): many calls in a row, threaded and alone, every
    one the same bits as the first, as a decode step's 30 layers run them."""
    rng = np.random.default_rng(7)
    q = mx.array(rng.standard_normal((1, 9, 3, 64)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 3, 4099, 64)).astype(np.float32)) for _ in "kv")
    visible = mx.array(np.tril(np.ones((3, 3), bool)))
    small = [x[..., :40, :] for x in (k, v)]  # below the threaded size: one thread
    outs = [
        built.tree_attention(q, *(small if i % 3 == 2 else (k, v)), 0.125, visible)
        for i in range(60)
    ]
    mx.eval(outs)
    first, first_small = np.array(outs[0]), np.array(outs[2])
    for i, out in enumerate(outs):
        assert np.array_equal(np.array(out), first_small if i % 3 == 2 else first)


def test_tree_attention_rejects_what_it_cannot_run(built):
    q, kv = mx.zeros((1, 9, 4, 64)), mx.zeros((1, 3, 10, 64))
    with pytest.raises(ValueError, match="32"):  # 3 x 12 = 36 rows per K/V head
        built.tree_attention(mx.zeros((1, 9, 12, 64)), kv, kv, 1.0, None)
    with pytest.raises(ValueError, match="D must be"):
        built.tree_attention(mx.zeros((1, 9, 1, 80)), *[mx.zeros((1, 3, 5, 80))] * 2, 1.0, None)
    with pytest.raises(ValueError, match="float32"):
        built.tree_attention(q.astype(mx.float16), kv, kv, 1.0, None)
    with pytest.raises(ValueError, match=r"\(T, T\)"):
        built.tree_attention(q, kv, kv, 1.0, mx.ones((4, 5), mx.bool_))


def test_joint_attention_attends_each_segment_as_alone(built):
    """A joint forward's layer in one call: each segment (one-token steps and masked trees,
    caches short and long enough to thread, strided cache views) gets the bits
    ``tree_attention`` gives it alone, and the padding rows after the last are zeros."""
    rng = np.random.default_rng(11)
    counts, cached = [1, 3, 1, 4], [5, 700, 130, 4100]
    q = mx.array(rng.standard_normal((1, 9, sum(counts) + 3, 64)).astype(np.float32))
    caches = [
        [mx.array(rng.standard_normal((1, 3, s + t + 20, 64)).astype(np.float32))[:, :, : s + t]
         for _ in "kv"]
        for s, t in zip(cached, counts, strict=True)
    ]  # fmt: skip
    visible = [
        None if t == 1 else mx.array((rng.random((t, t)) < 0.5) | np.eye(t, dtype=bool))
        for t in counts
    ]
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    joint = np.array(built.joint_attention(q, keys, values, counts, 0.125, visible))
    start = 0
    for (k, v), t, mask in zip(caches, counts, visible, strict=True):
        alone = built.tree_attention(q[:, :, start : start + t], k, v, 0.125, mask)
        assert np.array_equal(np.array(alone), joint[:, :, start : start + t])
        start += t
    assert not joint[:, :, start:].any()


def test_joint_attention_rejects_what_it_cannot_run(built):
    q, kv = mx.zeros((1, 9, 4, 64)), mx.zeros((1, 3, 10, 64))
    with pytest.raises(ValueError, match="per segment"):
        built.joint_attention(q, [kv], [kv, kv], [1, 1], 1.0, [None, None])
    with pytest.raises(ValueError, match="counts' sum"):
        built.joint_attention(q, [kv, kv], [kv, kv], [3, 2], 1.0, [None, None])
    with pytest.raises(ValueError, match="32"):
        built.joint_attention(mx.zeros((1, 9, 12, 64)), [kv], [kv], [11], 1.0, [None])
    with pytest.raises(ValueError, match=r"\(T, T\)"):
        built.joint_attention(q, [kv], [kv], [2], 1.0, [mx.ones((3, 3), mx.bool_)])


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (3, 1536), (5, 37), (2, 8), (1, 3)])
def test_swiglu_is_silu_gate_times_up(built, rows, width):
    """silu(gate) * up to float32 rounding (float64 reference), over gates from far below to
    far above zero (where exp under- and overflows), widths with and without a partial
    vector at the end."""
    rng = np.random.default_rng(width + rows)
    gate = rng.normal(0, 6, (rows, width)).astype(np.float32)
    gate.flat[:3] = [-200.0, 200.0, 0.0][: gate.size]
    up = rng.normal(0, 2, (rows, width)).astype(np.float32)
    got = np.array(built.swiglu(mx.array(np.concatenate([gate, up], axis=1))))
    g = gate.astype(np.float64)
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * up, rtol=1e-6, atol=1e-30)


def test_swiglu_rows_do_not_depend_on_their_neighbours(built):
    """Each row of a batch gets the bits it gets alone, in any leading shape (a tree's row and
    a one-token step run the same MLP), and a strided view (a transposed product) is read as
    its values."""
    rng = np.random.default_rng(3)
    gate_up = mx.array(rng.normal(0, 4, (6, 2 * 45)).astype(np.float32))
    batch = np.array(built.swiglu(gate_up[None]))
    for r in range(6):
        assert np.array_equal(np.array(built.swiglu(gate_up[r : r + 1]))[0], batch[0, r])
    strided = mx.array(np.ascontiguousarray(np.array(gate_up).T)).T
    assert np.array_equal(np.array(built.swiglu(strided)), batch[0])


def test_swiglu_rejects_what_it_cannot_run(built):
    with pytest.raises(ValueError, match="float32"):
        built.swiglu(mx.zeros((2, 8), mx.float16))
    with pytest.raises(ValueError, match="even"):
        built.swiglu(mx.zeros((2, 7)))


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """A compiler that fails leaves no half-built module where the next run would load it."""
    if not BUILDS_HERE:
        pytest.skip("the CPU kernels are built on Linux x86-64 only")
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        kernels._build()
    assert list((tmp_path / "kernels").iterdir()) == []


def test_builds_from_scratch(tmp_path, monkeypatch):
    """An empty cache folder: one build, into its versioned folder, that loads and agrees."""
    if not BUILDS_HERE:
        pytest.skip("the CPU kernels are built on Linux x86-64 only")
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    path = kernels._build()
    assert path.parent.parent == tmp_path / "kernels" and path.exists()
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [path.parent.name]
    kernels._check(kernels._load(path))
    assert kernels._build() == path  # cached: no second build
