"""The drafter a run starts from: a new random one (optionally starting as the target's own LM
head), or ``--init``'s, grown to more residual layers without changing what it predicts.

Legend: H target hidden size, V target vocab, K draft vocab, E drafter width.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from redrafter_mlx.core.decode.llm import target_dims
from redrafter_mlx.core.drafters.redrafter import Drafter, load_drafter, random_drafter
from redrafter_mlx.core.errors import DrafterError, TrainError
from redrafter_mlx.training.options import TrainOptions


def initial_drafter(model, vocab: np.ndarray | None, opts: TrainOptions):
    """``(drafter, vocab)`` to train: ``opts.init``'s drafter (grown to
    ``opts.num_draft_layers``; its own draft vocabulary) or a new one over ``vocab (K,)``
    (None: the full vocabulary)."""
    if not opts.init:
        return new_drafter(model, vocab, **_shape(opts)), vocab
    try:
        drafter = load_drafter(opts.init, model)
    except DrafterError as e:
        raise TrainError(f"--init {opts.init}: {e}") from None
    if (opts.num_draft_layers or 0) > drafter.args.num_draft_layers:
        drafter = grow_layers(drafter, opts.num_draft_layers, model)
    vocab = np.array(drafter.draft_vocab) if drafter.args.draft_vocab_size else None
    return drafter, vocab


def _shape(opts: TrainOptions) -> dict:
    return dict(
        seed=opts.seed,
        head=opts.head,
        exit_dim=opts.exit_dim,
        num_draft_layers=opts.num_draft_layers,
        identity_init=opts.identity_init,
        context_layers=opts.context_layers,
    )


def new_drafter(
    model,
    vocab: np.ndarray | None,
    *,
    seed: int,
    head: str,
    exit_dim: int = 0,
    num_draft_layers: int | None = None,
    identity_init: bool = True,
    context_layers: tuple[int, ...] = (),
):
    """A random drafter for ``model`` with draft vocabulary ``vocab (K,)`` (None: full),
    width ``exit_dim`` (0: 2H) and ``num_draft_layers`` residual layers (None: 2)."""
    hidden, size = target_dims(model)
    drafter = random_drafter(
        hidden,
        size,
        seed,
        exit_dim=exit_dim or None,
        head=head,
        num_draft_layers=2 if num_draft_layers is None else num_draft_layers,
        draft_vocab_size=int(vocab.shape[0]) if vocab is not None else None,
        context_layers=list(context_layers) or None,
    )
    if context_layers:
        drafter.start_fused_as_hidden()
    if vocab is not None:
        drafter.draft_vocab = mx.array(vocab)
    if head == "target" and identity_init:
        start_as_identity(drafter)
    drafter.bind_target(model)
    return drafter


def start_as_identity(drafter) -> None:
    """Start a ``head == "target"`` drafter close to returning its context ``h``: its logits
    then begin as the target's own (right scale, sensible ranking) instead of near-uniform.
    ``input_proj`` (E, 2H) and the last layer (H, E) route the first H features through;
    residual blocks are damped."""
    h, e = drafter.args.hidden_size, drafter.args.exit_dim
    route = mx.eye(min(h, e), dtype=mx.float32)
    if "input_proj" in drafter:
        w = mx.zeros((e, 2 * h)).at[: min(h, e), : min(h, e)].add(route)
        drafter.input_proj.weight, drafter.input_proj.bias = w, mx.zeros((e,))
    for block in drafter.lm_head[:-1]:
        block.linear.weight = block.linear.weight * 0.1
    drafter.lm_head[-1].weight = mx.zeros((h, e)).at[: min(h, e), : min(h, e)].add(route)
    mx.eval(drafter.parameters())


def grow_layers(drafter, layers: int, model):
    """A copy of ``drafter`` with ``layers`` residual layers: the new ones (first in the stack)
    have zero weights, and ``x + silu(0) = x``, so it predicts exactly what ``drafter`` did."""
    old = drafter.args
    grown = Drafter(type(old)(**{**old.__dict__, "num_draft_layers": layers}))
    added = layers - old.num_draft_layers
    weights = {}
    for name, value in tree_flatten(drafter.parameters()):
        if name.startswith("lm_head."):  # the old layers move up past the added ones
            index, rest = name[len("lm_head.") :].split(".", 1)
            name = f"lm_head.{int(index) + added}.{rest}"
        weights[name] = value
    for i in range(added):
        block = grown.lm_head[i].linear
        weights[f"lm_head.{i}.linear.weight"] = mx.zeros_like(block.weight)
        weights[f"lm_head.{i}.linear.bias"] = mx.zeros_like(block.bias)
    grown.load_weights(list(weights.items()), strict=True)
    grown.bind_target(model)
    mx.eval(grown.parameters())
    return grown
