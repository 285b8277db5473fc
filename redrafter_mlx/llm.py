"""The target's verify forward over an mlx-lm Llama-family model's own submodules.

Legend: T new tokens, S cached tokens, H hidden size, V vocab.

Every token carries an explicit position, and attention uses an explicit boolean mask over
``cache + T``, so the same forward serves prefill (a chain), autoregressive steps (T = 1) and
tree verification (a packed tree of draft tokens). RoPE takes per-row offsets, so tokens are
moved to the batch axis to give each its own position.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from redrafter_mlx.cache import KVCache


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """Floating dtype of activations (a quantized model's scales dtype, never uint32)."""
    embed = model.model.embed_tokens
    return embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype


def make_cache(model: nn.Module) -> KVCache:
    """An empty pre-allocating KV cache shaped for ``model``."""
    attn = model.model.layers[0].self_attn
    head_dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads  # rows = out features, quantized too
    return KVCache(len(model.model.layers), attn.n_kv_heads, head_dim, compute_dtype(model))


# On the CPU (OpenBLAS, x86) a projection of 2 or 3 rows costs less as ``W @ x.T`` than as mlx's
# ``x @ W.T`` (benchmarks/README.md, "verify forward"); other backends keep mlx's own Linear.
TRANSPOSED_ROWS = (2, 3)
# Forwards of up to this many tokens (decode steps, trees) run per-layer compiled blocks, traced
# once per T; longer ones (prefill chunks, whose lengths vary) run the modules directly.
COMPILED_MAX_ROWS = 32


def _project(linear: nn.Module, x: mx.array, transposed: bool) -> mx.array:
    """x (1, T, in) -> (1, T, out); as ``W @ x.T`` when ``transposed`` and ``linear`` is a plain
    (unquantized) Linear."""
    if not transposed or type(linear) is not nn.Linear:
        return linear(x)
    y = (linear.weight @ x[0].T).T
    if "bias" in linear:
        y = y + linear.bias
    return y[None]


def _mlp(mlp: nn.Module, x: mx.array, transposed: bool) -> mx.array:
    """The layer's MLP, with transposed projections for mlx-lm's Llama MLP (SiLU-gated)."""
    if not (transposed and isinstance(mlp, llama.MLP)):
        return mlp(x)
    gate = _project(mlp.gate_proj, x, True)
    return _project(mlp.down_proj, nn.silu(gate) * _project(mlp.up_proj, x, True), True)


def _before_attention(layer, cpu: bool, h: mx.array, positions: mx.array):
    """h (1, T, H) -> queries (1, heads, T, D), keys and values (1, kv_heads, T, D)."""
    attn, t = layer.self_attn, h.shape[1]
    transposed = cpu and t in TRANSPOSED_ROWS
    x = layer.input_layernorm(h)
    # (T, heads, 1, D): tokens on the batch axis so RoPE applies one offset per token.
    queries = _project(attn.q_proj, x, transposed).reshape(t, attn.n_heads, 1, -1)
    keys = _project(attn.k_proj, x, transposed).reshape(t, attn.n_kv_heads, 1, -1)
    queries = attn.rope(queries, offset=positions).transpose(2, 1, 0, 3)
    keys = attn.rope(keys, offset=positions).transpose(2, 1, 0, 3)
    values = _project(attn.v_proj, x, transposed).reshape(1, t, attn.n_kv_heads, -1)
    return queries, keys, values.transpose(0, 2, 1, 3)


def _after_attention(layer, cpu: bool, h: mx.array, out: mx.array) -> mx.array:
    """Residual stream h (1, T, H) and attention output (1, heads, T, D) -> the layer's output."""
    attn, t = layer.self_attn, h.shape[1]
    transposed = cpu and t in TRANSPOSED_ROWS
    h = h + _project(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(1, t, -1), transposed)
    return h + _mlp(layer.mlp, layer.post_attention_layernorm(h), transposed)


class _CompiledLayers:
    """Each layer's halves around attention, compiled (mlx traces them once per input shape).

    The traces capture the layer's weights: a model changed after its first small forward (new
    weights, quantized in place) would keep computing with the old ones.
    """

    def __init__(self, model: nn.Module):
        cpu = mx.default_device() == mx.cpu
        layers = model.model.layers
        self.before = [mx.compile(partial(_before_attention, x, cpu)) for x in layers]
        self.after = [mx.compile(partial(_after_attention, x, cpu)) for x in layers]


def _layer_blocks(model: nn.Module, num_tokens: int, compiled: bool) -> tuple[list, list]:
    """The per-layer (before, after) attention halves to run ``num_tokens`` tokens with."""
    if not compiled or num_tokens > COMPILED_MAX_ROWS:
        layers = model.model.layers
        return (
            [partial(_before_attention, x, False) for x in layers],
            [partial(_after_attention, x, False) for x in layers],
        )
    compiled = model.__dict__.get("_redrafter_compiled")
    if compiled is None:  # a plain attribute: nn.Module would treat a list as parameters
        compiled = model._redrafter_compiled = _CompiledLayers(model)
    return compiled.before, compiled.after


def forward(
    model: nn.Module,
    tokens: mx.array,
    positions: mx.array,
    mask: mx.array | None,
    cache: KVCache,
    *,
    compiled: bool = True,
) -> mx.array:
    """Run the target over ``tokens (T,)`` at ``positions (T,)``; return final-norm hidden (T, H).

    ``mask (T, S + T)`` is boolean (True = may attend), ``None`` means attend to everything
    (one token). K/V are written at ``cache.offset`` and not committed. ``compiled=False`` keeps
    a forward of any T on mlx-lm's modules: prompts have arbitrary lengths, and each new T
    would compile new kernels (seconds of g++ on CPU, during which Ctrl-C is ignored).
    """
    cache.reserve(tokens.shape[0])
    positions = positions.astype(mx.int32)
    h = model.model.embed_tokens(tokens)[None]
    before, after = _layer_blocks(model, tokens.shape[0], compiled)
    for i, layer in enumerate(model.model.layers):
        queries, keys, values = before[i](h, positions)
        keys, values = cache.write(i, keys, values)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=layer.self_attn.scale, mask=mask
        )
        h = after[i](h, out)
    return model.model.norm(h)[0]


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """Final-norm hidden (..., H) -> logits (..., V)."""
    if hasattr(model, "lm_head"):
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def chain_mask(cached: int, new: int) -> mx.array:
    """Causal mask (new, cached + new) for a chain of ``new`` tokens after ``cached`` tokens."""
    rows = mx.arange(new)[:, None] + cached
    return mx.arange(cached + new)[None] <= rows
