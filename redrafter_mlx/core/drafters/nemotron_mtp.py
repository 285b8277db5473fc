"""Nemotron-H's native MTP head, chained for depth and searched as beams as Qwen3.5's is
(:mod:`~redrafter_mlx.core.drafters.mtp`: only the head differs).

Legend: B beams, E entries, S cached entries, H hidden.

The head (``mtp.*`` of a Nemotron-H checkpoint with ``num_nextn_predict_layers: 1``) is a
short stack of Nemotron-H blocks by ``mtp_hybrid_override_pattern`` (attention ``*`` and MoE
``E``; mlx-lm's blocks): the first block also holds ``enorm``, ``hnorm`` and ``eh_proj`` over
``[enorm(embed(token t + 1)), hnorm(hidden t)]``, the last a ``final_layernorm``. The target's
output head scores its output; its attention has no positional encoding, so positions only
order the entries.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.nemotron_h import Model as NemotronH
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock

from redrafter_mlx.core.drafters.mtp import MTPDrafter, _EntryCache
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "nemotron_h_mtp"
BLOCKS = {"attention": "*", "full_attention": "*", "moe": "E"}  # mtp_layers_block_type


def head_pattern(text: dict) -> list[str]:
    """The head's blocks from a Nemotron-H config: ``mtp_hybrid_override_pattern`` or
    ``mtp_layers_block_type``; ValueError unless attention and MoE blocks only."""
    pattern = text.get("mtp_hybrid_override_pattern")
    if pattern is None and isinstance(text.get("mtp_layers_block_type"), list):
        pattern = [BLOCKS.get(t, "?") for t in text["mtp_layers_block_type"]]
    if not pattern or any(t not in ("*", "E") for t in pattern):
        raise ValueError(f"MTP layer pattern {pattern!r}: need attention (*) and MoE (E) only")
    return list(pattern)


class NemotronMTPHead(nn.Module):
    """The head's weights by mlx-vlm's split names (``layers.{i}``, the first's ``enorm``,
    ``hnorm``, ``eh_proj``, the last's ``final_layernorm``); the token embedding and output
    head are the target's (:meth:`bind`)."""

    shift = 0  # entry t (hidden t, token t + 1) sits at position t

    def __init__(self, args: ModelArgs, pattern: list[str]):
        super().__init__()
        self.args = dataclasses.replace(args, hybrid_override_pattern=pattern)
        hidden, eps = args.hidden_size, args.layer_norm_epsilon
        self.layers = [NemotronHBlock(self.args, t) for t in pattern]
        first, last = self.layers[0], self.layers[-1]
        first.enorm = nn.RMSNorm(hidden, eps=eps)
        first.hnorm = nn.RMSNorm(hidden, eps=eps)
        first.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        last.final_layernorm = nn.RMSNorm(hidden, eps=eps)
        self._target = None

    @property
    def fc(self) -> nn.Linear:
        """The input projection, by Qwen3.5's head's name (the drafter's part reads the
        head's dtype from it)."""
        return self.layers[0].eh_proj

    @property
    def attention(self) -> list[NemotronHBlock]:
        return [layer for layer in self.layers if layer.block_type == "*"]

    def bind(self, embed: nn.Module, final_norm: nn.Module, head) -> None:
        """The target's token embedding, final norm and output projection."""
        self._target = (embed, final_norm, head)

    def fuse(self, taps: list[mx.array]) -> mx.array:
        """The target's last layer's output ``(..., H)`` -> its final-norm hidden state."""
        return self._target[1](taps[0])

    def run(self, tokens, hidden, offset, cache: list[tuple], mask) -> tuple:
        """Entries of ``tokens (B, E)`` with ``hidden (B, E, H)`` after each attention
        block's ``cache`` K/V -> ``(output (B, E, H), [(keys, values)] new per attention)``."""
        first = self.layers[0]
        x = [first.enorm(self._target[0](tokens)), first.hnorm(hidden)]
        h = first.eh_proj(mx.concatenate(x, -1))
        caches = iter(cache)
        new = []
        for layer in self.layers:
            slot = None
            if layer.block_type == "*":
                slot = _EntryCache(*next(caches), offset)
            h = layer(h, mask=mask, cache=slot)
            if slot is not None:
                new.append(slot.new)
        return self.layers[-1].final_layernorm(h), new

    def logits(self, hidden: mx.array) -> mx.array:
        return self._target[2](hidden)

    def target_ids(self, index: mx.array) -> mx.array:
        return index.astype(mx.int32)

    def load(self, weights: dict[str, mx.array]) -> None:
        """Strict load of the head's tensors: ``mtp.*`` of an original checkpoint (each
        expert's own, stacked as mlx-lm stacks the target's) or mlx-vlm's split folder."""
        original = any(k.startswith("mtp.") for k in weights)
        named = {
            "backbone." + k.removeprefix("mtp."): v
            for k, v in weights.items()
            if (k.startswith("mtp.") or not original) and not k.endswith((".k_scale", ".v_scale"))
        }
        try:  # mlx-lm's stacking of the target's experts, over the head's blocks
            named = NemotronH.sanitize(SimpleNamespace(args=self.args), named)
            out = [(k.removeprefix("backbone."), v) for k, v in named.items()]
            self.load_weights(out, strict=True)
        except (ValueError, KeyError) as e:
            raise DrafterError(f"MTP weights: {' '.join(str(e).split())[:200]}") from None


class NemotronMTPDrafter(MTPDrafter):
    """A Nemotron-H MTP head as the speculative step's source (Qwen3.5's MTP drafting)."""

    kind = MODEL_TYPE

    def _empty_cache(self) -> list[tuple[mx.array, mx.array]]:
        args = self.module.args
        head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        shape = (1, args.num_key_value_heads, 0, head_dim)
        dtype = self.module.fc.weight.dtype
        return [(mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for _ in self.module.attention]
