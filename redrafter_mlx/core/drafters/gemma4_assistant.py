"""Gemma 4's assistant drafter (``gemma4_assistant``, Google's MTP drafter for Gemma 4),
searched as beams.

Legend: B beams, S target K/V slots, H the assistant's hidden, Hb the target's hidden
("backbone"), V vocabulary.

The assistant has no K/V of its own: its decoder layers (mlx-lm's Gemma 4 layers, every one
K/V-shared) attend, bidirectionally, to the target's own K/V of the last full-attention and
the last sliding-window layer that compute K/V, over every committed token (sliding layers
within their window). One step takes ``pre_projection([embed(token) * sqrt(Hb), hidden])``
(``hidden`` the target's final-norm hidden state of the last committed token, then the
assistant's own ``post_projection`` output when chained), runs the layers and the final norm
at the position of that last committed token (held for every depth, as mlx-vlm and HF do),
and scores the vocabulary with its own tied embedding (E2B / E4B: a centroid-routed sparse
head, the tokens of the top clusters only). Beams are searched over it as over EAGLE-3's
decoder.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import DecoderLayer
from mlx_lm.models.gemma4_text import ModelArgs as TextArgs

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.source import Reading, Source
from redrafter_mlx.core.drafters.beam_search import best, narrow
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "gemma4_assistant"
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclasses.dataclass
class AssistantArgs:
    """The assistant's config: its own layers' ``text`` args (every layer K/V-shared), the
    target's hidden size it reads, and its head (tied, or centroid-routed)."""

    text: TextArgs
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, config: dict) -> AssistantArgs:
        """From a ``gemma4_assistant`` ``config.json`` (ValueError when it lacks its parts)."""
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("no text_config")
        args = TextArgs.from_dict(text)
        # HF: no (or 0) shared layers declared means all of them share the target's K/V
        if not args.num_kv_shared_layers:
            args.num_kv_shared_layers = args.num_hidden_layers
        fields = {f.name for f in dataclasses.fields(cls)} - {"text"}
        return cls(text=args, **{k: v for k, v in config.items() if k in fields})


class _Inner(nn.Module):
    def __init__(self, text: TextArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = [DecoderLayer(text, i) for i in range(text.num_hidden_layers)]
        self.norm = nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps)


class MaskedEmbedder(nn.Module):
    """The E2B / E4B sparse head: ``centroids`` score clusters of tokens (``token_ordering``
    lists each cluster's); only the top clusters' tokens are scored, the rest get one less
    than the least of those (as HF and mlx-vlm do), lazily."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        text = args.text
        self.top_k, self.clusters = args.centroid_intermediate_top_k, args.num_centroids
        self.centroids = nn.Linear(text.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((text.vocab_size,), mx.int32)
        self.freeze(keys="token_ordering", recurse=False)

    def __call__(self, hidden: mx.array, embedding: mx.array) -> mx.array:
        """``hidden (B, H)``, the tied ``embedding (V, H)`` -> logits ``(B, V)``."""
        vocab = embedding.shape[0]
        top = mx.argpartition(self.centroids(hidden), kth=-self.top_k, axis=-1)[:, -self.top_k :]
        ordering = self.token_ordering.reshape(self.clusters, vocab // self.clusters)
        chosen = ordering[top].reshape(hidden.shape[0], -1)  # (B, top_k * V / clusters)
        logits = (embedding[chosen] @ hidden[:, :, None])[..., 0]
        floor = mx.min(logits) - 1.0  # over the whole batch, as mlx-vlm's
        out = mx.broadcast_to(floor.astype(hidden.dtype), (hidden.shape[0], vocab))
        return mx.put_along_axis(out, chosen, logits.astype(hidden.dtype), axis=-1)


class Assistant(nn.Module):
    """The assistant's weights by HF's names (``model.{embed_tokens,layers,norm}``,
    ``pre_projection``, ``post_projection``, ``masked_embedding``, ``lm_head`` when untied);
    the target's token embedding (and its scale) is the target's (:meth:`bind`)."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        text = args.text
        self.model = _Inner(text)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, args.backbone_hidden_size, bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(args)
        self._target = None

    def bind(self, embed: nn.Module, scale: float) -> None:
        """The target's token embedding and the factor its inputs are scaled by."""
        self._target = (embed, scale)

    def step(self, tokens, hidden, kv: dict, masks: dict, position) -> tuple:
        """``tokens (B,)`` with ``hidden (B, Hb)`` at ``position ()`` over the target's ``kv``
        ``{layer type: (keys, values) (1, K, S, D)}`` under boolean ``masks`` ``(S,)`` ->
        ``(next hidden (B, Hb), logits (B, V))``."""
        embed, scale = self._target
        x = mx.concatenate([embed(tokens) * scale, hidden], -1)
        h = self.pre_projection(x)[:, None]  # (B, 1, H)
        rows = h.shape[0]
        for layer in self.model.layers:
            keys, values = kv[layer.layer_type]
            shared = (_rows(keys, rows), _rows(values, rows))
            mask = masks[layer.layer_type][None, None, None]
            h, _, _ = layer(h, mask, None, shared_kv=shared, offset=position)
        h = self.model.norm(h)[:, 0]
        return self.post_projection(h), self.logits(h)

    def logits(self, h: mx.array) -> mx.array:
        if self.args.use_ordered_embeddings:
            return self.masked_embedding(h, self.model.embed_tokens.weight)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def load(self, weights: dict[str, mx.array]) -> None:
        """Strict load of an HF / mlx-vlm ``gemma4_assistant`` folder's tensors."""
        out = {}
        for key, value in weights.items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if key == "masked_embedding.token_ordering":
                value = value.astype(mx.int32)
            out[key] = value
        try:
            self.load_weights(list(out.items()), strict=True)
        except ValueError as e:
            message = " ".join(str(e).split())[:200]
            raise DrafterError(f"Gemma 4 assistant weights: {message}") from None


def _rows(x: mx.array, n: int) -> mx.array:
    return mx.broadcast_to(x, (n, *x.shape[1:]))


class AssistantDrafter(Source):
    """Gemma 4's assistant as the speculative step's source: it keeps nothing per sequence
    and reads the target's final hidden state and, at draft time, the sequence's K/V of the
    target layers ``kv_layers`` ``{layer type: K/V slot}``."""

    kind = MODEL_TYPE

    def __init__(self, module: Assistant, kv_layers: dict[str, int], window: int):
        self.module, self.kv_layers, self.window = module, kv_layers, window
        # what width checks read, as BeamDrafter's (``drafter.args.draft_vocab``)
        vocab = module.args.text.vocab_size
        self.drafter = SimpleNamespace(args=SimpleNamespace(draft_vocab=vocab))

    def draft(self, sequence, reading: Reading, *, width, length, **options) -> tuple:
        """Beams ``(W, L)`` from ``reading.pending``, their log-probs ``(W, L - 1)``, no host
        read: the valid K/V (the prefix and the accepted path, ``reading.count`` long) is
        masked lazily."""
        kept = max(width, options.get("search_width", 0))
        end = sequence.offset + reading.path.shape[0]  # slots written: prefix + staged path
        valid = sequence.offset + reading.count  # tokens the target has K/V of
        slots = mx.arange(end)
        position = valid - 1  # the last committed token's, which the hidden state is of
        kv, masks = {}, {}
        for kind, slot in self.kv_layers.items():
            kv[kind] = (
                sequence.kv.keys[slot][..., :end, :],
                sequence.kv.values[slot][..., :end, :],
            )
            inside = slots < valid
            if kind == SLIDING:  # bidirectional window: |q - k| < window, and k <= q here
                inside = inside & (position - slots < self.window)
            masks[kind] = inside
        beams, logprobs = self.search(reading.context, reading.pending, kv, masks, position,
                                      width=kept, length=length)  # fmt: skip
        return (*narrow(beams, logprobs, width), 0)

    def search(self, hidden, pending, kv, masks, position, *, width: int, length: int):
        """Beam search from ``hidden (Hb,)`` and ``pending ()``: each depth one batched step
        of the live beams."""
        beams = pending.reshape(1, 1).astype(mx.int32)
        scores, token_logprobs = mx.zeros((1,)), mx.zeros((1, 0))
        hidden = hidden[None]
        position = mx.array(position) if isinstance(position, int) else position
        for _ in range(1, length):
            hidden, logits = self.module.step(beams[:, -1], hidden, kv, masks, position)
            logprobs = log_softmax(logits.astype(mx.float32))  # (B, V)
            vocab = logprobs.shape[1]
            flat = (scores[:, None] + logprobs).reshape(-1)
            top = best(flat, min(width, flat.shape[0]))
            source, tokens = top // vocab, (top % vocab).astype(mx.int32)
            beams = mx.concatenate([beams[source], tokens[:, None]], axis=1)
            picked = logprobs.reshape(-1)[top][:, None]
            token_logprobs = mx.concatenate([token_logprobs[source], picked], axis=1)
            scores, hidden = flat[top], hidden[source]
        return beams, token_logprobs
