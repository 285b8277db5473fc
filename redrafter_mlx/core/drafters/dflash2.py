"""DFlash2 drafters (z-lab's, e.g. for Qwen3.8-27B): DFlash (core/drafters/dflash.py) with a grouped
dynamic causal convolution around each layer's attention and MLP, input and output scales,
and a candidate selector that chains the block's positions.

Legend as core/drafters/dflash.py's, and C the convolutions' kernel, G their groups, K the
selector's candidates per position, R its rank.

A layer is DFlash's with each sublayer wrapped: ``x + finish(sublayer(prepare(norm(x))))``,
where ``prepare`` and ``finish`` each mix a position with the ``C - 1`` block positions before
it, by a base kernel plus one predicted from the (normed) input, per group of ``H / G``
channels. The selector scores candidate ``t`` at depth ``d`` after token ``u`` as
``logit_d(t) + sum(pred[u] * proj(h_d) * succ[t])`` over the top ``K`` of ``logit_d``:
mlx-vlm drafts the argmax chain. Here that is a first-order chain ``q(t | u)`` (softmax over
the ``K`` candidates), and the tree is its best-first tree
(:func:`~redrafter_mlx.core.drafters.dflash.best_tree`), whose first node is the first of
mlx-vlm's chain (:meth:`DFlash2Drafter.chain`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.drafters.dflash import (
    DFlash,
    DFlashArgs,
    DFlashDrafter,
    Layer,
    best_tree,
    parsed,
)
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "dflash2"
ARCHITECTURE = "DFlash2DraftModel"
# where a z-lab config keeps them: its ``dflash_config`` (speculators': the top level)
OWN_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


@dataclass
class DFlash2Args(DFlashArgs):
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    @classmethod
    def from_dict(cls, config: dict) -> DFlash2Args:
        """From a z-lab DFlash2 ``config.json`` (its own sizes in ``dflash_config``) or a
        speculators one. DrafterError (one line) for what this runtime cannot run."""
        return cls(**parsed(config, "DFlash2", _own_fields))


def _own_fields(flat: dict, dflash: dict) -> dict:
    """DFlash2's fields beyond DFlash's, checked; KeyError for a missing size."""
    own = {**flat, **dflash}
    conv, group, rank, top_k = checked.sizes(own, *OWN_SIZES)
    if flat["hidden_size"] % group:
        raise DrafterError(f"conv_group_size {group} does not divide hidden_size")
    if top_k > flat["vocab_size"]:
        raise DrafterError(f"selector_top_k {top_k} exceeds the vocabulary")
    if checked.given(flat, "hidden_act", "silu") != "silu":
        raise DrafterError(f"hidden_act {flat['hidden_act']!r}: only silu")
    scales = {
        name: checked.number(name, checked.given(own, name, 1.0))
        for name in ("input_embedding_scale", "output_multiplier")
    }
    sizes = dict(zip(OWN_SIZES, (conv, group, rank, top_k), strict=True))
    return sizes | scales


def grouped_causal(hidden: mx.array, dynamic: mx.array, base: mx.array, group: int) -> mx.array:
    """``hidden (B, L, H)`` mixed along L: ``out[l] = sum_c (base[c] + dynamic[l, c]) *
    hidden[l - c]`` (zeros before the block), ``dynamic (B, L, C, G)`` one weight per group
    of ``group`` channels, ``base (C, H)``."""
    batch, length, size = hidden.shape
    blocks = hidden.reshape(batch, length, -1, group)
    out = mx.zeros_like(blocks)
    for c in range(base.shape[0]):
        shifted = mx.pad(blocks[:, : length - c], [(0, 0), (c, 0), (0, 0), (0, 0)])
        kernel = base[c].reshape(-1, group).astype(hidden.dtype) + dynamic[:, :, c, :, None]
        out = out + kernel * shifted
    return out.reshape(batch, length, size)


class GroupedConv(nn.Module):
    """mlx-vlm's ``GroupedDynamicCausalConv``: ``base_kernel (2, C, H)`` (prepare, finish)
    and ``kernel_projection`` (``H -> 2 * C * G``: both dynamic kernels, from the input)."""

    def __init__(self, args: DFlash2Args):
        super().__init__()
        groups = args.hidden_size // args.conv_group_size
        self.group = args.conv_group_size
        self.base_kernel = mx.zeros((2, args.conv_kernel_size, args.hidden_size))
        self.kernel_projection = nn.Linear(
            args.hidden_size, 2 * args.conv_kernel_size * groups, bias=False
        )

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x (B, L, H)`` -> (mixed ``x``, the finishing kernel ``(B, L, C, G)``)."""
        kernel = self.base_kernel.shape[1]
        dynamic = self.kernel_projection(x).reshape(*x.shape[:2], 2, kernel, -1)
        mixed = grouped_causal(x, dynamic[:, :, 0], self.base_kernel[0], self.group)
        return mixed, dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_causal(x, dynamic, self.base_kernel[1], self.group)


class Layer2(Layer):
    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        self.attention_conv = GroupedConv(args)
        self.mlp_conv = GroupedConv(args)

    def __call__(self, x, rope, offset, keys, values, mask):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(
            self.self_attn(h, rope, offset, keys, values, mask), kernel
        )
        out, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(out), kernel)


class Selector(nn.Module):
    """mlx-vlm's ``CandidateSelector``: the codebooks ``(V, R)`` and ``hidden_projection``."""

    def __init__(self, args: DFlash2Args):
        super().__init__()
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def chain(self, logits: mx.array, hidden: mx.array):
        """``step(d, last (P,))`` for :func:`best_tree`: the top-``K`` candidates of
        ``logits (d, V)`` at depth ``d`` and their log-probs after each ``last`` token, given
        the block's hidden states ``(d, H)``."""
        k = min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(logits, -k, axis=-1)[:, -k:].astype(mx.int32)  # (d, K)
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(hidden)  # (d, R)
        successors = self.successor_codebook(candidates)  # (d, K, R)

        def step(d: int, last: mx.array) -> tuple[mx.array, mx.array]:
            edge = self.predecessor_codebook(last) * projected[d]  # (P, R)
            scores = unary[d][None] + edge @ successors[d].T  # (P, K)
            return candidates[d][None], log_softmax(scores.astype(mx.float32))

        return step


class DFlash2(DFlash):
    """DFlash's weights plus each layer's ``attention_conv`` / ``mlp_conv`` and the
    ``candidate_selector`` (its codebooks' ``.weight`` may be left off, as z-lab saves them)."""

    name = "DFlash2"
    layer_class = Layer2

    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        self.candidate_selector = Selector(args)

    def load(self, weights: dict[str, mx.array], embed: nn.Module, head) -> None:
        named = {}
        for key, value in weights.items():
            key = key.removeprefix("model.")
            if key.removeprefix("candidate_selector.") in CODEBOOKS:
                key += ".weight"
            named[key] = value
        super().load(named, embed, head)

    def embed(self, tokens: mx.array) -> mx.array:
        return super().embed(tokens) * self.args.input_embedding_scale

    def scores(self, hidden: mx.array) -> mx.array:
        logits = self._target[1](hidden) * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return logits if not cap else mx.tanh(logits / cap) * cap


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter as the step's source: one block forward per step, the best-first
    tree of ``width`` nodes under the selector's chain (module docstring)."""

    kind = "dflash2"

    def draft(self, sequence: Sequence, reading: Reading, *, width: int, length: int, **_):
        """``width`` beams of ``length``: beam ``j`` the path to the chain's ``j``-th most
        probable node, then -1s (log-prob -inf)."""
        step = self.steps(sequence, reading, length)
        beams, token_logprobs = best_tree(step, length - 1, reading.pending, width)
        return beams, token_logprobs, 0

    def chain(self, sequence: Sequence, reading: Reading, length: int) -> mx.array:
        """The ``length - 1`` tokens ``(L - 1,)`` mlx-vlm drafts greedily: each depth's best
        candidate after the one before."""
        step, last, tokens = self.steps(sequence, reading, length), reading.pending.reshape(1), []
        for d in range(length - 1):
            candidates, logprobs = step(d, last.astype(mx.int32))
            last = candidates[0][mx.argmax(logprobs[0])].reshape(1)
            tokens.append(last)
        return mx.concatenate(tokens)

    def steps(self, sequence: Sequence, reading: Reading, length: int):
        """The selector's chain (:meth:`Selector.chain`) over the block after the reading."""
        hidden = self.module.hidden(*self.block(sequence, reading))[: length - 1]
        return self.module.candidate_selector.chain(self.module.scores(hidden), hidden)
