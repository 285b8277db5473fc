"""The CPU plan's verify forward: plain Llama/Qwen2 blocks as compiled halves around attention,
with fused projections, RoPE from shared cos/sin tables, grouped attention and the CPU kernels
(:mod:`~redrafter_mlx.backend.cpu.kernels`). Numerically it is the generic forward
(:class:`redrafter_mlx.core.decode.llm.Forward`) to float32 rounding; only how it runs differs.

Legend: T new tokens, S cached tokens, H hidden size, D head dim.

:class:`FusedForward` works on its own structural copy of the target (the caller's model is
never changed): the copy's q/k/v and gate/up Linears hold views of one stacked matrix each, so
each decode step runs one product instead of several, and the copy's compiled halves are
traced once per number of tokens.
"""

from __future__ import annotations

import functools
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2

from redrafter_mlx.backend.cpu.kernels import TREE_HEAD_SIZES, TREE_ROWS, CpuKernels, cpu_kernels
from redrafter_mlx.core.decode.joint import JointView
from redrafter_mlx.core.decode.llm import Forward, TokenRope, chain_mask, compute_dtype, inner_model
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.sequence import View
from redrafter_mlx.core.decode.tree import verified_size

GENERIC = Plan()


def _matmul(weight: mx.array, x: mx.array, transposed: bool) -> mx.array:
    """x (1, T, in) @ weight (out, in).T -> (1, T, out), as ``weight @ x.T`` when ``transposed``."""
    return (weight @ x[0].T).T[None] if transposed else x @ weight.T


def _project(linear: nn.Module, x: mx.array, transposed: bool) -> mx.array:
    """x (1, T, in) -> (1, T, out); as ``W @ x.T`` when ``transposed`` and ``linear`` is a plain
    (unquantized) Linear."""
    if not transposed or type(linear) is not nn.Linear:
        return linear(x)
    y = _matmul(linear.weight, x, True)
    return y + linear.bias if "bias" in linear else y


def _fuse(linears: list[nn.Module]) -> mx.array | None:
    """Stack plain bias-free Linears' weights (out_i, in) into one (sum of out_i, in) matrix.

    Each module's weight becomes its rows of the stack (a view: the weights are not held
    twice). One matmul instead of several costs less per decode step (fewer BLAS calls).
    None, and nothing changed, when any of them is quantized or has a bias.
    """
    if any(type(x) is not nn.Linear or "bias" in x for x in linears):
        return None
    stacked = mx.concatenate([x.weight for x in linears])
    mx.eval(stacked)
    start = 0
    for x in linears:
        rows = x.weight.shape[0]
        x.weight = stacked[start : start + rows]
        start += rows
    mx.eval([x.weight for x in linears])
    return stacked


def _split_rows(linears: list[nn.Module]) -> list[int]:
    """Where ``_fuse``'s stacked output splits back into each Linear's output."""
    ends = [x.weight.shape[0] for x in linears]
    return [sum(ends[: i + 1]) for i in range(len(ends) - 1)]


def _mlp(mlp: nn.Module, gate_up: mx.array | None, x: mx.array, transposed: bool, swiglu):
    """The layer's MLP; mlx-lm's Llama MLP (SiLU-gated) runs its own projections here when
    they are fused (gate and up as one ``gate_up`` matmul) or transposed, and its gate as the
    CPU kernel ``swiglu`` (float32) where that is given."""
    if not isinstance(mlp, llama.MLP) or (gate_up is None and not transposed):
        return mlp(x)
    if gate_up is None:
        gate, up = _project(mlp.gate_proj, x, transposed), _project(mlp.up_proj, x, transposed)
        return _project(mlp.down_proj, nn.silu(gate) * up, transposed)
    fused = _matmul(gate_up, x, transposed)
    if swiglu is not None and fused.dtype == mx.float32:
        return _project(mlp.down_proj, swiglu(fused), transposed)
    gate, up = mx.split(fused, 2, axis=-1)
    return _project(mlp.down_proj, nn.silu(gate) * up, transposed)


def rope_tables(attn, positions: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array] | None:
    """RoPE's cos and sin at ``positions (T,)``, each (1, T, 1, D / 2), for every layer to share.

    On the CPU backend ``mx.fast.rope`` with per-token offsets runs as a graph that recomputes
    the angles for every call (two per layer); a forward computes them once. The tables come
    from the layer's own RoPE module applied to ``[1, .., 1, 0, .., 0]``, which returns exactly
    the cos and sin it rotates with (any base, scaling or frequencies). None for RoPE that is
    traditional (interleaved) or partial, or not an ``nn.RoPE``-like module.
    """
    rope, d = attn.rope, attn.k_proj.weight.shape[0] // attn.n_kv_heads
    rope = rope.inner if isinstance(rope, TokenRope) else rope
    if getattr(rope, "traditional", True) or getattr(rope, "dims", None) != d:
        return None
    t, half = positions.shape[0], d // 2
    basis = mx.concatenate([mx.ones((half,)), mx.zeros((half,))]).astype(dtype)
    rotated = rope(mx.broadcast_to(basis, (t, 1, 1, d)), offset=positions).reshape(1, t, 1, d)
    return rotated[..., :half], rotated[..., half:]


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (1, T, heads, D) rotated as ``mx.fast.rope`` rotates (halves, not interleaved)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _before_attention(layer, plan: Plan, qkv: mx.array | None, h: mx.array, *rope_args):
    """h (1, T, H) -> queries (1, heads, T, D), keys and values (1, kv_heads, T, D).

    ``qkv`` is the layer's fused q/k/v weight (``_fuse``), or None to run the three Linears.
    ``rope_args``: ``(cos, sin)`` from :func:`rope_tables`, or ``(positions,)`` for the layer's
    own RoPE module.
    """
    attn, t = layer.self_attn, h.shape[1]
    transposed = t in plan.transposed_rows
    x = layer.input_layernorm(h)
    linears = [attn.q_proj, attn.k_proj, attn.v_proj]
    if qkv is None:
        queries, keys, values = (_project(p, x, transposed) for p in linears)
    else:
        queries, keys, values = mx.split(_matmul(qkv, x, transposed), _split_rows(linears), -1)
    values = values.reshape(1, t, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if len(rope_args) == 2:
        queries = _rotate(queries.reshape(1, t, attn.n_heads, -1), *rope_args)
        keys = _rotate(keys.reshape(1, t, attn.n_kv_heads, -1), *rope_args)
        return queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3), values
    (positions,) = rope_args
    # (T, heads, 1, D): tokens on the batch axis so RoPE applies one offset per token.
    queries = attn.rope(queries.reshape(t, attn.n_heads, 1, -1), offset=positions)
    keys = attn.rope(keys.reshape(t, attn.n_kv_heads, 1, -1), offset=positions)
    return queries.transpose(2, 1, 0, 3), keys.transpose(2, 1, 0, 3), values


def _after_attention(
    layer, plan: Plan, gate_up: mx.array | None, swiglu, h: mx.array, out: mx.array
) -> mx.array:
    """Residual stream h (1, T, H) and attention output (1, heads, T, D) -> the layer's output
    (``gate_up`` and ``swiglu``: :func:`_mlp`'s)."""
    attn, t = layer.self_attn, h.shape[1]
    transposed = t in plan.transposed_rows
    h = h + _project(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(1, t, -1), transposed)
    return h + _mlp(layer.mlp, gate_up, layer.post_attention_layernorm(h), transposed, swiglu)


def attention(
    queries,
    keys,
    values,
    scale: float,
    mask: mx.array | None,
    grouped: bool,
    kernels: CpuKernels | None = None,
):
    """Queries (1, heads, T, D), keys/values (1, kv_heads, S + T, D), mask (T, S + T) ->
    (1, heads, T, D). The new tokens are the last T keys; every query sees all S cached ones
    (the forward's masks are chains and trees after the cache: their first S columns are all
    True, and a long cache's attention reads only the last T).

    ``grouped``: :func:`split_attention` (query heads grouped per K/V head, the cached prefix
    unmasked, exponentials by :func:`exp2`), which costs less than
    ``mx.fast.scaled_dot_product_attention``'s fallback on the CPU backend; otherwise that
    fused kernel. ``kernels``: with ``grouped``, :func:`kernel_attention` instead of
    :func:`split_attention`.
    """
    if not grouped:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    if kernels is not None:
        return kernel_attention(queries, keys, values, scale, mask, kernels)
    return split_attention(queries, keys, values, scale, mask)


def kernel_attention(queries, keys, values, scale: float, mask, kernels: CpuKernels):
    """Attention by our CPU primitives (``backend/cpu/kernels.py``): a few query rows per K/V head
    (decode steps, trees) as one ``tree_attention``, which reads each cached key and value
    once; more (prompt chunks) as :func:`split_attention`'s grouped products around one
    ``masked_softmax``, a vectorised pass per row where the MLX-op softmax takes a dozen or
    more passes over the scores. Either masks only the new tokens' (T, T) block."""
    _, heads, t, d = queries.shape
    kv_heads, cached = keys.shape[1], keys.shape[2] - t
    visible = None if mask is None else mask[:, cached:]
    float32 = all(x.dtype == mx.float32 for x in (queries, keys, values))
    if float32 and d in TREE_HEAD_SIZES and heads // kv_heads * t <= TREE_ROWS:
        return kernels.tree_attention(queries, keys, values, scale, visible)
    grouped = (queries * scale).reshape(1, kv_heads, heads // kv_heads * t, d)
    product = partial(_grouped_product, rows=product_rows(t, heads // kv_heads))
    scores = product(grouped, keys.swapaxes(-1, -2)).astype(mx.float32)
    probs = kernels.masked_softmax(scores, visible)
    return product(probs.astype(values.dtype), values).reshape(1, heads, t, d)


def split_attention(queries, keys, values, scale: float, mask: mx.array | None) -> mx.array:
    """Attention in blocks of keys sharing one softmax: the S cached keys, which every query
    sees (no mask: nothing of size T x S is built or selected), and the T new ones under the
    mask's (T, T) block (one block of all keys when ``mask`` is None); their exponentials
    against one max, summed, and the output divided once by the total (exact: the softmax's
    own arithmetic, split by columns).

    On the CPU backend ``mx.exp`` runs about 12 ns an element (scalar), and a tree of T nodes
    takes ``heads * T * S`` of them per layer: :func:`exp2` on scores scaled by log2(e) costs
    less than half as much. Products run :func:`product_rows` rows at a time.
    """
    _, heads, t, d = queries.shape
    kv_heads, cached = keys.shape[1], keys.shape[2] - t
    rows = heads // kv_heads * t  # each K/V head's query group as rows
    # One softmax where the split cannot pay: a prompt chunk (scores too many for exp2's
    # passes to stay in cache), or scores too few for exp2 (mx.exp either way; one softmax is
    # fewer ops for small trees; a one-token step, unmasked, has fewer ops to save and wins
    # only past a few thousand cached tokens).
    least = EXP2_MIN if mask is not None else ONE_TOKEN_EXP2_MIN
    if t > 4 * SMALL_ROWS or kv_heads * rows * (cached + t) < least:
        return softmax_attention(queries, keys, values, scale, mask)
    grouped = (queries * (scale * LOG2_E)).reshape(1, kv_heads, rows, d)
    product = partial(_grouped_product, rows=product_rows(t, heads // kv_heads))
    if mask is None or rows * cached < SPLIT_MIN:  # a few ops cost less than fewer elements
        blocks = [(0, None, mask)]
    else:  # (T, T) block: the tree's ancestors, a chain's causal block
        blocks = [(0, cached, None), (cached, None, mask[:, cached:])]
    scores = []
    for start, stop, visible in blocks:  # (1, kv_heads, rows, keys), in log2 units
        block = product(grouped, keys[..., start:stop, :].swapaxes(-1, -2)).astype(mx.float32)
        scores.append(block if visible is None else _masked(block, visible, -mx.inf))
    peak = functools.reduce(mx.maximum, [x.max(axis=-1, keepdims=True) for x in scores])
    total, out = 0.0, 0.0
    for (start, stop, visible), block in zip(blocks, scores, strict=True):
        probs = _pow2(block - peak)  # peak is finite: each token sees itself
        probs = probs if visible is None else _masked(probs, visible, 0.0)
        total = total + probs.sum(axis=-1, keepdims=True)
        out = out + product(probs.astype(values.dtype), values[..., start:stop, :])
    return (out / total.astype(out.dtype)).reshape(1, heads, t, d)


def softmax_attention(queries, keys, values, scale: float, mask: mx.array | None) -> mx.array:
    """Query heads grouped per K/V head (one product each), every key under the whole mask,
    ``mx.softmax``: for prompt chunks, whose (group * T, S + T) scores per head are large."""
    _, heads, t, d = queries.shape
    kv_heads = keys.shape[1]
    grouped = (queries * scale).reshape(1, kv_heads, heads // kv_heads * t, d)
    scores = grouped @ keys.swapaxes(-1, -2)  # (1, kv_heads, group * T, S + T)
    if mask is not None:
        scores = _masked(scores, mask, -mx.inf)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values).reshape(1, heads, t, d)


def _masked(block: mx.array, visible: mx.array, fill: float) -> mx.array:
    """``block (1, K, group * T, n)`` with ``fill`` where ``visible (T, n)`` is False."""
    t, n = visible.shape
    kv_heads = block.shape[1]
    return mx.where(visible, block.reshape(1, kv_heads, -1, t, n), fill).reshape(block.shape)


# Below these many scores, MLX's per-op overhead (~10 us) outweighs the per-element savings:
# attention runs as one block over all keys, and ``mx.exp`` (one op) instead of exp2 (16);
# below EXP2_MIN a tree's attention is one ``mx.softmax`` (:func:`split_attention`), below
# ONE_TOKEN_EXP2_MIN a one-token step's.
# Above EXP2_MAX (8 MB of scores) exp2's 16 passes no longer stay in cache.
SPLIT_MIN = EXP2_MIN = 32768
ONE_TOKEN_EXP2_MIN = 40960  # 9 query heads: 4,551 cached tokens
EXP2_MAX = 1 << 21


def _pow2(x: mx.array) -> mx.array:
    """``2 ** x`` for ``x <= 0``: :func:`exp2` for mid-sized arrays, else ``mx.exp``."""
    return exp2(x) if EXP2_MIN <= x.size <= EXP2_MAX else mx.exp(x * LN_2)


SMALL_ROWS = 8  # the most rows the small-row BLAS kernel takes (backend/cpu/csrc/smallrows.c)


def product_rows(t: int, group: int) -> int | None:
    """Rows per matmul in the attention of ``t`` tokens with ``group`` query heads per K/V
    head: as many whole heads' ``t`` rows as the small-row kernel takes (up to 8), or chunks
    of 8 rows for the bigger verified trees (16, 32), so that kernel runs each product
    (OpenBLAS runs 9-48-row products against the cache slower, and its threads stall when the
    cores are shared); None: one product per K/V head (prompt chunks)."""
    if t > SMALL_ROWS:
        return SMALL_ROWS if t % SMALL_ROWS == 0 and t <= 4 * SMALL_ROWS else None
    heads = max(g for g in range(1, group + 1) if group % g == 0 and g * t <= SMALL_ROWS)
    return heads * t


def _grouped_product(a: mx.array, b: mx.array, rows: int | None) -> mx.array:
    """a (1, K, R, X) @ b (1, K, X, Y) -> (1, K, R, Y), as products of ``rows`` rows of ``a``
    each against their head's ``b`` (broadcast, not copied); one product per head for None."""
    if rows is None:
        return a @ b
    kv_heads, _, inner = a.shape[1:]
    chunks = a.reshape(1, kv_heads, -1, rows, inner) @ b[:, :, None]
    return chunks.reshape(1, kv_heads, -1, b.shape[-1])


LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
# 2**f on [-1/2, 1/2], highest power first (Cephes, as MLX's own exp uses)
EXP2_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)
ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float32 to an integer


def exp2(x: mx.array) -> mx.array:
    """``2 ** x`` for float32 ``x <= 0`` (within 2e-7 relative; 0 below -127), from additions,
    products and one bit shift: each a vectorised pass on the CPU backend, where ``mx.exp``
    runs a scalar loop. ``x = n + f`` with n an integer and ``|f| <= 1/2``; ``2 ** f`` is a
    polynomial, ``2 ** n`` the float whose exponent field is ``n + 127``."""
    x = mx.maximum(x, -127.0)  # -inf (masked) too; 2**-127's exponent field is 0: +0.0
    n = (x + ROUND) - ROUND
    f = x - n
    poly = EXP2_POLY[0]
    for c in EXP2_POLY[1:]:
        poly = poly * f + c
    power = mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
    return poly * power


class _CompiledLayers:
    """Each layer's halves around attention, compiled (mlx traces them once per input shape),
    with q/k/v and gate/up fused into one matmul each where the layers allow (``_fuse``).

    The traces capture the layer's weights: a model changed after its first small forward (new
    weights, quantized in place) would keep computing with the old ones. ``swiglu``: the CPU
    kernel for the MLP's gate, or None (MLX ops).
    """

    def __init__(self, model: nn.Module, plan: Plan, swiglu=None):
        self.before, self.after = [], []
        self.qkv, self.gate_up = [], []  # per layer: the stacked weights, or None
        for x in model.model.layers:
            attn, mlp = x.self_attn, x.mlp
            self.qkv.append(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
            llama_mlp = isinstance(mlp, llama.MLP)
            self.gate_up.append(_fuse([mlp.gate_proj, mlp.up_proj]) if llama_mlp else None)
            self.before.append(mx.compile(partial(_before_attention, x, plan, self.qkv[-1])))
            after = partial(_after_attention, x, plan, self.gate_up[-1], swiglu)
            self.after.append(mx.compile(after))


class FusedForward(Forward):
    """The specialised forward (``plan.llama_layers``) over plain Llama/Qwen2 blocks: the
    generic one for prompts (any length, uncompiled) and forwards of more than
    ``plan.compiled_max_rows`` tokens, compiled fused halves for the rest."""

    def __init__(self, model: nn.Module, plan: Plan):
        super().__init__(model)
        self.plan = plan
        kernels = cpu_kernels() if plan.cpu_kernels else None
        self.kernels = kernels if plan.grouped_attention else None  # attention's
        swiglu = kernels.swiglu if kernels else None
        self.layers = _CompiledLayers(self.model, plan, swiglu)  # re-points the copy's weights
        layers = self.model.model.layers
        # prompts: the generic halves, but for the gate's kernel (over the fused gate/up)
        gate_ups = self.layers.gate_up if swiglu else [None] * len(layers)
        pairs = zip(layers, gate_ups, strict=True)
        self.eager = (
            [partial(_before_attention, x, GENERIC, None) for x in layers],
            [partial(_after_attention, x, GENERIC, g, swiglu) for x, g in pairs],
        )
        self.shared_rope = plan.rope_tables and _one_rope(layers)
        self.dtype = compute_dtype(self.model)

    def run(self, tokens: mx.array, view: View, compiled: bool) -> mx.array:
        plan, mask = self.plan, view.mask
        if isinstance(mask, str):
            mask = chain_mask(view.offset, tokens.shape[0])
        small = compiled and tokens.shape[0] <= plan.compiled_max_rows

        def attend(i, layer, queries, keys, values):
            keys, values = view.write(i, keys, values)
            scale = layer.self_attn.scale
            grouped = plan.grouped_attention
            return attention(queries, keys, values, scale, mask, grouped, self.kernels)

        return self._layers(tokens, view.positions, small, attend, view.record)

    def run_joint(self, tokens: mx.array, joint: JointView, compiled: bool) -> mx.array:
        """The joint forward (:mod:`~redrafter_mlx.core.decode.joint`): the compiled halves once
        over all N rows (padded to the plan's next tree size, a shape traced at warm-up),
        attention per segment against its own sequence's cache, as that sequence's own
        forward runs it -> hidden ``(N, H)``."""
        plan, n = self.plan, tokens.shape[0]
        small = compiled and n <= plan.compiled_max_rows
        rows = verified_size(n, plan.tree_sizes) if small else n
        positions = joint.positions
        if rows > n:  # padding rows: token 0 at position 0, attending to nothing
            tokens = mx.concatenate([tokens, mx.zeros((rows - n,), tokens.dtype)])
            positions = mx.concatenate([positions, mx.zeros((rows - n,), positions.dtype)])

        def attend(i, layer, queries, keys, values):
            return self._joint_attention(i, layer, joint, queries, keys, values, rows - n)

        return self._layers(tokens, positions, small, attend, joint.record)[:n]

    def _layers(self, tokens, positions, small: bool, attend, record) -> mx.array:
        """The layers over ``tokens (T,)`` at ``positions (T,)`` -> final-norm hidden
        ``(T, H)``: compiled halves (``small``) or eager ones around ``attend(i, layer,
        queries, keys, values)``, each layer's output handed to ``record``."""
        model, every = self.model, self.plan.async_layers
        h = model.model.embed_tokens(tokens)[None]
        before, after = (self.layers.before, self.layers.after) if small else self.eager
        layers = model.model.layers
        tables = None
        if self.shared_rope:
            tables = rope_tables(layers[0].self_attn, positions, self.dtype)
        rope_args = tables or (positions,)
        for i, layer in enumerate(layers):
            queries, keys, values = before[i](h, *rope_args)
            h = after[i](h, attend(i, layer, queries, keys, values))
            record(i, h)
            if every and (i + 1) % every == 0 and i + 1 < len(layers):
                mx.async_eval(h)  # start computing while Python builds the next layers
        return model.model.norm(h)[0]

    def _joint_attention(self, i, layer, joint: JointView, queries, keys, values, padding: int):
        """Each segment's attention ``(1, heads, T_i, D)`` over its own sequence, side by
        side, then zeros for the padding rows -> ``(1, heads, N', D)``: one
        ``joint_attention`` call where every segment fits the tree kernel (each attended as
        alone, to the bit), else one attention per segment."""
        scale, grouped = layer.self_attn.scale, self.plan.grouped_attention
        written = [
            view.write(i, keys[:, :, start:stop], values[:, :, start:stop])
            for view, (start, stop) in zip(joint.views, joint.bounds, strict=True)
        ]
        if self.kernels is not None and _joint_kernel_fits(queries, joint, written):
            ks, vs = (list(x) for x in zip(*written, strict=True))
            counts = [stop - start for start, stop in joint.bounds]
            visible = [
                None if view.mask is None else view.mask[:, -count:]
                for view, count in zip(joint.views, counts, strict=True)
            ]
            return self.kernels.joint_attention(queries, ks, vs, counts, scale, visible)
        outs = []
        for view, (start, stop), (k, v) in zip(joint.views, joint.bounds, written, strict=True):
            q = queries[:, :, start:stop]
            outs.append(attention(q, k, v, scale, view.mask, grouped, self.kernels))
        if padding:
            b, heads, _, d = queries.shape
            outs.append(mx.zeros((b, heads, padding, d), queries.dtype))
        return mx.concatenate(outs, axis=2)


def _joint_kernel_fits(queries, joint: JointView, written) -> bool:
    """Whether every segment's attention is one the tree kernel runs (float32, its head
    sizes, at most ``TREE_ROWS`` query rows per K/V head): what :func:`kernel_attention`
    runs it with alone."""
    _, heads, _, d = queries.shape
    if queries.dtype != mx.float32 or d not in TREE_HEAD_SIZES:
        return False
    for (start, stop), (k, v) in zip(joint.bounds, written, strict=True):
        if k.dtype != mx.float32 or v.dtype != mx.float32:
            return False
        if heads // k.shape[1] * (stop - start) > TREE_ROWS:
            return False
    return True


def _rope_key(rope: nn.Module) -> tuple:
    """What tells RoPE modules apart: their type and plain settings (dims, base, scaling)."""
    rope = rope.inner if isinstance(rope, TokenRope) else rope
    plain = (int, float, bool, str, type(None))
    return type(rope), sorted((k, v) for k, v in vars(rope).items() if isinstance(v, plain))


def _one_rope(layers) -> bool:
    """Whether every layer rotates alike (SmolLM3 leaves every few layers unrotated), so one
    pair of RoPE tables serves them all."""
    first = _rope_key(layers[0].self_attn.rope)
    return all(_rope_key(x.self_attn.rope) == first for x in layers[1:])


LLAMA_BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock)


def has_llama_layers(model: nn.Module) -> bool:
    """Whether every layer is a plain full-attention Llama or Qwen2 block (mistral loads as
    llama): what the specialised path computes exactly."""
    layers = inner_model(model).layers
    return bool(layers) and all(
        type(x) in LLAMA_BLOCKS and not getattr(x, "use_sliding", False) for x in layers
    )
