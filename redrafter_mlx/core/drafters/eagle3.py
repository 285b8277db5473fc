"""EAGLE-3 drafters (the ``speculators`` / SGLang checkpoint layout) as beam-search sources.

Legend: W beams, L beam length, S drafter entries cached, E new entries, n path rows,
H drafter hidden, Ht target hidden, K draft vocab, V target vocab, D head dim.

An EAGLE-3 drafter reads three target layers' outputs (``taps``), fuses them (``fc``:
``3 Ht -> H``) and runs one decoder layer (sometimes more) whose first attention sees
``[norm(embed(token)), norm(hidden)]`` (``2 H`` wide). Its *entry* ``t`` pairs the fused
feature of target position ``t`` with the token at ``t + 1`` and sits at drafter position
``t + 1``; its output, normed and projected (``lm_head``, over a draft vocabulary mapped to the
target's by ``d2t``: ``target = draft + d2t[draft]``), predicts the token at ``t + 2``.
Drafting one token deeper feeds the drafter's own output back as the hidden state.

Per sequence (:class:`Eagle3Part`): the fused features of every committed token, and the
layers' K/V of every entry whose token is committed (``offset - 1`` of them). A step's draft
runs the entry pairing the last committed feature with the step's root, then one entry per
accepted-path row (rows past the accepted count are computed and masked out: the count is
not on the host yet), then a beam search from the last accepted row's entry; the commit keeps
the entries whose tokens it commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3 import MLP  # SwiGLU, the names both formats use

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.source import Reading, Source
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.drafters.beam_search import best, narrow
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "eagle3"


@dataclass
class Eagle3Args:
    """The drafter's config (``config.json`` of the speculators layout; the decoder layer's own
    sizes in ``transformer_layer_config``)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    num_hidden_layers: int = 1
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    tie_word_embeddings: bool = False
    # hidden_states indices in HF's numbering (0 = the embeddings): layer i - 1's output
    target_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        checked.heads(self.num_attention_heads, self.num_key_value_heads)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: dict, target_layers: int | None = None) -> Eagle3Args:
        """From a speculators / SGLang ``config.json``; ``target_layers`` (the target's layer
        count) gives the default layers read (``[2, n // 2, n - 3]``) when the config names
        none. DrafterError (one line) for a config that is not EAGLE-3's."""
        if not isinstance(config, dict):
            raise DrafterError("not an EAGLE-3 config: not a JSON object")
        layer = config.get("transformer_layer_config") or config
        if not isinstance(layer, dict):
            raise DrafterError("not an EAGLE-3 config: transformer_layer_config is no object")
        try:
            return cls(**_fields(config, layer, target_layers))
        except KeyError as e:
            raise DrafterError(f"not an EAGLE-3 config: {e!r} missing or malformed") from None
        except DrafterError as e:
            raise DrafterError(f"not an EAGLE-3 config: {e}") from None

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose outputs it reads (HF hidden-state index - 1)."""
        return tuple(max(i - 1, 0) for i in self.target_layer_ids)

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size

    @property
    def own_head(self) -> bool:
        return not (self.tie_word_embeddings and self.draft_vocab_size == self.vocab_size)


def _fields(config: dict, layer: dict, target_layers: int | None) -> dict:
    """:class:`Eagle3Args`' fields from a speculators / SGLang config (``layer``: its
    ``transformer_layer_config``, or the config itself), each type-checked
    (core/drafters/checked.py); KeyError for a missing one."""
    hidden, inter, heads, vocab = checked.sizes(
        layer, "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"
    )
    rope = checked.section(layer, "rope_parameters")
    ids = config.get("target_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = checked.section(config, "eagle_config").get("eagle_aux_hidden_state_layer_ids")
    if not ids and target_layers is not None:
        ids = [2, target_layers // 2, max(target_layers - 3, 0)]
    head_dim = layer.get("head_dim")
    theta = rope.get("rope_theta", checked.given(layer, "rope_theta", 10000.0))
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": checked.integer(
            "num_key_value_heads", checked.given(layer, "num_key_value_heads", heads)
        ),
        "vocab_size": vocab,
        "draft_vocab_size": checked.integer(
            "draft_vocab_size", checked.given(config, "draft_vocab_size", vocab)
        ),
        "target_hidden_size": checked.integer(
            "target_hidden_size", checked.given(config, "target_hidden_size", hidden)
        ),
        "num_hidden_layers": checked.integer(
            "num_hidden_layers", checked.given(layer, "num_hidden_layers", 1)
        ),
        "head_dim": None if head_dim is None else checked.integer("head_dim", head_dim),
        "rms_norm_eps": checked.number("rms_norm_eps", checked.given(layer, "rms_norm_eps", 1e-6)),
        "rope_theta": checked.number("rope_theta", theta),
        "attention_bias": checked.flag(
            "attention_bias", checked.given(layer, "attention_bias", False)
        ),
        **{
            name: checked.flag(name, checked.given(config, name, False))
            for name in ("norm_before_residual", "norm_before_fc", "tie_word_embeddings")
        },
        "target_layer_ids": checked.indices("target_layer_ids", ids) if ids else [],
    }


class Attention(nn.Module):
    """Self-attention over a cached prefix, its new entries and (for beams) each beam's own
    drafted entries."""

    def __init__(self, args: Eagle3Args, input_size: int):
        super().__init__()
        heads, kv_heads, dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(input_size, heads * dim, bias=bias)
        self.k_proj = nn.Linear(input_size, kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(input_size, kv_heads * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, args.hidden_size, bias=bias)
        self.shape = (heads, kv_heads, dim)
        self.theta = args.rope_theta

    def __call__(self, x: mx.array, offset, keys: mx.array, values: mx.array, mask: mx.array):
        """``x (B, E, in)`` at positions ``offset + 0 .. E - 1`` (``offset`` an int or a ``()``
        array) over ``keys``/``values (B, Kh, S, D)`` before them, ``mask (B, 1, E, S + E)``
        -> ``(output (B, E, H), new keys, new values (B, Kh, E, D))``."""
        batch, rows, _ = x.shape
        heads, kv_heads, dim = self.shape

        def split(y, n):
            return y.reshape(batch, rows, n, dim).transpose(0, 2, 1, 3)

        rope = dict(dims=dim, traditional=False, base=self.theta, scale=1.0, offset=offset)
        q = mx.fast.rope(split(self.q_proj(x), heads), **rope)
        k = mx.fast.rope(split(self.k_proj(x), kv_heads), **rope)
        v = split(self.v_proj(x), kv_heads)
        all_k = mx.concatenate([keys, k], axis=2)
        all_v = mx.concatenate([values, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, all_k, all_v, scale=dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, rows, -1)), k, v


class Layer(nn.Module):
    """A decoder layer; the first (``first``) attends over ``[norm(embeds), norm(hidden)]``."""

    def __init__(self, args: Eagle3Args, first: bool):
        super().__init__()
        eps = args.rms_norm_eps
        self.first = first
        self.norm_before_residual = args.norm_before_residual
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=eps)
        width = 2 * args.hidden_size if first else args.hidden_size
        self.self_attn = Attention(args, width)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, embeds, hidden, offset, keys, values, mask):
        """``embeds``/``hidden (B, E, H)`` -> ``(output (B, E, H), new keys, new values)``."""
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        out, k, v = self.self_attn(x, offset, keys, values, mask)
        h = residual + out
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class Eagle3(nn.Module):
    """The drafter's weights, by the speculators layout's names (``fc``, ``layers.{i}``,
    ``norm``, ``lm_head``, ``d2t``, optional ``embed_tokens`` and ``input_norm``)."""

    shift = 1  # entry t (feature t, token t + 1) sits at drafter position t + 1

    def __init__(self, args: Eagle3Args):
        super().__init__()
        self.args = args
        taps = max(len(args.target_layer_ids), 1)
        self.fc = nn.Linear(taps * args.target_hidden_size, args.hidden_size, bias=False)
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(taps * args.target_hidden_size, eps=args.rms_norm_eps)
        self.layers = [Layer(args, first=i == 0) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if args.own_head:
            self.lm_head = nn.Linear(args.hidden_size, args.draft_vocab_size, bias=False)
        if args.draft_vocab_size != args.vocab_size:
            self.d2t = mx.zeros((args.draft_vocab_size,), mx.int32)

    def fuse(self, taps: list[mx.array]) -> mx.array:
        """The target layers' outputs ``[(..., Ht)] * 3`` -> the fused feature ``(..., H)``."""
        x = mx.concatenate(taps, axis=-1)
        if "input_norm" in self:
            x = self.input_norm(x)
        return self.fc(x)

    def logits(self, hidden: mx.array) -> mx.array:
        """Layer output ``(..., H)`` -> draft-vocabulary logits ``(..., K)``."""
        x = self.norm(hidden)
        return self.lm_head(x) if "lm_head" in self else self.embed_tokens.as_linear(x)

    def target_ids(self, draft: mx.array) -> mx.array:
        """Draft-vocabulary indices -> the target's token ids."""
        draft = draft.astype(mx.int32)
        return draft + self.d2t[draft] if "d2t" in self else draft

    def run(self, tokens, hidden, offset, cache: list[tuple], mask) -> tuple:
        """Entries of ``tokens (B, E)`` with ``hidden (B, E, H)`` at ``offset`` after each
        layer's ``cache`` K/V ``(B, Kh, S, D)`` -> ``(output (B, E, H), [(keys, values)] new
        per layer)``."""
        embeds = self.embed_tokens(tokens)
        new = []
        for layer, (keys, values) in zip(self.layers, cache, strict=True):
            hidden, k, v = layer(embeds, hidden, offset, keys, values, mask)
            new.append((k, v))
        return hidden, new

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A checkpoint's tensors as this module names them: SGLang / the original EAGLE-3
        name the layer ``midlayer``; ``t2d`` and the target's tensors are dropped; without
        its own ``embed_tokens`` it is taken from the target (:meth:`bind_target`)."""
        out = {}
        for name, value in weights.items():
            name = name.replace("midlayer.", "layers.0.")
            if name == "t2d" or name.startswith("verifier_") or "rotary_emb" in name:
                continue
            if name == "d2t":
                value = value.astype(mx.int32)
            if name == "lm_head.weight" and not self.args.own_head:
                continue
            out[name] = value
        return out

    def load(self, weights: dict[str, mx.array], target_embed: nn.Module) -> None:
        """Load a checkpoint's ``weights`` strictly and use the target's token embedding
        where its shape fits (the drafter was trained with the target's, frozen: as the
        reference runtimes do); a checkpoint without ``embed_tokens`` needs it to fit.
        DrafterError (one line) for missing or misshapen tensors."""
        weights = self.sanitize(weights)
        fits = tuple(target_embed.weight.shape[-1:]) == (self.args.hidden_size,) or hasattr(
            target_embed, "scales"
        )
        borrowed = fits or "embed_tokens.weight" not in weights
        if borrowed:
            weights = {k: v for k, v in weights.items() if not k.startswith("embed_tokens.")}
        expected = dict(tree_flatten(self.parameters()))
        if borrowed:
            del expected["embed_tokens.weight"]
        if problem := _unfit(expected, weights):
            raise DrafterError(f"EAGLE-3 weights: {problem}")
        # only the config's tensors: checkpoints carry others (a d2t the full vocabulary does
        # not need), and a stray name can end in MLX's ``KeyError: 0`` inside ``update``
        self.load_weights([(k, weights[k]) for k in expected], strict=False)
        if borrowed:
            self.embed_tokens = target_embed


def _unfit(expected: dict[str, mx.array], weights: dict[str, mx.array]) -> str | None:
    """What keeps ``weights`` from loading as ``expected`` (name -> parameter), in words:
    tensors it lacks (another drafter's weights lack most), shapes that differ; None when it
    fits. MLX's non-strict load checks neither."""
    if missing := sorted(expected.keys() - weights.keys()):
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"missing {', '.join(missing[:3])}{more} (not this config's drafter?)"
    for name, value in expected.items():
        if weights[name].shape != value.shape:
            shape = tuple(weights[name].shape)
            return f"{name} has shape {shape}, the config needs {tuple(value.shape)}"
    return None


class Eagle3Part:
    """One sequence's EAGLE-3 state: fused features of its committed tokens ``(offset, H)``
    and each layer's K/V of its entries ``(1, Kh, entries, D)``, with what a step staged."""

    def __init__(self, owner: Eagle3Drafter):
        self.owner = owner
        self.features = None  # (F, H), F = committed tokens
        self.cache: list[tuple[mx.array, mx.array]] = []
        self.entries = 0
        self._staged_features = None  # (n, H): rows in the order the next commit takes them
        self._staged_cache: list[tuple[mx.array, mx.array]] | None = None  # (1, Kh, E, D)

    @property
    def length(self) -> int:
        return 0 if self.features is None else self.features.shape[0]

    @property
    def staged_features(self) -> mx.array | None:
        return self._staged_features

    def stage_features(self, features: mx.array) -> None:
        self._staged_features = features

    def stage_entries(self, cache: list[tuple[mx.array, mx.array]]) -> None:
        self._staged_cache = cache

    def append_entries(self, cache: list[tuple[mx.array, mx.array]], count: int) -> None:
        self.cache = [
            (mx.concatenate([k, nk[:, :, :count]], 2), mx.concatenate([v, nv[:, :, :count]], 2))
            for (k, v), (nk, nv) in zip(self.cache, cache, strict=True)
        ]
        self.entries += count

    def commit(self, ids: list[int]) -> None:
        n = len(ids)
        staged = self._staged_features
        if staged is None or staged.shape[0] < n:  # fed without taps (an autoregressive step):
            staged = mx.zeros((n, self.owner.module.args.hidden_size), self._dtype())  # drafts
        added = staged[:n]  # from these rows are worse, never wrong
        self.features = added if self.features is None else mx.concatenate([self.features, added])
        if self._staged_cache is not None:  # entries whose tokens are now committed
            self.append_entries(self._staged_cache, self.length - 1 - self.entries)
        self._staged_features = self._staged_cache = None

    def rewind(self, length: int) -> None:
        self.features = None if length == 0 else self.features[:length]
        keep = min(self.entries, max(length - 1, 0))  # entry length - 1 pairs with a new token
        self.cache = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.cache]
        self.entries = keep
        self._staged_features = self._staged_cache = None

    def arrays(self) -> list[mx.array]:
        kv = [a for pair in self.cache for a in pair]
        return kv + ([] if self.features is None else [self.features])

    def _dtype(self):
        return self.owner.module.fc.weight.dtype


class Eagle3Drafter(Source):
    """An EAGLE-3 drafter as the speculative step's source (:class:`~redrafter_mlx.core.
    drafting.Source`): it reads ``taps``, keeps an :class:`Eagle3Part` per sequence and drafts
    ``W`` beams by beam search over its decoder (each beam attends to the sequence's entries
    and its own drafted ones)."""

    kind = "eagle3"

    def __init__(self, module: Eagle3):
        self.module = module
        self.drafter = module  # what width checks read (``args.draft_vocab``), as BeamDrafter's
        self.taps = module.args.taps

    def new_part(self) -> Eagle3Part:
        return Eagle3Part(self)

    def part(self, sequence: Sequence) -> Eagle3Part:
        return sequence.part_of(self)

    def observe(self, sequence: Sequence, taps: dict, rows: mx.array) -> None:
        features = self.module.fuse([taps[i][rows] for i in self.taps])
        self.part(sequence).stage_features(features)

    # -- entries

    def catch_up(self, sequence: Sequence, part: Eagle3Part) -> None:
        """Compute (and keep) the entries of committed tokens not yet entered (after a prompt
        or a rewind): entry ``t`` pairs feature ``t`` with token ``t + 1``."""
        start, stop = part.entries, part.length - 1
        if stop <= start:
            return
        if not part.cache:
            part.cache = self._empty_cache()
        tokens = mx.array(sequence.ids[start + 1 : stop + 1])[None]
        hidden = part.features[start:stop][None]
        mask = _causal(start, stop - start)
        _, new = self.module.run(tokens, hidden, start + self.module.shift, part.cache, mask)
        part.append_entries(new, stop - start)

    def entries(self, sequence: Sequence, reading: Reading) -> tuple:
        """The step's new entries: the last committed feature with the root token, then each
        path row with the token after it -> ``(outputs (E, H), new K/V per layer, root
        entry index ())``. Staged in the part: the commit keeps those it commits."""
        part = self.part(sequence)
        self.catch_up(sequence, part)
        root = reading.tokens[:1] if reading.path.shape[0] else reading.pending.reshape(1)
        tokens = mx.concatenate([root.astype(mx.int32), reading.following()])
        hidden = part.features[-1:]
        if reading.path.shape[0]:
            hidden = mx.concatenate([hidden, part.staged_features.astype(hidden.dtype)])
        if not part.cache:
            part.cache = self._empty_cache()
        count = tokens.shape[0]
        out, new = self.module.run(
            tokens[None],
            hidden[None],
            part.entries + self.module.shift,
            part.cache,
            _causal(part.entries, count),
        )
        part.stage_entries(new)
        return out[0], new, reading.count

    # -- beams

    def draft(self, sequence: Sequence, reading: Reading, *, width, length, **options):
        """Beams ``(W, L)`` from ``reading.pending``, their drafted tokens' log-probs
        ``(W, L - 1)`` and 0 host reads (a floor prunes after the step's read)."""
        kept = max(width, options.get("search_width", 0))
        part = self.part(sequence)
        outputs, new, root = self.entries(sequence, reading)
        prefix = [
            (mx.concatenate([k, nk], 2), mx.concatenate([v, nv], 2))
            for (k, v), (nk, nv) in zip(part.cache, new, strict=True)
        ]
        valid = mx.arange(prefix[0][0].shape[2]) <= part.entries + root  # entries after the
        position = part.entries + root + self.module.shift  # root's: rows not accepted
        beams, logprobs = self.search(
            outputs[root], reading.pending, prefix, valid, position, width=kept, length=length
        )
        return (*narrow(beams, logprobs, width), 0)

    def search(self, hidden, pending, prefix, valid, position, *, width: int, length: int):
        """Beam search from the root entry's output ``hidden (H,)`` (at drafter position
        ``position``), each depth one batched decoder pass over the live beams."""
        module = self.module
        beams = pending.reshape(1, 1).astype(mx.int32)
        scores = mx.zeros((1,))
        token_logprobs = mx.zeros((1, 0))
        hidden = hidden[None, None]  # (B, 1, H)
        own = [(mx.zeros((1, *k.shape[1:2], 0, k.shape[3]), k.dtype),) * 2 for k, _ in prefix]
        for depth in range(1, length):
            logprobs = log_softmax(module.logits(hidden[:, 0]).astype(mx.float32))  # (B, K)
            rows, vocab = logprobs.shape
            flat = (scores[:, None] + logprobs).reshape(-1)
            top = best(flat, min(width, flat.shape[0]))
            source, index = top // vocab, top % vocab
            tokens = module.target_ids(index)
            beams = mx.concatenate([beams[source], tokens[:, None]], axis=1)
            token_logprobs = mx.concatenate(
                [token_logprobs[source], logprobs.reshape(-1)[top][:, None]], axis=1
            )
            scores = flat[top]
            if depth == length - 1:
                break
            own = [(k[source], v[source]) for k, v in own]
            cache = [
                (
                    mx.concatenate([_rows(pk, len(top)), k], 2),
                    mx.concatenate([_rows(pv, len(top)), v], 2),
                )
                for (pk, pv), (k, v) in zip(prefix, own, strict=True)
            ]
            mask = mx.concatenate([valid, mx.ones((depth,), mx.bool_)])
            mask = mx.broadcast_to(mask, (len(top), 1, 1, mask.shape[0]))
            hidden, new = module.run(tokens[:, None], hidden[source], position + depth, cache, mask)
            own = [
                (mx.concatenate([k, nk], 2), mx.concatenate([v, nv], 2))
                for (k, v), (nk, nv) in zip(own, new, strict=True)
            ]
        return beams, token_logprobs

    def _empty_cache(self) -> list[tuple[mx.array, mx.array]]:
        args = self.module.args
        shape = (1, args.num_key_value_heads, 0, args.head_dim)
        dtype = self.module.fc.weight.dtype
        return [(mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for _ in self.module.layers]


def _rows(x: mx.array, n: int) -> mx.array:
    return mx.broadcast_to(x, (n, *x.shape[1:]))


def _causal(cached: int, new: int) -> mx.array:
    """Boolean ``(new, cached + new)``: every cached entry, and the new ones up to each."""
    return mx.arange(cached + new)[None] <= (mx.arange(new)[:, None] + cached)
