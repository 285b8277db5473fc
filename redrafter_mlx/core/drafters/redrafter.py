"""The ReDrafter drafter: an RNN over draft tokens plus a residual MLP head.

Legend: B rows (beams), H target hidden size, E exit width, V target vocab, K draft vocab.

Loadable from the reference checkpoint format (``../shared/REDRAFTER.md`` section 2): parameter
names are ``rnn_w``, ``rnn_u``, ``input_proj`` (only when E != 2H), ``lm_head.{i}.linear`` and
``lm_head.{N}``. Our optional extensions, stored in ``config.json``, leave that format loadable:

- ``draft_vocab_size`` K: the head scores only K token ids (a ``draft_vocab (K,)`` tensor in the
  checkpoint, usually the target's most frequent tokens), which makes the vocab projection
  V/K times cheaper. Draft indices are mapped back to target ids with ``draft_vocab``.
- ``head: "target"``: the last layer predicts a hidden vector (E -> H) that is scored against the
  target's own (frozen) LM-head rows for the draft vocabulary, instead of a trained E -> K matrix.
- ``context_layers``: target layers (0-based) whose outputs join the final hidden state, EAGLE-3
  style: each tap RMS-normalised (:func:`tap_features`), then ``[taps..., h]`` ((n + 1) H) is
  projected to H by ``context_proj`` (bias-free), which is the context ``h`` the rest reads.
  Absent (None): the last-layer-only drafter of the reference and of v1-v5.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from redrafter_mlx.core.atomic import write_text, write_with
from redrafter_mlx.core.decode.llm import compute_dtype, head_linear, inner_model, target_dims
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.errors import DrafterError

MODEL_TYPE = "recurrent_drafting_drafter"


@dataclass
class DrafterArgs:
    vocab_size: int
    hidden_size: int
    exit_dim: int | None = None
    num_draft_layers: int = 2
    rnn: bool = True
    head: str = "own"
    draft_vocab_size: int | None = None
    context_layers: list[int] | None = None
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        if self.exit_dim is None:
            self.exit_dim = 2 * self.hidden_size
        if self.head not in ("own", "target"):
            raise DrafterError(f"unknown drafter head {self.head!r} (expected 'own' or 'target')")
        sizes = {
            "vocab_size": (self.vocab_size, 1),
            "hidden_size": (self.hidden_size, 1),
            "exit_dim": (self.exit_dim, 1),
            "num_draft_layers": (self.num_draft_layers, 0),
            "draft_vocab_size": (self.draft_vocab_size or 1, 1),
        }
        for name, (value, least) in sizes.items():
            checked.integer(name, value, least=least)
        checked.flag("rnn", self.rnn)
        if self.context_layers is not None:
            self.context_layers = checked.indices("context_layers", self.context_layers)

    @classmethod
    def from_dict(cls, config: dict) -> DrafterArgs:
        """Build from a config dict, ignoring keys we do not use (reference extras)."""
        if not isinstance(config, dict):
            raise DrafterError("not a JSON object")
        missing = [k for k in ("vocab_size", "hidden_size") if k not in config]
        if missing:
            raise DrafterError(f"missing {' and '.join(missing)}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class Drafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        h, e = args.hidden_size, args.exit_dim
        if args.rnn:
            self.rnn_w = nn.Linear(h, h, bias=False)
            self.rnn_u = nn.Linear(h, h, bias=True)
        if e != 2 * h:
            self.input_proj = nn.Linear(2 * h, e)
        if args.context_layers:
            taps = len(args.context_layers)
            self.context_proj = nn.Linear((taps + 1) * h, h, bias=False)
        out = h if args.head == "target" else args.draft_vocab
        self.lm_head = [ResBlock(e) for _ in range(args.num_draft_layers)]
        self.lm_head.append(nn.Linear(e, out, bias=False))
        if args.draft_vocab_size:
            self.draft_vocab = mx.arange(args.draft_vocab_size)
        self._target_rows = None  # (K, H) frozen target LM-head rows, for head == "target"

    def bind_target(self, target: nn.Module) -> None:
        """Copy the target's LM-head rows for the draft vocabulary (``head == "target"`` only)."""
        if self.args.head != "target":
            return
        rows = lm_head_rows(target, self.draft_ids(mx.arange(self.args.draft_vocab)))
        self._target_rows = rows.astype(self.lm_head[-1].weight.dtype)  # the drafter's dtype
        mx.eval(self._target_rows)

    def draft_ids(self, index: mx.array) -> mx.array:
        """Draft-vocab indices -> target token ids."""
        return self.draft_vocab[index] if self.args.draft_vocab_size else index

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs this drafter reads besides the final hidden state."""
        return tuple(self.args.context_layers or ())

    def fuse(self, hidden: mx.array, taps: mx.array | None) -> mx.array:
        """Final hidden ``(B, H)`` and tapped features ``(B, n H)`` (:func:`tap_features`; None
        without ``context_layers``) -> the context ``(B, H)`` the head reads."""
        if "context_proj" not in self:
            return hidden
        return self.context_proj(mx.concatenate([taps.astype(hidden.dtype), hidden], axis=-1))

    def start_fused_as_hidden(self) -> None:
        """``context_proj`` starts as passing the final hidden state through (tap columns
        zero): a new layered drafter starts as the last-layer-only one, taps learnt from 0."""
        h = self.args.hidden_size
        weight = mx.zeros(self.context_proj.weight.shape, self.context_proj.weight.dtype)
        self.context_proj.weight = weight.at[:, -h:].add(mx.eye(h, dtype=weight.dtype))

    def rnn_step(self, state: mx.array, embeds: mx.array) -> mx.array:
        """RNN state (B, H), embedded input tokens (B, H) -> new state (B, H)."""
        if self.args.rnn:
            return nn.silu(self.rnn_w(embeds) + self.rnn_u(state))
        return state + embeds

    def logits(self, context: mx.array, state: mx.array) -> mx.array:
        """Target hidden (B, H) and RNN state (B, H) -> draft logits (B, K)."""
        return self.score(self.features(context, state))

    def features(self, context: mx.array, state: mx.array) -> mx.array:
        """(B, H), (B, H) -> last layer's output (B, D): logits (D = K) for the own head, a
        predicted target hidden state (D = H) for ``head == "target"``."""
        x = mx.concatenate([context, state], axis=-1)
        if "input_proj" in self:
            x = self.input_proj(x)
        for layer in self.lm_head:
            x = layer(x)
        return x

    def score(self, features: mx.array) -> mx.array:
        """Last layer's output (..., D) -> draft logits (..., K)."""
        if self.args.head == "target":
            return features @ self._target_rows.T.astype(features.dtype)
        return features


def tap_features(outputs: list[mx.array], eps: float = 1e-6) -> mx.array:
    """Tapped layer outputs ``[(..., H)] * n`` -> ``(..., n H)`` float32, each RMS-normalised
    (the residual stream's scale grows with depth; normalised, float16 caches hold it and one
    projection weighs the layers alike)."""
    normed = []
    for x in outputs:
        x = x.astype(mx.float32)
        normed.append(x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps))
    return mx.concatenate(normed, axis=-1)


def tensor_shapes(args: DrafterArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint of ``args`` holds, by name, with its shape: the
    module's own parameters (lazy, never evaluated, so this allocates nothing), for the
    converter's and the loader's format checks."""
    return {name: tuple(p.shape) for name, p in tree_flatten(Drafter(args).parameters())}


def lm_head_rows(target: nn.Module, ids: mx.array) -> mx.array:
    """The target's (frozen) LM-head rows for token ids ``(K,)`` -> ``(K, H)`` float32."""
    # The head applied to the identity gives W.T (H, V), tied/untied/quantized alike.
    basis = mx.eye(target_dims(target)[0], dtype=compute_dtype(target))
    return mx.stop_gradient(head_linear(target, basis).T[ids].astype(mx.float32))


def random_drafter(target_hidden: int, target_vocab: int, seed: int = 0, **kwargs) -> Drafter:
    """A randomly initialised drafter for a target (tests, and the start of training)."""
    mx.random.seed(seed)
    drafter = Drafter(DrafterArgs(vocab_size=target_vocab, hidden_size=target_hidden, **kwargs))
    mx.eval(drafter.parameters())
    return drafter


def save_drafter(drafter: Drafter, out: Path | str) -> None:
    """Write ``config.json`` + ``model.safetensors`` atomically (temp files, then rename)."""

    weights = dict(tree_flatten(drafter.parameters()))
    write_with(Path(out) / "model.safetensors", lambda tmp: mx.save_safetensors(str(tmp), weights))
    write_text(Path(out) / "config.json", json.dumps(asdict(drafter.args), indent=2) + "\n")


def load_drafter(
    path: Path | str, target: nn.Module | None = None, dtype: mx.Dtype | None = None
) -> Drafter:
    """Load a drafter folder (reference format or ours), check it against ``target``, eval it;
    its floating weights cast to ``dtype`` when given (the target's LM-head rows it scores with
    too)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DrafterError(f"{path}: a file, not a drafter folder (config.json, safetensors)")
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    for f in (config_file, weights_file):
        if not f.exists():
            raise DrafterError(
                f"{f}: missing (a drafter folder has config.json + model.safetensors)"
            )
    try:
        args = DrafterArgs.from_dict(json.loads(config_file.read_text()))
    except (ValueError, TypeError) as e:  # DrafterError and JSONDecodeError are ValueErrors
        raise DrafterError(f"{config_file}: not a drafter config ({e})") from None
    if target is not None:
        check_matches_target(args, target, config_file)
    drafter = Drafter(args)
    try:
        weights = mx.load(str(weights_file))
    except (ValueError, RuntimeError) as e:
        raise DrafterError(
            f"{weights_file}: unreadable, corrupt or truncated ({_short(e)})"
        ) from None
    try:
        weights = {k: v for k, v in weights.items() if not k.startswith("emb_norm")}
        drafter.load_weights(list(weights.items()), strict=True)
    except (ValueError, RuntimeError) as e:
        raise DrafterError(
            f"{weights_file}: does not match its config.json (layers or sizes): {_short(e)}"
        ) from None
    if dtype is not None:
        drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    if target is not None:
        drafter.bind_target(target)
    return drafter


def _short(error: Exception) -> str:
    """An exception's message on one line, at most 240 characters."""
    detail = " ".join(str(error).split())
    return detail if len(detail) < 240 else detail[:237] + "..."


def check_matches_target(args: DrafterArgs, target: nn.Module, where: Path | str) -> None:
    """Raise if the drafter's hidden size or vocabulary differ from the target's."""
    hidden, vocab = target_dims(target)
    if (args.hidden_size, args.vocab_size) != (hidden, vocab):
        raise DrafterError(
            f"{where}: drafter is for hidden_size {args.hidden_size} / vocab_size "
            f"{args.vocab_size}, but the target has {hidden} / {vocab}"
        )
    layers = len(inner_model(target).layers)
    if args.context_layers and max(args.context_layers) >= layers:
        raise DrafterError(
            f"{where}: drafter reads target layers {args.context_layers}, but the target has "
            f"{layers} layers"
        )
