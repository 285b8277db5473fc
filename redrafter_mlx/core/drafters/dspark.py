"""DSpark drafters (DeepSeek / PKU): a DFlash block forward plus a Markov head, drafting
best-first trees.

Legend: P proposals per block, V vocab, r the Markov head's rank, k paths searched.

DSpark is DFlash's drafter (``core/drafters/dflash.py``: fused target layers as context, one forward
over ``[pending, mask, ...]``) with two changes: the pending token's own row scores the first
proposal (``sample_from_anchor``: the block is ``P`` rows, not ``P + 1``), and a low-rank
Markov head corrects each proposal's logits by the token before it::

    logits_i(u_i | u_{i-1}) = base_i + markov_w2(markov_w1(u_{i-1}))   # (V,), rank r

mlx-vlm samples that chain one token at a time (greedy only in its round loop). Here the tree
is the best-first tree of ``W`` nodes under the chain's probabilities (``best_tree`` with
each depth's log-probs after each path's last token), verified by the exact tree verifier:
greedy output equals autoregressive decoding and sampling keeps the target's distribution.
A checkpoint's confidence head (an early-stop signal for adaptive chains) proposes nothing:
its tensors are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.drafters.dflash import DFlash, DFlashArgs, DFlashDrafter, best_tree, parsed
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "dspark"


@dataclass
class DSparkArgs(DFlashArgs):
    """DFlash's args; ``block_size`` is mlx-vlm's verification width (the pending token and
    ``P`` proposals), whatever the checkpoint counts."""

    markov_rank: int = 256
    sample_from_anchor: bool = True

    @classmethod
    def from_dict(cls, config: dict) -> DSparkArgs:
        """From a DSpark ``config.json``: DFlash's fields (mlx-vlm's layout or speculators'
        own ``dspark`` ones, sliding layers included,
        :func:`~redrafter_mlx.core.drafters.dflash.parsed`), then DSpark's own.
        DrafterError (one line) for what this runtime cannot run."""
        return cls(**parsed(config, DSpark.name, _own_fields))


def _own_fields(flat: dict, dflash: dict) -> dict:
    """DSpark's fields from ``dflash_config`` (else the top level), read as mlx-vlm 0.7.10's
    ``DSparkConfig.from_dict`` reads them (its ``block_size`` counted as here; speculators'
    layouts arrive counted so, ``dspark_bonus_anchor``); KeyError for a missing one,
    DrafterError for what this runtime cannot run."""

    def given(name, default):
        return dflash.get(name, flat.get(name, default))

    unsupported = [
        ("markov_head_type", given("markov_head_type", "vanilla") != "vanilla"),
        ("attention sinks", bool(dflash.get("attention_sink_bias"))),
        ("a draft window", given("draft_window_size", None) is not None),
        ("hidden_act", flat.get("hidden_act", "silu") != "silu"),
        ("causal layers", bool(flat.get("dflash_query_causal"))),
    ]
    if what := [name for name, bad in unsupported if bad]:
        raise DrafterError(f"DSpark drafters with {', '.join(what)} are not supported yet")
    raw = given("block_size", None)
    if raw is None:
        raise KeyError("block_size")
    # a checkpoint counts the proposals (gamma) unless it says its block has the anchor
    anchor = 0 if flat.get("dspark_bonus_anchor") else 1
    return {
        "block_size": checked.integer("block_size", raw, least=2 - anchor) + anchor,
        "markov_rank": checked.integer("markov_rank", given("markov_rank", 256)),
        "sample_from_anchor": bool(given("sample_from_anchor", True)),
        "rope_traditional": not flat.get("rope_is_neox_style", True),
    }


class Markov(nn.Module):
    """The Markov head (mlx-vlm's ``VanillaMarkov``): ``previous (k,) -> (k, V)`` logits
    added to a proposal's, through rank ``r``."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(previous))


class DSpark(DFlash):
    """DFlash's weights plus ``markov_head.{markov_w1,markov_w2}``; the block is ``P`` rows
    from the pending token when its row scores the first proposal (``sample_from_anchor``)."""

    name = "DSpark"

    def __init__(self, args: DSparkArgs):
        super().__init__(args)
        self.markov_head = Markov(args.vocab_size, args.markov_rank)
        anchored = args.sample_from_anchor
        self.block_length, self.first_row = args.proposals + (not anchored), int(not anchored)

    def load(self, weights: dict[str, mx.array], embed: nn.Module, head) -> None:
        """DFlash's strict load, less the confidence head (module docstring)."""
        kept = {k: v for k, v in weights.items() if "confidence_head." not in k}
        super().load(kept, embed, head)


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter as the speculative step's source: one block forward per step, then the
    best-first tree of ``width`` nodes under the Markov chain's probabilities."""

    kind = MODEL_TYPE

    def draft(self, sequence, reading, *, width: int, length: int, **_):
        """``width`` beams of ``length``: beam ``j`` the path to the ``j``-th most probable
        node, then -1s (log-prob -inf), as DFlash's."""
        base = self.logits(sequence, reading)[: length - 1].astype(mx.float32)
        beams, token_logprobs = best_tree(self.after(base), length - 1, reading.pending, width)
        return beams, token_logprobs, 0

    def after(self, base: mx.array):
        """``step(d, last (k,))`` for :func:`~redrafter_mlx.core.drafters.dflash.best_tree`: every
        token ``(1, V)`` and depth ``d``'s log-probs ``(k, V)`` after paths ending in ``last``,
        from the block's logits ``base (P, V)``."""
        markov = self.module.markov_head
        tokens = mx.arange(base.shape[-1], dtype=mx.int32)[None]

        def step(d: int, last: mx.array) -> tuple[mx.array, mx.array]:
            return tokens, log_softmax(base[d][None] + markov(last).astype(mx.float32))

        return step
