"""DFlash drafters (block diffusion, the z-lab layout) drafting best-first trees.

Legend: L beam length (block size), P proposals per block (``block_size - 1``), N tree nodes
drafted, S context tokens, H hidden, V vocab, Kh K/V heads, D head dim.

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

A layer may slide (``layer_types``, ``sliding_window`` ``w``): it sees only the context within
``w - 1`` positions of its query, by a key mask over the whole context (:meth:`DFlash.masks`).
Configs come in z-lab's layout or speculators' (:func:`flattened`); DFlash2
(core/drafters/dflash2.py) is this module with its own layers and tree, DSpark
(core/drafters/dspark.py) with its own block rows (:attr:`DFlash.block_length`,
:attr:`DFlash.first_row`) and tree: both trees are :func:`best_tree`'s, over a chain whose
log-probs depend on the token before.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3 import MLP  # SwiGLU, the names both formats use
from mlx_lm.models.rope_utils import initialize_rope

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.source import Reading, Source
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.drafters.beam_search import best
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "dflash"
GEMMA4_MASK = 4  # Gemma's <mask>: mlx-vlm's default for z-lab's Gemma 4 DFlash configs


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
    sliding_window: int | None = None
    causal_sliding: bool = False  # sliding layers causal inside the block (speculators' default)
    rope_traditional: bool = False  # GPT-J pairing; Qwen's checkpoints pair halves (NeoX)

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
        ``target_layer_ids``) or a speculators one (``transformer_layer_config``,
        ``aux_hidden_state_layer_ids``). DrafterError (one line) for what this runtime
        cannot run."""
        return cls(**parsed(config, "DFlash"))

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"


LAYER_TYPES = ("full_attention", "sliding_attention")


def parsed(config: object, name: str, extra=None) -> dict:
    """The fields of a DFlash-family config (``name``'s: "DFlash", "DFlash2", "DSpark"),
    flattened from either layout (:func:`flattened`) and type-checked; ``extra(flat, dflash)``
    adds a subtype's own. DrafterError (one line) naming ``name`` for a malformed config."""
    if not isinstance(config, dict):
        raise DrafterError(f"not a {name} config: not a JSON object")
    try:
        flat, dflash = flattened(config)
        fields = _fields(flat, dflash) | (extra(flat, dflash) if extra else {})
    except KeyError as e:
        raise DrafterError(f"not a {name} config: {e!r} missing or malformed") from None
    except DrafterError as e:
        raise DrafterError(f"not a {name} config: {e}") from None
    if "sample_from_anchor" not in fields and flat.get("sample_from_anchor"):  # DSpark's only
        raise DrafterError(
            f"not a {name} config: blocks drafted from the anchor (sample_from_anchor) are not"
            " supported"
        )
    if dflash.get("causal"):
        raise DrafterError(f"{name} drafter: causal draft blocks are not supported")
    return fields


def flattened(config: dict) -> tuple[dict, dict]:
    """``(flat, dflash)``: a z-lab config and its ``dflash_config`` as they are; speculators'
    layouts as z-lab's, with no ``dflash_config`` (:func:`_speculators`, :func:`_open_spec`)."""
    spec = config.get("speculative_config")
    if isinstance(spec, dict) and spec.get("method"):
        return _open_spec(config, spec)
    if "speculators_model_type" in config:
        return _speculators(config)
    return config, checked.section(config, "dflash_config")


def _speculators(config: dict) -> tuple[dict, dict]:
    """speculators' own layout: the sizes under ``transformer_layer_config``, the target
    layers as ``aux_hidden_state_layer_ids`` (Hugging Face hidden-state indices, as EAGLE-3's:
    index ``i`` is layer ``i - 1``'s output), ``block_size`` the block's rows (the anchor and
    its masks: ``block_size`` proposals when the anchor's row proposes too, else one fewer)."""
    layer = checked.section(config, "transformer_layer_config")
    outer = {k: v for k, v in config.items() if k != "transformer_layer_config" and v is not None}
    ids = checked.indices("aux_hidden_state_layer_ids", config["aux_hidden_state_layer_ids"])
    flat = {**layer, **outer}
    if "block_size" in flat and _anchored(flat):  # every row of its block proposes (DSpark's)
        flat["block_size"] = checked.integer("block_size", flat["block_size"]) + 1
    return _from_speculators(flat, ids, 1)


def _open_spec(config: dict, spec: dict) -> tuple[dict, dict]:
    """The Open Spec Config speculators writes (sizes at the top level, the rest under
    ``speculative_config``: ``target_layer_ids`` counted from ``target_layer_start_idx``,
    ``speculative_tokens`` drafts per block after the anchor)."""
    flat = {**config, **{k: v for k, v in spec.items() if v is not None}}
    ids = checked.indices("target_layer_ids", spec["target_layer_ids"])
    start = checked.integer(
        "target_layer_start_idx", spec.get("target_layer_start_idx", 0), least=0
    )
    tokens = checked.integer("speculative_tokens", spec["speculative_tokens"])
    return _from_speculators({**flat, "block_size": tokens + 1}, ids, start)


def _from_speculators(flat: dict, ids: list[int], start: int) -> tuple[dict, dict]:
    """A speculators layout's ``flat`` keys with the layers read (``ids`` counted from
    ``start``) and its sliding layers' causality, refusing what z-lab's layout cannot say."""
    vocab, draft = flat.get("vocab_size"), flat.get("draft_vocab_size")
    if draft is not None and draft != vocab:
        raise DrafterError(f"a draft vocabulary of {draft} (not the target's {vocab})")
    _anchored(flat)
    non_causal = checked.flag(
        "sliding_window_non_causal", flat.get("sliding_window_non_causal", False)
    )
    flat = {**flat, "target_layer_ids": [max(i - start, 0) for i in ids]}
    # its block size now counts the pending token and the proposals, as mlx-vlm's DSpark
    # configs say with dspark_bonus_anchor (core/drafters/dspark.py)
    return flat | {"causal_sliding": not non_causal, "dspark_bonus_anchor": True}, {}


def _anchored(flat: dict) -> bool:
    """Whether a speculators block's anchor row scores the first proposal
    (``sample_from_anchor``: DSpark's default; DFlash's parse refuses it, :func:`parsed`)."""
    return checked.flag("sample_from_anchor", flat.get("sample_from_anchor", False))


def _fields(config: dict, dflash: dict) -> dict:
    """:class:`DFlashArgs`' fields from a z-lab config (``dflash``: its ``dflash_config``),
    each type-checked (core/drafters/checked.py); KeyError for a missing one."""
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hidden, inter, layers, heads = checked.sizes(config, *names)
    kv_heads, head_dim, vocab = checked.sizes(
        config, "num_key_value_heads", "head_dim", "vocab_size"
    )
    checked.heads(heads, kv_heads)
    rope = dict(checked.section(config, "rope_parameters"))
    theta = rope.pop("rope_theta", checked.given(config, "rope_theta", 10000.0))
    mask_token = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask_token is None and config.get("model_type") == "gemma4":
        mask_token = GEMMA4_MASK
    softcap = dflash.get("final_logit_softcapping", config.get("final_logit_softcapping"))
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
        "block_size": checked.integer(
            "block_size", dflash.get("block_size", checked.given(config, "block_size", 16))
        ),
        "rms_norm_eps": checked.number("rms_norm_eps", checked.given(config, "rms_norm_eps", 1e-6)),
        "rope_theta": checked.number("rope_theta", theta),
        "rope_scaling": rope or config.get("rope_scaling"),
        "max_position_embeddings": checked.integer(
            "max_position_embeddings", checked.given(config, "max_position_embeddings", 262144)
        ),
        "final_logit_softcapping": None
        if softcap is None
        else checked.number("final_logit_softcapping", softcap),
        **_windows(config, layers),
    }


def _windows(config: dict, layers: int) -> dict:
    """``layer_types``, ``sliding_window`` and ``causal_sliding``, checked: one known type
    per layer, and a window when a layer slides."""
    types = list(checked.given(config, "layer_types", []) or [])
    if types and (len(types) != layers or any(t not in LAYER_TYPES for t in types)):
        raise DrafterError(f"layer_types {types}: need one of {list(LAYER_TYPES)} per layer")
    window = checked.given(config, "sliding_window", None)
    if "sliding_attention" in types:
        window = checked.integer("sliding_window", window, least=2)
    return {
        "layer_types": types,
        "sliding_window": window if "sliding_attention" in types else None,
        "causal_sliding": bool(config.get("causal_sliding", False)),
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


class Scaled(nn.Module):
    """``embed`` (token ids ``(L,)`` -> ``(L, H)``) times ``scale``: a target's input as its
    own forward makes it (Gemma's ``embed_scale``, ``sqrt(H)``). A DFlash-family block starts
    from it, as mlx-vlm binds these drafters and as z-lab's reference embeds (HF's Gemma
    embedding scales itself); kept out of the drafter's parameters (``_target``)."""

    def __init__(self, embed: nn.Module, scale: float):
        super().__init__()
        self._embed, self.scale = embed, scale

    def __call__(self, tokens: mx.array) -> mx.array:
        return self._embed(tokens) * self.scale


class DFlash(nn.Module):
    """The drafter's weights by the z-lab names (``fc``, ``hidden_norm``, ``layers.{i}``,
    ``norm``; a ``model.`` prefix is dropped); the token embedding and LM head are the
    target's (a checkpoint's own ``embed_tokens`` is used when it has one)."""

    name = "DFlash"  # what its errors call it
    layer_class = Layer

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(
            len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False
        )
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args) for _ in range(args.num_hidden_layers)]
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
            raise DrafterError(f"{self.name} weights: {' '.join(str(e).split())[:200]}") from None
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

    def marginals(self, pending, offset, context, masks) -> mx.array:
        """Logits ``(P, V)`` of the ``P = args.proposals`` tokens after ``pending ()`` (at
        position ``offset``, an int or ``()`` array) given each layer's context K/V and key
        mask (:meth:`masks`)."""
        return self.scores(self.hidden(pending, offset, context, masks))

    def hidden(self, pending, offset, context, masks) -> mx.array:
        """The block's final-norm hidden states ``(P, H)`` of the rows that score the proposals
        after ``pending`` (its masks)."""
        size = self.block_length
        block = mx.concatenate(
            [
                pending.reshape(1).astype(mx.int32),
                mx.full((size - 1,), self.args.mask_token_id, mx.int32),
            ]
        )
        h = self.embed(block)[None]
        for layer, (keys, values), mask in zip(self.layers, context, masks, strict=True):
            h = layer(h, self.rope, offset, keys, values, mask)
        return self.norm(h[0, self.first_row :])

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids ``(L,)`` -> the block's input ``(L, H)``: the target's embedding."""
        return self._target[0](tokens)

    def scores(self, hidden: mx.array) -> mx.array:
        """Final-norm hidden ``(..., H)`` -> logits ``(..., V)`` through the target's head."""
        logits = self._target[1](hidden)
        cap = self.args.final_logit_softcapping
        return logits if not cap else mx.tanh(logits / cap) * cap

    def masks(self, visible: mx.array, positions: mx.array, offset) -> list[mx.array]:
        """Each layer's key mask over ``[context, block]``: ``visible (S,)`` the context keys
        that join, at ``positions (S,)``; the block at ``offset ..``. A full layer sees them
        all (``(S + L,)``); a sliding one of window ``w`` only the context positions within
        ``w - 1`` of its query (``(L, S + L)``): of the block's first, as mlx-vlm's
        non-causal sliding layers, or of each query, causally inside the block (speculators)."""
        size, args = self.block_length, self.args
        full = mx.concatenate([visible, mx.ones((size,), mx.bool_)])
        if "sliding_attention" not in args.layer_types:
            return [full] * len(self.layers)
        rows = mx.arange(size)
        queries = offset + (rows if args.causal_sliding else mx.zeros((size,), mx.int32))
        near = visible[None] & (positions[None] > queries[:, None] - args.sliding_window)
        inside = mx.ones((size, size), mx.bool_)  # mlx-vlm's: the whole block
        if args.causal_sliding:
            gap = rows[:, None] - rows[None]
            inside = (gap >= 0) & (gap < args.sliding_window)
        sliding = mx.concatenate([near, inside], axis=1)
        return [sliding if args.sliding(i) else full for i in range(len(self.layers))]

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

    def fit_default(self, shape):
        """A tree of at most the block's drafted tokens (``args.proposals``), as deep as it."""
        proposals = self.module.args.proposals
        width, length = min(shape.width, proposals), min(shape.length, proposals + 1)
        return replace(shape, width=width, length=length)

    def check_shape(self, shape) -> None:
        """ValueError when beams of ``shape`` are longer than the block drafts (the pending
        token and ``args.proposals`` marginals)."""
        block = self.module.args.proposals + 1
        if shape.length > block:
            raise ValueError(
                f"beam length {shape.length} exceeds the {self.module.name} drafter's block size "
                f"{block}"
            )

    def blank(self, count: int) -> list[tuple[mx.array, mx.array]]:
        args = self.module.args
        shape = (1, args.num_key_value_heads, count, args.head_dim)
        dtype = self.module.fc.weight.dtype
        return [(mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for _ in self.module.layers]

    def logits(self, sequence: Sequence, reading: Reading) -> mx.array:
        """The marginals' logits ``(P, V)`` after ``reading.pending``."""
        return self.module.marginals(*self.block(sequence, reading))

    def block(self, sequence: Sequence, reading: Reading) -> tuple:
        """The block forward's inputs after ``reading.pending``: ``(pending, offset, context,
        masks)``; the context is the committed tokens' plus the staged rows that join
        (``reading.count`` of them)."""
        part = self.part(sequence)
        context = part.cache or self.blank(0)
        staged = 0
        if reading.path.shape[0] and part.staged is not None:
            staged = part.staged[0][0].shape[2]
            context = [
                (mx.concatenate([k, sk], 2), mx.concatenate([v, sv], 2))
                for (k, v), (sk, sv) in zip(context, part.staged, strict=True)
            ]
        joins = mx.arange(staged) < reading.count
        visible = mx.concatenate([mx.ones((part.length,), mx.bool_), joins])
        positions = mx.arange(part.length + staged)  # staged rows follow the committed ones
        offset = part.length + (reading.count if staged else 0)
        masks = self.module.masks(visible, positions, offset)
        return reading.pending, offset, context, masks

    def draft(self, sequence: Sequence, reading: Reading, *, width: int, length: int, **_):
        """``width`` beams of ``length`` from the best-first tree of ``width`` nodes: beam
        ``j`` is the path to the ``j``-th most probable node, then -1s (log-prob -inf)."""
        logprobs = log_softmax(self.logits(sequence, reading)[: length - 1].astype(mx.float32))
        beams, token_logprobs = best_first(logprobs, reading.pending, width)
        return beams, token_logprobs, 0


def best_first(logprobs: mx.array, pending: mx.array, nodes: int) -> tuple[mx.array, mx.array]:
    """The ``nodes`` most probable prefixes under per-depth ``logprobs (d, V)`` (DDTree's
    Algorithm 1), as beams ``(nodes, d + 1)`` from ``pending`` (each the path to one node,
    then -1) and their tokens' log-probs ``(nodes, d)`` (-inf after the node)."""
    tokens = mx.arange(logprobs.shape[1], dtype=mx.int32)[None]
    return best_tree(lambda d, last: (tokens, logprobs[d][None]), logprobs.shape[0], pending, nodes)


def best_tree(
    step, depth: int, pending: mx.array, nodes: int, *, keep: int | None = None
) -> tuple[mx.array, mx.array]:
    """:func:`best_first` for any chain (a drafter whose marginals depend on the token
    before: DFlash2's selector, DSpark's Markov head): ``step(d, last (P,))`` gives the
    tokens ``(P, K)`` (or ``(1, K)`` for all) that may follow each path's ``last`` token at
    depth ``d`` and their log-probs ``(P, K)`` (or ``(1, K)``). A child scores no higher than
    its parent, so the top ``nodes`` of each depth extend the top ``nodes`` of the one before,
    and one top-``nodes`` over all depths keeps a closed tree (too few candidates: the rest
    are beams of the root alone). ``keep`` (default ``nodes``) paths are searched per depth:
    1 is the greedy chain."""
    keep = keep or nodes
    paths = mx.zeros((1, 0), mx.int32)
    scores = mx.zeros((1,))
    token_logprobs = mx.zeros((1, 0))
    last = pending.reshape(1).astype(mx.int32)
    candidates = []  # per depth: (paths (P, d), scores, token_logprobs)
    for d in range(depth):
        tokens, logprobs = step(d, last)
        shape = (paths.shape[0], logprobs.shape[-1])
        tokens, logprobs = mx.broadcast_to(tokens, shape), mx.broadcast_to(logprobs, shape)
        flat = (scores[:, None] + logprobs).reshape(-1)
        top = best(flat, min(keep, flat.shape[0]))
        source, last = top // shape[1], tokens.reshape(-1)[top]
        paths = mx.concatenate([paths[source], last[:, None]], axis=1)
        token_logprobs = mx.concatenate(
            [token_logprobs[source], logprobs.reshape(-1)[top][:, None]], axis=1
        )
        scores = flat[top]
        candidates.append((paths, scores, token_logprobs))
    return _chosen(candidates, depth, pending, nodes)


def _chosen(candidates: list, depth: int, pending: mx.array, nodes: int):
    """The ``nodes`` best of all depths' ``candidates`` as :func:`best_first`'s beams."""
    rows, all_scores, all_logprobs = [], [], []
    for d, (paths, scores, lps) in enumerate(candidates):
        pad = depth - d - 1
        rows.append(mx.concatenate([paths, mx.full((paths.shape[0], pad), -1, mx.int32)], axis=1))
        all_logprobs.append(mx.concatenate([lps, mx.full((lps.shape[0], pad), -mx.inf)], axis=1))
        # ties between a node and its child: the shallower first, so the set stays closed
        all_scores.append(scores - 1e-6 * d)
    rows, all_logprobs = mx.concatenate(rows), mx.concatenate(all_logprobs)
    if (short := nodes - rows.shape[0]) > 0:  # fewer nodes than asked: root-only beams
        rows = mx.concatenate([rows, mx.full((short, depth), -1, mx.int32)])
        all_logprobs = mx.concatenate([all_logprobs, mx.full((short, depth), -mx.inf)])
        all_scores.append(mx.full((short,), -mx.inf))
    chosen = best(mx.concatenate(all_scores), nodes)
    root = mx.broadcast_to(pending.reshape(1, 1).astype(mx.int32), (nodes, 1))
    return mx.concatenate([root, rows[chosen]], axis=1), all_logprobs[chosen]
