"""The target's verify forward over an mlx-lm Llama-family model's own submodules.

Legend: T new tokens, S cached tokens, H hidden size, V vocab.

Every token carries an explicit position, and attention uses an explicit boolean mask over
``cache + T``, so the same forward serves prefill (a chain), autoregressive steps (T = 1) and
tree verification (a packed tree of draft tokens). RoPE takes per-row offsets, so tokens are
moved to the batch axis to give each its own position.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

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


def _attention(attn, x, positions, mask, cache: KVCache, layer: int) -> mx.array:
    """x (1, T, H) -> (1, T, H); writes this layer's K/V for the T tokens into ``cache``."""
    t = x.shape[1]
    # (T, heads, 1, D): tokens on the batch axis so RoPE applies one offset per token.
    queries = attn.rope(attn.q_proj(x).reshape(t, attn.n_heads, 1, -1), offset=positions)
    keys = attn.rope(attn.k_proj(x).reshape(t, attn.n_kv_heads, 1, -1), offset=positions)
    values = attn.v_proj(x).reshape(1, t, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys, values = cache.write(layer, keys.transpose(2, 1, 0, 3), values)
    out = mx.fast.scaled_dot_product_attention(
        queries.transpose(2, 1, 0, 3), keys, values, scale=attn.scale, mask=mask
    )
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, t, -1))


def forward(
    model: nn.Module,
    tokens: mx.array,
    positions: mx.array,
    mask: mx.array | None,
    cache: KVCache,
) -> mx.array:
    """Run the target over ``tokens (T,)`` at ``positions (T,)``; return final-norm hidden (T, H).

    ``mask (T, S + T)`` is boolean (True = may attend), ``None`` means attend to everything
    (one token). K/V are written at ``cache.offset`` and not committed.
    """
    cache.reserve(tokens.shape[0])
    positions = positions.astype(mx.int32)
    h = model.model.embed_tokens(tokens)[None]
    for i, layer in enumerate(model.model.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), positions, mask, cache, i)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
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
