"""DFlash drafters (block diffusion, the z-lab layout) drafting best-first trees.

Legend: L beam length (block size), N tree nodes drafted, S context tokens, H hidden,
V vocab, Kh K/V heads, D head dim.

A DFlash drafter reads several target layers (``target_layer_ids``: the layers' outputs), fuses
them into a *context* feature per committed token (``hidden_norm(fc(concat))``), and in ONE
forward over the block ``[pending, mask, ..., mask]`` (positions after the context, no causal
mask inside the block) gives a marginal distribution for each of the ``L - 1`` next tokens,
scored with the target's own LM head. Each layer's attention sees the context's K/V (projected
from the fused features: kept per sequence, :class:`DFlashPart`) and the block's own.

From the marginals the tree is DDTree's (Algorithm 1, best-first): the ``N`` most probable
prefixes under the factorised distribution ``q(u) = prod_i q_i(u_i)``. Every prefix of a top-N
prefix is in the top N (its score is no lower), and the top ``N`` of depth ``d + 1`` extend the
top ``N`` of depth ``d``, so a beam search of width ``N`` per depth followed by one top-``N``
over all depths finds them on the device, without the heap's host loop. They go to the decoder
as ``N`` beams (each the path to one node, continued by token -1 at log-prob -inf, which the
step prunes away), so the verified tree is exactly those nodes (plus the root).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3 import MLP  # SwiGLU, the names both formats use
from mlx_lm.models.rope_utils import initialize_rope

from redrafter_mlx.core import checked
from redrafter_mlx.core.accept import log_softmax
from redrafter_mlx.core.draft import best
from redrafter_mlx.core.drafting import Reading, Source
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.core.sequence import Sequence

MODEL_TYPE = "dflash"


@dataclass
class DFlashArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 262144
    final_logit_softcapping: float | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_traditional: bool = False  # GPT-J pairing; Qwen's checkpoints pair halves (NeoX)

    NAME = "DFlash"  # the type's name in its messages

    @property
    def draft_vocab(self) -> int:
        return self.vocab_size

    @property
    def proposals(self) -> int:
        """How many marginals one block forward gives (the tokens after the pending one)."""
        return self.block_size - 1

    @classmethod
    def from_dict(cls, config: dict) -> DFlashArgs:
        """From a z-lab ``config.json`` (``dflash_config``: ``mask_token_id``,
        ``target_layer_ids``). DrafterError (one line) for what this runtime cannot run."""
        if not isinstance(config, dict):
            raise DrafterError(f"not a {cls.NAME} config: not a JSON object")
        try:
            dflash = checked.section(config, "dflash_config")
            args = cls(**cls.fields(config, dflash))
        except KeyError as e:
            raise DrafterError(f"not a {cls.NAME} config: {e!r} missing or malformed") from None
        except DrafterError as e:
            raise DrafterError(f"not a {cls.NAME} config: {e}") from None
        if any(t != "full_attention" for t in args.layer_types) or dflash.get("causal"):
            raise DrafterError(
                f"{cls.NAME} drafters with sliding or causal layers are not supported"
            )
        return args

    @staticmethod
    def fields(config: dict, dflash: dict) -> dict:
        return _fields(config, dflash)


def _fields(config: dict, dflash: dict) -> dict:
    """:class:`DFlashArgs`' fields from a z-lab config (``dflash``: its ``dflash_config``),
    each type-checked (core/checked.py); KeyError for a missing one."""
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hidden, inter, layers, heads = checked.sizes(config, *names)
    kv_heads, head_dim, vocab = checked.sizes(
        config, "num_key_value_heads", "head_dim", "vocab_size"
    )
    checked.heads(heads, kv_heads)
    rope = dict(checked.section(config, "rope_parameters"))
    theta = rope.pop("rope_theta", checked.given(config, "rope_theta", 10000.0))
    mask_token = dflash.get("mask_token_id", config.get("mask_token_id"))
    softcap = config.get("final_logit_softcapping")
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "mask_token_id": checked.integer("mask_token_id", mask_token, least=0),
        "target_layer_ids": checked.indices(
            "target_layer_ids", dflash.get("target_layer_ids") or config["target_layer_ids"]
        ),
        "block_size": checked.integer("block_size", checked.given(config, "block_size", 16)),
        "rms_norm_eps": checked.number("rms_norm_eps", checked.given(config, "rms_norm_eps", 1e-6)),
        "rope_theta": checked.number("rope_theta", theta),
        "rope_scaling": rope or config.get("rope_scaling"),
        "max_position_embeddings": checked.integer(
            "max_position_embeddings", checked.given(config, "max_position_embeddings", 262144)
        ),
        "final_logit_softcapping": None
        if softcap is None
        else checked.number("final_logit_softcapping", softcap),
        "layer_types": list(config.get("layer_types") or []),
    }


class Attention(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        h, heads, kv, dim = (
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.q_proj = nn.Linear(h, heads * dim, bias=False)
        self.k_proj = nn.Linear(h, kv * dim, bias=False)
        self.v_proj = nn.Linear(h, kv * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, h, bias=False)
        self.q_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.shape = (heads, kv, dim)

    def split(self, x: mx.array, heads: int) -> mx.array:
        """``(B, T, heads * D)`` -> ``(B, heads, T, D)``."""
        return x.reshape(*x.shape[:2], heads, -1).transpose(0, 2, 1, 3)

    def context(self, features: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """Context K/V of fused ``features (1, T, H)`` at positions ``offset ..``."""
        _, kv, _ = self.shape
        keys = rope(self.k_norm(self.split(self.k_proj(features), kv)), offset=offset)
        return keys, self.split(self.v_proj(features), kv)

    def __call__(self, x, rope, offset, keys, values, mask):
        """The block ``x (1, L, H)`` at ``offset ..`` over context ``keys``/``values``."""
        heads, kv, dim = self.shape
        q = rope(self.q_norm(self.split(self.q_proj(x), heads)), offset=offset)
        k = rope(self.k_norm(self.split(self.k_proj(x), kv)), offset=offset)
        v = self.split(self.v_proj(x), kv)
        keys, values = mx.concatenate([keys, k], 2), mx.concatenate([values, v], 2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))


class Layer(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, rope, offset, keys, values, mask):
        h = x + self.self_attn(self.input_layernorm(x), rope, offset, keys, values, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlash(nn.Module):
    """The drafter's weights by the z-lab names (``fc``, ``hidden_norm``, ``layers.{i}``,
    ``norm``; a ``model.`` prefix is dropped); the token embedding and LM head are the
    target's (a checkpoint's own ``embed_tokens`` is used when it has one)."""

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(
            len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False
        )
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [Layer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            args.head_dim,
            args.rope_theta,
            args.rope_traditional,
            args.rope_scaling,
            args.max_position_embeddings,
        )
        self._target = None  # (embedding, head): the target's, bound by load
        # the block a forward runs (the pending token, then masks) and the first of its rows
        # that scores a proposal: DFlash's pending row scores none
        self.block_length, self.first_row = args.block_size, 1

    def load(self, weights: dict[str, mx.array], embed: nn.Module, head) -> None:
        """Strict load of a checkpoint's ``weights``; ``embed``/``head`` the target's token
        embedding and its output projection (``hidden -> logits``)."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        own = weights.pop("embed_tokens.weight", None)
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head")}
        try:
            self.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            problem = " ".join(str(e).split())[:200]
            raise DrafterError(f"{self.args.NAME} weights: {problem}") from None
        if own is not None:
            embed = nn.Embedding(*own.shape)
            embed.weight = own
        self.bind(embed, head)

    def bind(self, embed: nn.Module, head) -> None:
        """Score with ``head`` (``hidden -> logits``) and embed with ``embed``: the target's."""
        self._target = (embed, head)

    def features(self, taps: list[mx.array]) -> mx.array:
        """Target layers' outputs ``[(..., H)]`` -> context features ``(..., H)``."""
        return self.hidden_norm(self.fc(mx.concatenate(taps, axis=-1)))

    def context(self, features: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        """Each layer's K/V of ``features (T, H)`` at positions ``offset ..``."""
        return [layer.self_attn.context(features[None], self.rope, offset) for layer in self.layers]

    def marginals(self, pending, offset, context, mask) -> mx.array:
        """Logits ``(P, V)`` of the ``P = args.proposals`` tokens after ``pending ()`` (at
        position ``offset``, an int or ``()`` array) given each layer's context K/V and the
        key ``mask``."""
        embed, head = self._target
        size = self.block_length
        block = mx.concatenate(
            [
                pending.reshape(1).astype(mx.int32),
                mx.full((size - 1,), self.args.mask_token_id, mx.int32),
            ]
        )
        h = embed(block)[None]
        for layer, (keys, values) in zip(self.layers, context, strict=True):
            h = layer(h, self.rope, offset, keys, values, mask)
        logits = head(self.norm(h[0, self.first_row :]))
        cap = self.args.final_logit_softcapping
        return logits if not cap else mx.tanh(logits / cap) * cap

    def parameter_names(self) -> set[str]:
        return {k for k, _ in tree_flatten(self.parameters())}


class DFlashPart:
    """One sequence's DFlash context: each layer's K/V of its committed tokens
    ``(1, Kh, S, D)``, and those a step staged for the rows it may commit."""

    def __init__(self, owner: DFlashDrafter):
        self.owner = owner
        self.cache: list[tuple[mx.array, mx.array]] | None = None
        self.length = 0
        self.staged: list[tuple[mx.array, mx.array]] | None = None

    def commit(self, ids: list[int]) -> None:
        n = len(ids)
        new = self.staged
        if new is None or new[0][0].shape[2] < n:  # fed without taps: an empty context there
            new = self.owner.blank(n)  # (drafts from it are worse, never wrong)
        new = [(k[:, :, :n], v[:, :, :n]) for k, v in new]
        if self.cache is None:
            self.cache = new
        else:
            self.cache = [
                (mx.concatenate([k, nk], 2), mx.concatenate([v, nv], 2))
                for (k, v), (nk, nv) in zip(self.cache, new, strict=True)
            ]
        self.length += n
        self.staged = None

    def rewind(self, length: int) -> None:
        self.cache = (
            None if not length else [(k[:, :, :length], v[:, :, :length]) for k, v in self.cache]
        )
        self.length = length
        self.staged = None

    def arrays(self) -> list[mx.array]:
        return [a for pair in self.cache or [] for a in pair]


class DFlashDrafter(Source):
    """A DFlash drafter as the speculative step's source: one drafter forward per step, a
    best-first tree of ``width`` nodes from its marginals (module docstring)."""

    kind = "dflash"
    prunes = True  # beams end where their node does

    def __init__(self, module: DFlash):
        self.module = module
        self.drafter = module  # what width checks read (``args.draft_vocab``), as BeamDrafter's
        self.taps = tuple(module.args.target_layer_ids)

    def new_part(self) -> DFlashPart:
        return DFlashPart(self)

    def part(self, sequence: Sequence) -> DFlashPart:
        return sequence.part_of(self)

    def observe(self, sequence: Sequence, taps: dict, rows: mx.array) -> None:
        """Stage the context K/V of ``rows`` (at the positions they will be committed at)."""
        part = self.part(sequence)
        features = self.module.features([taps[i][rows] for i in self.taps])
        part.staged = self.module.context(features, part.length)

    def check_shape(self, shape) -> None:
        """ValueError when beams of ``shape`` are longer than the block drafts (the pending
        token and ``args.proposals`` marginals)."""
        args = self.module.args
        if shape.length > args.proposals + 1:
            raise ValueError(
                f"beam length {shape.length} exceeds the {args.NAME} drafter's block size "
                f"{args.proposals + 1}"
            )

    def blank(self, count: int) -> list[tuple[mx.array, mx.array]]:
        args = self.module.args
        shape = (1, args.num_key_value_heads, count, args.head_dim)
        dtype = self.module.fc.weight.dtype
        return [(mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for _ in self.module.layers]

    def logits(self, sequence: Sequence, reading: Reading) -> mx.array:
        """The marginals' logits ``(L - 1, V)`` after ``reading.pending``: the context is the
        committed tokens' plus the staged rows that join (``reading.count`` of them)."""
        part = self.part(sequence)
        context = part.cache or self.blank(0)
        staged = 0
        if reading.path.shape[0] and part.staged is not None:
            staged = part.staged[0][0].shape[2]
            context = [
                (mx.concatenate([k, sk], 2), mx.concatenate([v, sv], 2))
                for (k, v), (sk, sv) in zip(context, part.staged, strict=True)
            ]
        size = self.module.block_length
        joins = mx.arange(staged) < reading.count
        mask = mx.concatenate(
            [mx.ones((part.length,), mx.bool_), joins, mx.ones((size,), mx.bool_)]
        )
        offset = part.length + (reading.count if staged else 0)
        return self.module.marginals(reading.pending, offset, context, mask)

    def draft(self, sequence: Sequence, reading: Reading, *, width: int, length: int, **_):
        """``width`` beams of ``length`` from the best-first tree of ``width`` nodes: beam
        ``j`` is the path to the ``j``-th most probable node, then -1s (log-prob -inf)."""
        logprobs = log_softmax(self.logits(sequence, reading)[: length - 1].astype(mx.float32))
        beams, token_logprobs = best_first(logprobs, reading.pending, width)
        return beams, token_logprobs, 0


def best_first(
    logprobs: mx.array, pending: mx.array, nodes: int, *, keep: int | None = None, after=None
) -> tuple[mx.array, mx.array]:
    """The ``nodes`` most probable prefixes under per-depth ``logprobs (d, V)`` (DDTree's
    Algorithm 1), as beams ``(nodes, d + 1)`` from ``pending`` (each the path to one node,
    then -1) and their tokens' log-probs ``(nodes, d)`` (-inf after the node).

    ``after(d, last (k,)) -> (k, V)``, when given, is depth ``d``'s log-probs after each path
    whose last token is ``last`` (a drafter whose marginals depend on the previous token,
    DSpark's): still exact, since a top-``nodes`` node's parent is in its depth's top
    ``nodes``. ``keep`` (default ``nodes``) paths are searched per depth: 1 is the greedy
    chain."""
    depth, vocab = logprobs.shape
    keep = min(keep or nodes, vocab)
    paths = mx.zeros((1, 0), mx.int32)
    scores = mx.zeros((1,))
    token_logprobs = mx.zeros((1, 0))
    candidates = []  # per depth: (paths (keep, d), scores, token_logprobs)
    for d in range(depth):
        if after is None:
            step = mx.broadcast_to(logprobs[d][None], (paths.shape[0], vocab))
        else:
            last = paths[:, -1] if d else pending.reshape(1).astype(mx.int32)
            step = after(d, last)
        flat = (scores[:, None] + step).reshape(-1)
        top = best(flat, min(keep, flat.shape[0]))
        source, token = top // vocab, (top % vocab).astype(mx.int32)
        paths = mx.concatenate([paths[source], token[:, None]], axis=1)
        token_logprobs = mx.concatenate(
            [token_logprobs[source], step[source, token][:, None]], axis=1
        )
        scores = flat[top]
        candidates.append((paths, scores, token_logprobs))
    rows, all_scores, all_logprobs = [], [], []
    for d, (paths, scores, lps) in enumerate(candidates):
        pad = depth - d - 1
        rows.append(mx.concatenate([paths, mx.full((paths.shape[0], pad), -1, mx.int32)], axis=1))
        all_logprobs.append(mx.concatenate([lps, mx.full((lps.shape[0], pad), -mx.inf)], axis=1))
        # ties between a node and its child: the shallower first, so the set stays closed
        all_scores.append(scores - 1e-6 * d)
    chosen = best(mx.concatenate(all_scores), nodes)
    beams = mx.concatenate(rows)[chosen]
    root = mx.broadcast_to(pending.reshape(1, 1).astype(mx.int32), (nodes, 1))
    return mx.concatenate([root, beams], axis=1), mx.concatenate(all_logprobs)[chosen]
