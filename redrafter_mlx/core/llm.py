"""The target's verify forward over an mlx-lm model's own modules.

Legend: T new tokens, S cached tokens, H hidden size, V vocab.

Every token carries an explicit position, and attention uses an explicit boolean mask over
``cache + T``, so the same forward serves prefill (a chain), autoregressive steps (T = 1) and
tree verification (a packed tree of draft tokens).

The generic path runs the model's own ``model.model(tokens, cache=...)`` (any mlx-lm
architecture whose layers are attention layers): each layer gets a :class:`TreeLayerCache`
that writes its K/V into our :class:`KVCache`, hands the layer the tree mask through
``make_mask`` (windowed for sliding-window layers, by position), and whose ``offset`` is the
tokens' positions; each RoPE module is wrapped (:class:`TokenRope`) to rotate every token at
its own position by moving the tokens to the batch axis, where RoPE takes one offset per row.

A device :class:`~redrafter_mlx.core.plan.Plan` may ask for the specialised path instead
(``llama_layers``): plain Llama/Qwen2 blocks run as compiled halves around attention with
fused projections, RoPE from shared cos/sin tables and grouped attention. Numerically it is
the same forward.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import RotatingKVCache

from redrafter_mlx.core.cache import KVCache
from redrafter_mlx.core.plan import Plan

GENERIC = Plan()
# A chain of new tokens after the cache, each attending to the cache and the chain up to it:
# MLX's fused attention builds this mask itself (a prompt's mask is never materialised).
CAUSAL = "causal"


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """Floating dtype of activations: the embedding's weight, or a quantized embedding's
    floating scales (affine), or else (microscaled formats keep uint8 scales) the first
    floating parameter, e.g. a norm's weight."""
    embed = model.model.embed_tokens
    for x in (getattr(embed, "scales", None), embed.weight):
        if x is not None and mx.issubdtype(x.dtype, mx.floating):
            return x.dtype
    for _, x in tree_flatten(model.parameters()):
        if mx.issubdtype(x.dtype, mx.floating):
            return x.dtype
    raise ValueError("the model has no floating-point parameters to take a dtype from")


def target_dims(model: nn.Module) -> tuple[int, int]:
    """``(hidden_size, vocab_size)`` of a loaded target model."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    vocab = getattr(args, "vocab_size", None)
    if hidden is None or vocab is None:
        emb = model.model.embed_tokens
        vocab = vocab or emb.weight.shape[0]
        hidden = hidden or getattr(emb, "dims", None) or emb.weight.shape[1]
    return int(hidden), int(vocab)


def make_cache(model: nn.Module) -> KVCache:
    """An empty pre-allocating KV cache for ``model`` (each layer shaped by its first write)."""
    return KVCache(len(model.model.layers), compute_dtype(model))


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


def _mlp(mlp: nn.Module, gate_up: mx.array | None, x: mx.array, transposed: bool) -> mx.array:
    """The layer's MLP; mlx-lm's Llama MLP (SiLU-gated) runs its own projections here when
    they are fused (gate and up as one ``gate_up`` matmul) or transposed."""
    if not isinstance(mlp, llama.MLP) or (gate_up is None and not transposed):
        return mlp(x)
    if gate_up is None:
        gate, up = _project(mlp.gate_proj, x, transposed), _project(mlp.up_proj, x, transposed)
    else:
        gate, up = mx.split(_matmul(gate_up, x, transposed), 2, axis=-1)
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
    layer, plan: Plan, gate_up: mx.array | None, h: mx.array, out: mx.array
) -> mx.array:
    """Residual stream h (1, T, H) and attention output (1, heads, T, D) -> the layer's output."""
    attn, t = layer.self_attn, h.shape[1]
    transposed = t in plan.transposed_rows
    h = h + _project(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(1, t, -1), transposed)
    return h + _mlp(layer.mlp, gate_up, layer.post_attention_layernorm(h), transposed)


def _attention(queries, keys, values, scale: float, mask: mx.array | None, grouped: bool):
    """Queries (1, heads, T, D), keys/values (1, kv_heads, S, D), mask (T, S) -> (1, heads, T, D).

    ``grouped``: each K/V head's query group runs as one matmul (heads grouped as rows), which
    costs less than ``mx.fast.scaled_dot_product_attention``'s fallback on the CPU backend;
    otherwise that fused kernel.
    """
    if not grouped:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    _, heads, t, d = queries.shape
    kv_heads = keys.shape[1]
    grouped = (queries * scale).reshape(1, kv_heads, heads // kv_heads * t, d)
    scores = grouped @ keys.swapaxes(-1, -2)  # (1, kv_heads, group * T, S)
    if mask is not None:
        scores = scores.reshape(1, kv_heads, heads // kv_heads, t, -1)
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        scores = scores.reshape(1, kv_heads, heads // kv_heads * t, -1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values).reshape(1, heads, t, d)


class _CompiledLayers:
    """Each layer's halves around attention, compiled (mlx traces them once per input shape),
    with q/k/v and gate/up fused into one matmul each where the layers allow (``_fuse``).

    The traces capture the layer's weights: a model changed after its first small forward (new
    weights, quantized in place) would keep computing with the old ones.
    """

    def __init__(self, model: nn.Module, plan: Plan):
        self.before, self.after = [], []
        self.qkv, self.gate_up = [], []  # per layer: the stacked weights, or None
        for x in model.model.layers:
            attn, mlp = x.self_attn, x.mlp
            self.qkv.append(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
            llama_mlp = isinstance(mlp, llama.MLP)
            self.gate_up.append(_fuse([mlp.gate_proj, mlp.up_proj]) if llama_mlp else None)
            self.before.append(mx.compile(partial(_before_attention, x, plan, self.qkv[-1])))
            self.after.append(mx.compile(partial(_after_attention, x, plan, self.gate_up[-1])))


def _layer_blocks(model: nn.Module, num_tokens: int, compiled: bool, plan: Plan):
    """The per-layer (before, after) attention halves to run ``num_tokens`` tokens with."""
    if not compiled or num_tokens > plan.compiled_max_rows:
        layers = model.model.layers
        return (
            [partial(_before_attention, x, GENERIC, None) for x in layers],
            [partial(_after_attention, x, GENERIC, None) for x in layers],
        )
    # A plain attribute (nn.Module would treat a dict of lists as parameters), one per plan.
    per_plan = model.__dict__.setdefault("_redrafter_compiled", {})
    if plan not in per_plan:
        per_plan[plan] = _CompiledLayers(model, plan)
    return per_plan[plan].before, per_plan[plan].after


def forward(
    model: nn.Module,
    tokens: mx.array,
    positions: mx.array,
    mask: mx.array | str | None,
    cache: KVCache,
    *,
    compiled: bool = True,
    plan: Plan = GENERIC,
) -> mx.array:
    """Run the target over ``tokens (T,)`` at ``positions (T,)``; return final-norm hidden (T, H).

    ``mask (T, S + T)`` is boolean (True = may attend), ``None`` means attend to everything
    (one token), :data:`CAUSAL` a chain after the cache (a prompt). K/V are written at
    ``cache.offset`` and not committed. ``plan``: the device's way of running it
    (:mod:`redrafter_mlx.backend.plan`). ``compiled=False`` keeps the specialised path's
    forward of any T uncompiled: prompts have arbitrary lengths, and each new T would compile
    new kernels (seconds of g++ on CPU, during which Ctrl-C is ignored).
    """
    cache.reserve(tokens.shape[0])
    positions = positions.astype(mx.int32)
    if plan.llama_layers and has_llama_layers(model):
        return _llama_forward(model, tokens, positions, mask, cache, compiled, plan)
    return _model_forward(model, tokens, positions, mask, cache)


def _model_forward(model, tokens, positions, mask, cache: KVCache) -> mx.array:
    """The generic path: the model's own ``model.model`` with one tree cache per layer."""
    caches = [
        TreeLayerCache(cache, i, positions, mask, window)
        for i, window in enumerate(_prepared(model))
    ]
    return model.model(tokens[None], cache=caches)[0]


def _llama_forward(model, tokens, positions, mask, cache: KVCache, compiled: bool, plan: Plan):
    """The specialised path (``plan.llama_layers``) over plain Llama/Qwen2 blocks."""
    if isinstance(mask, str):
        mask = chain_mask(cache.offset, tokens.shape[0])
    h = model.model.embed_tokens(tokens)[None]
    before, after = _layer_blocks(model, tokens.shape[0], compiled, plan)
    layers = model.model.layers
    dtype = compute_dtype(model)
    shared = plan.rope_tables and _one_rope(layers)
    tables = rope_tables(layers[0].self_attn, positions, dtype) if shared else None
    rope_args = tables or (positions,)
    every = plan.async_layers
    for i, layer in enumerate(layers):
        queries, keys, values = before[i](h, *rope_args)
        keys, values = cache.write(i, keys, values)
        out = _attention(queries, keys, values, layer.self_attn.scale, mask, plan.grouped_attention)
        h = after[i](h, out)
        if every and (i + 1) % every == 0 and i + 1 < len(layers):
            mx.async_eval(h)  # start computing while Python builds the next layers
    return model.model.norm(h)[0]


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
    layers = model.model.layers
    return bool(layers) and all(
        type(x) in LLAMA_BLOCKS and not getattr(x, "use_sliding", False) for x in layers
    )


class TokenRope(nn.Module):
    """A layer's RoPE module that rotates each token at its own position.

    mlx-lm's attention calls ``self.rope(x, offset=cache.offset)`` with ``x (1, heads, T, D)``;
    a :class:`TreeLayerCache`'s offset is the tokens' positions ``(T,)``. MLX's RoPE takes one
    offset per batch row, so the tokens go to the batch axis and back. Any other call (an int
    offset, mlx-lm's own caches) passes through unchanged.
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        per_token = (
            isinstance(offset, mx.array)
            and offset.ndim == 1
            and x.ndim == 4
            and x.shape[0] == 1
            and offset.shape[0] == x.shape[2] > 1
        )
        if not per_token:
            return self.inner(x, offset=offset, **kwargs)
        return self.inner(x.swapaxes(0, 2), offset=offset, **kwargs).swapaxes(0, 2)


ROPE_NAMES = ("rope", "rotary_emb")


def _prepared(model: nn.Module) -> list[tuple[int, int] | None]:
    """Wrap every attention's RoPE in :class:`TokenRope` (once per model) and return each
    layer's sliding window ``(size, keep)`` (None: full attention), read from the model's own
    ``make_cache`` (a ``RotatingKVCache`` marks a sliding-window layer)."""
    windows = model.__dict__.get("_redrafter_windows")
    if windows is not None:
        return windows
    for _, module in model.model.named_modules():
        for name in ROPE_NAMES:
            rope = module.get(name)
            if isinstance(rope, nn.Module) and not isinstance(rope, TokenRope):
                module[name] = TokenRope(rope)
    layer_caches = model.make_cache() if hasattr(model, "make_cache") else []
    windows = [None] * len(model.model.layers)
    for i, c in enumerate(layer_caches[: len(windows)]):
        if isinstance(c, RotatingKVCache):
            windows[i] = (c.max_size, c.keep)
    model.__dict__["_redrafter_windows"] = windows  # a plain attribute, not a parameter
    return windows


class TreeLayerCache:
    """One layer's cache as mlx-lm's attention modules use it, over our :class:`KVCache`.

    ``offset`` is the positions ``(T,)`` (for :class:`TokenRope`), ``update_and_fetch`` writes
    the layer's new K/V ``(1, K, T, D)`` and returns ``(1, K, S + T, D)``, ``make_mask`` returns
    the forward's mask ``(T, S + T)``, narrowed by position on sliding-window layers (a key
    ``k`` is seen from ``q`` when ``pos(q) - pos(k) < window``, or among the first ``keep``).
    Cached tokens sit at positions ``0 .. S - 1``.
    """

    def __init__(self, cache: KVCache, layer: int, positions, mask, window=None):
        self.cache, self.layer = cache, layer
        self.offset = positions
        self.mask, self.window = mask, window

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.write(self.layer, keys, values)

    def make_mask(
        self, n: int, *, window_size: int | None = None, return_array: bool = False, **_
    ) -> mx.array | str | None:
        size, keep = (window_size, 0) if window_size else (self.window or (None, 0))
        mask, s = self.mask, self.cache.offset
        if isinstance(mask, str) and (size is not None or return_array):
            mask = chain_mask(s, n)  # the model (or the window) needs it as an array
        if size is None:
            return mask
        key_positions = mx.concatenate([mx.arange(s, dtype=mx.int32), self.offset])
        seen = self.offset[:, None] - key_positions[None] < size
        if keep:
            seen = seen | (mx.arange(s + n) < keep)[None]
        return seen if mask is None else seen & mask


def head_linear(model: nn.Module, hidden: mx.array) -> mx.array:
    """Final-norm hidden (..., H) -> the output projection (..., V), before any logit
    transform (the LM head's own matrix, or the tied embedding's)."""
    if hasattr(model, "lm_head"):
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """Final-norm hidden (..., H) -> logits (..., V), as the model's own ``__call__`` ends:
    the output projection, then soft-capping (Gemma 2) or a logit scale where the model has
    one."""
    logits = head_linear(model, hidden)
    args = getattr(model, "args", None)
    cap = getattr(args, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    scale = getattr(args, "logits_scaling", None)  # granite
    if scale:
        logits = logits / scale
    return logits


def chain_mask(cached: int, new: int) -> mx.array:
    """Causal mask (new, cached + new) for a chain of ``new`` tokens after ``cached`` tokens."""
    rows = mx.arange(new)[:, None] + cached
    return mx.arange(cached + new)[None] <= rows
