"""Native multi-token-prediction heads of Qwen3.5 / 3.6, chained for depth and searched as
beams.

Legend: B beams, E entries, S cached entries, H hidden.

Qwen3.5 checkpoints carry an MTP head (``mtp.*``): ``fc`` over ``[norm(embed(token t + 1)),
norm(hidden t)]`` (``hidden t`` the target's final-norm hidden state at ``t``), one Qwen3.5
full-attention decoder layer (gated queries, partial RoPE) with its own K/V, and a final norm;
in the MoE models (Qwen3.5 / 3.6-35B-A3B) the layer's MLP is mlx-lm's sparse MoE block
(routed experts and a gated shared expert), as in the target's own layers;
the target's LM head scores its output, which predicts the token at ``t + 2``. Feeding its own
output back as the hidden state chains it for depth. Entry ``t`` sits at position ``t``.

The drafting is EAGLE-3's (:class:`~redrafter_mlx.core.drafters.eagle3.Eagle3Drafter`: entries along
the accepted path, a beam search over the head, its K/V a part of the sequence); only the head
differs. The target's final hidden state is read as the last layer's output through the
target's own final norm, so the head needs no other hook into the forward.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from redrafter_mlx.core.drafters.eagle3 import Eagle3Drafter
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "qwen3_5_mtp"
NORMS = (  # stored as offsets from 1 in HF checkpoints (Qwen3.5's zero-centred RMSNorm)
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


class _EntryCache:
    """mlx-lm's layer-cache interface over fixed K/V ``(B, Kh, S, D)``: the layer's new K/V
    are appended for its attention and kept in ``new``; ``offset`` its tokens' first
    position (an int or a ``()`` array)."""

    def __init__(self, keys: mx.array, values: mx.array, offset):
        self.keys, self.values, self.offset = keys, values, offset
        self.new = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.new = (keys, values)
        return mx.concatenate([self.keys, keys], 2), mx.concatenate([self.values, values], 2)


class MTPHead(nn.Module):
    """The head's weights by mlx-vlm's split names (``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``layers.{i}``, ``norm``); the token embedding, final norm and LM
    head are the target's (:meth:`bind`)."""

    shift = 0  # entry t (hidden t, token t + 1) sits at position t

    def __init__(self, args: TextModelArgs, layers: int = 1):
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        full = dataclasses.replace(args, full_attention_interval=1)
        self.layers = [DecoderLayer(full, 0) for _ in range(layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self._target = None

    def bind(self, embed: nn.Module, final_norm: nn.Module, head) -> None:
        """The target's token embedding, final norm and output projection."""
        self._target = (embed, final_norm, head)

    def fuse(self, taps: list[mx.array]) -> mx.array:
        """The target's last layer's output ``(..., H)`` -> its final-norm hidden state."""
        return self._target[1](taps[0])

    def run(self, tokens, hidden, offset, cache: list[tuple], mask) -> tuple:
        """Entries of ``tokens (B, E)`` with ``hidden (B, E, H)`` at ``offset`` after each
        layer's ``cache`` K/V -> ``(output (B, E, H), [(keys, values)] new per layer)``."""
        embed = self._target[0]
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embed(tokens)), self.pre_fc_norm_hidden(hidden)], -1
        )
        h = self.fc(x)
        new = []
        for layer, (keys, values) in zip(self.layers, cache, strict=True):
            slot = _EntryCache(keys, values, offset)
            h = layer(h, mask, slot)
            new.append(slot.new)
        return self.norm(h), new

    def logits(self, hidden: mx.array) -> mx.array:
        return self._target[2](hidden)

    def target_ids(self, index: mx.array) -> mx.array:
        return index.astype(mx.int32)

    def load(self, weights: dict[str, mx.array]) -> None:
        """Strict load of the head's tensors: ``mtp.*`` of an original checkpoint (norms
        stored as offsets from 1) or mlx-vlm's split folder (already ``weight + 1``)."""
        original = any(k.startswith("mtp.") for k in weights)
        out = {}
        for key, value in weights.items():
            if original and not key.startswith("mtp."):
                continue
            name = key.removeprefix("mtp.")
            if original and name.endswith(NORMS) and value.ndim == 1:
                value = value + 1.0
            out[name] = value
        try:
            out = stack_experts(out)
        except ValueError as e:
            raise DrafterError(f"MTP weights: {e}") from None
        try:
            self.load_weights(list(out.items()), strict=True)
        except ValueError as e:
            raise DrafterError(f"MTP weights: {' '.join(str(e).split())[:200]}") from None


EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)")


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A MoE head's experts as mlx-lm's ``switch_mlp`` holds them: one tensor ``(E, ...)`` per
    projection, from per-expert tensors (``experts.{e}.gate_proj.weight``) or the fused
    ``experts.gate_up_proj`` ``(E, 2 I, H)`` / ``experts.down_proj``; dense heads unchanged.
    ValueError (one line) for experts numbered with gaps."""
    out = dict(weights)
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        prefix = key.removesuffix(".experts.gate_up_proj")
        gate, up = mx.split(out.pop(key), 2, axis=-2)
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
        out[f"{prefix}.switch_mlp.up_proj.weight"] = up
        if f"{prefix}.experts.down_proj" in out:
            out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    groups: dict[tuple, dict[int, str]] = {}
    for key in out:
        if match := EXPERT.fullmatch(key):
            prefix, expert, projection, suffix = match.groups()
            groups.setdefault((prefix, projection, suffix), {})[int(expert)] = key
    for (prefix, projection, suffix), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            raise ValueError(f"{prefix}.experts numbered {sorted(keys)}, not 0..{len(keys) - 1}")
        stacked = mx.stack([out.pop(keys[e]) for e in range(len(keys))])
        out[f"{prefix}.switch_mlp.{projection}.{suffix}"] = stacked
    return out


class MTPDrafter(Eagle3Drafter):
    """A Qwen3.5 MTP head, dense or MoE, as the speculative step's source (EAGLE-3's drafting,
    this head)."""

    kind = "mtp"

    def __init__(self, module: MTPHead, last_layer: int):
        self.module = module
        # what width checks read, as BeamDrafter's (``drafter.args.draft_vocab``)
        self.drafter = SimpleNamespace(args=SimpleNamespace(draft_vocab=module.args.vocab_size))
        self.taps = (last_layer,)
